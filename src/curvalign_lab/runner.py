"""Studies: each paper's central claim as an experiment that can fail.

Every study

* quotes the claim as the paper states it (``paper``, with its equation / table) and, per claim,
  the paper's own effect on the study's metric with the seed-file section it comes from,
* trains *arms* with the same seeds (``seed_base`` .. ``seed_base + seeds - 1``): the method, the
  comparison the paper makes, the claim's obvious baseline, and a *calibrated positive control*
  (an arm handicapped by a known amount of the size the claim is about, e.g. a known share of
  train captions moved to another image) that the metric must separate with the study's seeds;
  trained-vs-untrained is a sanity row only,
* tests the claim's precondition (AGR's lambda_E > 2 lambda_H, DualPath's open gate, heads at
  least as good as the frozen features) and says "not reproduced in this regime" where the
  claim's mechanism is absent (encoder training),
* chooses each arm's learning rate on validation from one shared grid (``kit.LR_GRID``) and
  decides convergence by the shared noise-aware rule (``curvalign.stats.curve_converged``),
* reports paired effect sizes with 95% intervals (``curvalign.stats``), the minimal detectable
  effect at the run's own seed SD, and decides each claim by ``kit.decide`` (written into
  the output), Holm-corrected over the study's claims (``kit.apply_holm``): holds / does
  not hold / equivalent within ±delta / inconclusive / underpowered at n seeds / not reproduced
  in this regime.
* on a synthetic world, a scripted study may decide each claim about a method on a
  *world-inclusive* interval (``vary_world``: seed s trains and is evaluated on
  the world of seed s, ``world_inclusive``), the fixed-world (seed-only) interval reported
  beside it (``with_world``).

Each study is one file under ``curvalign_lab/studies/`` defining ``STUDY``: a declared
``declare.Study`` (claims, arms, measure, control handicap as data; run by
``declare.run_declared``) or a ``declare.Scripted`` one (its own ``run`` function).
``run_study`` runs either and writes ``study.json`` and ``study.md`` into ``out``
(``power=True``: a pilot on a disjoint seed base plans the seeds; ``quick=True``: a smoke run on
a tiny store); ``run_all`` runs every study into ``out/NAME``; ``curvalign_lab.results`` turns
those JSON files into the results pages and compares two seed bases (``--stability``).

Study definitions name the recipes they study and set their options (configuration); what a
method computes (routing statistics, text-pair embeddings, factor-wise composition) is asked of
the recipe. The synthetic world is not the papers' data (no pixels, no real language, a small
known taxonomy): a claim that holds or fails here is evidence about the mechanism at this scale,
not a reproduction of the papers' tables.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from curvalign.errors import ConfigError
from curvalign.report.tables import write_json
from curvalign_lab import kit, page
from curvalign_lab.declare import (
    PILOT_OFFSET,
    Scripted,
    Study,
    configured,
    option_names,
    run_declared,
)
from curvalign_lab.studies import registry

Notify = Callable[[str], None]

#: every study by name (``studies.registry()``: one file each)
STUDIES: dict[str, Study | Scripted] = registry()

#: the order ``run_all`` runs them in (the page keeps ``STUDIES``' order): the studies whose
#: verdicts moved between seed bases or whose controls did not separate first, the ones whose
#: claims are not reproduced in this regime (atmg, wordnet) last, so that a run cut short by the
#: machine's budget still answers the open questions
RUN_ORDER = (
    "phyclip-factors",
    "dualpath-forgetting",
    "proclip-product",
    "agr-curriculum",
    "atmg-curvature",
    "wordnet-dimensions",
)

_FIXED = (
    "out",
    "lr_cache",
    "steps",
    "data",
    "overrides",
    "seeds",
    "seed_base",
    "show_progress",
    "notify",
)


def _literal(value: Any) -> str:
    return (
        (",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "()")
        if isinstance(value, (tuple, list))
        else str(value)
    )


def study_options(name: str) -> set[str]:
    """The ``--set`` options study ``name`` takes (a declared study: ``lr_grid`` and its
    ``configure`` parameters, ``declare.option_names``)."""
    study = STUDIES[name]
    if isinstance(study, Scripted):
        return {p for p in inspect.signature(study.run).parameters if p not in _FIXED}
    return option_names(study)


def parse_study_options(name: str, items: Sequence[str]) -> dict[str, Any]:
    """``["curvatures=0.1,1,3", "part_dim=16"]`` -> keyword options of study ``name``, checked
    against its signature (values are Python literals; a comma list becomes a tuple)."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    allowed = study_options(name)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"study option {item!r} is not NAME=VALUE")
        if key not in allowed:
            raise ConfigError(
                f"study {name} has no option {key!r}; options: {', '.join(sorted(allowed)) or 'none'}"
            )
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise ConfigError(f"study option {key}={raw!r}: expected a Python literal") from None
        out[key] = value
    return out


