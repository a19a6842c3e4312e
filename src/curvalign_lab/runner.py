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
* on a synthetic world, decides each claim about a method (PHyCLIP's, ProCLIP's, AtMG's, AGR's,
  DualPath's) on a *world-inclusive* interval (``vary_world``: seed s trains and is evaluated on
  the world of seed s, ``world_inclusive``), the fixed-world (seed-only) interval reported
  beside it (``with_world``).

Each study is ``study_NAME(out, *, steps, data, overrides, seeds, seed_base, lr_grid,
show_progress, notify, **options)`` returning a JSON-ready dict; ``run_study`` writes
``study.json`` and ``study.md`` into ``out`` (``power=True``: a pilot, then the seeds the
paper's effects need within ``max_seeds``); ``run_all`` runs every study into ``out/NAME``;
``curvalign_lab.results`` turns those JSON files into docs/results.md and compares two seed
bases (``--stability``).

Study definitions name the recipes they study and set their options (configuration); what a
method computes (routing statistics, text-pair embeddings, factor-wise composition) is asked of
the recipe. The synthetic world is not the papers' data (no pixels, no real language, a small
known taxonomy): a claim that holds or fails here is evidence about the mechanism at this scale,
not a reproduction of the papers' tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from curvalign.errors import ConfigError
from curvalign.report.tables import write_json
from curvalign_lab import kit
from curvalign_lab.common import (
    Notify,
)
from curvalign_lab.studies.agr_curriculum import study_agr_curriculum
from curvalign_lab.studies.atmg_curvature import study_atmg_curvature
from curvalign_lab.studies.dualpath_forgetting import study_dualpath_forgetting
from curvalign_lab.studies.phyclip_factors import study_phyclip_factors
from curvalign_lab.studies.proclip_product import study_proclip_product
from curvalign_lab.studies.wordnet_dimensions import study_wordnet_dimensions

# --- running ------------------------------------------------------------------------------------

STUDIES: dict[str, Callable[..., dict[str, Any]]] = {
    "agr-curriculum": study_agr_curriculum,
    "dualpath-forgetting": study_dualpath_forgetting,
    "atmg-curvature": study_atmg_curvature,
    "phyclip-factors": study_phyclip_factors,
    "proclip-product": study_proclip_product,
    "wordnet-dimensions": study_wordnet_dimensions,
}

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
        ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
        if isinstance(value, (tuple, list))
        else str(value)
    )


def parse_study_options(name: str, items: Sequence[str]) -> dict[str, Any]:
    """``["curvatures=0.1,1,3", "part_dim=16"]`` -> keyword options of study ``name``, checked
    against its signature (values are Python literals; a comma list becomes a tuple)."""
    import ast
    import inspect

    allowed = {p for p in inspect.signature(STUDIES[name]).parameters if p not in _FIXED}
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
    show_progress: bool = False,
    notify: Notify | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run study ``name`` with seeds ``seed_base .. seed_base + seeds - 1`` and write
    ``study.json`` and ``study.md`` into ``out``.

    ``power``: the ``seeds`` run is a pilot; from its per-seed SDs ``kit.plan_seeds`` picks the
    fewest seeds that detect every claim's paper effect at 80% power within ``max_seeds`` (the
    user's budget), and the study runs again with that many (the pilot's wall time and the
    plan are in the output, ``power_plan``)."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    if power and max_seeds < 2:
        raise ConfigError(f"max_seeds must be >= 2 with power, got {max_seeds}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notify = notify or (lambda m: None)

    def once(n: int) -> dict[str, Any]:
        return STUDIES[name](
            out,
            steps=steps,
            data=data,
            overrides=list(overrides),
            seeds=n,
            seed_base=seed_base,
            show_progress=show_progress,
            notify=notify,
            **({"lr_cache": Path(lr_cache)} if lr_cache else {}),
            **options,
        )

    result = once(seeds)
    plan = None
    if power:
        plan = kit.plan_seeds(result["claims"], max_seeds) | {
            "pilot_seeds": seeds,
            "pilot_wall_s": result["wall_s"],
        }
        plan["estimated_wall_s"] = round(result["wall_s"] * plan["seeds"] / seeds, 1)
        notify(
            f"{name}: pilot of {seeds} seeds -> {plan['seeds']} seeds "
            f"(about {plan['estimated_wall_s']:.0f} s)"
            + (
                f"; out of budget: {', '.join(plan['out_of_budget'])}"
                if plan["out_of_budget"]
                else ""
            )
        )
        if plan["seeds"] != seeds:
            result = once(plan["seeds"])
            result["wall_s"] = round(result["wall_s"] + plan["pilot_wall_s"], 1)
        result["power_plan"] = plan
    result["seed_base"] = seed_base
    result["command"] = (
        f"curvalign study {name} --out {out} --seeds {seeds}"
        + (f" --seed-base {seed_base}" if seed_base else "")
        + (f" --power --max-seeds {max_seeds}" if power else "")
        + (f" --steps {steps}" if steps else "")
        + (f" --data {data}" if data else "")
        + "".join(f" --set {k}={_literal(v)}" for k, v in options.items())
        + "".join(f" {o}" for o in overrides)
    )
    write_json(out / "study.json", result)
    (out / "study.md").write_text(study_markdown(result, heading="#"))
    return result


def study_markdown(result: dict[str, Any], heading: str = "##", figure_dir: str = "") -> str:
    """One study's section: claim, setup, command, verdicts with intervals, tables, plots."""
    md = [
        f"{heading} {result['name']}",
        "",
        f"**The paper's claim.** {result['paper']}",
        "",
        f"**Setup.** {result['setup']} Seeds: {', '.join(map(str, result['seeds']))} (paired). "
        f"Wall time: {result['wall_s']:.0f} s.",
        "",
        f"**Command.** `{result['command']}`",
        "",
        *(
            [
                f"**Seeds from the pilot.** {plan['pilot_seeds']} pilot seeds -> {plan['seeds']} "
                f"seeds (budget {plan['max_seeds']}); seeds each claim needs for its paper effect: "
                + ", ".join(
                    f"{k}: {v if v else 'over budget'}" for k, v in plan["per_claim"].items()
                )
                + ".",
                "",
            ]
            if (plan := result.get("power_plan"))
            else []
        ),
        f"**Verdict rule.** {result['rule']}.",
        "",
        *([f"**What the measure means.** {result['notes']}", ""] if result.get("notes") else []),
        result["markdown"],
    ]
    for f in result["figures"]:
        md.append(f"![{Path(f).stem}]({figure_dir}{Path(f).name})")
    return "\n".join(md) + "\n"


def run_all(
    out: str | Path,
    *,
    names: Sequence[str] | None = None,
    steps: int | None = None,
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
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
