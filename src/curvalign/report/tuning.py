"""Tuning with an equal budget for every method, then a benchmark of the tuned configurations.

The protocol (Musgrave et al., "A Metric Learning Reality Check", 2020; the Deep Learning Tuning
Playbook): the method is the scientific variable; learning rate, weight decay, temperature and
scale are nuisance variables, tuned for every recipe (``clip`` included) with the same number of
trials, on validation only. The chosen configuration is then re-trained over several seeds and
evaluated once on test, beside the paper-default configuration (docs/evaluation.md).

One recipe's tuning
    search space  the recipe's ``search_space()`` (declared in its recipe file), the learning
                  rate's range widened by a learning-rate range test (``train/lr_range.py``,
                  read on validation) when ``lr_range_steps`` > 0; a knob whose default lies
                  outside its declared range is widened to hold it (``fit_defaults``)
    trial 0       the recipe's default configuration (``enqueue_trial`` of every knob's default,
                  run with no tuned override at all), so the best trial is never worse than the
                  defaults on the selection metric (ties go to the earlier trial)
    sampler       Optuna's TPE with a fixed seed (reseeded with the number of trials already in
                  the study, so a resumed study does not replay its first draws); its random
                  start-up is ``startup_trials(trials)`` = max(1, trials // 3) trials, trial 0
                  included
    pruning       the median pruner (``MedianPruner``, the same start-up) through the trainer's
                  validation hook (``TrialHook``): a trial whose first-seed validation falls
                  below the median of earlier trials at the same step stops there, but never
                  before ``PRUNE_WARMUP`` of its steps nor before the last phase boundary its
                  recipe declares (``Recipe.phase_steps``); trial 0 is never pruned; only the
                  default selection metric prunes (the validation curve is that metric)
    one trial     ``seeds`` training runs (default 2, seeds ``seed``, ``seed + 1``) with the
                  steps and validation cadence the re-training uses (``steps``, else the
                  store's default; the epoch rule of ``TrainConfig.validation_interval``); its
                  value is the mean over seeds of the selection metric of each run's best
                  validation weights (default ``mean_r1``: the trainer's own mean of T2I and
                  I2T R@1; any metric path of ``evaluate``, e.g. ``zeroshot/top1``)
    budget        ``trials`` finished trials per recipe (a failed or pruned trial counts)
    data          the store without its test images (``tuning_store``): nothing in tuning can
                  read the test split
    step-0 check  a trial whose step-0 health check fired on any seed is marked (``step0``
                  column of trials.csv, and the tuned row of the benchmark table)

Files (``out/``): ``study.db`` (the Optuna studies in SQLite: a killed run continues where it
stopped; a trial killed mid-way is run again), ``trials.csv``, ``best/NAME.yaml`` (the best
configuration, a file ``curvalign train --config`` accepts), ``history.png`` (value per trial and
best so far), ``lr_range/NAME.png`` and ``tuning.json``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import yaml

from curvalign.data import load_store
from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError, CurvalignError
from curvalign.train.hooks import Decision, TrainerHook, ValidationEvent

if TYPE_CHECKING:
    import optuna

    from curvalign.config import RunConfig
    from curvalign.recipes.base import Knob, Recipe
    from curvalign.recipes.health import Step0Health
    from curvalign.towers import TowersConfig
    from curvalign.train.fitting import FitResult, RunSpec
    from curvalign.train.lr_range import LRRangeResult
    from curvalign.train.trainer import Trainer

Notify = Callable[[str], None]

#: the selection metric by default: the trainer's validation score (mean of T2I and I2T R@1)
DEFAULT_METRIC = "mean_r1"
#: seeds a benchmark of tuned configurations trains by default (paired across recipes)
DEFAULT_TUNED_SEEDS = 5
#: steps of the learning-rate range test that seeds each recipe's lr range (0: no test)
DEFAULT_LR_RANGE_STEPS = 60
#: training seeds per trial: its value is their mean (one seed's best validation is noisy
#: enough that tuning picked configurations worse than the defaults)
DEFAULT_TRIAL_SEEDS = 2
#: share of a trial's steps before which it is never pruned (the same for every recipe; a
#: curriculum's last phase boundary moves it later, ``Recipe.phase_steps``)
PRUNE_WARMUP = 0.25
#: the version of the tuning protocol; a study made under another is not resumed (3: the
#: settings hold each recipe's chosen settings as typed values)
PROTOCOL = 3
STUDY_DB = "study.db"
TRIALS_CSV = "trials.csv"
#: what a study must agree on to be resumed
STUDY_KEYS = ("metric", "steps", "trials", "seed", "seeds", "protocol", "data", "overrides")
# overrides that say how to run, not what to train: a study resumes whatever they are (the
# throughput warning tells a user on a busy machine to add ``num_threads=1``)
RUNTIME_KEYS = frozenset({"num_threads", "device", "log_every", "tensorboard", "checkpoint_every"})


def metric_direction(metric: str) -> str:
    """ "minimize" for tree distances (TIE, LCA), "maximize" for every other metric."""
    from curvalign.report.tables import LOWER_IS_BETTER

    return "minimize" if metric in LOWER_IS_BETTER else "maximize"


def metric_label(metric: str) -> str:
    return "validation mean R@1" if metric == DEFAULT_METRIC else f"validation {metric}"


# --- data: the test split is not part of tuning ---------------------------------------------


def without_test(store: FeatureStore) -> FeatureStore:
    """``store`` without its "test" images and without the "test" split name. Reads the split
    labels only (never ``split_image_ids("test")`` nor a test feature)."""
    names = list(store.split_names or [])
    if store.image_split is None or "test" not in names:
        return store
    test = names.index("test")
    keep = torch.nonzero(store.image_split != test).flatten()
    sub = store.subset(keep)
    assert sub.image_split is not None
    split = sub.image_split.clone()
    split[split > test] -= 1
    return dataclasses.replace(
        sub, image_split=split, split_names=[n for n in names if n != "test"]
    )


def tuning_store(store: FeatureStore, val_fraction: float = 0.1, seed: int = 0) -> FeatureStore:
    """The store tuning trains and selects on: without test, with a "val" split (the store's own,
    or the seeded hold-out of train images the trainer would make)."""
    from curvalign.train.validation import validation_store

    tuned, info = validation_store(without_test(store), val_fraction, seed, data="tuning data")
    if info["source"] == "none":
        raise ConfigError(f"cannot tune on this data: {info['reason']} (no validation split)")
    return tuned


# --- search space -----------------------------------------------------------------------------


def space_of(recipe: str, lr_range: tuple[float, float] | None = None) -> dict[str, Any]:
    """The recipe's declared search space, its lr knob widened to cover ``lr_range`` too.

    The test widens the declared range around the paper rate and never narrows it: a short ramp
    on one seed sets a range, not a rate (read on the training loss, it suggested [3.3e-3, 0.1]
    for ``clip`` on ``wordnet:mammal.n.01``, whose best validation comes at its paper rate 5e-4;
    it now reads the validation error, and the declared range still stays searchable)."""
    from curvalign.recipes import get_recipe
    from curvalign.recipes.base import Knob

    space = dict(get_recipe(recipe).search_space())
    if lr_range is not None and "lr" in space:
        declared = space["lr"]
        assert declared.low is not None and declared.high is not None  # a float knob's range
        low, high = min(lr_range[0], declared.low), max(lr_range[1], declared.high)
        space["lr"] = Knob(
            "float", low, high, log=True, why=f"{declared.why}, widened by the lr range test"
        )
    return space


def startup_trials(trials: int) -> int:
    """TPE's random start-up (and the pruner's) for a budget of ``trials``: a third of the
    budget, at least one (trial 0, the defaults, is one of them). TPE's own default of 10 would
    make 10 of 12 trials random."""
    return max(1, trials // 3)


def default_config(spec: RunSpec, store: FeatureStore) -> RunConfig:
    """The recipe's default configuration on ``store`` as a run resolves it: ``spec`` (the
    user's settings applied) with the data-dependent initial values resolved from the train
    features."""
    from curvalign.config import resolve_data_init

    return resolve_data_init(spec.config, store)


def _config_value(config: RunConfig, key: str) -> Any:
    if key in {f.name for f in dataclasses.fields(config.train)}:
        return getattr(config.train, key)
    return config.recipe_config.get(key)


def default_point(space: Mapping[str, Knob], config: RunConfig) -> dict[str, Any]:
    """The point of ``space`` that is the configuration ``config`` (a ``RunConfig``, e.g.
    ``default_config``): each knob's config value, a knob's own ``default`` where it is not a
    config field (a factor: 1.0)."""
    point: dict[str, Any] = {}
    for name, knob in space.items():
        if knob.default is not None:
            value = knob.default
        elif knob.factor_of:
            value = 1.0
        else:
            value = _config_value(config, name)
        if value is None:
            raise ConfigError(
                f"recipe {config.recipe!r}: the search-space knob {name!r} has no default value "
                "(neither a config value nor a Knob default)"
            )
        if knob.kind == "float":
            value = float(value)
        elif knob.kind == "int":
            value = int(value)
        point[name] = value
    return point


def fit_defaults(
    space: Mapping[str, Knob], point: Mapping[str, Any]
) -> tuple[dict[str, Knob], list[str]]:
    """``space`` with every knob widened to hold its default in ``point`` (a range's end moved
    to the default, a missing choice added): trial 0 must be a point of the space TPE models.
    Returns the space and one line per widened knob."""
    from curvalign.recipes.base import Knob

    out, notes = dict(space), []
    for name, knob in space.items():
        value = point[name]
        if knob.contains(value):
            continue
        if knob.kind == "choice":
            out[name] = dataclasses.replace(knob, choices=(*knob.choices, value))
            notes.append(f"{name}: the default {value!r} added to the choices")
            continue
        if knob.log and value <= 0:
            raise ConfigError(
                f"the search-space knob {name!r} is on a log scale but its default is {value}"
            )
        low, high = min(knob.low, value), max(knob.high, value)
        out[name] = Knob(**{**dataclasses.asdict(knob), "low": low, "high": high})
        notes.append(f"{name}: range widened to [{low:.3g}, {high:.3g}] to hold the default")
    return out, notes


def trial_overrides(
    recipe_cls: type[Recipe],
    space: Mapping[str, Knob],
    params: Mapping[str, Any],
    config: RunConfig,
) -> dict[str, Any]:
    """Config overrides {key: value} of one sampled point: a factor knob (``Knob.factor_of``)
    times the data-resolved values of its keys in ``config``, the other knobs through the
    recipe's ``search_overrides``."""
    factors = {k: v for k, v in params.items() if k in space and space[k].factor_of}
    out = recipe_cls.search_overrides({k: v for k, v in params.items() if k not in factors})
    for name, factor in factors.items():
        for key in space[name].factor_of:
            base = _config_value(config, key)
            if base is None:
                raise ConfigError(
                    f"recipe {config.recipe!r}: knob {name!r} scales {key!r}, which the data "
                    "did not resolve"
                )
            out[key] = float(base) * float(factor)
    return out


