"""Benchmark orchestration: train several recipes on the same data with the same budget, evaluate
each with ``curvalign.eval.evaluate``, and write a side-by-side table and plots.

This module (unlike ``curvalign.eval``) drives the trainer. Every recipe gets the same data, the
same steps, batch size and seed; only the recipe differs. ``key=value`` overrides apply to every
recipe; ``NAME.key=value`` (e.g. ``phyclip.num_factors=16``) only to recipe NAME.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from curvalign.data import load_store
from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.agr import AGR
from curvalign.recipes.atmg import Atmg
from curvalign.recipes.clip import Clip
from curvalign.recipes.dualpath import DualPath
from curvalign.recipes.hycoclip import Hycoclip
from curvalign.recipes.meru import Meru
from curvalign.recipes.phyclip import Phyclip
from curvalign.recipes.proclip import Proclip

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
    out = []
    for item in DEMO_OVERRIDES:
        head = item.split("=", 1)[0].partition(".")
        if head[2] and head[0] not in recipes:
            continue
        out.append(item)
    return out


#: log keys worth a curve, matched by substring
CURVE_KEYS = ("curvature", "temperature", "routing", "gate", "alpha", "beta")


@dataclass
class BenchmarkResult:
    """What ``run_benchmark`` produced: per-recipe evaluations, run directories, timings and files."""

    results: dict[str, dict[str, Any]]
    run_dirs: dict[str, Path]
    train_seconds: dict[str, float]
    eval_seconds: dict[str, float]
    files: dict[str, Path] = field(default_factory=dict)
    data: str = ""
    steps: int | None = None


def split_overrides(overrides: Iterable[str], recipes: Sequence[str]) -> dict[str, list[str]]:
    """{recipe: overrides for it}: plain ``key=value`` for all, ``NAME.key=value`` for NAME only."""
    out: dict[str, list[str]] = {name: [] for name in recipes}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        head, _, rest = key.partition(".")
        if rest and head in out:
            out[head].append(f"{rest}={value}")
        elif rest and head not in ("train", "recipe"):
            raise ConfigError(
                f"override {item!r} names recipe {head!r}, which is not in this benchmark "
                f"({', '.join(recipes)})"
            )
        else:
            for name in recipes:
                out[name].append(item)
    return out


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


def run_benchmark(
    recipes: Sequence[str],
    data: str | FeatureStore,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    overrides: Iterable[str] = (),
    split: str = "test",
    show_progress: bool = True,
    notify: Notify | None = None,
    plots: bool = True,
    title: str = "benchmark",
) -> BenchmarkResult:
    """Train each recipe on ``data`` into ``out_dir/runs/NAME`` (replacing an earlier run there),
    evaluate it on ``split``, and write ``results.json``, ``results.md`` and PNG plots to ``out_dir``."""
    from curvalign.eval import run_evaluation
    from curvalign.recipes import recipe_names
    from curvalign.runs import load_run, read_log
    from curvalign.train.trainer import train

    notify = notify or (lambda message: None)
    recipes = list(recipes)
    if not recipes:
        raise ConfigError("no recipes to benchmark")
    known = recipe_names()
    unknown = [r for r in recipes if r not in known]
    if unknown:
        raise ConfigError(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if len(set(recipes)) != len(recipes):
        raise ConfigError(f"recipes listed twice: {', '.join(recipes)}")
    per_recipe = split_overrides(overrides, recipes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    store, spec = load_store(data)
    notify(
        f"data {spec}: {store.num_images} images, {store.num_texts} captions "
        f"({time.perf_counter() - t0:.1f}s)"
    )

    result = BenchmarkResult({}, {}, {}, {}, data=spec, steps=steps)
    logs: dict[str, list[dict[str, Any]]] = {}
    arrays: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(recipes, 1):
        notify(f"[{i}/{len(recipes)}] training {name}" + (f" for {steps} steps" if steps else ""))
        t = time.perf_counter()
        run_dir = train(
            name,
            store,
            out / "runs" / name,
            steps=steps,
            overrides=per_recipe[name],
            overwrite=True,
            show_progress=show_progress,
        )
        result.train_seconds[name] = time.perf_counter() - t
        t = time.perf_counter()
        loaded = load_run(run_dir)  # evaluate what was saved, not the live object
        # one embedding of the split serves the metrics and the plots' arrays
        evaluated = run_evaluation(loaded.recipe, store, split=split)
        evaluation = evaluated.metrics
        evaluation["meta"].update(
            step=loaded.step,
            run_dir=str(run_dir),
            train_seconds=round(result.train_seconds[name], 2),
        )
        result.results[name] = evaluation
        result.run_dirs[name] = Path(run_dir)
        if plots:
            arrays[name] = evaluated.arrays.as_dict()
            logs[name] = read_log(run_dir)
        result.eval_seconds[name] = time.perf_counter() - t
        r = evaluation["retrieval"]
        notify(
            f"    {name}: train {result.train_seconds[name]:.1f}s, eval {result.eval_seconds[name]:.1f}s, "
            f"T2I R@1 {100 * r['t2i@1']:.1f}, I2T R@1 {100 * r['i2t@1']:.1f}"
        )

    result.files = write_benchmark_outputs(
        result, out, logs if plots else None, arrays if plots else None, title
    )
    return result


def write_benchmark_outputs(
    result: BenchmarkResult,
    out: Path,
    logs: dict[str, list[dict[str, Any]]] | None,
    arrays: dict[str, dict[str, Any]] | None,
    title: str = "benchmark",
) -> dict[str, Path]:
    """results.json, results.md and the PNG plots of a benchmark."""
    from curvalign.report import plots
    from curvalign.report.tables import markdown_table, write_json

    files: dict[str, Path] = {}
    payload = {
        "data": result.data,
        "steps": result.steps,
        "recipes": list(result.results),
        "train_seconds": result.train_seconds,
        "eval_seconds": result.eval_seconds,
        "results": result.results,
    }
    files["json"] = write_json(out / "results.json", payload)
    md = [
        f"# {title}",
        "",
        f"data: `{result.data}`; steps: {result.steps or 'recipe default'}; "
        "recalls and accuracies in %, ties counted against the model; n/a = does not apply.",
        "",
        markdown_table(result.results),
    ]
    md += ["", "| recipe | train s | eval s | run dir |", "|---|---:|---:|---|"]
    md += [
        f"| {n} | {result.train_seconds[n]:.1f} | {result.eval_seconds[n]:.1f} | `{result.run_dirs[n]}` |"
        for n in result.results
    ]
    files["markdown"] = out / "results.md"
    files["markdown"].write_text("\n".join(md) + "\n")
    if arrays is not None:
        files["retrieval_png"] = plots.retrieval_bars(result.results, out / "retrieval.png")
        if any("hierarchy" in r or "zeroshot" in r for r in result.results.values()):
            files["hierarchy_png"] = plots.hierarchy_bars(result.results, out / "hierarchy.png")
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
                logs, keys[:8], out / "curves.png", title="training curves"
            )
    return files