def _run_scripted(
    study: Scripted,
    out: Path,
    *,
    steps: int | None,
    data: str | None,
    overrides: Sequence[str],
    seeds: int,
    seed_base: int,
    power: bool,
    max_seeds: int,
    lr_cache: str | Path | None,
    quick: bool,
    show_progress: bool,
    notify: Notify,
    options: dict[str, Any],
) -> dict[str, Any]:
    """A scripted study, planned on a pilot of a disjoint base when ``power`` (its claims
    re-decided with their plans), or as a smoke run when ``quick``."""
    from curvalign_lab.declare import QUICK_OVERRIDES, QUICK_SEEDS

    if quick:
        data, steps, seeds, power = study.quick_data, study.quick_steps, QUICK_SEEDS, False
        overrides = [*QUICK_OVERRIDES, *overrides]
        allowed = {p for p in inspect.signature(study.run).parameters}
        options = {"lr_grid": ()} | dict(study.quick) | options
        if "vary_world" in allowed:
            options.setdefault("vary_world", False)

    def once(n: int, base: int, where: Path) -> dict[str, Any]:
        return study.run(
            where,
            steps=steps,
            data=data,
            overrides=list(overrides),
            seeds=n,
            seed_base=base,
            show_progress=show_progress,
            notify=notify,
            **({"lr_cache": Path(lr_cache)} if lr_cache else {}),
            **options,
        )

    if not power:
        return once(seeds, seed_base, out)
    # the pilot: a seed base disjoint from the confirmatory one (and from the other bases a
    # stability check uses), so that the plan and the verdict never share a seed
    pilot_base = seed_base + PILOT_OFFSET
    pilot = once(seeds, pilot_base, out / "pilot")
    plan = kit.plan_seeds(pilot["claims"], max_seeds) | {
        "pilot_seeds": seeds,
        "pilot_seed_base": pilot_base,
        "pilot_wall_s": pilot["wall_s"],
    }
    notify(
        f"{study.name}: pilot of {seeds} seeds (base {pilot_base}) -> {plan['seeds']} seeds"
        + (
            f"; underpowered by plan: {', '.join(plan['out_of_budget'])}"
            if plan["out_of_budget"]
            else ""
        )
    )
    result = once(plan["seeds"], seed_base, out)
    result["wall_s"] = round(result["wall_s"] + plan["pilot_wall_s"], 1)
    result["claims"] = [
        kit.with_plan(c, plan["per_claim"].get(kit.base_claim(c["claim"])))
        for c in result["claims"]
    ]
    kit.apply_holm(result["claims"])
    result["verdict"] = "; ".join(f"{c['claim']}: {c['holm_outcome']}" for c in result["claims"])
    result["holds"] = all(c["holm_verdict"] == kit.HOLDS for c in result["claims"])
    result["power_plan"] = plan
    return result


