"""Benchmark orchestration: train several recipes on the same data with the same budget, evaluate
each with ``curvalign.eval.evaluate``, and write a side-by-side table and plots.

This module (unlike ``curvalign.eval``) drives the trainer. Every recipe gets the same data, the
same steps, batch size and seed; only the recipe differs. ``key=value`` overrides apply to every
recipe; ``NAME.key=value`` (e.g. ``phyclip.num_factors=16``) only to recipe NAME.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from curvalign.data import load_store
from curvalign.data.encoders import disclosure_note
from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError, CurvalignError
from curvalign.eval.result import EvaluationResult
from curvalign.eval.ridge import ROW_NAME as RIDGE_ROW
from curvalign.recipes.agr import AGR
from curvalign.recipes.atmg import Atmg
from curvalign.recipes.clip import Clip
from curvalign.recipes.dualpath import DualPath
from curvalign.recipes.hycoclip import Hycoclip
from curvalign.recipes.meru import Meru
from curvalign.recipes.phyclip import Phyclip
from curvalign.recipes.proclip import Proclip

if TYPE_CHECKING:
    from curvalign.eval.pipeline import Evaluation
    from curvalign.eval.ridge import RidgeMap
    from curvalign.runs import LoadedRun
    from curvalign.towers import TowersConfig
    from curvalign.train.fitting import RunSpec

Notify = Callable[[str], None]

#: the demo's defaults: all eight recipes on a small synthetic world, about a minute on 2 CPU cores
DEMO_RECIPES = tuple(
    cls.name for cls in (Clip, Meru, Hycoclip, Atmg, Phyclip, Proclip, AGR, DualPath)
)
DEMO_STEPS = 40
DEMO_WORLD = "synthetic:images=600,text_pairs=400"
#: PHyCLIP at its paper size (k=64 factors of d=8) costs about ten times a MERU step on a CPU; the
#: demo keeps d=8 with k=16 so that all eight recipes fit the one-minute budget
DEMO_OVERRIDES = (
    "batch_size=64",
    "pair_batch_size=32",
    "tensorboard=false",
    "log_every=5",
    "checkpoint_every=0",
    "phyclip.num_factors=16",
)


def demo_overrides(recipes: Sequence[str]) -> list[str]:
    """``DEMO_OVERRIDES`` without the per-recipe ones of recipes the demo does not run."""
    from curvalign.config import parse_override

    out = []
    for item in DEMO_OVERRIDES:
        head, _, rest = parse_override(item)[0].partition(".")
        if rest and head not in recipes:
            continue
        out.append(item)
    return out


#: log keys worth a curve, matched by substring
CURVE_KEYS = ("curvature", "temperature", "routing", "gate", "alpha", "beta")


@dataclass(frozen=True)
class BenchmarkRow:
    """One row of a benchmark table: what it is and how its training went.

    kind       "trained", "untrained" (the same head at step 0), "frozen" or "chance"
    recipe     the recipe's name (None for the frozen-features and chance rows)
    status     "ok" or "failed"; ``reason`` says why a trained row failed
    seeds, best_step, last_step, converged, warnings
               per seed of a trained row (``converged`` None where the curve was too short to
               tell; ``warnings`` prefixed "seed S: ")
    """

    kind: str
    recipe: str | None
    status: str = "ok"
    reason: str | None = None
    seeds: tuple[int, ...] = ()
    best_step: tuple[int, ...] = ()
    last_step: tuple[int, ...] = ()
    converged: tuple[bool | None, ...] = ()
    warnings: tuple[str, ...] = ()
    #: a trained row's own step-0 row (the table compares the two); a baseline's description;
    #: the arm of a tuned benchmark ("paper" or "tuned")
    untrained: str | None = None
    note: str | None = None
    arm: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as results.json holds it (the per-seed fields only for a trained row)."""
        out: dict[str, Any] = {"kind": self.kind, "recipe": self.recipe, "status": self.status}
        out.update({k: v for k, v in (("note", self.note), ("arm", self.arm)) if v is not None})
        if self.kind != "trained":
            return out
        return {
            **out,
            "untrained": self.untrained,
            "reason": self.reason,
            "seeds": list(self.seeds),
            "best_step": list(self.best_step),
            "last_step": list(self.last_step),
            "converged": list(self.converged),
            "warnings": list(self.warnings),
        }

    # dict-style reads, for callers written against the former {field: value} rows
    def get(self, key: str, default: Any = None) -> Any:
        return self.to_json().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]