def suggest(trial: Any, space: Mapping[str, Any]) -> dict[str, Any]:
    """One point of ``space`` drawn through an Optuna trial."""
    params: dict[str, Any] = {}
    for name, knob in space.items():
        if knob.kind == "float":
            params[name] = trial.suggest_float(name, knob.low, knob.high, log=knob.log)
        elif knob.kind == "int":
            params[name] = trial.suggest_int(name, int(knob.low), int(knob.high), log=knob.log)
        else:
            params[name] = trial.suggest_categorical(name, list(knob.choices))
    return params


def describe_params(params: Mapping[str, Any]) -> str:
    """``lr=2.1e-03, weight_decay=1.0e-04, learn_curvature=false``: compact, for tables."""
    parts = []
    for key, value in params.items():
        if isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        elif isinstance(value, float):
            parts.append(f"{key}={value:.2g}")
        else:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def require_optuna() -> ModuleType:
    """The ``optuna`` module, or one clear error naming the extra that installs it."""
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "tuning needs Optuna: pip install 'curvalign[tune]' (or pip install optuna)"
        ) from None
    return optuna


# --- the tuning loop ------------------------------------------------------------------------


@dataclass
class TuningResult:
    """What ``run_tuning`` produced. ``best`` = {recipe: {"trial", "value", "params",
    "overrides", "config_file", "best_step", "converged", "defaults" (the best trial is the
    default configuration), "step0" (the step-0 check's codes, "" when it passed), "default_value"
    (trial 0's value)} or None when no trial finished}."""

    metric: str
    direction: str
    trials: int
    steps: int | None
    seed: int
    data: str
    seeds: int = DEFAULT_TRIAL_SEEDS
    best: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)
    lr_ranges: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per recipe: the knobs widened to hold their defaults (``fit_defaults``)
    widened: dict[str, list[str]] = field(default_factory=dict)
    #: per recipe: (trials whose step-0 check fired, counted trials)
    step0_fired: dict[str, tuple[int, int]] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    #: this call's wall time (a resumed tuning counts only its own part)
    wall_seconds: float = 0.0
    #: seconds of every trial in the study per recipe, over all the calls that ran them: what
    #: the tuning cost in trials, resumed or not
    trial_seconds: dict[str, float] = field(default_factory=dict)

    def budget_line(self) -> str:
        pruning = (
            f"median pruning after {round(100 * PRUNE_WARMUP)}% of a trial's steps and after "
            "its recipe's curriculum phases"
            if self.metric == DEFAULT_METRIC
            else "no pruning (the selection metric is not the validation curve)"
        )
        return (
            f"tuning budget: {self.trials} trials per recipe (the same for every recipe), "
            f"trial 0 = the defaults, {self.steps or 'default'} steps each at the re-training's "
            f"validation cadence, Optuna TPE (seed {self.seed}, {startup_trials(self.trials)} "
            f"random start-up trials), {pruning}; selection metric: {metric_label(self.metric)} "
            f"of each trial's best validation weights, mean over {self.seeds} seed(s); the "
            "test split is never read while tuning"
        )