def run_study(
    name: str,
    out: str | Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
    lr_cache: str | Path | None = None,
    quick: bool = False,
    show_progress: bool = False,
    notify: Notify | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run study ``name`` with seeds ``seed_base .. seed_base + seeds - 1`` and write
    ``study.json`` and ``study.md`` into ``out``.

    ``power``: first a pilot of ``seeds`` seeds on the disjoint base ``seed_base +
    PILOT_OFFSET`` (a scripted study's into ``out/pilot``); from its per-seed SDs each claim is
    planned (exact noncentral-t MDE at the paper's effect, or at the distance to the margin,
    capped at ``max_seeds``), the study runs with the seeds the powered claims need, and each
    claim is decided with its plan: "underpowered" only where the plan needs more than the
    cap (``power_plan`` in the output holds the pilot's SDs, planned n and cap).
    ``quick``: a smoke run (the study's tiny store, 2 seeds, a few steps, no learning-rate grid,
    no pilot, no world-inclusive re-runs)."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    if power and max_seeds < 2:
        raise ConfigError(f"max_seeds must be >= 2 with power, got {max_seeds}")
    if power and seeds < 2:
        raise ConfigError(f"a pilot needs at least 2 seeds for an SD, got {seeds}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notify = notify or (lambda m: None)
    study = STUDIES[name]
    if isinstance(study, Scripted):
        result = _run_scripted(
            study,
            out,
            steps=steps,
            data=data,
            overrides=overrides,
            seeds=seeds,
            seed_base=seed_base,
            power=power,
            max_seeds=max_seeds,
            lr_cache=lr_cache,
            quick=quick,
            show_progress=show_progress,
            notify=notify,
            options=options,
        )
    else:
        result = run_declared(
            configured(study, options, quick),
            out,
            steps=steps,
            data=data,
            overrides=overrides,
            seeds=seeds,
            seed_base=seed_base,
            power=power,
            max_seeds=max_seeds,
            lr_grid=options.get("lr_grid", kit.LR_GRID),
            lr_cache=Path(lr_cache) if lr_cache else None,
            quick=quick,
            show_progress=show_progress,
            notify=notify,
        )
    result["seed_base"] = seed_base
    result["command"] = (
        f"curvalign study {name} --out {out}"
        + (" --quick" if quick else f" --seeds {seeds}")
        + (f" --seed-base {seed_base}" if seed_base else "")
        + (f" --power --max-seeds {max_seeds}" if power else "")
        + (f" --steps {steps}" if steps and not quick else "")
        + (f" --data {data}" if data and not quick else "")
        + "".join(f" --set {k}={_literal(v)}" for k, v in options.items())
        + "".join(f" {o}" for o in overrides)
    )
    write_json(out / "study.json", result)
    (out / "study.md").write_text(page.study_page(result, heading="#"))
    return result


def study_markdown(result: dict[str, Any], heading: str = "##", figure_dir: str = "") -> str:
    """One study's section (``page.study_page``)."""
    return page.study_page(result, heading=heading, figure_dir=figure_dir)


def run_all(
    out: str | Path,
    *,
    names: Sequence[str] | None = None,
    steps: int | None = None,
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
    quick: bool = False,
    overrides: Sequence[str] = (),
    lr_cache: str | Path | None = None,
    show_progress: bool = False,
    notify: Notify | None = None,
) -> dict[str, dict[str, Any]]:
    """Every study (or ``names``) into ``out/NAME``; ``steps`` (if given) for each. The wall
    time of the whole run is written to ``out/wall.json``."""
    out = Path(out)
    notify = notify or (lambda m: None)
    timer = kit.Timer()
    results = {}
    order = list(names or [*RUN_ORDER, *(n for n in STUDIES if n not in RUN_ORDER)])
    for name in order:
        notify(f"study {name}")
        results[name] = run_study(
            name,
            out / name,
            steps=steps,
            seeds=seeds,
            seed_base=seed_base,
            power=power,
            max_seeds=max_seeds,
            quick=quick,
            overrides=overrides,
            lr_cache=lr_cache,
            show_progress=show_progress,
            notify=notify,
        )
        # after each study, so that a run cut short still says how long its part took
        done = len(results) == len(order)
        write_json(
            out / "wall.json",
            {"wall_s": timer.seconds(), "studies": list(results), "complete": done},
        )
    notify(f"study all: {timer.seconds():.0f} s")
    return results
