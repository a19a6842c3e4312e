"""Tuning with an equal budget (curvalign.report.tuning): search spaces declared by every recipe,
the learning-rate range test, the test split never read while tuning, resumable studies (a real
process killed with SIGKILL), the best configuration as a file `train --config` accepts, and a
benchmark of paper-default and tuned rows."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("optuna")

from curvalign.cli import app  # noqa: E402
from curvalign.config import TrainConfig, resolve_config  # noqa: E402
from curvalign.data import load_store  # noqa: E402
from curvalign.data.features import FeatureStore  # noqa: E402
from curvalign.recipes import get_recipe, recipe_names  # noqa: E402
from curvalign.recipes.base import Knob  # noqa: E402
from curvalign.report import tuning  # noqa: E402
from curvalign.train.fitting import RunSpec  # noqa: E402
from curvalign.train.lr_range import suggest_range  # noqa: E402

TINY = "synthetic:images=120,text_pairs=60,captions_max=3"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16", "tensorboard=false", "checkpoint_every=0"]
runner = CliRunner()


# --- search spaces ------------------------------------------------------------------------------


def _point(knob: Knob, where: float):
    """A value inside ``knob`` (``where`` in [0, 1] along its range)."""
    if knob.kind == "choice":
        return knob.choices[-1] if where > 0.5 else knob.choices[0]
    if knob.log:
        return knob.low * (knob.high / knob.low) ** where
    value = knob.low + (knob.high - knob.low) * where
    return int(round(value)) if knob.kind == "int" else value


@pytest.fixture(scope="module")
def tiny_store() -> FeatureStore:
    return load_store(TINY)[0]


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_declares_a_space_whose_every_point_configures_it(name, tiny_store):
    cls = get_recipe(name)
    defaults = tuning.default_config(RunSpec.parse(name, TINY), tiny_store)
    space = cls.search_space()
    assert {"lr", "weight_decay"} <= set(space)
    lr = space["lr"]  # a log range around the paper's rate
    paper = dict(cls.train_defaults).get("lr", 1e-3)
    assert lr.log and lr.low < paper < lr.high
    train_fields = {f for f in TrainConfig.__dataclass_fields__}
    recipe_fields = set(cls.Config.__dataclass_fields__)
    for where in (0.0, 0.5, 1.0):
        params = {k: _point(knob, where) for k, knob in space.items()}
        assert all(space[k].contains(v) for k, v in params.items())
        overrides = tuning.trial_overrides(cls, space, params, defaults)
        assert set(overrides) <= train_fields | recipe_fields, set(overrides) - train_fields
        # every point builds a valid config (a bad range would raise here, e.g. init > max)
        config = resolve_config(name, TINY, overrides=overrides)
        for key, value in overrides.items():
            got = getattr(config.train, key) if key in train_fields else config.recipe_config[key]
            assert got == pytest.approx(value) if isinstance(value, float) else got == value


def test_method_knobs_where_the_papers_leave_them_open():
    assert get_recipe("clip").search_space().keys() == {"lr", "weight_decay", "temperature_init"}
    assert "entailment_weight" in get_recipe("meru").search_space()
    assert {"curvature_init", "learn_curvature", "tangent_norm_init"} <= set(
        get_recipe("meru").search_space()
    )
    assert "weight_init" in get_recipe("proclip").search_space()
    assert {"switch_at", "gate_warmup", "loss_warmup"} <= set(get_recipe("dualpath").search_space())
    agr = get_recipe("agr")
    out = agr.search_overrides({"curriculum_scale": 4.0, "lr": 1e-3})
    assert out["alpha_end"] == pytest.approx(4 * 5_000 / 120_000) and out["lr"] == 1e-3
    assert out["alpha_start"] < out["alpha_end"] <= out["beta_start"] < out["beta_end"] <= 0.9


# --- lr range test ------------------------------------------------------------------------------


def test_lr_range_reading_on_a_hand_made_curve():
    lrs = [1e-6 * 10 ** (k / 10) for k in range(61)]  # 1e-6 .. 1
    # flat, falling from 1e-4 to a minimum at 1e-2, then rising steeply
    losses = [
        5.0 if lr < 1e-4 else max(1.0, 5.0 - 2.0 * math.log10(lr / 1e-4)) + 30 * max(0.0, math.log10(lr / 1e-2))
        for lr in lrs
    ]  # fmt: skip
    reading = suggest_range(lrs, losses)
    assert reading["reached_divergence"]
    assert 10**-2.3 <= reading["at_minimum"] <= 10**-1.7
    low, high = reading["suggested"]
    assert high == pytest.approx(reading["at_minimum"] / 10) and low == pytest.approx(high / 30)
    assert 1e-4 <= reading["steepest"] <= 1e-2  # where the loss falls
    never = suggest_range(lrs, [5.0 - k * 0.01 for k in range(61)])
    assert not never["reached_divergence"] and never["at_minimum"] == lrs[-1]


# --- the test split is never read while tuning -------------------------------------------------


class SplitTripwireStore(FeatureStore):
    """A store whose test split cannot be asked for (by the split accessors)."""

    def split_image_ids(self, name):
        if name == "test":
            raise AssertionError("the test split was read during tuning")
        return super().split_image_ids(name)

    def texts_of_split(self, name):
        if name == "test":
            raise AssertionError("the test split was read during tuning")
        return super().texts_of_split(name)


def _tripwire_store() -> FeatureStore:
    store, spec = load_store(TINY)
    fields = {f: getattr(store, f) for f in FeatureStore.__dataclass_fields__}
    fields["meta"] = {**store.meta, "spec": spec}
    return SplitTripwireStore(**fields)


def test_tuning_store_has_no_test_images():
    store = _tripwire_store()
    tuned = tuning.tuning_store(store)
    assert "test" not in tuned.split_names and "val" in tuned.split_names
    test_index = store.split_names.index("test")
    n_test = int((store.image_split == test_index).sum())
    assert n_test > 0 and tuned.num_images == store.num_images - n_test
    kept = {tuple(r.tolist()) for r in tuned.image_features}
    tests = store.image_features[store.image_split == test_index]
    assert not any(tuple(r.tolist()) in kept for r in tests)


def test_tuning_never_reads_test_and_writes_its_files(tmp_path):
    store = _tripwire_store()
    out = tmp_path / "tune"
    result = tuning.run_tuning(
        ["clip"], store, out, trials=2, steps=4, overrides=TINY_TRAIN, lr_range_steps=8
    )  # the tripwire store raises if anything asks for its test split
    assert result.counted == {"clip": 2} and result.best["clip"] is not None
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["recipe"] for r in rows] == ["clip", "clip"] and all(
        r["outcome"] == "ok" for r in rows
    )
    assert {"lr", "weight_decay", "temperature_init"} <= set(rows[0])
    best_value = max(float(r["value"]) for r in rows)
    assert result.best["clip"]["value"] == pytest.approx(best_value, abs=1e-5)  # csv: 6 digits
    # the lr range test widens the declared range (never narrows it), and every trial's lr lies
    # in the union; a head warm-started at the alignment may find validation lowest at the
    # ramp's first rate, and then the declared range is used as it is
    declared = tuning.space_of("clip")["lr"]
    widened = declared
    if "clip" in result.lr_ranges:
        low, high = result.lr_ranges["clip"]["suggested"]
        widened = tuning.space_of("clip", (low, high))["lr"]
        assert (widened.low, widened.high) == (min(low, declared.low), max(high, declared.high))
    assert all(widened.low <= float(r["lr"]) <= widened.high for r in rows)
    assert (out / "history.png").stat().st_size > 0 and (out / "lr_range" / "clip.png").exists()
    assert (out / "study.db").exists()
    # the best configuration is a file `curvalign train --config` accepts, with the tuned values
    best = out / "best" / "clip.yaml"
    run = tmp_path / "run"
    res = runner.invoke(
        app, ["train", "--config", str(best), "--out", str(run), "--steps", "2", "-q"]
    )
    assert res.exit_code == 0, res.output
    saved = json.loads((run / "config.json").read_text())
    assert saved["recipe"] == "clip"
    assert saved["train"]["lr"] == pytest.approx(result.best["clip"]["params"]["lr"])
    assert saved["recipe_config"]["temperature_init"] == pytest.approx(
        result.best["clip"]["params"]["temperature_init"]
    )


def test_selection_metric_is_checked_before_training(tmp_path):
    from curvalign.errors import ConfigError

    with pytest.raises(ConfigError, match="selection metric 'nope/x'"):
        tuning.run_tuning(
            ["clip"], TINY, tmp_path, trials=1, steps=2, overrides=TINY_TRAIN, metric="nope/x"
        )
    assert tuning.metric_direction("hierarchy/TIE") == "minimize"
    assert tuning.metric_direction("zeroshot/top1") == "maximize"


# --- resumable after kill -9 --------------------------------------------------------------------


def _counted(db: Path, name: str) -> list:
    import optuna

    if not db.exists():
        return []
    try:
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
    except (KeyError, Exception):  # not created yet
        return []
    return tuning._counted(study)


def _finished_trials_read_only(db: Path, name: str) -> int:
    """Trials of study ``name`` that finished, read through a read-only SQLite connection: the
    child is still creating the tables, and optuna.load_study would create them too (a race the
    child then lost with "table ... already exists")."""
    import sqlite3

    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            (count,) = conn.execute(
                "SELECT COUNT(*) FROM trials JOIN studies USING (study_id) "
                "WHERE studies.study_name = ? AND trials.state = 'COMPLETE'",
                (name,),
            ).fetchone()
    except sqlite3.Error:  # tables not created yet, or a write in progress
        return 0
    return int(count)


def test_killed_tuning_continues_where_it_stopped(tmp_path):
    out = tmp_path / "tune"
    # the third trial hangs until the kill (its first seed: a trial trains two seeds, so the
    # fifth training call): on an idle machine tiny trials can otherwise all finish between two
    # polls, and the kill would land on a finished tuning
    script = textwrap.dedent(
        f"""
        import time
        import curvalign.train.fitting as fitting
        from curvalign.report.tuning import run_tuning
        real_fit, calls = fitting.fit, []
        def fit(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:
                time.sleep(600)
            return real_fit(*args, **kwargs)
        fitting.fit = fit
        run_tuning(["clip"], {TINY!r}, {str(out)!r}, trials=4, steps=6,
                   overrides={TINY_TRAIN!r}, lr_range_steps=0)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 300
        while _finished_trials_read_only(out / "study.db", "clip") < 2:
            assert proc.poll() is None, "tuning ended before it could be killed"
            assert time.monotonic() < deadline, "no trial finished in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = {t.number: (t.params, t.value) for t in _counted(out / "study.db", "clip")}
    assert len(before) == 2  # the third was cut off mid-way: it runs again
    result = tuning.run_tuning(
        ["clip"], TINY, out, trials=4, steps=6, overrides=TINY_TRAIN, lr_range_steps=0
    )
    after = _counted(out / "study.db", "clip")
    assert result.counted == {"clip": 4} and len(after) == 4  # exactly the budget, not more
    for t in after:  # the trials finished before the kill are kept as they were
        if t.number in before:
            assert (t.params, t.value) == before[t.number]
    new = [t.params for t in after if t.number not in before]
    assert all(p not in [b[0] for b in before.values()] for p in new)  # continued, not replayed
    rows = list(csv.DictReader((out / "trials.csv").open()))
    # four counted trials: finished, or pruned (a pruned trial counts against the budget)
    counted = [
        r["outcome"] for r in rows if r["outcome"] == "ok" or r["outcome"].startswith("pruned")
    ]
    assert len(counted) == 4 and counted.count("ok") >= 2, [r["outcome"] for r in rows]
    # a different budget is a different study: refused, not silently mixed
    from curvalign.errors import ConfigError

    with pytest.raises(ConfigError, match="other settings"):
        tuning.run_tuning(
            ["clip"], TINY, out, trials=5, steps=6, overrides=TINY_TRAIN, lr_range_steps=0
        )
    # how to run is not what to train: a busy machine's num_threads=1 resumes the same study
    again = tuning.run_tuning(
        ["clip"],
        TINY,
        out,
        trials=4,
        steps=6,
        overrides=[*TINY_TRAIN, "num_threads=1"],
        lr_range_steps=0,
    )
    assert again.counted == {"clip": 4} and len(_counted(out / "study.db", "clip")) == 4
    # a resumed call ran no trial, yet reports what the trials cost over every call
    spent = sum(t.user_attrs["seconds"] for t in _counted(out / "study.db", "clip"))
    assert again.trial_seconds == {"clip": pytest.approx(spent)} and spent > 0
    assert json.loads((out / "tuning.json").read_text())["trial_seconds"]["clip"] == spent


# --- the tuned benchmark -----------------------------------------------------------------------


@pytest.mark.slow  # tuning, then a benchmark of both arms, end to end (21 s, loaded)
def test_benchmark_tune_writes_paper_and_tuned_rows_with_the_budget(tmp_path):
    out = tmp_path / "bench"
    res = runner.invoke(
        app,
        ["benchmark", "--recipes", "clip,meru", "--data", TINY, "--out", str(out), "--steps", "4",
         "--tune", "2", "--seeds", "2", "--lr-range-steps", "0", "--quiet", *TINY_TRAIN],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    payload = json.loads((out / "results.json").read_text())
    for row in ("clip (paper)", "clip (tuned)", "meru (paper)", "meru (tuned)",
                "clip (tuned, step 0)", "meru (paper, step 0)", "chance"):  # fmt: skip
        assert row in payload["stats"], row
    assert len(payload["stats"]["meru (tuned)"]["retrieval/t2i@1"]["values"]) == 2  # paired seeds
    md = (out / "results.md").read_text()
    assert "tuning budget: 2 trials per recipe" in md and "configuration" in md
    assert "paper defaults" in md and "lr=" in md
    rows = list(csv.DictReader((out / "tuning" / "trials.csv").open()))
    assert sum(r["recipe"] == "clip" for r in rows) == sum(r["recipe"] == "meru" for r in rows) == 2
    assert (out / "tuning" / "best" / "meru.yaml").exists()
    # tuned rows are compared with the baselines too
    assert "meru (tuned) − meru (tuned, step 0)" in md
    # their gains count the test items as well as the seeds, in both arms
    hows = {g["how"] for row in payload["gains"].values() for g in row.values()}
    assert hows and "seeds only" not in hows, payload["gains"]


def test_tuned_benchmarks_default_to_five_seeds(tmp_path, monkeypatch):
    from curvalign.errors import ConfigError

    seen = {}

    def fake(recipes, data, out, **kwargs):
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(tuning, "run_tuned_benchmark", fake)
    args = ["benchmark", "--recipes", "clip", "--data", TINY, "--out", str(tmp_path / "b")]
    res = runner.invoke(app, [*args, "--tune", "3"])
    assert res.exit_code != 0 and "stop here" in res.output
    assert seen["seeds"] == 5 and seen["trials"] == 3 and seen["metric"] == "mean_r1"
    seen.clear()
    runner.invoke(app, [*args, "--tune", "3", "--seeds", "2", "--tune-metric", "zeroshot/top1"])
    assert seen["seeds"] == 2 and seen["metric"] == "zeroshot/top1"


@pytest.mark.parametrize("recipe", ["meru", "hycoclip", "atmg", "phyclip"])
def test_the_scale_knob_keeps_the_data_aware_ratio_between_the_sides(recipe):
    """The tuned scale is a factor on each side's data-aware scale: on a store whose image and
    text norms differ by 30x (EfficientNet images vs unit-norm MiniLM texts on COCO-MINI), every
    point of the space keeps the default's image/text scale ratio, so no trial puts one side at
    the other's scale (tuned MERU, HyCoCLIP and PHyCLIP fell to chance there with a shared raw
    ``scale_init``)."""
    from curvalign.data.statistics import FeatureNorms

    cls = get_recipe(recipe)
    knob = cls.search_space()["tangent_norm_init"]
    assert "scale_init" not in cls.search_space()
    norms = FeatureNorms(30.0, 1.0, image_dim=16, text_dim=16, image_rows=8, text_rows=8)

    def scales(**over):
        config = cls.Config(**over)
        resolved = cls.resolve_init(config, norms)
        return resolved["image_scale_init"], resolved["text_scale_init"]

    image0, text0 = scales()
    for factor in (knob.low, 1.0, knob.high):
        image, text = scales(tangent_norm_init=factor)
        assert image == pytest.approx(image0 * factor, rel=1e-3)
        assert text / image == pytest.approx(text0 / image0, rel=1e-3)


def test_a_range_test_whose_loss_only_rises_leaves_the_declared_range(tmp_path, monkeypatch):
    """DualPath's phases change its loss as the ramp runs: the loss is lowest at the ramp's first
    rate and the test reads a range 300x below it; the tuner keeps the declared range instead,
    and a resumed study does not read the ramp again."""
    import optuna

    from curvalign.train import lr_range
    from curvalign.train.lr_range import LRRangeResult

    lrs = [1e-6, 1e-4, 1e-2, 1.0]
    rising = LRRangeResult(
        "clip", lrs, [1, 2, 3, 4], [1, 2, 3, 4], 1e-6, 1e-6, (3e-9, 1e-7), False, "end"
    )
    calls = []

    def fake(*args, **kwargs):
        calls.append(args)
        return rising

    monkeypatch.setattr(lr_range, "lr_range_test", fake)
    study = optuna.create_study(direction="maximize")
    notes = []
    assert (
        tuning._lr_range(
            "clip", TINY, tmp_path, study, RunSpec.parse("clip", TINY), 8, notes.append
        )
        is None
    )
    assert any("declared lr range" in n for n in notes)
    assert study.user_attrs["lr_range"]["uninformative"] is True
    assert (
        tuning._lr_range(
            "clip", TINY, tmp_path, study, RunSpec.parse("clip", TINY), 8, notes.append
        )
        is None
    )
    assert len(calls) == 1  # read once, kept in the study
