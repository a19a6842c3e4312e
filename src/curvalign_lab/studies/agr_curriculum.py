"""agr-curriculum: AGR's routing claims (seed 000, Definition 5.2, Theorem 5.3, Prop. 5.1).

A declared study (``declare.Study``). Three arms train AGR with the paper's curriculum in steps,
its proportions kept (``schedule``): router on at ``steps/9`` (four-phase), ``T_w = alpha_end =
2 steps/3``, beta ramping from T_w to ``8 steps/9``; the single schedule ramps alpha = beta =
t/T_w. The routing statistics are measured *during* training, at T_w and at the end, through
the shared ``fit``'s trainer hooks (``declare.During``: ``recipe.routing_summary`` on matched
test pairs, the last weights); Theorem 5.3's premise (lambda_E > 2 lambda_H) is read from each
run's log up to T_w (``decay_rate``).

The learning rate: the claims are about the router, which the contrastive loss trains only
through the query gate (S_AGR reads the routed Euclidean score through alpha g w w_E), so each
arm's rate is chosen on validation among the grid's rates where the gate opens on validation
pairs (``Study.admissible`` -> ``Bench.choose_lr``); the page's learning-rate table lists every
rate tried with its precondition. The control: the four-phase arm with its hyperbolic score
flattened (``hyperbolic_flattened``: S_H = -d / tau_H at a fixed tau_H, a scanned dose), the
extreme of Theorem 5.3's premise (a hyperbolic branch whose loss barely falls), its w̄(T_w) rise
over the clean four-phase arm sized on a pilot to the single - four-phase claim (0.78). Before
T_w the four-phase curriculum keeps beta = 0, so its router weighs S_H against 0 and w̄(T_w)
cannot pass the load-balance target 0.5: no handicap of the hyperbolic branch reaches 0.78 over
the clean arm's 0.1, and the control shows the statistic's reach by its sign and its width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.data.features import FeatureStore
from curvalign.recipes.agr import AGR
from curvalign.recipes.base import Recipe
from curvalign_lab import kit
from curvalign_lab.common import STUDY_WORLD, matched_test_pairs
from curvalign_lab.declare import (
    QUICK_WORLD,
    Arm,
    Claim,
    Control,
    During,
    Handicap,
    Measured,
    Study,
    Trained,
)

AGR_PAPER = (
    '"Single-schedule runs exhibit w̄(T_w) = 0.93 (Euclidean-dominated), while four-phase '
    'curriculum achieves w̄(T_w) = 0.15 (balanced)" (seed 000, Sec. 5, Theorem 5.3; '
    "Definition 5.2: Euclidean dominance if w̄(T_w) = (1/B²) Σ w_ij(T_w) > 0.9, balanced in "
    "[0.1, 0.9])."
)
#: router steps before T_w the claims need (four-phase: T_w - steps/9): 250 at 450 steps
AGR_ROUTER_STEPS = 250
#: the step budget at which the four-phase router trains ``AGR_ROUTER_STEPS`` before T_w
AGR_STEPS = 450
#: the mean query gate g at T_w below which the routing claims are untestable (as DualPath's
#: gate-opened precondition): the Euclidean correction reaches S_AGR only through alpha g w w_E
AGR_GATE_OPEN = 0.5
#: the paper's embedding is 512-d; 128 for time
EMBED_DIM = 128

FOUR, SINGLE = "four-phase", "single"


def decay_rate(log: Sequence[Mapping[str, Any]], key: str, until: int) -> float:
    """The convergence rate lambda of Theorem 5.3's model ``L(t) = L_0 exp(-lambda t)`` (seed 000,
    App., Eq. 31): minus the least-squares slope of ``ln L`` against the step, over the logged
    values of ``key`` up to step ``until``. ``nan`` with fewer than three positive values."""
    points = [
        (float(r["step"]), math.log(float(r[key])))
        for r in log
        if key in r and "step" in r and r["step"] <= until and float(r[key]) > 0
    ]
    if len(points) < 3:
        return math.nan
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return math.nan
    return -sum((x - mx) * (y - my) for x, y in points) / sxx


def routing_class(w_mean: float) -> str:
    """Definition 5.2 (seed 000): Euclidean dominance if w̄ > 0.9, hyperbolic dominance if
    w̄ < 0.1, balanced otherwise."""
    if not math.isfinite(w_mean):
        return "n/a"
    if w_mean > 0.9:
        return "Euclidean dominance"
    if w_mean < 0.1:
        return "hyperbolic dominance"
    return "balanced"


def warmup_end(steps: int) -> int:
    """T_w = alpha_end for a budget of ``steps``: two thirds of it (the paper's 5K of 7.5K)."""
    return max(2, round(steps * 2 / 3))


def curriculum(steps: int) -> tuple[str, ...]:
    """The four-phase curriculum in steps for a budget of ``steps`` (every arm's options before
    its own): router from ``steps/9``, T_w at ``2 steps/3``, beta until ``8 steps/9``."""
    t_w = warmup_end(steps)
    return (
        "schedule_unit=steps",
        f"alpha_start={max(1, round(steps / 9))}",
        f"alpha_end={t_w}",
        f"beta_start={t_w}",
        f"beta_end={max(t_w + 1, round(steps * 8 / 9))}",
        f"entropy_anneal_end={max(1, round(steps * 5 / 12))}",
        f"embed_dim={EMBED_DIM}",
        f"lora_rank={min(64, EMBED_DIM // 4)}",
    )


def hyperbolic_flattened(dose: float, steps: int) -> tuple[str, ...]:
    """The control's handicap: the hyperbolic score S_H = -d / tau_H (Eq. 9) at a fixed
    temperature ``tau_H = dose`` (the paper's 1): at a large dose every pair's S_H is near 0,
    so the hyperbolic branch carries little of the ranking and its loss falls slowly (Theorem
    5.3's lambda_H small), the regime in which the theorem sends the router towards the
    Euclidean side. ``steps`` is unused (the handicap is the same at every budget)."""
    del steps
    return (f"tau_h_init={dose:g}", "learn_tau_h=false")


def _routing_on(
    recipe: Recipe, store: FeatureStore, image_ids: torch.Tensor, text_ids: torch.Tensor
) -> dict[str, float]:
    """``recipe.routing_summary`` on the matched rows (``image_ids[i]`` with ``text_ids[i]``,
    [P] each; ``matched_test_pairs``) of ``store``."""
    from curvalign.eval import embed, embed_text_part

    with torch.no_grad():
        t = embed_text_part(recipe, store, "text", text_ids)
        i = embed(recipe, store.image_features[image_ids].float(), "image")
    model: Any = recipe  # an AGR recipe: its routing statistics
    return dict(model.routing_summary(t, i))


def routing(bench: kit.Bench, recipe: Recipe) -> dict[str, float]:
    """The routing statistics of a model during training, on the test split's matched pairs
    (B² pairs as in Definition 5.2)."""
    return _routing_on(recipe, bench.store, *matched_test_pairs(bench.store))


def gate_open(store: FeatureStore, image_ids: Any, text_ids: Any, recipe: Recipe) -> str | None:
    """The routing claims' precondition on one trained model: None when its mean query gate g
    on the given pairs is at least ``AGR_GATE_OPEN``, else why not."""
    g = _routing_on(recipe, store, image_ids, text_ids).get("gate", math.nan)
    if math.isfinite(g) and g >= AGR_GATE_OPEN:
        return None
    return f"query gate g = {g:.3g} < {AGR_GATE_OPEN:g}"


def gate_admissible(bench: kit.Bench) -> Callable[[Recipe], str | None]:
    """``Study.admissible``: the query gate open on *validation* pairs (never the test split),
    the precondition each learning rate of the grid must meet to be chosen."""
    val_pairs = matched_test_pairs(bench.store, "val")

    def admissible(recipe: Recipe) -> str | None:
        return gate_open(bench.store, *val_pairs, recipe)

    return admissible


def agr_gate_precondition(gates: dict[str, float]) -> str | None:
    """None when every arm's mean query gate g at T_w (``gates``: arm -> g, mean over seeds)
    is at least ``AGR_GATE_OPEN``; else why the routing claims cannot be tested there. With the
    gate shut S_AGR reads the routed Euclidean score only through alpha g w w_E, so the
    contrastive loss's gradient on the router's w is scaled by g ~ 0: w̄ then measures the
    router's regularisers (load balance, entropy), not Theorem 5.3's dynamics."""
    shut = {arm: g for arm, g in gates.items() if not (math.isfinite(g) and g >= AGR_GATE_OPEN)}
    if not shut:
        return None
    listed = ", ".join(f"{arm} g = {g:.3g}" for arm, g in shut.items())
    return (
        f"the query gate stayed shut at T_w ({listed} < {AGR_GATE_OPEN:g}): S_AGR reads the "
        "Euclidean score only through alpha g w w_E, so the loss barely trains the router and w̄ "
        "reflects its regularisers, not the curriculum"
    )


def at_warmup_end(trained: Trained, label: str, key: str) -> dict[int, float]:
    """Per seed: the routing statistic ``key`` of arm (or control) ``label`` at T_w."""
    t_w = warmup_end(trained.bench.steps)
    return {s: v[t_w][key] for s, v in trained.during.get(label, {}).items() if t_w in v}


def decay_rates(trained: Trained, arm: str) -> dict[str, dict[int, float]]:
    """Per branch ("euclidean", "hyperbolic"), per seed: ``decay_rate`` of the arm's branch loss
    up to T_w, from each run's log (what the trainer logged during training)."""
    from curvalign.runs import read_log

    t_w = warmup_end(trained.bench.steps)
    out: dict[str, dict[int, float]] = {}
    for seed, run in trained.runs[arm].items():
        log = read_log(run.run_dir)
        for branch in ("euclidean", "hyperbolic"):
            out.setdefault(branch, {})[seed] = decay_rate(log, f"loss_{branch}", t_w)
    return out


def _mean(values: Mapping[int, float]) -> float:
    finite = [v for v in values.values() if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def precondition(trained: Trained) -> str | None:
    """The claims' preconditions (else "not reproduced in this regime"): Theorem 5.3's premise
    lambda_E > 2 lambda_H, measured in the single-schedule arm up to T_w, and the query gate
    open at T_w in both compared arms (``agr_gate_precondition``)."""
    rates = decay_rates(trained, SINGLE)
    lam_e, lam_h = _mean(rates["euclidean"]), _mean(rates["hyperbolic"])
    premise = (
        None
        if math.isfinite(lam_e) and lam_e > 2 * lam_h
        else f"Theorem 5.3 needs lambda_E > 2 lambda_H; measured in the single-schedule arm up to "
        f"T_w: lambda_E = {lam_e:.2e}, lambda_H = {lam_h:.2e} per step"
    )
    gates = agr_gate_precondition(
        {arm: _mean(at_warmup_end(trained, arm, "gate")) for arm in (SINGLE, FOUR)}
    )
    return "; ".join(p for p in (premise, gates) if p) or None


def measure(trained: Trained) -> dict[str, Measured]:
    """The three claims' per-seed effects at T_w: w̄(single) - 0.9; w̄ single - four-phase;
    m̄ = mean(alpha g w w_E) single - four-phase. Routing statistics are not a test metric of
    items, so the intervals count seeds."""
    why = precondition(trained)
    w_single, w_four = (at_warmup_end(trained, a, "w_mean") for a in (SINGLE, FOUR))
    m_single, m_four = (at_warmup_end(trained, a, "euclidean_share") for a in (SINGLE, FOUR))
    classes = ", ".join(
        f"{arm}: " + "/".join(routing_class(w) for w in kit.per_seed(ws))
        for arm, ws in ((SINGLE, w_single), (FOUR, w_four))
    )
    return {
        "dominance": Measured(
            {s: w - 0.9 for s, w in w_single.items()},
            precondition=why,
            note=f"Definition 5.2 per seed at T_w: {classes}",
        ),
        "single>four": Measured(
            {s: w_single[s] - w_four[s] for s in trained.seeds if s in w_single and s in w_four},
            precondition=why,
        ),
        "share": Measured(
            {s: m_single[s] - m_four[s] for s in trained.seeds if s in m_single and s in m_four},
            precondition=why,
        ),
    }


def control_effect(trained: Trained, label: str, seed: int) -> float:
    """The control's effect on one seed: w̄(T_w) of the four-phase arm with its hyperbolic
    score flattened by the dose, minus the clean four-phase arm's (dominance up: positive)."""
    return (
        at_warmup_end(trained, label, "w_mean")[seed] - at_warmup_end(trained, FOUR, "w_mean")[seed]
    )


STATISTICS = (
    ("w_mean", "w̄"),
    ("w_pos", "w positives"),
    ("w_neg", "w negatives"),
    ("gate", "query gate g"),
    ("euclidean_share", "m̄"),
    ("e_above_h", "share β·S_E > S_H"),
)


def tables(trained: Trained, measured: Mapping[str, Measured]) -> str:
    """The page's tables: the learning rate per arm with each rate's precondition, the routing
    statistics at T_w and at the end, Definition 5.2's class per seed and the loss decay rates."""
    steps = trained.bench.steps
    t_w = warmup_end(steps)
    lines = [
        "**Learning rate and its precondition.** Each arm's rate is chosen on validation among "
        f"the grid's rates where the query gate opens (mean g >= {AGR_GATE_OPEN:g} on validation "
        "pairs), because with the gate shut S_AGR reads the routed Euclidean score only through "
        "alpha g w w_E: the loss then barely trains the router and w̄ measures its "
        "regularisers, not the curriculum. A rate where the gate stays shut scores -inf.",
        "",
        "| arm | rate | validation mean R@1 x100 | precondition (query gate open) | chosen |",
        "|---|---:|---:|---|---|",
    ]
    choice = trained.bench.lr_choice
    for arm, c in choice.items():
        for lr, value in c.grid:
            reason = (c.excluded or {}).get(f"{lr:g}")
            lines.append(
                f"| {arm} | {lr:g} | "
                + (f"{100 * value:.1f}" if math.isfinite(value) else "-")
                + f" | {'not met: ' + reason if reason else 'met'} | "
                + ("yes" if lr == c.chosen else "")
                + " |"
            )
    if not choice:
        lines.append("| every arm | no grid (`--quick` or `lr=` set) | | not checked | |")
    labels = [*ARMS, *(k for k in trained.during if k not in ARMS)]
    lines += [
        "",
        f"Routing statistics (x100, mean over seeds) at T_w = step {t_w} and at the end, on the "
        "test split's matched pairs:",
        "",
        "| arm | when | " + " | ".join(label for _, label in STATISTICS) + " |",
        "|---|---|" + "---:|" * len(STATISTICS),
    ]
    for label in labels:
        per_seed = trained.during.get(label, {})
        for when in sorted({m for v in per_seed.values() for m in v}):
            cells = [
                _mean({s: v[when].get(key, math.nan) for s, v in per_seed.items() if when in v})
                for key, _ in STATISTICS
            ]
            name = "T_w" if when == t_w else f"end (step {when})"
            lines.append(
                f"| {label} | {name} | " + " | ".join(f"{100 * c:.1f}" for c in cells) + " |"
            )
    lines += [
        "",
        "Routing at T_w by Definition 5.2 (Euclidean dominance w̄ > 0.9, hyperbolic dominance "
        "w̄ < 0.1, balanced otherwise):",
        "",
        "| arm | w̄(T_w) per seed | class |",
        "|---|---|---|",
    ]
    for label in labels:
        ws = kit.per_seed(at_warmup_end(trained, label, "w_mean"))
        lines.append(
            f"| {label} | {', '.join(f'{w:.3f}' for w in ws)} | "
            f"{', '.join(routing_class(w) for w in ws)} |"
        )
    lines += [
        "",
        "| arm | lambda_E per 1000 steps (up to T_w) | lambda_H per 1000 steps |",
        "|---|---|---|",
    ]
    for arm in ARMS:
        rates = decay_rates(trained, arm)
        lines.append(
            f"| {arm} | "
            + " | ".join(
                ", ".join(f"{1000 * v:.3g}" for v in kit.per_seed(rates[b]))
                for b in ("euclidean", "hyperbolic")
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


ARMS = (FOUR, SINGLE)


def figures(trained: Trained, out: Path) -> list[Path]:
    """The routing weight, gate, alpha and beta as logged during training, per arm (first seed),
    with T_w marked."""
    from curvalign.report import plots
    from curvalign.runs import read_log

    seed = trained.seeds[0]
    logs = {arm: read_log(trained.runs[arm][seed].run_dir) for arm in ARMS}
    keys = [
        k for k in ("routing_weight", "gate", "alpha", "beta") if any(k in r for r in logs[FOUR])
    ]
    if not keys:
        return []
    return [
        plots.log_curves(
            logs,
            keys,
            out / "agr_routing.png",
            title=f"AGR (seed {seed}): routing weight and gate per arm",
            marks={"T_w": warmup_end(trained.bench.steps)},
        )
    ]


AGR_NOTES = (
    "w̄ averages w over all B² pairs, of which B² - B are negatives. By Prop. 5.1 the router's "
    "gradient moves w_ij towards whichever score is larger for that pair (w up where "
    "β·S_E > S_H); for a negative S_H = -d ≤ 0 while its cosine is near 0, so β·S_E > S_H on "
    "almost every negative once β > 0 (the 'share β·S_E > S_H' column). w̄ therefore tracks the "
    "offset between the two scores on negatives, not the curriculum; w on positives and the "
    "effective Euclidean share m̄ = mean(α·g·w·w_E) (how much of the Euclidean correction can "
    "reach S_AGR) are reported beside it. The paper's 0.15 may be the query gate g of its "
    "Appendix A/B rather than w̄: g is reported too. The verdicts use the paper's statistic "
    "(w̄) and m̄. The statistics are measured during training (at T_w and at the end, the "
    "last weights) through the trainer's hooks. The control is the four-phase arm with its "
    "hyperbolic score flattened (S_H = -d/τ_H at a fixed τ_H read off a pilot's scan of 3, 10 "
    "and 30; the paper's τ_H is 1), the extreme of Theorem 5.3's premise: a hyperbolic branch "
    "that carries little of the ranking, which should lose routing weight. It is sized on the "
    "single - four-phase claim's 78 points, which it cannot reach: before T_w the four-phase "
    "curriculum keeps β = 0, so its router weighs S_H against 0 and w̄(T_w) cannot pass the "
    "load-balance target 0.5 whatever the hyperbolic branch does. The control then shows the "
    "statistic's reach by its sign and width: an interval above 0 and narrower than 78 points "
    "means a difference of the claim's size would have been seen."
)

STUDY = Study(
    name="agr-curriculum",
    paper=AGR_PAPER,
    claims=(
        Claim(
            "dominance",
            "single schedule: w̄(T_w) > 0.9 (Euclidean dominance)",
            words="Single-schedule runs exhibit w̄(T_w) = 0.93 (Euclidean-dominated)",
            source="seed 000, Sec. 5: w̄(T_w) = 0.93 against Definition 5.2's 0.9",
            effect=0.03,
            min_steps=AGR_STEPS,
        ),
        Claim(
            "single>four",
            "w̄(T_w): single schedule > four-phase",
            words=(
                "Single-schedule runs exhibit w̄(T_w) = 0.93 (Euclidean-dominated), while "
                "four-phase curriculum achieves w̄(T_w) = 0.15 (balanced)"
            ),
            source="seed 000, Sec. 5: 0.93 (single) - 0.15 (four-phase)",
            effect=0.78,
            min_steps=AGR_STEPS,
        ),
        Claim(
            "share",
            "m̄(T_w) = mean(α·g·w·w_E): single schedule > four-phase",
            words="no words in the paper: the project's statistic (see the notes)",
            source="seed 000: m̄ is this project's statistic, no number in the paper",
            effect=None,
            role="exploratory",
            min_steps=AGR_STEPS,
        ),
    ),
    arms=(Arm(FOUR, AGR.name), Arm(SINGLE, AGR.name, ("single_schedule=true",))),
    measure=measure,
    control=Control(
        FOUR,
        Handicap(
            "the four-phase arm's hyperbolic score flattened: τ_H fixed at {dose} (the paper's 1)",
            doses=(3.0, 10.0, 30.0),
            dose=30.0,
            apply=lambda store, dose, seed: store,
            options=hyperbolic_flattened,
        ),
        "single>four",
        effect=control_effect,
    ),
    data=STUDY_WORLD,
    steps=AGR_STEPS,
    baselines=("the single schedule (the paper's ablation)",),
    preconditions=(
        "Theorem 5.3's premise lambda_E > 2 lambda_H (single schedule, up to T_w)",
        f"the query gate open at T_w (mean g >= {AGR_GATE_OPEN:g}) in both compared arms",
    ),
    notes=AGR_NOTES,
    quick_data=QUICK_WORLD,
    quick_steps=4,
    schedule=curriculum,
    during=During(lambda steps: (warmup_end(steps), steps), routing),
    select_best=False,
    admissible=gate_admissible,
    tables=tables,
    figures=figures,
)