def _counted(study: Any) -> list[Any]:
    """Trials that used up budget: finished (complete, pruned or failed) with a recorded outcome;
    a trial killed mid-way has none and does not count."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
    return [
        t for t in study.get_trials(deepcopy=False) if t.state in done and "outcome" in t.user_attrs
    ]


def _open_study(
    name: str,
    storage: str,
    direction: str,
    settings: Mapping[str, Any],
    notify: Notify,
    pruner: Any = None,
) -> Any:
    """Create or load study ``name``; a loaded one must have the same settings. Trials left
    RUNNING by a killed process are closed as failed (uncounted) and queued to run again (the
    defaults trial stays the defaults trial)."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction=direction,  # type: ignore[arg-type]  # "minimize" or "maximize"
        load_if_exists=True,
        pruner=pruner,
    )
    saved = study.user_attrs.get("settings")
    if saved is None:
        study.set_user_attr("settings", dict(settings))
    elif saved != json.loads(json.dumps(dict(settings))):
        changed = [k for k in STUDY_KEYS if saved.get(k) != json.loads(json.dumps(settings.get(k)))]
        raise ConfigError(
            f"the tuning study {name!r} in {storage} was made with other settings "
            f"({', '.join(changed)} differ); use a new --out or the same settings to resume it"
        )
    if study.direction.name.lower() != direction:
        raise ConfigError(f"study {name!r} optimises the other direction; use a new --out")
    killed = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
    for t in killed:
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        marker = {"defaults": True} if t.user_attrs.get("defaults") else None
        study.enqueue_trial(dict(t.params), user_attrs=marker, skip_if_exists=False)
    if killed:
        notify(f"  {name}: {len(killed)} trial(s) were cut off by a stop; running them again")
    return study


class TrialPruned(Exception):
    """A trial's first seed was stopped by the pruner at ``step``; ``codes``: the step-0
    check's warnings of that seed."""

    def __init__(self, step: int, codes: Sequence[str] = ()) -> None:
        super().__init__(f"pruned at step {step}")
        self.step = step
        self.codes = list(codes)


class TrialHook(TrainerHook):
    """One trial run's trainer hook (``fit``'s ``hooks``): reports each validation to the
    Optuna ``trial`` (``trial.report``) and stops the run (``Decision.STOP``) when the pruner
    says so (``trial.should_prune``), never before ``warmup`` of the run's steps nor before the
    recipe's last phase boundary (``Recipe.phase_steps``); ``trial`` None: no pruning."""

    def __init__(self, trial: optuna.Trial | None = None, warmup: float = PRUNE_WARMUP) -> None:
        self.trial, self.warmup = trial, warmup
        self.pruned_at: int | None = None

    def not_before(self, trainer: Trainer) -> int:
        """The first step at which this run may be pruned."""
        from curvalign.train.trainer import run_steps

        total = run_steps(trainer.train_config)
        phases = tuple(trainer.recipe.phase_steps(total))
        return max(math.ceil(self.warmup * total), max(phases, default=0))

    def on_validation(self, trainer: Trainer, event: ValidationEvent) -> Decision | None:
        if self.trial is None or event.step == 0:
            return None
        self.trial.report(float(event.score), int(event.step))
        if event.step >= self.not_before(trainer) and self.trial.should_prune():
            self.pruned_at = int(event.step)
            return Decision.STOP
        return None


