"""atmg-curvature: AtMG's stability across curvatures (seed 001, Table 5)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from curvalign.recipes.base import Recipe
from curvalign.stats import mean_interval
from curvalign_lab import kit
from curvalign_lab.common import (
    ATMG,
    CONTROL_NOISE,
    MERU,
    STUDY_WORLD,
    Notify,
    finite_difference,
    load_study_data,
    make_bench,
    metric_of,
    metric_table,
    nan_interval,
    noisy_store,
    study_result,
    with_world,
    world_inclusive,
)
from curvalign_lab.declare import QUICK_WORLD, Scripted

# --- atmg-curvature (seed 001, Table 5; Tables 3-4 as secondary evidence) ------------------------

ATMG_PAPER = (
    '"we trained models using fixed curvatures. As detailed in Table 5, MERU failed to converge '
    'for curvatures ≥ 0.5, whereas our model demonstrated almost constant accuracy" (seed 001, '
    "Sec. 6.4, Table 5: ImageNet zero-shot accuracy at fixed curvature)."
)
CURVATURES = (0.1, 0.5, 1.0, 3.0)
#: seed 001, Table 5: MERU 28.4 at c = 0.1 and no result ("failed to converge") at c >= 0.5
ATMG_MERU_DROP = 0.284
ATMG_SOURCE = "seed 001, Sec. 6.4 / Table 5: MERU 28.4 at c=0.1, failed (taken as 0) at c ≥ 0.5"
#: seed 001, Table 5: AtMG at c >= 0.5 (mean 29.05) minus AtMG at c = 0.1 (29.6)
ATMG_STABLE = -0.0055
ATMG_REGIME = (
    "MERU's failure at c ≥ 0.5 comes from 120K-step training of the encoders (seed 001, Sec. 6.4); "
    "heads on frozen features lack that mechanism, so the measured difference is reported, not "
    "decided"
)


def measured_regime(effect: kit.Interval, paper_effect: float, scale: float = 100.0) -> str:
    """Why a claim about encoder training is not reproduced by heads on frozen features, from
    the data: where the interval's upper bound lies below the paper's effect, the paper's effect
    is excluded here ("a drop of 28.4 points is excluded: upper bound 2.4"); otherwise the
    interval is too wide to exclude it, and the reason is the mechanism alone (``ATMG_REGIME``)."""
    if effect.n >= 2 and math.isfinite(effect.high) and effect.high < paper_effect:
        return (
            f"heads on frozen features: an effect of {paper_effect * scale:.3g} points is "
            f"excluded, upper bound {effect.high * scale:.2f} (the paper's comes from encoder "
            "training)"
        )
    return ATMG_REGIME + (
        f"; the interval (upper bound {effect.high * scale:.2f}) does not exclude "
        f"{paper_effect * scale:.3g} points"
        if math.isfinite(effect.high)
        else ""
    )


def with_measured_regime(claim: dict[str, Any]) -> dict[str, Any]:
    """``claim`` with its regime reason measured (``measured_regime``) and re-decided."""
    effect = kit.Interval(**{k: claim["effect"][k] for k in ("mean", "low", "high", "n")})
    inputs = dict(claim["inputs"])
    inputs["regime"] = measured_regime(effect, float(claim["paper_effect"]), inputs["scale"])
    control = claim["control"]
    control_iv = (
        None
        if control is None
        else kit.Interval(**{k: control[k] for k in ("mean", "low", "high", "n")})
    )
    verdict = kit.decide(effect, control_iv, **inputs)
    return claim | {"inputs": inputs, "verdict": verdict.kind, "outcome": verdict.text}


ATMG_NOTES = (
    "Zero-shot top-1 over the 108 leaf classes of the synthetic world, each arm's weights "
    "selected on validation mean R@1. Curvature fixed as in the authors' fixed-curvature runs. "
    "Ordering is secondary: an untrained head already orders many chains (distance to the origin "
    "grows with the feature norm), so each ordering is reported as trained - untrained; the image "
    "ordering is given in both directions, HyCoCLIP's (crop nearer the origin than its image) and "
    "AtMG Table 3's (parts further out), which are complements of one another."
)


def study_atmg_curvature(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    seeds: int = 3,
    seed_base: int = 0,
    lr_grid: Sequence[float] | None = kit.LR_GRID,
    lr_cache: Path | None = None,
    show_progress: bool = False,
    notify: Notify = lambda m: None,
    curvatures: Sequence[float] = CURVATURES,
    stable_margin: float = 0.02,
    control_noise: float = CONTROL_NOISE,
    vary_world: bool = True,
) -> dict[str, Any]:
    """AtMG vs MERU at fixed curvatures (the authors' configs: curvature not learnt), zero-shot
    top-1 with validation-selected weights.

    Claims (primary, Table 5): (1) at c >= 0.5 AtMG's zero-shot top-1 exceeds MERU's (mean over
    those c); (2) MERU drops: MERU(c = min) - mean MERU(c >= 0.5) > 0; (3) AtMG is "almost
    constant": mean AtMG(c >= 0.5) - AtMG(c = min) > -``stable_margin``.
    Claims (1) and (2) are "not reproduced in this regime": MERU's failure comes from 120K-step
    encoder training (``ATMG_REGIME``), which heads on frozen features lack; the measured values
    are reported. Claim (3) is also decided as an equivalence within ±``stable_margin`` (TOST).
    Calibrated control: AtMG at the smallest c with ``control_noise`` of its train captions moved
    to another image; clean - noisy must be > 0 and at least ``stable_margin`` (the size claim
    (3) is about). Sanity row: AtMG at the smallest c, trained - untrained.
    Secondary (reported, not decided): hierarchy ordering in both directions against the
    untrained head: text chains; image pairs with the crop closer to the origin (HyCoCLIP) and
    with the crop further out (AtMG's Table 3: parts further from the origin).
    ``vary_world`` (synthetic data): the claims are about the methods, not one world, so MERU and
    AtMG at every curvature are trained again with seed s on the world of seed s
    (``world_inclusive``, each arm at the learning rate it chose on the study's world); each claim
    is decided on that world-inclusive interval and the fixed-world (seed-only) one is reported
    beside it (``with_world``). The label-noise control, the sanity row and the orderings stay
    on the study's world.
    """
    from curvalign.report import plots

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 150
    data = data or STUDY_WORLD
    store, _ = load_study_data(data)
    bench = make_bench(
        out,
        store,
        data,
        steps,
        overrides,
        notify,
        show_progress,
        lr_grid=lr_grid,
        lr_cache=lr_cache,
    )
    zs: dict[tuple[str, float, str], dict[int, float]] = {}
    order: dict[tuple[str, float, str, str], dict[int, float]] = {}
    conv = {}
    for c in curvatures:
        for recipe in (MERU, ATMG):
            extra = [f"curvature_init={c}", "learn_curvature=false", f"curvature_min={min(c, 0.1)}"]
            runs = {}
            for seed in seed_list:
                runs[seed] = bench.train(f"{recipe}-c{c:g}", recipe, extra, seed)
                for kind, model in (
                    ("trained", runs[seed].recipe),
                    ("untrained", bench.untrained(recipe, extra, seed)),
                ):
                    ev = bench.evaluate(model)
                    zs.setdefault((recipe, c, kind), {})[seed] = metric_of(ev, "zeroshot/top1")
                    text = metric_of(ev, "ordering/text/chain")
                    image = metric_of(ev, "ordering/image/pairs")
                    for key, v in (
                        ("text chain", text),
                        ("image: crop nearer origin (HyCoCLIP)", image),
                        ("image: crop further out (AtMG Table 3)", 1.0 - image),
                    ):
                        order.setdefault((recipe, c, kind, key), {})[seed] = v
            conv[f"{recipe} c={c:g}"] = kit.convergence_record(runs)
    low = min(curvatures)
    noisy_arm = f"control: {ATMG} c={low:g}, {control_noise:.0%} label noise"
    extra = [f"curvature_init={low}", "learn_curvature=false", f"curvature_min={min(low, 0.1)}"]
    runs = {}
    for seed in seed_list:
        runs[seed] = bench.train(
            noisy_arm, ATMG, extra, seed, store_from=noisy_store(bench, control_noise)
        )
        ev = bench.evaluate(runs[seed].recipe)
        zs.setdefault((ATMG, low, "noisy"), {})[seed] = metric_of(ev, "zeroshot/top1")
    conv[noisy_arm] = kit.convergence_record(runs)

    high = [c for c in curvatures if c >= 0.5]
    seeds_ = seed_list

    def avg(recipe: str, cs: Sequence[float], kind: str = "trained") -> dict[int, float]:
        return {s: sum(zs[(recipe, c, kind)][s] for c in cs) / len(cs) for s in seeds_}

    budget_ok = bool(high) and steps >= 50
    ctrl = kit.difference(zs[(ATMG, low, "trained")], zs[(ATMG, low, "noisy")])
    claim = functools.partial(
        kit.claim_record,
        control=ctrl,
        control_what=f"AtMG c={low:g} clean - {control_noise:.0%} label noise",
        control_min=stable_margin,
        budget_ok=budget_ok,
        sanity=kit.difference(zs[(ATMG, low, "trained")], zs[(ATMG, low, "untrained")]),
        sanity_what=f"AtMG c={low:g} trained - untrained",
    )
    claims = [
        claim(
            "zero-shot top-1 at c ≥ 0.5: AtMG > MERU",
            kit.difference(avg(ATMG, high), avg(MERU, high)) if high else nan_interval(),
            paper_effect=ATMG_MERU_DROP,
            paper_source=ATMG_SOURCE,
            regime=ATMG_REGIME,
            role="regime",
        ),
        claim(
            f"MERU drops: MERU(c={low:g}) - MERU(c ≥ 0.5) > 0",
            kit.difference(zs[(MERU, low, "trained")], avg(MERU, high)) if high else nan_interval(),
            paper_effect=ATMG_MERU_DROP,
            paper_source=ATMG_SOURCE,
            regime=ATMG_REGIME,
            role="regime",
        ),
        claim(
            f"AtMG almost constant: AtMG(c ≥ 0.5) - AtMG(c={low:g}) > -{stable_margin:g}",
            kit.difference(avg(ATMG, high), zs[(ATMG, low, "trained")]) if high else nan_interval(),
            threshold=-stable_margin,
            delta=stable_margin,
            paper_effect=ATMG_STABLE,
            paper_source="seed 001, Table 5: AtMG 29.6 at c=0.1, mean 29.05 at c ≥ 0.5",
        ),
    ]
    world_rows: dict[str, dict[int, float]] = {}
    if vary_world and data.strip().startswith("synthetic") and high:
        claims, world_rows = _atmg_world_claims(bench, data, seeds_, curvatures, claims)
    # the two claims about encoder training: their reason measured on the deciding interval
    claims[:2] = [with_measured_regime(c) for c in claims[:2]]
    rows = {
        f"{r} c={c:g} {kind}: zero-shot top-1": zs[(r, c, kind)]
        for r in (MERU, ATMG)
        for c in curvatures
        for kind in ("trained", "untrained")
    }
    rows[f"{ATMG} c={low:g} {control_noise:.0%} label noise: zero-shot top-1"] = zs[
        (ATMG, low, "noisy")
    ]
    rows |= world_rows
    secondary = ["| recipe, ordering | trained - untrained (mean over c, 95%) |", "|---|---:|"]
    for r in (MERU, ATMG):
        for key in (
            "text chain",
            "image: crop nearer origin (HyCoCLIP)",
            "image: crop further out (AtMG Table 3)",
        ):
            diffs = {
                s: sum(
                    order[(r, c, "trained", key)][s] - order[(r, c, "untrained", key)][s]
                    for c in curvatures
                )
                / len(curvatures)
                for s in seeds_
            }
            vals = [v for v in kit.per_seed(diffs) if math.isfinite(v)]
            cell = mean_interval(vals).format(100.0, 1) if vals else "n/a"
            untrained = [order[(r, c, "untrained", key)][s] for c in curvatures for s in seeds_]
            base = sum(untrained) / len(untrained)
            secondary.append(f"| {r}, {key} (untrained {100 * base:.1f}) | {cell} |")
    figures = [
        plots.line_plot(
            list(curvatures),
            {
                f"{r} {kind}": [sum(kit.per_seed(zs[(r, c, kind)])) / seeds for c in curvatures]
                for r in (MERU, ATMG)
                for kind in ("trained", "untrained")
            },
            out / "atmg_zeroshot.png",
            "curvature c (fixed)",
            "zero-shot top-1 (mean over seeds)",
            "AtMG vs MERU at fixed curvature",
            logx=True,
        )
    ]
    setup = (
        f"{data}, {steps} steps per run, curvature fixed (learn_curvature=false) at "
        f"{', '.join(f'{c:g}' for c in curvatures)}; weights selected on validation mean R@1."
        + (
            " Claims decided on world-inclusive intervals: MERU and AtMG at every curvature "
            "trained again with seed s on the synthetic world of seed s (each arm at the "
            "learning rate it chose here); the seed-only interval on this world is reported "
            "beside each, the label-noise control and the sanity row on this world only."
            if world_rows
            else ""
        )
    )
    return study_result(
        "atmg-curvature",
        ATMG_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seeds_,
        timer=timer,
        tables=metric_table("run (x100)", rows)
        + "\nSecondary evidence, hierarchy ordering (share of correctly ordered, x100):\n\n"
        + "\n".join(secondary)
        + "\n",
        convergence=conv,
        figures=figures,
        notes=ATMG_NOTES,
    )


def _atmg_world_claims(
    bench: kit.Bench,
    data: str,
    seed_list: Sequence[int],
    curvatures: Sequence[float],
    claims: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]]]:
    """AtMG-curvature's three claims re-decided on world-inclusive intervals
    (``world_inclusive``: MERU and AtMG at every curvature trained with seed s on the world of
    seed s, zero-shot top-1 measured there), and the per-world rows for the metric table. The
    claims keep their own inputs (regime, threshold, delta) and their seed-only control."""
    arms, recipes = {}, {}
    for c in curvatures:
        for recipe in (MERU, ATMG):
            label = f"{recipe}-c{c:g}"
            arms[label] = [
                f"curvature_init={c}",
                "learn_curvature=false",
                f"curvature_min={min(c, 0.1)}",
            ]
            recipes[label] = recipe

    def measure(wb: kit.Bench, w: Any, arm: str, recipe: Recipe) -> dict[str, float]:
        return {arm: metric_of(wb.evaluate(recipe), "zeroshot/top1")}

    wr = world_inclusive(bench, data, seed_list, arms, recipes, measure=measure)
    low = min(curvatures)
    high = [c for c in curvatures if c >= 0.5]

    def avg(recipe: str, cs: Sequence[float]) -> dict[int, float]:
        return {s: sum(wr[f"{recipe}-c{c:g}"][s] for c in cs) / len(cs) for s in seed_list}

    world_effects = [
        finite_difference(avg(ATMG, high), avg(MERU, high)),
        finite_difference(wr[f"{MERU}-c{low:g}"], avg(MERU, high)),
        finite_difference(avg(ATMG, high), wr[f"{ATMG}-c{low:g}"]),
    ]
    decided = [
        with_world(c, w if w.n else None, data) for c, w in zip(claims, world_effects, strict=True)
    ]
    rows = {
        f"{recipes[a]} c={c:g} trained: zero-shot top-1 (world of its seed)": wr[a]
        for c in curvatures
        for a in (f"{MERU}-c{c:g}", f"{ATMG}-c{c:g}")
    }
    return decided, rows


#: the study as its runner sees it (``runner.run_study``); ``quick``: the smoke run's options
STUDY = Scripted(
    "atmg-curvature",
    study_atmg_curvature,
    quick={"curvatures": (0.1, 1.0)},
    quick_data=QUICK_WORLD,
    quick_steps=4,
)
