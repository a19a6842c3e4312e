"""The tuning protocol that cannot lose to the defaults (curvalign.report.tuning): trial 0 is
every recipe's default configuration, the best trial is never below it, every knob the step-0
check can name is in its recipe's search space, pruning waits for the warm-up and for a
curriculum's phases, trials validate at the re-training's cadence and average two seeds, and a
trial whose step-0 check fired is marked."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import pytest

pytest.importorskip("optuna")

from curvalign.config import TrainConfig, resolve_config  # noqa: E402
from curvalign.data import load_store  # noqa: E402
from curvalign.data.validation_split import train_image_count  # noqa: E402
from curvalign.recipes import get_recipe, recipe_names  # noqa: E402
from curvalign.recipes.base import Knob  # noqa: E402
from curvalign.report import tuning  # noqa: E402
from curvalign.runs import recipe_input_dims  # noqa: E402
from curvalign.train.fitting import RunSpec  # noqa: E402
from curvalign.train.hooks import Decision  # noqa: E402
from curvalign.train.trainer import build_model  # noqa: E402

TINY = "synthetic:images=120,text_pairs=60,captions_max=3"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16", "tensorboard=false", "checkpoint_every=0"]


@pytest.fixture(scope="module")
def tiny_store():
    return load_store(TINY)[0]


def _health_knobs(recipe) -> set[str]:
    """Every config key the step-0 check (recipes/health.py) can name for ``recipe``, read
    from the same contract it reads."""
    names = set(recipe.scale_knobs)
    names |= {recipe.temperature_knob, recipe.radius_gap_knob} - {None}
    names |= {key for _, key in recipe.step0_scalars().values()}
    if not recipe.scale_knobs and recipe.curvature_value() is not None:
        names.add("curvature_init")  # flat_geometry / far_out name it without a scale knob
    return names


@pytest.mark.parametrize("name", recipe_names())
def test_every_knob_the_step0_check_can_name_is_in_the_search_space(name, tiny_store):
    config = tuning.default_config(RunSpec.parse(name, TINY), tiny_store)
    recipe = build_model(config, *recipe_input_dims(config, tiny_store))
    space = get_recipe(name).search_space()
    held = set(space) | {key for knob in space.values() for key in knob.moves}
    named = _health_knobs(recipe)
    assert named, name  # every recipe's check names something
    assert named <= held, f"{name}: {sorted(named - held)} not in its search space"


@pytest.mark.parametrize("name", recipe_names())
def test_the_default_point_is_the_default_configuration(name, tiny_store):
    cls = get_recipe(name)
    spec = RunSpec.parse(name, TINY)
    defaults = tuning.default_config(spec, tiny_store)
    space = cls.search_space()
    point = tuning.default_point(space, defaults)
    fitted, widened = tuning.fit_defaults(space, point)
    assert widened == [], widened  # every declared range holds its recipe's defaults
    assert all(fitted[k].contains(v) for k, v in point.items())
    # the point, configured as any sampled point is, gives back the defaults
    overrides = tuning.trial_overrides(cls, fitted, point, defaults)
    again = tuning.default_config(spec.with_values(overrides), tiny_store)
    assert again.train == defaults.train
    for key, value in defaults.recipe_config.items():
        got = again.recipe_config[key]
        assert got == pytest.approx(value, rel=1e-6) if isinstance(value, float) else got == value


def test_a_default_outside_its_range_widens_the_range_and_a_missing_choice_is_added():
    space = {
        "lr": Knob("float", 1e-4, 1e-2, log=True),
        "temperature_init": Knob("float", 0.02, 0.2, log=True),
        "learn": Knob("choice", choices=(True,)),
    }
    point = {"lr": 1e-3, "temperature_init": 5.0, "learn": False}
    fitted, notes = tuning.fit_defaults(space, point)
    assert fitted["lr"] is space["lr"]  # inside: untouched
    assert (fitted["temperature_init"].low, fitted["temperature_init"].high) == (0.02, 5.0)
    assert fitted["learn"].choices == (True, False)
    assert len(notes) == 2 and "temperature_init" in notes[0]


def test_the_random_start_up_is_sized_to_the_budget():
    assert [tuning.startup_trials(n) for n in (1, 2, 3, 12, 30)] == [1, 1, 1, 4, 10]


class _Trial:
    def __init__(self, prune: bool) -> None:
        self.prune, self.reports = prune, []

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.prune


def _trainer(total, phases=()):
    recipe = SimpleNamespace(phase_steps=lambda t: tuple(phases))
    return SimpleNamespace(train_config=SimpleNamespace(steps=total), recipe=recipe)


def test_pruning_waits_for_the_warm_up_and_for_a_curriculums_phases():
    event = lambda step: SimpleNamespace(step=step, score=0.1)  # noqa: E731
    hook = tuning.TrialHook(_Trial(prune=True))
    plain = _trainer(100)
    assert hook.on_validation(plain, event(0)) is None  # step 0: nothing trained
    assert hook.on_validation(plain, event(20)) is None  # inside the warm-up (25%)
    assert hook.on_validation(plain, event(25)) is Decision.STOP and hook.pruned_at == 25
    late = tuning.TrialHook(_Trial(prune=True))
    curriculum = _trainer(100, phases=(10, 40, 60))
    assert late.on_validation(curriculum, event(50)) is None  # before the last phase boundary
    assert late.on_validation(curriculum, event(60)) is Decision.STOP
    assert tuning.TrialHook(None).on_validation(plain, event(90)) is None  # trial 0: never


@pytest.mark.parametrize("name", ["agr", "dualpath"])
def test_curriculum_recipes_declare_their_phases(name, tiny_store):
    config = resolve_config(name, TINY, steps=1000)
    recipe = build_model(config, *recipe_input_dims(config, tiny_store))
    phases = recipe.phase_steps(1000)
    assert phases and list(phases) == sorted(phases) and 0 < phases[-1] < 1000
    clip = resolve_config("clip", TINY, steps=1000)
    assert build_model(clip, *recipe_input_dims(clip, tiny_store)).phase_steps(1000) == ()


def test_tune_2_trial_0_is_the_defaults_and_the_best_is_never_below_it(tmp_path, tiny_store):
    out = tmp_path / "tune"
    result = tuning.run_tuning(
        ["clip"], TINY, out, trials=2, steps=6, overrides=TINY_TRAIN, lr_range_steps=0
    )
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["trial"] for r in rows] == ["0", "1"]
    zero = rows[0]
    assert zero["defaults"] == "yes" and rows[1]["defaults"] == ""
    defaults = resolve_config("clip", TINY, overrides=TINY_TRAIN)
    assert float(zero["lr"]) == defaults.train.lr
    assert float(zero["weight_decay"]) == defaults.train.weight_decay
    assert float(zero["temperature_init"]) == defaults.recipe_config["temperature_init"]
    # the mean over two seeds
    seeds = [float(v) for v in zero["seed_values"].split()]
    assert len(seeds) == 2 and float(zero["value"]) == pytest.approx(sum(seeds) / 2, abs=1e-5)
    # never below the defaults on the selection metric
    best = result.best["clip"]
    assert best["value"] >= float(zero["value"]) - 1e-6 and best["default_value"] is not None
    assert best["value"] >= best["default_value"]
    assert best["value"] == pytest.approx(max(float(r["value"]) for r in rows), abs=1e-5)
    # the re-training's cadence: the epoch rule on the store the trials train on
    split = tuning.tuning_store(tiny_store)
    every = TrainConfig(batch_size=16).validation_interval(train_image_count(split))
    assert {int(r["val_every"]) for r in rows} == {every}
    assert all(r["step0"] for r in rows)  # "ok" or the codes, for every finished trial


def test_a_trial_whose_step0_check_fires_is_marked(tmp_path):
    # a temperature of 5 flattens clip's logits (cosines / 5 span < 1): flat_logits at step 0;
    # as the user's override it is the default configuration, outside the declared range
    notes: list[str] = []
    result = tuning.run_tuning(
        ["clip"],
        TINY,
        tmp_path / "tune",
        trials=1,
        steps=4,
        overrides=[*TINY_TRAIN, "temperature_init=5.0"],
        lr_range_steps=0,
        notify=notes.append,
    )
    assert any("temperature_init" in line for line in result.widened["clip"])
    rows = list(csv.DictReader((tmp_path / "tune" / "trials.csv").open()))
    assert rows[0]["defaults"] == "yes" and "flat_logits" in rows[0]["step0"]
    assert float(rows[0]["temperature_init"]) == 5.0
    best = result.best["clip"]
    assert best["defaults"] and "flat_logits" in best["step0"]
    cell = tuning.tuned_description(best)
    assert cell.startswith("= the defaults") and "⚠ step-0: flat_logits" in cell
    assert result.step0_fired["clip"] == (1, 1)
    assert any("step-0 check: flat_logits" in n for n in notes)
    assert math.isfinite(best["value"])


def test_a_pruned_trial_counts_and_stops_after_the_warm_up(tmp_path, monkeypatch):
    import optuna

    class AlwaysPrune(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return True

    monkeypatch.setattr(optuna.pruners, "MedianPruner", lambda **kwargs: AlwaysPrune())
    out = tmp_path / "tune"
    result = tuning.run_tuning(
        ["clip"], TINY, out, trials=2, steps=8, overrides=[*TINY_TRAIN, "val_every=2"],
        lr_range_steps=0,
    )  # fmt: skip
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["state"] for r in rows] == ["complete", "pruned"]  # trial 0 is never pruned
    assert rows[1]["outcome"] == "pruned at step 2 (below the median of earlier trials there)"
    assert result.counted == {"clip": 2} and result.best["clip"]["defaults"]


def test_the_lr_range_test_reads_validation(tiny_store):
    from curvalign.train.lr_range import lr_range_test

    found = lr_range_test("clip", tiny_store, steps=12, overrides=TINY_TRAIN)
    assert found.read_on == "validation" and "validation" in found.describe()
    assert 3 <= len(found.lrs) <= 12 and all(0.0 <= v <= 1.0 for v in found.losses)
    assert found.lrs == sorted(found.lrs) and found.lrs[0] >= 1e-6
    train = lr_range_test("clip", tiny_store, steps=12, overrides=TINY_TRAIN, read_on="train")
    # a warm-started head's training loss can diverge before the last step: at most 12 points
    assert train.read_on == "train" and 3 <= len(train.lrs) <= 12
    assert "validation" not in train.describe()


def test_a_defaults_trial_cut_off_by_a_kill_runs_again_as_the_defaults(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    settings = {"metric": "mean_r1"}
    study = tuning._open_study("clip", storage, "maximize", settings, print)
    study.enqueue_trial({"lr": 5e-4}, user_attrs={"defaults": True})
    cut = study.ask()  # drawn, then left RUNNING, as a killed process leaves it
    assert cut.user_attrs["defaults"] and cut.suggest_float("lr", 1e-4, 1e-2, log=True) == 5e-4
    notes: list[str] = []
    again = tuning._open_study("clip", storage, "maximize", settings, notes.append)
    rerun = again.ask()
    assert rerun.number != cut.number and rerun.user_attrs.get("defaults") is True
    assert rerun.suggest_float("lr", 1e-4, 1e-2, log=True) == 5e-4
    assert any("running them again" in n for n in notes)