def step0_codes_of(report: Step0Health | None) -> list[str]:
    """The codes of the warnings of a step-0 report (``FitResult.step0``); [] without one."""
    return [] if report is None else report.codes


def _study_overrides(spec: RunSpec) -> dict[str, Any]:
    """What a study records of the user's settings for one recipe: the chosen ones with their
    typed values, without those that say how to run (``RUNTIME_KEYS``)."""
    return {
        key: value
        for key, value in spec.chosen_values().items()
        if key.partition(".")[2] not in RUNTIME_KEYS
    }


def run_tuning(
    recipes: Sequence[str],
    data: str | FeatureStore,
    out_dir: str | Path,
    *,
    trials: int,
    steps: int | None = None,
    overrides: Iterable[str] = (),
    metric: str = DEFAULT_METRIC,
    seed: int = 0,
    seeds: int = DEFAULT_TRIAL_SEEDS,
    lr_range_steps: int = DEFAULT_LR_RANGE_STEPS,
    show_progress: bool = False,
    notify: Notify | None = None,
    max_trials_this_call: int | None = None,
    towers: str | TowersConfig | None = None,
    keep_runs: bool = False,
) -> TuningResult:
    """Tune every recipe with ``trials`` trials on ``data``'s train/validation images (module
    docstring), each trial the mean over ``seeds`` training seeds, writing into ``out_dir``. A
    second call on the same ``out_dir`` continues each study until it holds ``trials`` counted
    trials (``max_trials_this_call`` stops this call after that many new trials, for tests).

    ``overrides``: ``key=value`` for every recipe, ``NAME.key=value`` for recipe NAME, parsed
    once into each recipe's ``RunSpec``; a trial is that spec with its point's values
    (``RunSpec.with_values``), trained by ``train.fitting.fit`` in memory (``keep_runs``: each
    seed's run written under ``out/runs/NAME/trial-N/seed-S`` and kept). ``towers`` (a
    ``TowersConfig`` or its string): every trial trains them in front of the heads; the
    selection metric is then the validation curve (``mean_r1``, re-encoded by the trial's
    towers) and there is no learning-rate range test (it ramps heads on the store's features).
    """
    from curvalign.report.benchmark import check_recipes_against_data, check_towers_request
    from curvalign.stats import curve_converged

    started = time.perf_counter()
    notify = notify or (lambda message: None)
    recipes = list(recipes)
    require_optuna()
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError(f"--tune needs a number of trials >= 1, got {trials!r}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"tuning needs a number of seeds per trial >= 1, got {seeds!r}")
    full, spec = load_store(data)
    store = tuning_store(full, seed=seed)
    towers_config = check_towers_request(towers, recipes, store, spec)
    if towers_config is not None and metric != DEFAULT_METRIC:
        raise ConfigError(
            f"tuning with towers selects on {DEFAULT_METRIC} (the validation curve, re-encoded "
            f"by each trial's towers), not {metric!r}"
        )
    specs = check_recipes_against_data(
        recipes, store, spec, overrides, steps=steps, towers=towers_config
    )
    direction = metric_direction(metric)
    if metric != DEFAULT_METRIC:
        _check_metric(metric, specs[recipes[0]], store)
    if towers_config is not None and lr_range_steps > 0:
        notify("  no lr range test with towers (it ramps heads on the store's features)")
        lr_range_steps = 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(out / STUDY_DB).resolve()}"
    optuna = require_optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    result = TuningResult(metric, direction, trials, steps, seed, spec, seeds=seeds)
    settings = {
        "metric": metric,
        "steps": steps,
        "trials": trials,
        "seed": seed,
        "seeds": seeds,
        "protocol": PROTOCOL,
        "data": spec,
        "overrides": {name: _study_overrides(specs[name]) for name in recipes},
        "towers": None if towers_config is None else towers_config.to_dict(),
    }
    startup = startup_trials(trials)
    prune = metric == DEFAULT_METRIC
    studies: dict[str, Any] = {}
    new_trials = 0
    for i, name in enumerate(recipes, 1):
        from curvalign.recipes import get_recipe

        recipe_cls = get_recipe(name)
        pruner = optuna.pruners.MedianPruner(n_startup_trials=startup) if prune else None
        study = _open_study(name, storage, direction, settings, notify, pruner)
        studies[name] = study
        lr_range = _lr_range(name, store, out, study, specs[name], lr_range_steps, notify)
        if lr_range is not None:
            result.lr_ranges[name] = lr_range
        defaults = default_config(specs[name], store)
        space = space_of(name, tuple(lr_range["suggested"]) if lr_range else None)
        point = default_point(space, defaults)
        space, widened = fit_defaults(space, point)
        result.widened[name] = widened
        for line in widened:
            notify(f"  {name}: {line}")
        if not study.trials:  # trial 0: the defaults, run without any tuned override
            study.enqueue_trial(point, user_attrs={"defaults": True})
        while len(_counted(study)) < trials:
            if max_trials_this_call is not None and new_trials >= max_trials_this_call:
                break
            # reseeded by the trials already drawn: a resumed study continues, never replays
            study.sampler = optuna.samplers.TPESampler(
                seed=seed + len(study.trials), n_startup_trials=startup
            )
            trial = study.ask()
            params = suggest(trial, space)
            is_default = bool(trial.user_attrs.get("defaults"))
            tuned = {} if is_default else trial_overrides(recipe_cls, space, params, defaults)
            number = len(_counted(study)) + 1
            what = "the defaults: " if is_default else ""
            notify(
                f"[{i}/{len(recipes)}] {name} trial {number}/{trials}: {what}"
                f"{describe_params(params)}"
            )
            t0 = time.perf_counter()
            trial.set_user_attr("tuned", json.loads(json.dumps(tuned)))
            try:
                runs = _run_trial(
                    specs[name].with_values(tuned),
                    store,
                    out / "runs" / name / f"trial-{trial.number}" if keep_runs else None,
                    [seed + k for k in range(seeds)],
                    metric,
                    trial if prune and not is_default else None,
                    show_progress,
                )
                value = math.fsum(r["value"] for r in runs) / len(runs)
                first = runs[0]
                codes = list(dict.fromkeys(c for r in runs for c in r["step0"]))
                trial.set_user_attr("best_step", first["best_step"])
                trial.set_user_attr("last_step", first["last_step"])
                trial.set_user_attr("converged", curve_converged(first["history"]))
                trial.set_user_attr("val_history", first["history"])
                trial.set_user_attr("seed_values", [r["value"] for r in runs])
                trial.set_user_attr("val_every", first["val_every"])
                trial.set_user_attr("step0", "; ".join(codes))
                trial.set_user_attr("seconds", time.perf_counter() - t0)
                trial.set_user_attr("outcome", "ok")
                study.tell(trial, value)
                per_seed = ", ".join(f"{r['value']:.4f}" for r in runs)
                flag = f"; step-0 check: {', '.join(codes)}" if codes else ""
                notify(
                    f"    {metric_label(metric)} {value:.4f} (seeds: {per_seed}; best step "
                    f"{first['best_step']}){flag}"
                )
            except TrialPruned as pruned:
                trial.set_user_attr("seconds", time.perf_counter() - t0)
                trial.set_user_attr("step0", "; ".join(pruned.codes))
                trial.set_user_attr(
                    "outcome",
                    f"pruned at step {pruned.step} (below the median of earlier trials there)",
                )
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                notify(f"    pruned at step {pruned.step}")
            except (CurvalignError, RuntimeError, ValueError) as err:
                if str(err).startswith("interrupted"):
                    raise
                trial.set_user_attr("seconds", time.perf_counter() - t0)
                trial.set_user_attr("outcome", f"failed: {err}")
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                notify(f"    failed: {err}")
            new_trials += 1
        counted = _counted(study)
        result.counted[name] = len(counted)
        result.trial_seconds[name] = sum(float(t.user_attrs.get("seconds", 0.0)) for t in counted)
        result.step0_fired[name] = (
            sum(bool(t.user_attrs.get("step0")) for t in counted),
            len(counted),
        )
        result.best[name] = _best_of(study, recipe_cls, specs[name], out)
    result.files["study"] = out / STUDY_DB
    result.files["trials_csv"] = write_trials_csv(studies, out / TRIALS_CSV, metric)
    result.files["history_png"] = plot_history(studies, out / "history.png", metric)
    result.wall_seconds = time.perf_counter() - started
    result.files["json"] = _write_tuning_json(result, out / "tuning.json")
    return result