@dataclass
class BenchmarkResult:
    """What ``run_benchmark`` produced.

    results   {row: mean over seeds, shaped like one ``evaluate`` dict} (tables, plots); rows are
              each trained recipe, each untrained head ("NAME (step 0)"), "frozen features"
              (where it applies) and "chance"
    stats     {row: {metric path: {"mean", "low", "high", "n", "values"}}}: 95% interval over
              seeds and the per-seed values (seed order as ``seeds``)
    rows      {row: BenchmarkRow} (kind trained|untrained|frozen|chance, status, per-seed
              best/last steps, convergence and health warnings of a trained row)
    absent    {row: why it is not in the table} (e.g. frozen features on different spaces)
    seeds     the training seeds, the same for every recipe (paired comparisons)
    """

    results: dict[str, dict[str, Any]]
    run_dirs: dict[str, list[Path]]
    train_seconds: dict[str, float]
    eval_seconds: dict[str, float]
    files: dict[str, Path] = field(default_factory=dict)
    data: str = ""
    steps: int | None = None
    seeds: list[int] = field(default_factory=list)
    stats: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    rows: dict[str, BenchmarkRow] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    wall_seconds: float = 0.0
    #: extra header lines (a tuned benchmark's budget and selection metric)
    notes: list[str] = field(default_factory=list)
    #: extra Markdown table columns {header: [(row, cell)]} (a tuned row's configuration)
    extra_columns: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    #: what the store's encoders were trained on and what of the evaluation they saw
    #: (``meta["trained_on"]``, ``meta["seen_in_training"]``); empty for synthetic data
    disclosure: dict[str, Any] = field(default_factory=dict)
    #: the tower settings every trained row trained with (``TowersConfig.to_dict()``); None when
    #: the heads trained on the store's features
    towers: dict[str, Any] | None = None
    #: {row: per-seed ``RetrievalItems``} (one for a baseline evaluated once): the per-item
    #: retrieval ranks the gain intervals resample; not written to results.json
    items: dict[str, list[Any]] = field(default_factory=dict)
    #: {row: per-seed {metric path: [n] 0/1 per item}} (``Evaluation.hits``: zero-shot top-1 per
    #: image, hard negatives won); not written to results.json
    item_hits: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: what the tables computed once and share (``item_gaps``)
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def log_curve_keys(logs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Logged scalar keys worth plotting: first ``loss``, curvature, temperature, AGR's routing
    weight and gates, then the other matching keys (per-factor summaries, alpha, beta, ...)."""
    seen: dict[str, None] = {}
    for rows in logs.values():
        for row in rows:
            for k, v in row.items():
                if isinstance(v, (int, float)) and any(f in k for f in CURVE_KEYS):
                    seen.setdefault(k, None)
    first = [
        k
        for k in (
            "loss",
            "curvature",
            "curvature/mean",
            "temperature",
            "routing_weight",
            "gate",
            "dualpath_gate",
        )
        if k in seen or (k == "loss" and any("loss" in r for rows in logs.values() for r in rows))
    ]
    return first + [k for k in seen if k not in first]


def untrained_row(name: str) -> str:
    return f"{name} (step 0)"


def metric_leaves(result: object, prefix: str = "") -> dict[str, float | None]:
    """{"a/b": number or None} of the numeric leaves of a nested result dict
    (``EvaluationResult.to_json()``; its "meta" and "diagnostics" left out): the metric paths
    a benchmark summarises and tuning may select on. Anything but a dict gives {}."""
    out: dict[str, float | None] = {}
    if not isinstance(result, dict):
        return out
    for key, value in result.items():
        if not prefix and key in ("meta", "diagnostics"):
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(metric_leaves(value, path + "/"))
        elif value is None:
            out[path] = None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[path] = float(value)
    return out


def _mean_result(evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-seed evaluations averaged leaf by leaf (a leaf None in any seed stays None);
    meta and diagnostics of the first seed."""
    first = evaluations[0]

    def merge(nodes: list[Any]) -> Any:
        if isinstance(nodes[0], dict):
            return {
                k: merge([n.get(k) if isinstance(n, dict) else None for n in nodes])
                for k in nodes[0]
            }
        if all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in nodes):
            return sum(float(n) for n in nodes) / len(nodes)
        return nodes[0] if all(n == nodes[0] for n in nodes) else None

    out = merge(evaluations)
    out["meta"] = first.get("meta", {})
    if "diagnostics" in first:
        out["diagnostics"] = first["diagnostics"]
    return out


def _stats(evaluations: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{metric path: mean, 95% interval over seeds and per-seed values} of numeric leaves."""
    from curvalign.stats import mean_interval

    per_seed = [metric_leaves(e) for e in evaluations]
    out: dict[str, dict[str, Any]] = {}
    for path in per_seed[0]:
        found = [leaves.get(path) for leaves in per_seed]
        if any(v is None or v != v for v in found):
            continue
        values = [v for v in found if v is not None]  # all of them (checked above)
        interval = mean_interval(values)
        out[path] = {**interval.as_dict(), "values": values}
    return out


def check_recipes_against_data(
    recipes: Sequence[str],
    store: FeatureStore,
    spec: str,
    overrides: Iterable[str] = (),
    *,
    steps: int | None = None,
    towers: TowersConfig | None = None,
    specs: Mapping[str, RunSpec] | None = None,
) -> dict[str, RunSpec]:
    """Every recipe's ``RunSpec`` (parsed once from the command's ``key=value`` / ``NAME.key=
    value`` strings, ``train.fitting.per_recipe_overrides``, or the typed ``specs`` given) and
    a check of what it needs of the data, before any training: one error listing every recipe
    that cannot run. Returns {recipe: RunSpec}."""
    from curvalign.recipes import get_recipe
    from curvalign.train.fitting import RunSpec, per_recipe_overrides

    needs = {
        "boxes": (store.has_boxes, "box-level pairs (box_image_features, box_text_features)"),
        "text_pairs": (store.has_text_pairs, "scored text pairs (pair_a/pair_b_features)"),
    }
    per_recipe = per_recipe_overrides(overrides, recipes) if specs is None else {}
    out: dict[str, RunSpec] = {}
    problems: list[str] = []
    refused: set[str] = set()
    for name in recipes:
        try:
            out[name] = (
                RunSpec.parse(name, spec, overrides=per_recipe[name], steps=steps, towers=towers)
                if specs is None
                else dataclasses.replace(specs[name], towers=towers)
            )
        except CurvalignError as err:
            problems.append(f"{name}: {err}")
            continue
        missing = [
            what
            for part, (has, what) in needs.items()
            if part in get_recipe(name).requires and not has
        ]
        if missing:
            problems.append(f"{name} trains on {' and '.join(missing)}, which {spec} has none of")
            refused.add(name)
    if problems:
        runnable = [name for name in recipes if name in out and name not in refused]
        hint = (
            f"; to benchmark the {len(runnable)} that can run, pass --recipes {','.join(runnable)}"
            if runnable and len(runnable) + len(problems) == len(recipes)
            else ""
        )
        raise ConfigError(
            "cannot benchmark on this data (nothing was trained): " + "; ".join(problems) + hint
        )
    return out


def check_towers_request(
    towers: str | TowersConfig | None, recipes: Sequence[str], store: FeatureStore, spec: str
) -> TowersConfig | None:
    """The parsed tower settings of a benchmark, checked before any training: the settings
    themselves, what each recipe needs of tower batches (``check_recipe_parts``) and that every
    feature part of the store can be re-encoded for the evaluation (``check_reencodable``).
    ConfigError with one line otherwise; None without towers."""
    if towers is None:
        return None
    from curvalign.recipes import get_recipe
    from curvalign.towers import TowerError, TowersConfig, check_recipe_parts
    from curvalign.train.towers import check_reencodable

    try:
        config = towers if isinstance(towers, TowersConfig) else TowersConfig.parse(towers)
        for name in recipes:
            check_recipe_parts(
                sorted(get_recipe(name).requires), repr(name), streamed=config.shards is not None
            )
        check_reencodable(store, data=spec, text_locked=config.text == "locked")
    except TowerError as err:
        raise ConfigError(f"cannot benchmark with towers (nothing was trained): {err}") from None
    return config


def towers_note(config: TowersConfig) -> str:
    """The table header line of a tower benchmark."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    settings = ";".join(
        f"{k}={v}" for k, v in config.to_dict().items() if k != "encoder" and v != defaults[k]
    )
    described = f"`{config.encoder}`" + (f"; {settings}" if settings else "")
    return (
        f"Trained rows trained the towers too, every recipe with the same settings ({described}), "
        "and are evaluated on the store re-encoded by each run's best towers; the '(step 0)', frozen, ridge and chance rows read the store's own "
        "features (the frozen towers')."
    )