def _run_trial(
    spec: RunSpec,
    store: FeatureStore,
    run_dir: Path | None,
    seeds: Sequence[int],
    metric: str,
    trial: Any,
    show_progress: bool,
) -> list[dict[str, Any]]:
    """Train one configuration (``spec``) once per seed with ``fit`` (in memory; ``run_dir``:
    each seed's run written under ``run_dir/seed-S`` and kept); the first seed reports to
    ``trial`` for pruning (``TrialHook`` among ``fit``'s hooks), the others run only when it
    was not pruned. Per seed {"value" (read from the ``FitResult``), "best_step",
    "last_step", "history", "val_every", "step0" (codes)}. Raises ``TrialPruned``."""
    from curvalign.train.fitting import fit

    runs = []
    for k, seed in enumerate(seeds):
        hook = TrialHook(trial if k == 0 else None)
        result = fit(
            spec.with_train(seed=seed),
            None if run_dir is None else run_dir / f"seed-{seed}",
            data=store,
            hooks=[hook],
            overwrite=True,
            show_progress=show_progress,
        )
        if hook.pruned_at is not None:
            raise TrialPruned(hook.pruned_at, step0_codes_of(result.step0))
        if result.best_val is None:
            raise ConfigError("the trial ran without validation (val_every=0?)")
        runs.append(
            {
                "value": _value_of(result, store, metric),
                "best_step": result.best_step,
                "last_step": result.last_step,
                "history": [list(item) for item in result.val_history],
                "val_every": result.config.train.val_every,
                "step0": step0_codes_of(result.step0),
            }
        )
    return runs


def _check_metric(metric: str, spec: RunSpec, store: FeatureStore) -> None:
    """Fail before any training when ``metric`` is not a number ``evaluate`` gives on this data."""
    from curvalign.eval import evaluate
    from curvalign.report.benchmark import metric_leaves
    from curvalign.train.trainer import start_of_run

    model = start_of_run(spec.config, store)
    leaves = metric_leaves(evaluate(model, store, split="val", diagnostics=False).to_json())
    if leaves.get(metric) is None:
        known = ", ".join(sorted(k for k, v in leaves.items() if v is not None))
        raise ConfigError(
            f"selection metric {metric!r} is not computed on this data; choose {DEFAULT_METRIC} "
            f"or one of: {known}"
        )


def _value_of(result: FitResult, store: FeatureStore, metric: str) -> float:
    """A trial seed's value: the best validation (``mean_r1``) of the ``FitResult``, or
    ``metric`` of its best validation weights (``result.recipe``) on the validation split."""
    from curvalign.eval import evaluate

    if metric == DEFAULT_METRIC:
        assert result.best_val is not None
        return float(result.best_val)
    value = evaluate(result.recipe, store, split="val", diagnostics=False).metric(metric)
    if value is None or not math.isfinite(float(value)):
        raise ConfigError(f"selection metric {metric!r} is not a finite number for this trial")
    return float(value)


def _lr_range(
    name: str,
    store: FeatureStore,
    out: Path,
    study: Any,
    spec: RunSpec,
    steps: int,
    notify: Notify,
) -> dict[str, Any] | None:
    """The recipe's learning-rate range test (kept in the study, so a resumed run reuses it)."""
    from curvalign.train.lr_range import lr_range_test

    if steps <= 0:
        return None
    saved = study.user_attrs.get("lr_range")
    if saved is not None:
        return None if saved.get("uninformative") else saved
    # the ramp sets its own rates and length; only the paper's other settings and the user's
    # chosen ones apply
    ramp_keys = {"train.lr", "train.val_every", "train.patience", "train.steps"}
    kept = {k: v for k, v in spec.chosen_values().items() if k not in ramp_keys}
    try:
        found = lr_range_test(name, store, steps=steps, overrides=kept)
    except CurvalignError as err:
        notify(f"  {name}: lr range test failed ({err}); the declared lr range is used")
        return None
    notify(f"  lr range test: {found.describe()}")
    reading = found.to_json()
    (out / "lr_range").mkdir(parents=True, exist_ok=True)
    plot_lr_range(found, out / "lr_range" / f"{name}.png")  # the curve, used or not
    if found.lrs and found.at_minimum <= found.lrs[0]:
        # the curve rose from the ramp's first rate on: a curriculum or a schedule that changes
        # the loss as the ramp runs (DualPath's phases), or a validation that no rate improved;
        # nothing to read
        notify(
            f"  {name}: the {found.curve_label} was lowest at the ramp's first rate; the "
            "declared lr range is used"
        )
        study.set_user_attr("lr_range", {**reading, "uninformative": True})
        return None
    study.set_user_attr("lr_range", reading)
    return reading


def best_trial(study: Any) -> Any:
    """The best completed trial: the highest value (lowest for a minimised metric), ties to the
    earlier trial, so trial 0 (the defaults) wins every tie. None when no trial completed."""
    from optuna.trial import TrialState

    done = [t for t in _counted(study) if t.state == TrialState.COMPLETE and t.value is not None]
    if not done:
        return None
    sign = -1.0 if study.direction.name.lower() == "minimize" else 1.0
    return max(done, key=lambda t: (sign * float(t.value), -t.number))


def _defaults_trial(study: Any) -> Any:
    from optuna.trial import TrialState

    return next(
        (
            t
            for t in _counted(study)
            if t.user_attrs.get("defaults") and t.state == TrialState.COMPLETE
        ),
        None,
    )


def _best_of(
    study: Any, recipe_cls: type[Recipe], spec: RunSpec, out: Path
) -> dict[str, Any] | None:
    """The best completed trial and its configuration (``spec`` with the trial's values)
    written as ``best/NAME.yaml``."""
    best = best_trial(study)
    if best is None:
        return None
    name = spec.recipe
    # the values the trial ran with (none for the defaults trial; a factor knob resolved)
    tuned = best.user_attrs.get("tuned")
    if tuned is None:
        tuned = recipe_cls.search_overrides(best.params)
    config = spec.with_values(tuned).config.to_dict()
    path = out / "best" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    what = "the default configuration, " if best.user_attrs.get("defaults") else ""
    header = (
        f"# {name}: the best of {len(_counted(study))} tuning trials ({what}trial {best.number}, "
        f"value {best.value:.4f}); train it with: curvalign train --config {path.name} --out DIR\n"
    )
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(header + yaml.safe_dump(config, sort_keys=False))
    tmp.replace(path)
    default = _defaults_trial(study)
    return {
        "trial": best.number,
        "value": best.value,
        "params": dict(best.params),
        "overrides": dict(tuned),
        "config_file": path,
        "best_step": best.user_attrs.get("best_step"),
        "converged": best.user_attrs.get("converged"),
        "defaults": bool(best.user_attrs.get("defaults")),
        "step0": best.user_attrs.get("step0", ""),
        "default_value": None if default is None else default.value,
    }