def ridge_baseline(store: FeatureStore, seed: int) -> RidgeMap | str:
    """The ridge map (``eval/ridge.py``) fit on the train split, its strength chosen on the
    validation split (the store's own, or the trainer's seeded hold-out); a string saying why
    when it cannot be fit."""
    from curvalign.eval.ridge import fit_ridge
    from curvalign.train.validation import validation_store

    try:
        with_val, info = validation_store(store, 0.1, seed, data="the data")
        if info["source"] == "none":
            return f"no validation split to choose its strength on ({info['reason']})"
        return fit_ridge(with_val)
    except CurvalignError as err:
        return str(err)


def _check_benchmark_request(recipes: list[str], seeds: Any) -> None:
    """One clear error for an empty, unknown or repeated recipe list or a bad seed count."""
    from curvalign.recipes import recipe_names

    if not recipes:
        raise ConfigError("no recipes to benchmark")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(
            f"--seeds must be a whole number >= 1 (training runs per recipe), got {seeds!r}"
        )
    known = recipe_names()
    unknown = [r for r in recipes if r not in known]
    if unknown:
        raise ConfigError(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if len(set(recipes)) != len(recipes):
        raise ConfigError(f"recipes listed twice: {', '.join(recipes)}")


@dataclass(frozen=True)
class _Bench:
    """What every training run and evaluation of one benchmark shares."""

    store: FeatureStore
    split: str
    out: Path
    steps: int | None
    show_progress: bool
    notify: Notify
    plots: bool
    #: the tower settings every recipe trains with (``--towers``); None: heads on the features
    towers: TowersConfig | None = None


@dataclass
class _SeedRuns:
    """What the seeds of one trained recipe gave, gathered seed by seed."""

    status: str = "ok"
    reason: str | None = None
    seeds: list[int] = field(default_factory=list)
    best_step: list[int] = field(default_factory=list)
    last_step: list[int] = field(default_factory=list)
    converged: list[bool | None] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    trained: list[EvaluationResult] = field(default_factory=list)
    untrained: list[EvaluationResult] = field(default_factory=list)
    #: per-item retrieval ranks of each seed's evaluations (``Evaluation.items``)
    trained_items: list[Any] = field(default_factory=list)
    untrained_items: list[Any] = field(default_factory=list)
    trained_hits: list[dict[str, Any]] = field(default_factory=list)
    untrained_hits: list[dict[str, Any]] = field(default_factory=list)

    def row(self, name: str) -> BenchmarkRow:
        return BenchmarkRow(
            kind="trained",
            recipe=name,
            status=self.status,
            reason=self.reason,
            seeds=tuple(self.seeds),
            best_step=tuple(self.best_step),
            last_step=tuple(self.last_step),
            converged=tuple(self.converged),
            warnings=tuple(self.warnings),
            untrained=untrained_row(name),
        )


def _evaluate_seed(
    bench: _Bench, seed: int, run_dir: Path, runs: _SeedRuns
) -> tuple[LoadedRun, Evaluation]:
    """Evaluate a trained seed's best validation weights and its untrained head on the split;
    add both to ``runs``. Returns ``(loaded run, full evaluation)`` (the latter's arrays feed
    the plots: one embedding of the split gives the metrics and the arrays)."""
    from curvalign.eval import run_evaluation
    from curvalign.eval.health import health_of_run
    from curvalign.runs import load_run
    from curvalign.train.trainer import start_of_run

    loaded = load_run(run_dir)  # its best validation weights, as saved
    store = bench.store
    if bench.towers is not None:  # the run's features: the store re-encoded by its best towers
        from curvalign.train.towers import load_towers, reencode_store

        store = reencode_store(bench.store, load_towers(run_dir, "best"), data=f"{run_dir}")
    full = run_evaluation(loaded.recipe, store, split=bench.split)
    evaluation = full.metrics.with_run(
        step=loaded.step,
        weights=loaded.weights,
        last_step=loaded.last_step,
        seed=seed,
        run_dir=str(run_dir),
    )
    health = health_of_run(loaded)
    runs.seeds.append(seed)
    runs.best_step.append(loaded.step)
    runs.last_step.append(loaded.last_step)
    runs.converged.append(health.converged)
    runs.warnings += [f"seed {seed}: {w}" for w in health.warnings]
    runs.trained.append(evaluation)
    runs.trained_items.append(full.items)
    runs.trained_hits.append(full.hits)
    # the run's own step 0 (its saved config holds the resolved start); a tower run's untrained
    # row reads the plain store: the frozen towers' features
    untrained = start_of_run(loaded.config, bench.store)
    step0 = run_evaluation(untrained, bench.store, split=bench.split, diagnostics=False)
    runs.untrained.append(step0.metrics)
    runs.untrained_items.append(step0.items)
    runs.untrained_hits.append(step0.hits)
    return loaded, full


def _train_recipe(
    bench: _Bench,
    spec: RunSpec,
    label: str,
    seeds: list[int],
    result: BenchmarkResult,
    plot_inputs: tuple[dict[str, Any], dict[str, Any]],
) -> _SeedRuns:
    """Train and evaluate ``spec`` (one recipe, its towers included) with each seed into
    ``out/runs/NAME/seed-S``; the first failure stops its seeds and marks it failed (Ctrl-C
    stops the whole benchmark). Times and run folders go to ``result``; the first seed's arrays
    and log to ``plot_inputs`` (``(arrays, logs)``)."""
    from curvalign.runs import read_log
    from curvalign.train.fitting import fit

    name = spec.recipe
    runs = _SeedRuns()
    result.run_dirs[name] = []
    result.train_seconds[name] = result.eval_seconds[name] = 0.0
    for k, seed in enumerate(seeds):
        bench.notify(
            f"{label} training {name}, seed {seed}"
            + (f", {bench.steps} steps" if bench.steps else "")
        )
        t = time.perf_counter()
        try:
            run_dir = fit(
                spec.with_train(seed=seed),
                bench.out / "runs" / name / f"seed-{seed}",
                data=bench.store,
                overwrite=True,
                show_progress=bench.show_progress,
            ).run_dir
        except (CurvalignError, RuntimeError) as err:
            if str(err).startswith("interrupted"):
                raise  # Ctrl-C stops the benchmark, not just this recipe
            runs.status, runs.reason = "failed", f"seed {seed}: {err}"
            bench.notify(f"    {name} failed: {err}")
            break
        result.train_seconds[name] += time.perf_counter() - t
        t = time.perf_counter()
        loaded, full = _evaluate_seed(bench, seed, run_dir, runs)
        result.run_dirs[name].append(Path(run_dir))
        if bench.plots and k == 0:
            assert full.arrays is not None
            plot_inputs[0][name] = full.arrays.as_dict()
            plot_inputs[1][name] = read_log(run_dir)
        result.eval_seconds[name] += time.perf_counter() - t
        r = runs.trained[-1].retrieval
        bench.notify(
            f"    {name} seed {seed}: {loaded.describe()}, T2I R@1 {100 * r['t2i@1']:.1f}%, "
            f"I2T R@1 {100 * r['i2t@1']:.1f}%"
        )
    return runs


def _add_baselines(
    bench: _Bench,
    seed: int,
    result: BenchmarkResult,
    evaluations: dict[str, list[dict[str, Any]]],
) -> None:
    """The frozen-features row where the two sides share a space, else the ridge map (fit with
    ``seed``) where it can be fit, and chance; a baseline that does not apply goes to
    ``result.absent`` with its reason. ``evaluations`` {row: per-seed result JSON}
    (``EvaluationResult.to_json()``, chance's ``evaluate``-shaped dict) gets their rows."""
    from curvalign.eval import run_evaluation
    from curvalign.eval.chance import chance_evaluation
    from curvalign.eval.frozen import ROW_NAME, FrozenFeatures, shared_space_reason

    store, split = bench.store, bench.split
    reason = shared_space_reason(store)
    if reason is None:
        frozen = FrozenFeatures(store.image_dim, store.text_dim)
        done = run_evaluation(frozen, store, split=split, diagnostics=False)
        evaluations[ROW_NAME] = [done.metrics.to_json()]
        result.items[ROW_NAME] = [done.items]
        result.item_hits[ROW_NAME] = [done.hits]
        result.rows[ROW_NAME] = BenchmarkRow(kind="frozen", recipe=None)
    else:
        result.absent[ROW_NAME] = reason
        ridge = ridge_baseline(store, seed)
        if isinstance(ridge, str):
            result.absent[RIDGE_ROW] = ridge
        else:
            done = run_evaluation(ridge, store, split=split, diagnostics=False)
            evaluations[RIDGE_ROW] = [done.metrics.to_json()]
            result.items[RIDGE_ROW] = [done.items]
            result.item_hits[RIDGE_ROW] = [done.hits]
            result.rows[RIDGE_ROW] = BenchmarkRow(
                kind="frozen",
                recipe=None,
                note=f"ridge map image->text fit on train, alpha {ridge.alpha:g} chosen on "
                "validation",
            )
    chance = chance_evaluation(store, split=split)
    chance_map = chance_multilabel_map(store, split)
    if chance_map is not None:
        chance["multilabel"] = {"mAP": chance_map}
    evaluations["chance"] = [chance]
    result.rows["chance"] = BenchmarkRow(kind="chance", recipe=None)


def run_benchmark(
    recipes: Sequence[str],
    data: str | FeatureStore,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    overrides: Iterable[str] = (),
    split: str = "test",
    seeds: int = 3,
    show_progress: bool = True,
    notify: Notify | None = None,
    plots: bool = True,
    title: str = "benchmark",
    towers: str | TowersConfig | None = None,
    specs: Mapping[str, RunSpec] | None = None,
) -> BenchmarkResult:
    """Train each recipe with ``seeds`` seeds (the same ones for every recipe: base seed + 0..N-1)
    on ``data`` into ``out_dir/runs/NAME/seed-S`` (replacing earlier runs there), evaluate its best
    validation weights on ``split``, add the baselines (untrained heads, frozen features where
    the two sides share a space, chance), and write ``results.json``, ``results.md`` and PNG plots.

    Every recipe is checked against the data before any training. A recipe that fails while
    training is reported as failed with its reason; the others' results are still written.

    ``towers`` (a ``TowersConfig`` or its ``"SPEC;key=value"`` string, as ``curvalign train
    --towers``): every seed of every recipe trains the same towers in front of its heads
    (``curvalign.train.towers``) and is evaluated on the store re-encoded by its run's best
    towers (``reencode_store``); the step-0, frozen-features, ridge and chance rows read the
    plain store, i.e. the frozen towers' features. The tower settings, the recipes' parts and
    the store's re-encodable parts are checked before any training.

    ``specs``: each recipe's typed ``RunSpec`` (a tuned configuration) instead of ``overrides``
    (which must then be empty); their towers are ``towers``.
    """
    from curvalign.eval.frozen import ROW_NAME

    started = time.perf_counter()
    notify = notify or (lambda message: None)
    recipes = list(recipes)
    _check_benchmark_request(recipes, seeds)
    overrides = list(overrides)
    if specs is not None and overrides:
        raise ConfigError("run_benchmark takes specs or overrides, not both")
    out = Path(out_dir)

    t0 = time.perf_counter()
    store, spec = load_store(data)
    notify(
        f"data {spec}: {store.num_images} images, {store.num_texts} captions "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    towers_config = check_towers_request(towers, recipes, store, spec)
    run_specs = check_recipes_against_data(
        recipes, store, spec, overrides, steps=steps, towers=towers_config, specs=specs
    )
    base_seed = {name: run_specs[name].seed for name in recipes}
    out.mkdir(parents=True, exist_ok=True)

    bench = _Bench(store, split, out, steps, show_progress, notify, plots, towers_config)
    result = BenchmarkResult({}, {}, {}, {}, data=spec, steps=steps)
    if towers_config is not None:
        result.towers = towers_config.to_dict()
        result.notes.append(towers_note(towers_config))
    result.disclosure = {
        k: store.meta[k] for k in ("trained_on", "seen_in_training", "dataset") if k in store.meta
    }
    result.seeds = list(range(seeds))  # offsets; each recipe's seed is its base seed + offset
    evaluations: dict[str, list[dict[str, Any]]] = {}
    logs: dict[str, list[dict[str, Any]]] = {}
    arrays: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(recipes, 1):
        runs = _train_recipe(
            bench,
            run_specs[name],
            f"[{i}/{len(recipes)}]",
            [base_seed[name] + offset for offset in result.seeds],
            result,
            (arrays, logs),
        )
        result.rows[name] = runs.row(name)
        if runs.trained and runs.status == "ok":
            evaluations[name] = [e.to_json() for e in runs.trained]
            evaluations[untrained_row(name)] = [e.to_json() for e in runs.untrained]
            result.items[name] = list(runs.trained_items)
            result.items[untrained_row(name)] = list(runs.untrained_items)
            result.item_hits[name] = list(runs.trained_hits)
            result.item_hits[untrained_row(name)] = list(runs.untrained_hits)
            result.rows[untrained_row(name)] = BenchmarkRow(kind="untrained", recipe=name)
    _add_baselines(bench, min(base_seed.values()), result, evaluations)

    # table order: trained recipes, then the baselines
    order = (
        [n for n in recipes if n in evaluations]
        + [untrained_row(n) for n in recipes if untrained_row(n) in evaluations]
        + [n for n in (ROW_NAME, RIDGE_ROW, "chance") if n in evaluations]
    )
    for name in order:
        result.results[name] = _mean_result(evaluations[name])
        result.stats[name] = _stats(evaluations[name])
    add_chance_rates(result.stats)
    for name in recipes:
        if result.rows[name].status == "failed":
            result.results.setdefault(name, {})
    result.wall_seconds = time.perf_counter() - started
    result.files = write_benchmark_outputs(
        result, out, logs if plots else None, arrays if plots else None, title
    )
    return result


def converged_cells(result: BenchmarkResult) -> list[tuple[str, str]]:
    """(row, "3/3") converged seeds per trained row; "failed" for a failed recipe."""
    out = []
    for name, row in result.rows.items():
        if row.kind != "trained":
            continue
        if row.status == "failed":
            out.append((name, "failed"))
            continue
        flags = row.converged
        known = [f for f in flags if f is not None]
        out.append((name, f"{sum(bool(f) for f in known)}/{len(flags)}" if known else "?"))
    return out


def untrained_seeds(row: BenchmarkRow) -> int:
    """How many seeds of a trained row kept their step-0 weights (best validation at step 0)."""
    return sum(1 for s in row.best_step if s == 0)


#: the metric of the gain columns: mean of T2I and I2T R@1, the benchmark's selection metric
GAIN_METRIC = "mean@1"
#: the retrieval metric paths whose comparisons count the test items (``ItemGaps``)
ITEM_PATHS = {
    **{f"retrieval/{d}@{k}": f"{d}@{k}" for d in ("t2i", "i2t") for k in (1, 5, 10)},
    f"retrieval/{GAIN_METRIC}": GAIN_METRIC,
}


class ItemGaps:
    """Two-level intervals (``stats.two_level_difference``: seeds, then the test items, paired
    across the two rows) of the difference between two rows of a benchmark, from the per-item
    results it kept: the retrieval recalls from the ranks (``BenchmarkResult.items``; the test
    images are resampled with their captions), zero-shot top-1 and hard negatives from their
    0/1 hits (``BenchmarkResult.item_hits``).
    Every comparison of one metric reads the same bootstrap draws (``bootstrap_statistics``,
    made once per metric); ``gap`` is None where the ranks are missing (a tuned benchmark's
    merged rows, chance), so the table falls back to the per-seed values."""

    def __init__(self, result: BenchmarkResult, replicates: int = 1000, seed: int = 0):
        self.result, self.replicates, self.seed = result, replicates, seed
        self._totals: dict[tuple[str, str], list[Any] | None] = {}
        self._boot: dict[str, dict[Any, Any]] = {}
        self._done: dict[tuple[str, str, str], Any] = {}

    def totals(self, row: str, path: str) -> list[Any] | None:
        """Per-seed ``ItemTotals`` of ``row`` on metric ``path`` ("retrieval/t2i@1",
        "zeroshot/top1", ...); None where the row has no per-item results for it."""
        from curvalign.stats import ItemTotals

        key = (row, path)
        if key in self._totals:
            return self._totals[key]
        found: list[Any] | None = None
        if path in ITEM_PATHS:
            items = self.result.items.get(row)
            if items and all(i is not None for i in items):
                found = [i.totals(ITEM_PATHS[path]) for i in items]
        else:
            hits = self.result.item_hits.get(row)
            if hits and all(path in h and len(h[path]) for h in hits):
                found = [ItemTotals.from_values(h[path].double().numpy()) for h in hits]
        self._totals[key] = found
        return found

    def _resampled(self, path: str) -> dict[Any, Any]:
        from curvalign.stats import bootstrap_statistics

        if path not in self._boot:
            rows = set(self.result.items) | set(self.result.item_hits)
            every = [t for row in rows for t in (self.totals(row, path) or [])]
            sizes = {t.size for t in every}
            self._boot[path] = (
                bootstrap_statistics(every, self.replicates, self.seed) if len(sizes) == 1 else {}
            )
        return self._boot[path]

    def gap(self, a: str, b: str, path: str) -> tuple[Any, bool, str] | None:
        """(interval of a - b, excludes 0, "seeds and test items") on ``path``; None when a row
        has no per-item ranks or the two cannot be paired (different seeds or test items)."""
        from curvalign.stats import TwoLevelInterval, two_level_difference

        key = (a, b, path)
        if key in self._done:
            return self._done[key]
        ta, tb = self.totals(a, path), self.totals(b, path)
        found = None
        if ta and tb:
            swap = len(ta) == 1 and len(tb) > 1
            x, y = (tb, ta) if swap else (ta, tb)
            sizes_match = all(t.sums.shape == x[0].sums.shape for t in x + y)
            if len(y) in (1, len(x)) and sizes_match:
                iv = two_level_difference(
                    x, y, self.replicates, self.seed, self._resampled(path) or None
                )
                if swap:
                    iv = TwoLevelInterval(
                        -iv.mean, -iv.high, -iv.low, iv.n, iv.seed_se, iv.item_se, iv.df, iv.items
                    )
                found = (iv, iv.excludes_zero(), "seeds and test items")
        self._done[key] = found
        return found


def item_gaps(result: BenchmarkResult) -> ItemGaps:
    """The benchmark's ``ItemGaps`` (made once per result: the draws are shared by its tables)."""
    gaps = result.cache.get("item_gaps")
    if gaps is None or gaps.result is not result:
        gaps = result.cache["item_gaps"] = ItemGaps(result)
    return gaps


def _seed_gain_stat(stats: dict[str, Any]) -> dict[str, Any] | None:
    """Per-seed mean R@1 values of a row from its T2I and I2T R@1 (the fallback without ranks)."""
    from curvalign.stats import mean_interval

    t, i = stats.get("retrieval/t2i@1"), stats.get("retrieval/i2t@1")
    if not t or not i or len(t["values"]) != len(i["values"]):
        return None
    values = [0.5 * (x + y) for x, y in zip(t["values"], i["values"], strict=True)]
    return {**mean_interval(values).as_dict(), "values": values}


def alignment_row(result: BenchmarkResult) -> str | None:
    """The alignment row the gains are read against: the frozen features where the two sides
    share a space, else the ridge map; None when neither is in the table."""
    return next(
        (n for n, r in result.rows.items() if r.kind == "frozen" and n in result.stats), None
    )


def gains_of(result: BenchmarkResult) -> dict[str, dict[str, dict[str, Any]]]:
    """{trained row: {"alignment": gain, "step 0": gain}}: each trained row's mean R@1 minus
    the alignment row's (frozen features, or the ridge map where the two sides share no space)
    and minus its own step-0 row's. A gain is {"row": the baseline, "mean", "low", "high", "n",
    "better", "how"}: a 95% interval over seeds *and* test items (``ItemGaps``; the baseline's
    own sampling noise included) where the per-item ranks are at hand, else over seeds only
    ("how" says which); "better" True / False where the interval excludes 0 in the row's
    favour / against it, None where it does not."""
    from curvalign.report.tables import gap_interval

    gaps = item_gaps(result)
    path = f"retrieval/{GAIN_METRIC}"
    alignment = alignment_row(result)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, row in result.rows.items():
        if row.kind != "trained" or name not in result.stats:
            continue
        out[name] = {}
        for label, base in (("alignment", alignment), ("step 0", row.untrained)):
            if base is None or base not in result.stats:
                continue
            found = gaps.gap(name, base, path)
            if found is None:
                a, b = _seed_gain_stat(result.stats[name]), _seed_gain_stat(result.stats[base])
                if a is None or b is None:
                    continue
                diff, separated, _ = gap_interval(a, b)
                found = (diff, separated, "seeds only")
            diff, separated, how = found
            better = (diff.mean > 0) if separated else None
            out[name][label] = {
                "row": base,
                "mean": diff.mean,
                "low": diff.low,
                "high": diff.high,
                "n": diff.n,
                "better": better,
                "how": how,
            }
    return out


def chance_multilabel_map(store: FeatureStore, split: str) -> float | None:
    """Multi-label mAP of a random ranking on ``split``: the mean over the classes with a positive
    of ``stats.random_ranking_ap`` (positives among the annotated images of the split, as
    ``eval/multilabel.py`` averages); None without multi-labels."""
    import torch

    from curvalign.stats import random_ranking_ap

    if not store.has_multilabels:
        return None
    assert store.multilabel_to_image is not None and store.multilabel_class is not None
    image_ids = store.split_image_ids(split)
    in_split = torch.zeros(store.num_images, dtype=torch.bool)
    in_split[image_ids] = True
    owner, cls = store.multilabel_to_image.long(), store.multilabel_class.long()
    keep = in_split[owner]
    pairs = torch.unique(torch.stack([owner[keep], cls[keep]]), dim=1)
    annotated = int(torch.unique(pairs[0]).numel())
    if annotated == 0:
        return None
    counts = torch.bincount(pairs[1])
    aps = [random_ranking_ap(int(p), annotated) for p in counts.tolist() if p > 0]
    return sum(aps) / len(aps)


def add_chance_rates(stats: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Chance's entailment AUROC (0.5) and AP (the share of positive pairs, a random score's
    expected AP) where the other rows have entailment numbers, into the chance row's stats."""
    from curvalign.stats import mean_interval

    chance = stats.get("chance")
    if chance is None:
        return
    for source in ("taxonomy", "chains"):
        prefix = f"entailment/{source}/"
        row = next((r for n, r in stats.items() if n != "chance" and prefix + "AP" in r), None)
        if row is None:
            continue
        pos, neg = row.get(prefix + "positives"), row.get(prefix + "negatives")
        values = {prefix + "AUROC": 0.5}
        if pos and neg and pos["mean"] + neg["mean"] > 0:
            values[prefix + "AP"] = pos["mean"] / (pos["mean"] + neg["mean"])
        for path, value in values.items():
            chance.setdefault(path, {**mean_interval([value]).as_dict(), "values": [value]})


def verdicts_of(result: BenchmarkResult) -> dict[str, dict[str, Any]]:
    """Best/tied per column among the trained rows *and* the baselines they must beat (frozen
    features or the ridge map, the untrained heads); chance is shown, not ranked. A trained row
    whose best weights are step 0 in any seed is never best. Retrieval columns compare rows over
    seeds and test items (``ItemGaps``) where the per-item ranks are at hand."""
    from curvalign.report.tables import column_verdicts, stats_columns

    contenders = [
        n
        for n, r in result.rows.items()
        if r.kind in ("trained", "untrained", "frozen") and n in result.stats
    ]
    never = [
        n
        for n, r in result.rows.items()
        if r.kind == "untrained" or (r.kind == "trained" and untrained_seeds(r))
    ]
    trained = [n for n, r in result.rows.items() if r.kind == "trained" and n in result.stats]
    return column_verdicts(
        result.stats,
        contenders,
        stats_columns(result.stats),
        never,
        gap=item_gaps(result).gap,
        trained=trained,
    )


def best_step_cells(result: BenchmarkResult) -> list[tuple[str, str]]:
    """(row, "120, 80, 0 (= untrained in 1/3)") per trained row: the best validation step of each
    seed; "= untrained" when every seed kept its step-0 weights."""
    out = []
    for name, row in result.rows.items():
        if row.kind != "trained" or row.status == "failed":
            continue
        steps = row.best_step
        zero = untrained_seeds(row)
        cell = ", ".join(map(str, steps))
        if steps and zero == len(steps):
            cell += " = untrained"
        elif zero:
            cell += f" (= untrained in {zero}/{len(steps)})"
        out.append((name, cell))
    return out


def baseline_comparisons(result: BenchmarkResult) -> dict[str, dict[str, dict[str, Any]]]:
    """{trained row: {baseline row: {metric path: {"mean", "low", "high", "n", "better"}}}}: each
    trained row against the frozen row (frozen features or the ridge map) and against its own
    step-0 row; the difference is trained minus baseline (retrieval: over seeds and test items,
    ``ItemGaps``; other metrics paired over seeds against the step-0 row, against the single
    value for frozen/ridge); "better" is True / False when the 95% interval excludes 0 in the
    row's favour / against it, None when it does not, and absent for the unranked columns
    (leaf rate, depths, counts)."""
    from curvalign.report.tables import LOWER_IS_BETTER, UNRANKED, gap_interval

    gaps = item_gaps(result)

    frozen = [n for n, r in result.rows.items() if r.kind == "frozen" and n in result.stats]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, row in result.rows.items():
        if row.kind != "trained" or name not in result.stats:
            continue
        against = frozen + ([row.untrained] if row.untrained in result.stats else [])
        out[name] = {}
        for base in against:
            cells: dict[str, Any] = {}
            for path, stat in result.stats[name].items():
                other = result.stats[base].get(path)
                if other is None:
                    continue
                diff, separated, _ = gaps.gap(name, base, path) or gap_interval(stat, other)
                if path in UNRANKED:  # no better direction: the difference, no verdict
                    cells[path] = {**diff.as_dict()}
                    continue
                sign = -1.0 if path in LOWER_IS_BETTER else 1.0
                better = (sign * diff.mean > 0) if separated else None
                cells[path] = {**diff.as_dict(), "better": better}
            out[name][base] = cells
    return out


def baseline_table(result: BenchmarkResult, comparisons: dict[str, Any]) -> str:
    """Markdown: one line per (trained row, baseline), each column the difference in the table's
    units with ▲ (better, interval excludes 0), ▼ (worse) or = (interval includes 0)."""
    from curvalign.report.tables import stats_columns

    cols = [c for c in stats_columns(result.stats)]
    lines = [
        "| row − baseline | " + " | ".join(c[0] for c in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name, bases in comparisons.items():
        for base, cells in bases.items():
            out = []
            for _, path, kind in cols:
                cell = cells.get(path)
                if cell is None:
                    out.append("n/a")
                    continue
                scale, digits = (100.0, 1) if kind == "pct" else (1.0, 2)
                if "better" not in cell:  # leaf rate, depths: no better direction, no mark
                    out.append(f"{scale * cell['mean']:+.{digits}f}")
                    continue
                mark = {True: "▲", False: "▼", None: "="}[cell["better"]]
                out.append(f"{scale * cell['mean']:+.{digits}f} {mark}")
            lines.append(f"| {name} − {base} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def summary_lines(result: BenchmarkResult) -> list[str]:
    """The header lines every table of a benchmark carries: data, seeds, units, weights."""
    from curvalign.report.tables import UNITS

    n = len(result.seeds)
    return [
        f"data: `{result.data}`; steps: {result.steps or 'recipe default'}; {n} seed(s) per "
        f"recipe, the same for every recipe (paired); cells: mean ± 95% interval over seeds "
        "(Student t)" + ("" if n > 1 else "; one seed: no intervals, no verdicts"),
        f"units: {UNITS}. Ties count against the model; n/a = does not apply.",
        "Trained rows use each run's best validation weights (mean R@1 on the validation split); "
        "'(step 0)' rows are the same heads untrained; 'frozen features' ranks the input features "
        "by cosine; 'ridge (image→text)' maps image features into the text space (fit on "
        "train, strength chosen on validation) where the two sides share no space; 'chance' is "
        "a random ranking (expected value).",
        "Bold and verdicts rank trained rows against each other *and* against the frozen/ridge "
        "row and the untrained heads; a row whose best step is 0 (= untrained) is never bold.",
        *result.notes,
    ]


def trained_rows(result: BenchmarkResult) -> list[str]:
    """The trained rows that have numbers (failed recipes left out)."""
    return [n for n, r in result.rows.items() if r.kind == "trained" and n in result.stats]


def headline(result: BenchmarkResult, gains: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a headline table shows: {"columns": the headline metric columns (sibling/cousin
    recall marked "†" where chance is above every trained row), "more": the other columns that
    differ, "lead": the gain columns {header: [(row, cell)]}, "notes": lines for under the table
    (the constant columns, the gain columns' reading, the "†" note)}."""
    from curvalign.report.tables import (
        constant_line,
        gain_columns,
        headline_columns,
        mark_chance_columns,
    )

    gains = gains_of(result) if gains is None else gains
    shown, more, constant = headline_columns(result.stats)
    shown, chance_note = mark_chance_columns(shown, result.stats, trained_rows(result))
    lead = gain_columns(gains)
    hows = sorted({g["how"] for row in gains.values() for g in row.values()})
    notes = [line for line in (constant_line(constant), chance_note) if line]
    if lead:
        notes.append(
            "ΔR@1 align / step0: mean R@1 (T2I and I2T) minus the alignment row's "
            f"({alignment_row(result) or 'none'}) and "
            "minus the row's own step-0 row's, in points; ± the 95% interval over "
            + " / ".join(hows)
            + "; ▲ / ▼ where it excludes 0"
        )
    return {"columns": shown, "more": more, "lead": lead, "notes": notes}


def headline_markdown(
    result: BenchmarkResult, verdicts: dict[str, Any], gains: dict[str, Any]
) -> list[str]:
    """The headline table of results.md with its notes (the full table follows it)."""
    from curvalign.report.tables import markdown_headline_table

    head = headline(result, gains)
    lines = [markdown_headline_table(result.stats, head["columns"], verdicts, head["lead"])]
    lines += [f"{note}  " for note in head["notes"]]
    if head["more"]:
        lines.append("more columns below: " + ", ".join(c[0] for c in head["more"]))
    return lines


def write_benchmark_outputs(
    result: BenchmarkResult,
    out: Path,
    logs: dict[str, list[dict[str, Any]]] | None,
    arrays: dict[str, dict[str, Any]] | None,
    title: str = "benchmark",
) -> dict[str, Path]:
    """results.json, results.md and the PNG plots of a benchmark."""
    from curvalign.report import plots
    from curvalign.report.tables import (
        JSON_UNITS,
        markdown_stats_table,
        prompt_sensitivity_markdown,
        step0_cells,
        write_json,
    )

    files: dict[str, Path] = {}
    verdicts = verdicts_of(result)
    comparisons = baseline_comparisons(result)
    gains = gains_of(result)
    failed = {n: str(r.reason) for n, r in result.rows.items() if r.status == "failed"}
    payload = {
        "data": result.data,
        "steps": result.steps,
        "seeds": result.seeds,
        "units": JSON_UNITS,
        "recipes": [n for n, r in result.rows.items() if r.kind == "trained"],
        "train_seconds": result.train_seconds,
        "eval_seconds": result.eval_seconds,
        "wall_seconds": result.wall_seconds,
        "results": result.results,
        "stats": result.stats,
        "rows": {n: r.to_json() for n, r in result.rows.items()},
        "absent": result.absent,
        "failed": failed,
        "verdicts": verdicts,
        "baseline_comparisons": comparisons,
        "gains": gains,
        "notes": result.notes,
        "disclosure": result.disclosure,
        "towers": result.towers,
    }
    files["json"] = write_json(out / "results.json", payload)
    md = [f"# {title}", "", *summary_lines(result), ""]
    note = disclosure_note(result.disclosure)
    if note:  # every row of a benchmark reads the same store: the mark covers the table
        md[-1:-1] = [note]
    md += headline_markdown(result, verdicts, gains)
    md += ["", "Every column:", ""]
    md.append(
        markdown_stats_table(
            result.stats,
            verdicts,
            {
                "best step": best_step_cells(result),
                "converged": converged_cells(result),
                # BenchmarkRow reads as a mapping (get, [])
                "step 0": step0_cells(result.rows),  # type: ignore[arg-type]
                **result.extra_columns,
            },
        )
    )
    md += ["", "Verdicts (bold = best, only where the 95% interval of its lead excludes 0):", ""]
    md += [f"- {v['text']}" for v in verdicts.values()] or ["- (fewer than two trained rows)"]
    sensitivity = prompt_sensitivity_markdown(result.stats)
    if sensitivity:
        md += [
            "",
            "Prompt sensitivity (zero-shot top-1 in %, each template alone):",
            "",
            sensitivity,
        ]
    for name, why in result.absent.items():
        md += ["", f"Row '{name}' is absent: {why}."]
    for name, why in failed.items():
        md += ["", f"**{name} failed**: {why}"]
    if any(comparisons.values()):
        md += [
            "",
            "Each trained row against the frozen (or ridge) row and its own step-0 row "
            "(difference in the table's units; ▲ better / ▼ worse where the 95% interval "
            "excludes 0, = where it does not):",
            "",
            baseline_table(result, comparisons),
        ]
    warnings = [f"- {n}: {w}" for n, r in result.rows.items() for w in r.warnings if w]
    if warnings:
        md += ["", "Health warnings:", "", *warnings]
    md += [
        "",
        "| recipe | seeds | best step (per seed) | train s | eval s | run dirs |",
        "|---|---|---|---:|---:|---|",
    ]
    md += [
        f"| {n} | {', '.join(map(str, r.seeds))} | "
        f"{', '.join(map(str, r.best_step))} | {result.train_seconds.get(n, 0):.1f} | "
        f"{result.eval_seconds.get(n, 0):.1f} | "
        + ", ".join(f"`{d}`" for d in result.run_dirs.get(n, []))
        + " |"
        for n, r in result.rows.items()
        if r.kind == "trained"
    ]
    md += ["", f"wall time: {result.wall_seconds:.0f} s"]
    files["markdown"] = out / "results.md"
    files["markdown"].write_text("\n".join(md) + "\n")
    plotted = {n: r for n, r in result.results.items() if r}
    if arrays is not None:
        files["retrieval_png"] = plots.retrieval_bars(plotted, out / "retrieval.png", result.stats)
        if any("hierarchy" in r or "zeroshot" in r for r in plotted.values()):
            files["hierarchy_png"] = plots.hierarchy_bars(
                plotted, out / "hierarchy.png", result.stats
            )
        files["distances_png"] = plots.distance_histograms(
            {n: a["distance"] for n, a in arrays.items()}, out / "distances.png"
        )
        files["spectra_png"] = plots.spectra(
            {n: a["spectrum"] for n, a in arrays.items()}, out / "spectra.png"
        )
    if logs:
        keys = log_curve_keys(logs)
        if keys:
            files["curves_png"] = plots.log_curves(
                logs, keys[:8], out / "curves.png", title="training curves (first seed)"
            )
    return files