def write_trials_csv(studies: Mapping[str, Any], path: Path, metric: str) -> Path:
    """One row per trial of every study: recipe, trial, defaults ("yes" for the default
    configuration), state, value (the mean over seeds), the per-seed values, outcome, step-0
    check ("ok" or the codes of its warnings), validation cadence, best step, converged,
    seconds, then one column per knob."""
    rows, knobs = [], []
    for name, study in studies.items():
        for t in study.get_trials(deepcopy=False):
            for k in t.params:
                if k not in knobs:
                    knobs.append(k)
            finished = "outcome" in t.user_attrs
            rows.append(
                {
                    "recipe": name,
                    "trial": t.number,
                    "defaults": "yes" if t.user_attrs.get("defaults") else "",
                    "state": t.state.name.lower(),
                    "metric": metric,
                    "value": "" if t.value is None else f"{t.value:.6g}",
                    "seed_values": " ".join(
                        f"{v:.6g}" for v in t.user_attrs.get("seed_values", [])
                    ),
                    "outcome": t.user_attrs.get("outcome", "cut off (not counted)"),
                    "step0": (t.user_attrs.get("step0") or "ok")
                    if finished and "step0" in t.user_attrs
                    else "",
                    "val_every": t.user_attrs.get("val_every", ""),
                    "best_step": t.user_attrs.get("best_step", ""),
                    "converged": t.user_attrs.get("converged", ""),
                    "seconds": f"{t.user_attrs.get('seconds', 0.0):.1f}",
                    **{k: v for k, v in t.params.items()},
                }
            )
    fields = [
        "recipe",
        "trial",
        "defaults",
        "state",
        "metric",
        "value",
        "seed_values",
        "outcome",
        "step0",
        "val_every",
        "best_step",
        "converged",
        "seconds",
        *knobs,
    ]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def plot_history(studies: Mapping[str, Any], path: Path, metric: str) -> Path:
    """Optimisation history: each finished trial's value and the best so far, per recipe."""
    from optuna.trial import TrialState

    from curvalign.report.plots import plt, save_figure  # plots chose the Agg backend

    fig, ax = plt.subplots(figsize=(7, 4))
    minimize = metric_direction(metric) == "minimize"
    for name, study in studies.items():
        done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if not done:
            continue
        xs = list(range(1, len(done) + 1))
        ys = [float(t.value) for t in done]
        best, running = [], None
        for y in ys:
            running = y if running is None else (min if minimize else max)(running, y)
            best.append(running)
        (line,) = ax.plot(xs, best, label=f"{name} (best so far)")
        ax.scatter(xs, ys, color=line.get_color(), s=14, alpha=0.6)
    scale = "" if metric_direction(metric) == "minimize" else " (fraction)"
    ax.set_xlabel("finished trial")
    ax.set_ylabel(metric_label(metric) + scale)
    ax.set_title("tuning history (dots: trials; lines: best so far)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_lr_range(found: LRRangeResult, path: Path) -> Path:
    """The curve read (validation error or training loss) against learning rate (log axis) of
    one range test, the suggested range shaded."""
    from curvalign.report.plots import plt, save_figure  # plots chose the Agg backend

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(found.lrs, found.losses, alpha=0.35, label=found.curve_label)
    ax.plot(found.lrs, found.smoothed, label="smoothed")
    low, high = found.suggested
    ax.axvspan(low, high, alpha=0.15, color="green", label="suggested range")
    ax.axvline(found.at_minimum, ls="--", color="grey", lw=1, label="smoothed minimum")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(found.curve_label)
    ax.set_title(f"lr range test: {found.recipe}")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def _write_tuning_json(result: TuningResult, path: Path) -> Path:
    from curvalign.report.tables import write_json

    return write_json(
        path,
        {
            "metric": result.metric,
            "direction": result.direction,
            "trials": result.trials,
            "steps": result.steps,
            "seed": result.seed,
            "seeds": result.seeds,
            "startup_trials": startup_trials(result.trials),
            "data": result.data,
            "budget": result.budget_line(),
            "counted": result.counted,
            "best": result.best,
            "widened": result.widened,
            "step0_fired": {n: list(v) for n, v in result.step0_fired.items()},
            "lr_ranges": {
                n: {
                    k: v
                    for k, v in r.items()
                    if k in ("suggested", "at_minimum", "steepest", "read_on")
                }
                for n, r in result.lr_ranges.items()
            },
            "wall_seconds": result.wall_seconds,
            "trial_seconds": result.trial_seconds,
        },
    )


# --- the benchmark of tuned configurations ----------------------------------------------------


def tuned_description(best: Mapping[str, Any]) -> str:
    """The tuned row's configuration cell: its knobs, "= the defaults" when the default
    configuration won, and "⚠ step-0: CODES" when its step-0 check fired."""
    text = describe_params(best["params"])
    if best.get("defaults"):
        text = f"= the defaults ({text})"
    if best.get("step0"):
        text += f" ⚠ step-0: {best['step0']}"
    return text


def _arm_names(arm: str, recipes: Sequence[str]) -> dict[str, str]:
    """{row of a sub-benchmark: its name in the merged table} for the recipe rows of ``arm``:
    "NAME (arm)", "NAME (arm, step 0)"; baselines are not in it (they keep their names)."""
    from curvalign.report.benchmark import untrained_row

    names: dict[str, str] = {}
    for name in recipes:
        names[name] = f"{name} ({arm})"
        names[untrained_row(name)] = f"{name} ({arm}, step 0)"
    return names


def _renamed(result: Any, arm: str, recipes: Sequence[str]) -> tuple[dict, dict, dict]:
    """(stats, results, rows) of one sub-benchmark with its recipe rows renamed by ``arm``:
    "NAME (paper)", "NAME (paper, step 0)"; baselines keep their names."""
    names = _arm_names(arm, recipes)
    stats = {names.get(k, k): v for k, v in result.stats.items()}
    results = {names.get(k, k): v for k, v in result.results.items()}
    rows = {}
    for key, row in result.rows.items():
        if row.recipe is not None:
            untrained = names.get(row.untrained, row.untrained) if row.untrained else None
            row = dataclasses.replace(row, untrained=untrained, arm=arm)
        rows[names.get(key, key)] = row
    return stats, results, rows


def _best(tuning: TuningResult, name: str) -> dict[str, Any]:
    """The best trial of recipe ``name`` (``TuningResult.best``), which finished."""
    best = tuning.best.get(name)
    assert best is not None, name
    return best


def run_tuned_benchmark(
    recipes: Sequence[str],
    data: str | FeatureStore,
    out_dir: str | Path,
    *,
    trials: int,
    steps: int | None = None,
    overrides: Iterable[str] = (),
    metric: str = DEFAULT_METRIC,
    seeds: int = DEFAULT_TUNED_SEEDS,
    split: str = "test",
    seed: int = 0,
    lr_range_steps: int = DEFAULT_LR_RANGE_STEPS,
    show_progress: bool = False,
    notify: Notify | None = None,
    towers: str | TowersConfig | None = None,
) -> Any:
    """``run_tuning`` into ``out/tuning``, then a benchmark of the paper defaults (``out/paper``)
    and of each recipe's best configuration (``out/tuned``) over the same ``seeds`` seeds
    (paired), both evaluated once on ``split``; writes ``out/results.md`` / ``results.json``
    with, per recipe, the paper-default row and the tuned row (its configuration beside it), the
    step-0, frozen (or ridge) and chance rows, and the tuning budget in the header. Returns the
    merged ``BenchmarkResult``. ``towers``: every trial and every re-trained run trains them in
    front of the heads (``run_tuning``, ``run_benchmark``). The tuned arm trains each recipe's
    ``RunSpec`` with its best trial's values (``RunSpec.with_values``)."""
    from curvalign.report.benchmark import (
        BenchmarkResult,
        check_recipes_against_data,
        check_towers_request,
        run_benchmark,
        write_benchmark_outputs,
    )

    started = time.perf_counter()
    notify = notify or (lambda message: None)
    recipes = list(recipes)
    overrides = list(overrides)
    out = Path(out_dir)
    store, spec = load_store(data)
    store.meta.setdefault("spec", spec)  # the sub-runs and best/NAME.yaml name the data by it
    notify(f"tuning {', '.join(recipes)}: {trials} trials each on {spec} (test split left out)")
    tuning = run_tuning(
        recipes,
        store,
        out / "tuning",
        trials=trials,
        steps=steps,
        overrides=overrides,
        metric=metric,
        seed=seed,
        lr_range_steps=lr_range_steps,
        show_progress=show_progress,
        notify=notify,
        towers=towers,
    )
    notify(f"paper defaults: {seeds} seed(s) per recipe")
    paper = run_benchmark(
        recipes,
        store,
        out / "paper",
        steps=steps,
        overrides=overrides,
        split=split,
        seeds=seeds,
        show_progress=show_progress,
        notify=notify,
        plots=False,
        title="paper defaults",
        towers=towers,
    )
    tuned_names = [n for n in recipes if tuning.best.get(n)]
    merged = BenchmarkResult({}, {}, {}, {}, data=spec, steps=steps, seeds=list(paper.seeds))
    stats, results, rows = _renamed(paper, "paper", recipes)
    tuned = None
    if tuned_names:
        notify(f"tuned configurations: {seeds} seed(s) per recipe")
        towers_config = check_towers_request(towers, tuned_names, store, spec)
        paper_specs = check_recipes_against_data(
            tuned_names, store, spec, overrides, steps=steps, towers=towers_config
        )
        tuned_specs = {
            n: paper_specs[n].with_values(_best(tuning, n)["overrides"]) for n in tuned_names
        }
        tuned = run_benchmark(
            tuned_names,
            store,
            out / "tuned",
            steps=steps,
            specs=tuned_specs,
            towers=towers_config,
            split=split,
            seeds=seeds,
            show_progress=show_progress,
            notify=notify,
            plots=False,
            title="tuned configurations",
        )
        t_stats, t_results, t_rows = _renamed(tuned, "tuned", tuned_names)
        baselines = {k for k, r in t_rows.items() if r.recipe is None}
        stats.update({k: v for k, v in t_stats.items() if k not in baselines})
        results.update({k: v for k, v in t_results.items() if k not in baselines})
        rows.update({k: v for k, v in t_rows.items() if k not in baselines})
    # table order: per recipe paper then tuned, then their step-0 rows, then the baselines
    order = [f"{n} ({arm})" for n in recipes for arm in ("paper", "tuned")]
    order += [f"{n} ({arm}, step 0)" for n in recipes for arm in ("paper", "tuned")]
    order += [k for k in rows if k not in order]
    merged.stats = {k: stats[k] for k in order if k in stats}
    merged.results = {k: results[k] for k in order if k in results}
    merged.rows = {k: rows[k] for k in order if k in rows}
    merged.absent = dict(paper.absent)
    for name in recipes:
        if name not in tuned_names:
            merged.absent[f"{name} (tuned)"] = "no tuning trial finished (see trials.csv)"
    for sub, arm in ((paper, "paper"), (tuned, "tuned")):
        if sub is None:
            continue
        # the per-item results behind the gain intervals: recipe rows of both arms, the
        # baselines from the paper arm (the tuned arm evaluates the same ones again)
        names = _arm_names(arm, recipes if arm == "paper" else tuned_names)
        for source, target in ((sub.items, merged.items), (sub.item_hits, merged.item_hits)):
            for key, value in source.items():
                if arm == "paper" or key in names:
                    target[names.get(key, key)] = value
        for name, dirs in sub.run_dirs.items():
            merged.run_dirs[f"{name} ({arm})"] = dirs
            merged.train_seconds[f"{name} ({arm})"] = sub.train_seconds.get(name, 0.0)
            merged.eval_seconds[f"{name} ({arm})"] = sub.eval_seconds.get(name, 0.0)
    merged.notes = [
        tuning.budget_line() + ".",
        f"Each tuned configuration (best trial per recipe, `{out / 'tuning' / 'best'}/NAME.yaml`) "
        f"and each paper default re-trained over the same {seeds} seeds, evaluated once on "
        f"'{split}'.",
    ]
    fired = [f"{n} {k}/{total}" for n, (k, total) in tuning.step0_fired.items() if k and total]
    merged.notes.append(
        "Trials whose step-0 health check fired (trials.csv, column step0): "
        + (", ".join(fired) if fired else "none")
        + "; a tuned configuration marked ⚠ fired it."
    )
    merged.extra_columns = {
        "configuration": [(f"{n} (paper)", "paper defaults") for n in recipes]
        + [(f"{n} (tuned)", tuned_description(_best(tuning, n))) for n in tuned_names]
    }
    merged.wall_seconds = time.perf_counter() - started
    merged.files = write_benchmark_outputs(
        merged, out, None, None, f"tuned benchmark ({trials} trials per recipe)"
    )
    merged.files.update({f"tuning_{k}": v for k, v in tuning.files.items()})
    return merged
