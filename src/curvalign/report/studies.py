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
  effect at the run's own seed SD, and decides each claim by ``studykit.decide`` (written into
  the output), Holm-corrected over the study's claims (``studykit.apply_holm``): holds / does
  not hold / equivalent within ±delta / inconclusive / underpowered at n seeds / not reproduced
  in this regime.
* on a synthetic world, decides each claim about a method (PHyCLIP's, ProCLIP's, AtMG's, AGR's,
  DualPath's) on a *world-inclusive* interval (``vary_world``: seed s trains and is evaluated on
  the world of seed s, ``world_inclusive``), the fixed-world (seed-only) interval reported
  beside it (``_with_world``).

Each study is ``study_NAME(out, *, steps, data, overrides, seeds, seed_base, lr_grid,
show_progress, notify, **options)`` returning a JSON-ready dict; ``run_study`` writes
``study.json`` and ``study.md`` into ``out`` (``power=True``: a pilot, then the seeds the
paper's effects need within ``max_seeds``); ``run_all`` runs every study into ``out/NAME``;
``curvalign.report.results`` turns those JSON files into docs/results.md and compares two seed
bases (``--stability``).

Study definitions name the recipes they study and set their options (configuration); what a
method computes (routing statistics, text-pair embeddings, factor-wise composition) is asked of
the recipe. The synthetic world is not the papers' data (no pixels, no real language, a small
known taxonomy): a claim that holds or fails here is evidence about the mechanism at this scale,
not a reproduction of the papers' tables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.agr import AGR
from curvalign.recipes.atmg import Atmg
from curvalign.recipes.base import Recipe
from curvalign.recipes.dualpath import DualPath
from curvalign.recipes.meru import Meru
from curvalign.recipes.phyclip import Phyclip
from curvalign.recipes.proclip import Proclip
from curvalign.report import studykit as kit
from curvalign.report.tables import write_json
from curvalign.stats import mean_interval

#: each study tests a claim about named methods: it names them through their recipe classes
MERU, ATMG = Meru.name, Atmg.name

Notify = Callable[[str], None]


#: the synthetic world of the studies: 2500 images, so that validation and test hold 500 images
#: each (with 80 validation images a 1-point tolerance was at the noise level)
STUDY_WORLD = "synthetic:images=2500,val_fraction=0.2,text_pairs=0"

#: the calibrated control's handicap: this share of the train captions describe another image
CONTROL_NOISE = 0.1
#: ProCLIP's control, sized to its claim (+2 R@1 points): at 10% noise the product arm lost
#: -0.4 ± 1.9 points (it did not separate); a pilot (one seed each, 150 steps at lr 1e-2) lost
#: about 5 points at 30% and 20 at 60%, so 30% is the smallest pilot rate clearly above 2
PROCLIP_CONTROL_NOISE = 0.3
#: PHyCLIP's control, sized to its k claim (+1.5 R@1 points): its heads barely feel label noise
#: (10%: -0.1 ± 1.9 points; the pilot above: about 0.4 at 30%, 0.6 and 3.8 at 60%, too noisy to
#: calibrate), while the largest k at half the total dimension lost about 4 points on both pilot
#: seeds: the control halves k·d (no label noise unless ``control_noise`` > 0)
PHYCLIP_CONTROL_NOISE = 0.0

# --- shared helpers -----------------------------------------------------------------------------


def load_study_data(data: str) -> tuple[FeatureStore, Any]:
    """(store, SyntheticWorld or None): synthetic specs through ``data.load_synthetic_world``
    (the same store ``load_data`` returns, with its ground truth), others through
    ``data.load_store``."""
    from curvalign.data import load_store, load_synthetic_world

    if data.strip().partition(":")[0] == "synthetic":
        world = load_synthetic_world(data)
        return world.store, world
    return load_store(data)[0], None


def _noisy(bench: kit.Bench, rate: float) -> Callable[[int], FeatureStore]:
    """``store_from`` for a calibrated label-noise control arm (``kit.with_label_noise``)."""
    noisy = kit.with_label_noise(bench.store, rate)
    return lambda step: noisy


def _test_pairs(store: FeatureStore) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids, the first caption of each) of the test split: matched rows."""
    images = store.split_image_ids("test")
    t2i = store.text_to_image.long()
    first = torch.full((store.num_images,), -1, dtype=torch.long)
    order = torch.arange(len(t2i)).flip(0)
    first[t2i[order]] = order  # the last write is the smallest caption id
    texts = first[images]
    keep = texts >= 0
    return images[keep], texts[keep]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation with average ranks for ties."""

    def ranks(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        order = torch.argsort(v)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        uniq, inverse = torch.unique(v, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, r)
        counts = torch.bincount(inverse, minlength=len(uniq)).double()
        return (sums / counts)[inverse]

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denom) if denom > 0 else 0.0


def _interval_row(label: str, values: dict[int, float], scale: float = 100.0) -> str:
    """One row of a metric table; a label ending in "(count)" is printed unscaled."""
    if label.endswith("(count)"):
        scale = 1.0
    vals = [v for v in kit.per_seed(values) if v is not None and math.isfinite(v)]
    if not vals:
        return f"| {label} | n/a | |"
    iv = mean_interval(vals)
    seeds = ", ".join(f"{v * scale:.1f}" for v in vals)
    return f"| {label} | {iv.format(scale, 1)} | {seeds} |"


def _metric_table(title: str, rows: dict[str, dict[int, float]], scale: float = 100.0) -> str:
    lines = [f"| {title} | mean ± 95% | per seed |", "|---|---:|---|"]
    lines += [_interval_row(k, v, scale) for k, v in rows.items()]
    return "\n".join(lines) + "\n"


def _claims_table(claims: list[dict[str, Any]]) -> str:
    lines = [
        "| claim | paper's effect | MDE at these seeds | effect (95% interval) | calibrated "
        "control (95% interval) | verdict | Holm-adjusted verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        ok = "separated" if c.get("control_ok") else "did not separate"
        lines.append(
            f"| {c['claim']} ({c.get('role', 'primary')}) | {c.get('paper_effect_text', '')} | "
            f"{c.get('mde_text', '')} | {c['effect_text']} | {c['control_what']}: "
            f"{c['control_text']} ({ok}) | {c['outcome']} | **{c.get('holm_outcome', '')}** |"
        )
    sanity = [c for c in claims if c.get("sanity_text")]
    if sanity:
        lines.append("")
        lines.append("Sanity rows (trained - untrained: always passes; never decides a verdict):")
        lines.append("")
        for text in dict.fromkeys(c["sanity_text"] for c in sanity):
            lines.append(f"- {text}")
    return "\n".join(lines) + "\n"


def _convergence_table(conv: dict[str, dict[str, Any]]) -> str:
    lines = ["| arm | seeds converged | best steps | stopped at |", "|---|---:|---|---|"]
    for arm, c in conv.items():
        lines.append(
            f"| {arm} | {c['converged']}/{c['seeds']} | {', '.join(map(str, c['best_steps']))} | "
            f"{', '.join(map(str, c.get('last_steps', [])))} |"
        )
    return "\n".join(lines) + "\n"


def _finite_difference(a: dict[int, float], b: dict[int, float]) -> kit.Interval:
    """``kit.difference(a, b)``, or a nan interval (n = 0) where a value is missing or not
    finite (a metric the store cannot give)."""
    values = [*a.values(), *b.values()]
    if not values or not all(math.isfinite(v) for v in values):
        return _nan_interval()
    return kit.difference(a, b)


def _scalar(values: dict[int, float], offset: float = 0.0) -> kit.Interval:
    return mean_interval([v - offset for v in kit.per_seed(values)])


def _normalised(store: FeatureStore) -> FeatureStore:
    """Every feature tensor of ``store`` L2-normalised per row (ProCLIP Sec. 3.2 normalises the
    frozen CLIP features before its heads). Minimum stand-in for the recipe-owned input
    normalisation of the comparisons issue."""
    changes = {}
    for name, value in store.fields().items():  # on-disk names: each text part's files too
        if name.endswith("features") and isinstance(value, torch.Tensor) and value.ndim >= 2:
            changes[name] = torch.nn.functional.normalize(value.float(), dim=-1)
    return store.with_fields(**changes)


def _bench(
    out: Path,
    store: FeatureStore,
    data: str,
    steps: int,
    overrides: Sequence[str],
    notify: Notify,
    show_progress: bool,
    validations: int = 3,
    lr_grid: Sequence[float] | None = kit.LR_GRID,
    lr_cache: Path | None = None,
) -> kit.Bench:
    """The study's bench on ``store`` (``data`` is its spec): a ``steps`` budget with
    ``validations`` validation evaluations over it, each arm's learning rate chosen on
    validation from ``lr_grid`` (None or empty: ``kit.STUDY_LR_SCALE`` x the paper rate), the
    runs of that choice stored in ``lr_cache`` (``kit.cached_value``; None: not stored)."""
    return kit.Bench(
        out,
        store,
        data,
        steps,
        overrides,
        val_every=max(1, steps // validations),
        lr_grid=lr_grid,
        lr_cache=lr_cache,
        notify=notify,
        show_progress=show_progress,
    )


def _result(
    name: str,
    paper: str,
    claims: list[dict[str, Any]],
    *,
    setup: str,
    bench: kit.Bench,
    seeds: Sequence[int],
    timer: kit.Timer,
    tables: str,
    convergence: dict[str, dict[str, Any]],
    figures: Sequence[Path],
    notes: str = "",
    val_what: str = "validation mean R@1",
    **extra: Any,
) -> dict[str, Any]:
    kit.apply_holm(claims)
    family = (
        f"Family for the multiplicity correction: the {len(claims)} claims of this study "
        f"({sum(c.get('holm_family') is not None for c in claims)} testable here), Holm at "
        f"family-wise alpha {kit.ALPHA:g}.\n\n"
    )
    markdown = (
        family
        + _claims_table(claims)
        + "\n"
        + tables
        + f"\nConvergence ({val_what} every "
        + f"{bench.val_every} steps; converged = curvalign.stats.curve_converged: the best is not "
        + "the last validation and the last third of the curve rises by no more than its own "
        + f"noise (2 SD) or {bench.plateau_tol:g}):\n\n"
        + _convergence_table(convergence)
        + f"\nTraining: {bench.lr_text()}; an arm not flat at its {bench.steps}-step budget trains "
        + f"on in segments of {bench.val_every} steps up to {bench.max_steps} steps (the "
        + "'stopped at' column).\n"
    )
    return {
        "name": name,
        "paper": paper,
        "setup": setup,
        "notes": notes,
        "rule": kit.RULE,
        "claims": claims,
        "verdict": "; ".join(f"{c['claim']}: {c['holm_outcome']}" for c in claims),
        "holds": all(c["holm_verdict"] == kit.HOLDS for c in claims),
        "lr_choice": {
            label: {"recipe": c["recipe"], "chosen": c["chosen"], "grid": list(c["grid"].items())}
            for label, c in bench.lr_choice.items()
        },
        "lr_grid": list(bench.lr_grid or ()),
        "seeds": list(seeds),
        "steps": bench.steps,
        "data": bench.spec,
        "convergence": convergence,
        "learning_rates": {
            k: {"paper": p, "study": v} for k, (p, v) in bench.learning_rates.items()
        },
        "lr_scale": bench.lr_scale,
        "max_steps": bench.max_steps,
        "markdown": markdown,
        "figures": [str(f) for f in figures],
        "wall_s": timer.seconds(),
        **extra,
    }


# --- agr-curriculum (seed 000, Definition 5.2, Theorem 5.3, Prop. 5.1) ---------------------------

AGR_PAPER = (
    '"Single-schedule runs exhibit w̄(T_w) = 0.93 (Euclidean-dominated), while four-phase '
    'curriculum achieves w̄(T_w) = 0.15 (balanced)" (seed 000, Sec. 5, Theorem 5.3; '
    "Definition 5.2: Euclidean dominance if w̄(T_w) = (1/B²) Σ w_ij(T_w) > 0.9, balanced in "
    "[0.1, 0.9])."
)
AGR_ROUTER_STEPS = 250


def decay_rate(log: Sequence[dict[str, Any]], key: str, until: int) -> float:
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


#: the size the m̄ control must reach (m̄ has no number in the paper): the smallest effect the
#: paper states on its routing statistic (0.93 against Definition 5.2's 0.9)
AGR_M_CONTROL_MIN = 0.03
#: the mean query gate g at T_w below which the routing claims are untestable (as DualPath's
#: gate-opened precondition): the Euclidean correction reaches S_AGR only through alpha g w w_E
AGR_GATE_OPEN = 0.5


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


AGR_NOTES = (
    "w̄ averages w over all B² pairs, of which B² - B are negatives. By Prop. 5.1 the router's "
    "gradient moves w_ij towards whichever score is larger for that pair (w up where "
    "β·S_E > S_H); for a negative S_H = -d ≤ 0 while its cosine is near 0, so β·S_E > S_H on "
    "almost every negative once β > 0 (the 'share β·S_E > S_H' rows). w̄ therefore tracks the "
    "offset between the two scores on negatives, not the curriculum; w on positives and the "
    "effective Euclidean share m̄ = mean(α·g·w·w_E) (how much of the Euclidean correction can "
    "reach S_AGR) are reported beside it. The paper's 0.15 may be the query gate g of its "
    "Appendix A/B rather than w̄: g is reported too. The verdicts use the paper's statistic "
    "(w̄) and m̄. The control (the β throttle removed: the strongest push towards dominance) "
    "must move each statistic, against the single schedule, by at least the claim's own size "
    "(3 points for w̄ > 0.9, 78 for single - four-phase, 3 for m̄), not only away from 0."
)


def study_agr_curriculum(
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
    embed_dim: int = 128,
    vary_world: bool = True,
) -> dict[str, Any]:
    """Four-phase curriculum vs single-schedule warm-up, at T_w and at the end.

    Schedules in steps, the paper's proportions kept: router on at ``steps/9`` (four-phase),
    ``T_w = alpha_end = 2 steps/3``, beta ramps from T_w to ``8 steps/9``; the single schedule
    ramps alpha = beta = t/T_w. At the default 450 steps the router trains 250 steps (four-phase)
    / 300 steps (single) before T_w; below ``AGR_ROUTER_STEPS`` router steps the verdict is
    "too short to test the claim".
    Arms: four-phase; single schedule; control = the curriculum's β throttle removed (the router
    ramps in from step 0 as in the single schedule, but sees the full Euclidean score from the
    first step): the situation the theorem says produces dominance most surely, so the
    statistic must move against the single schedule if it can see dominance at all.
    Measured on matched test pairs (``recipe.routing_summary``): w̄, w on positives / negatives,
    the query gate g, m̄ = mean(alpha g w w_E) and the share of pairs with beta S_E > S_H.
    Claims decided: (1) single: w̄(T_w) > 0.9; (2) w̄(T_w) single > four-phase; (3) m̄(T_w)
    single > four-phase. Preconditions (else "not reproduced in this regime"): Theorem 5.3's
    premise lambda_E > 2 lambda_H, measured, and the query gate open at T_w
    (``agr_gate_precondition``). Control for each: control arm - single arm on the same statistic,
    checked for sign and size: at least the claim's paper effect (3 points for (1), 78 for (2):
    if the strongest push towards dominance cannot move the statistic by the claimed amount,
    the statistic cannot show the claimed difference) and ``AGR_M_CONTROL_MIN`` for (3).
    ``vary_world`` (synthetic data): the claims are about the curriculum, not one world, so the
    three arms are trained again with seed s on the world of seed s (``world_inclusive``, each at
    the learning rate it chose on the study's world, the statistics measured at T_w on that
    world's matched test pairs); each claim and its control (which compares the same arms) are
    decided on those world-inclusive intervals and the fixed-world (seed-only) ones are reported
    beside them (``_with_world``). The premise (lambda_E > 2 lambda_H) is measured on the study's
    world only.
    """
    from curvalign.report import plots
    from curvalign.runs import read_log

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 450
    data = data or STUDY_WORLD
    store, _ = load_study_data(data)
    t_w = max(2, round(steps * 2 / 3))
    a0 = max(1, round(steps / 9))
    b_end = max(t_w + 1, round(steps * 8 / 9))
    schedule = [
        "schedule_unit=steps",
        f"alpha_start={a0}",
        f"alpha_end={t_w}",
        f"beta_start={t_w}",
        f"beta_end={b_end}",
        f"entropy_anneal_end={max(1, round(steps * 5 / 12))}",
        f"embed_dim={embed_dim}",
        f"lora_rank={min(64, embed_dim // 4)}",
    ]
    bench = _bench(
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
    arms = {
        "four-phase": [],
        "single": ["single_schedule=true"],
        "control (no beta throttle)": ["alpha_start=0", "beta_start=0", "beta_end=0"],
    }
    image_ids, text_ids = _test_pairs(bench.store)
    stats: dict[str, dict[str, dict[int, dict[str, float]]]] = {a: {} for a in arms}
    conv, logs = {}, {}
    rates: dict[str, dict[int, float]] = {}
    for arm, extra in arms.items():
        runs = {}
        for seed in seed_list:

            def measure(step: int, recipe: Recipe, arm: str = arm, seed: int = seed) -> None:
                where = "T_w" if step == t_w else "end"
                stats[arm].setdefault(where, {})[seed] = _routing_on(
                    recipe, bench.store, image_ids, text_ids
                )

            runs[seed] = bench.train(
                arm,
                AGR.name,
                schedule + extra,
                seed,
                marks=(t_w, steps),
                on_mark=measure,
                select_best=False,
            )
            log = read_log(runs[seed].run_dir)
            if seed == seed_list[0]:
                logs[arm] = log
            for key in ("loss_euclidean", "loss_hyperbolic"):
                rates.setdefault(f"{arm}|{key}", {})[seed] = decay_rate(log, key, t_w)
        conv[arm] = kit.convergence_record(runs)

    def values(arm: str, where: str, key: str) -> dict[int, float]:
        return {s: v[key] for s, v in stats[arm].get(where, {}).items()}

    single, four, control = "single", "four-phase", "control (no beta throttle)"
    router_steps = min(t_w - a0, t_w)
    lam_e = kit.per_seed(rates["single|loss_euclidean"])
    lam_h = kit.per_seed(rates["single|loss_hyperbolic"])
    lam_e_mean, lam_h_mean = sum(lam_e) / len(lam_e), sum(lam_h) / len(lam_h)
    premise = (
        None
        if math.isfinite(lam_e_mean) and lam_e_mean > 2 * lam_h_mean
        else f"Theorem 5.3 needs lambda_E > 2 lambda_H; measured in the single-schedule arm up to "
        f"T_w: lambda_E = {lam_e_mean:.2e}, lambda_H = {lam_h_mean:.2e} per step"
    )
    gate_shut = agr_gate_precondition(
        {arm: _scalar(values(arm, "T_w", "gate")).mean for arm in (single, four)}
    )
    premise = "; ".join(p for p in (premise, gate_shut) if p) or None
    budget_ok = router_steps >= AGR_ROUTER_STEPS
    ctrl_w = kit.difference(values(control, "T_w", "w_mean"), values(single, "T_w", "w_mean"))
    ctrl_m = kit.difference(
        values(control, "T_w", "euclidean_share"), values(single, "T_w", "euclidean_share")
    )
    claims = [
        kit.claim_record(
            "single schedule: w̄(T_w) > 0.9 (Euclidean dominance)",
            _scalar(values(single, "T_w", "w_mean"), 0.9),
            ctrl_w,
            "w̄(T_w) control - single",
            budget_ok=budget_ok,
            paper_effect=0.03,
            paper_source="seed 000, Sec. 5: w̄(T_w) = 0.93 against Definition 5.2's 0.9",
            control_min=0.03,
            precondition=premise,
        ),
        kit.claim_record(
            "w̄(T_w): single schedule > four-phase",
            kit.difference(values(single, "T_w", "w_mean"), values(four, "T_w", "w_mean")),
            ctrl_w,
            "w̄(T_w) control - single",
            budget_ok=budget_ok,
            paper_effect=0.78,
            paper_source="seed 000, Sec. 5: 0.93 (single) - 0.15 (four-phase)",
            control_min=0.78,
            precondition=premise,
        ),
        kit.claim_record(
            "m̄(T_w) = mean(α·g·w·w_E): single schedule > four-phase",
            kit.difference(
                values(single, "T_w", "euclidean_share"), values(four, "T_w", "euclidean_share")
            ),
            ctrl_m,
            "m̄(T_w) control - single",
            budget_ok=budget_ok,
            paper_source="seed 000: m̄ is this project's statistic, no number in the paper",
            control_min=AGR_M_CONTROL_MIN,
            precondition=premise,
            role="exploratory",
        ),
    ]
    world_rows: dict[str, dict[int, float]] = {}
    world_classes: list[str] = []
    if vary_world and data.strip().startswith("synthetic"):
        full = {a: schedule + e for a, e in arms.items()}
        claims, world_rows, world_classes = _agr_world_claims(
            bench, data, seed_list, full, (t_w, steps), claims
        )
    rows: dict[str, dict[int, float]] = {
        f"{arm}: lambda_{branch[0].upper()} (loss decay rate per 1000 steps, up to T_w)": {
            s: 1000 * v for s, v in rates[f"{arm}|loss_{branch}"].items()
        }
        for arm in arms
        for branch in ("euclidean", "hyperbolic")
    }
    classes = ["| arm | w̄(T_w) per seed | class (Definition 5.2) |", "|---|---|---|"]
    for arm in arms:
        ws = kit.per_seed(values(arm, "T_w", "w_mean"))
        classes.append(
            f"| {arm} | {', '.join(f'{w:.3f}' for w in ws)} | "
            f"{', '.join(routing_class(w) for w in ws)} |"
        )
    for arm in arms:
        for where in ("T_w", "end"):
            for key, label in (
                ("w_mean", "w̄"),
                ("w_pos", "w positives"),
                ("w_neg", "w negatives"),
                ("gate", "query gate g"),
                ("euclidean_share", "m̄"),
                ("e_above_h", "share β·S_E > S_H"),
            ):
                rows[f"{arm} @ {where}: {label}"] = values(arm, where, key)
    rows |= world_rows
    classes += world_classes
    keys = [
        k for k in ("routing_weight", "gate", "alpha", "beta") if any(k in r for r in logs[four])
    ]
    figures = [
        plots.log_curves(
            logs,
            keys,
            out / "agr_routing.png",
            title=f"AGR (seed {seed_list[0]}): routing weight and gate per arm",
            marks={"T_w": t_w},
        )
    ]
    setup = (
        f"{data}, {steps} steps, T_w = {t_w}, four-phase router from step {a0} "
        f"({t_w - a0} router steps before T_w; single: {t_w}), beta until {b_end}; AGR with "
        f"embed_dim={embed_dim} (paper 512) for time; statistics on {len(image_ids)} matched "
        "test pairs (B² pairs as in Definition 5.2)."
        + (
            " Claims and their controls decided on world-inclusive intervals: the three arms "
            "trained again with seed s on the synthetic world of seed s (each at the learning "
            "rate it chose here), the statistics at T_w on that world's matched test pairs; the "
            "seed-only intervals on this world are reported beside them. The premise "
            "(lambda_E > 2 lambda_H) is measured on this world only."
            if world_rows
            else ""
        )
    )
    return _result(
        "agr-curriculum",
        AGR_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=_metric_table("routing statistic (x100)", rows)
        + "\nRouting at T_w by Definition 5.2 (Euclidean dominance w̄ > 0.9, hyperbolic dominance "
        + "w̄ < 0.1, balanced otherwise):\n\n"
        + "\n".join(classes)
        + "\n",
        convergence=conv,
        figures=figures,
        notes=AGR_NOTES,
        router_steps_before_warmup_end=router_steps,
        convergence_rates={k: {str(s): v for s, v in d.items()} for k, d in rates.items()},
        premise=premise,
        warmup_end_step=t_w,
        statistics={
            a: {w: {str(s): v for s, v in d.items()} for w, d in st.items()}
            for a, st in stats.items()
        },
    )


def _routing_on(
    recipe: Recipe, store: FeatureStore, image_ids: torch.Tensor, text_ids: torch.Tensor
) -> dict[str, float]:
    """``recipe.routing_summary`` on the matched rows (``image_ids[i]`` with ``text_ids[i]``,
    [P] each; ``_test_pairs``) of ``store``."""
    from curvalign.eval import embed, embed_text_part

    with torch.no_grad():
        t = embed_text_part(recipe, store, "text", text_ids)
        i = embed(recipe, store.image_features[image_ids].float(), "image")
    return recipe.routing_summary(t, i)


def _agr_world_claims(
    bench: kit.Bench,
    data: str,
    seed_list: Sequence[int],
    arms: dict[str, list[str]],
    marks: tuple[int, int],
    claims: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]], list[str]]:
    """AGR-curriculum's three claims and their controls re-decided on world-inclusive
    intervals: every arm (``arms``: its full overrides) trained with seed s on the world of seed
    s (``world_inclusive``, last weights), ``recipe.routing_summary`` at ``marks`` = (T_w, end)
    on that world's matched test pairs. Returns the claims, the per-world rows for the metric
    table and the per-world rows of the Definition 5.2 table."""
    t_w = marks[0]

    def on_mark(wb: kit.Bench, arm: str, step: int, recipe: Recipe) -> dict[str, float]:
        where = "T_w" if step == t_w else "end"
        summary = _routing_on(recipe, wb.store, *_test_pairs(wb.store))
        return {f"{arm} @ {where}: {k}": v for k, v in summary.items()}

    world = world_inclusive(
        bench,
        data,
        seed_list,
        arms,
        AGR.name,
        marks=marks,
        on_mark=on_mark,
        select_best=False,
    )

    def at(arm: str, key: str) -> dict[int, float]:
        return world[f"{arm} @ T_w: {key}"]

    single, four, control = "single", "four-phase", "control (no beta throttle)"
    w_single = at(single, "w_mean")
    w_ctrl = _finite_difference(at(control, "w_mean"), w_single)
    m_ctrl = _finite_difference(at(control, "euclidean_share"), at(single, "euclidean_share"))
    finite = all(math.isfinite(v) for v in w_single.values())
    effects = [
        (_scalar(w_single, 0.9) if finite else _nan_interval(), w_ctrl),
        (_finite_difference(w_single, at(four, "w_mean")), w_ctrl),
        (_finite_difference(at(single, "euclidean_share"), at(four, "euclidean_share")), m_ctrl),
    ]
    decided = [
        _with_world(c, e if e.n else None, data, world_control=k if k.n else None)
        for c, (e, k) in zip(claims, effects, strict=True)
    ]
    rows, classes = {}, []
    for arm in arms:
        for key, label in (("w_mean", "w̄"), ("euclidean_share", "m̄")):
            rows[f"{arm} @ T_w: {label} (world of its seed)"] = at(arm, key)
        ws = kit.per_seed(at(arm, "w_mean"))
        classes.append(
            f"| {arm} (world of its seed) | {', '.join(f'{w:.3f}' for w in ws)} | "
            f"{', '.join(routing_class(w) for w in ws)} |"
        )
    return decided, rows, classes


# --- dualpath-forgetting (seed 004) ---------------------------------------------------------------

DUALPATH_PAPER = (
    "viPolyQwen (seed 004), Secs. 3.4 and 4.5: the dual-path projection with its gate "
    "g = sigmoid(θ) (θ₀ = -5, logged 0.01 at step 2000 and 0.15 at 5000) lets Phase 2 add "
    'image-text alignment "without degrading" the text-similarity skill learnt in Phase 1; '
    "docs/design.md's reading: text-text ability after Phase 2 stays within a small margin of Phase 1."
)


DUALPATH_NOTES = (
    "The skill is what Phase 1 trains: texts embedded with the text-pair prefix "
    "(recipe.embed_text_pairs), Spearman of the cosine against the pair score on held-out "
    "paraphrase pairs, and text-text R@1 (a held-out same-topic query must retrieve a text of "
    "its topic first among all held-out partners). The paraphrases' topics are carried by no "
    "image, so Phase 2's image-caption loss cannot train the skill (a control drops it). In "
    "this architecture the gate mixes the two paths for image inputs only: a text input's "
    "embedding does not depend on θ, so the gate cannot by itself protect a text-text skill "
    "(the 'no gate' arm differs from 'full' only through the image side)."
)


def study_dualpath_forgetting(
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
    margin: float = 0.02,
    gate_speed: float = 50.0,
    vary_world: bool = True,
) -> dict[str, Any]:
    """Phase-1 skill measured as the paper means it, before and after Phase 2.

    World: text pairs are paraphrases about topics no image carries
    (``synthetic:...,paraphrase_topics=32``), so Phase 2's image-caption loss cannot train the
    skill by itself and can erase it. Skill = Spearman of the cosine (text-pair prefix:
    ``recipe.embed_text_pairs``) against the pair score on held-out pairs, and text-text R@1
    (each held-out same-topic query must retrieve a text of its topic first).
    Arms: full (gate with ``gate_speed`` so θ can move in a short run); gate open
    (``gate_init=0``, g = 0.5 from the start: the gate is open before its protection is tested);
    no gate (``gate_init=-30``); no text pairs in Phase 2; control = no gate and Phase 2 on
    conflicting pairs (partners shuffled): forgetting made true on purpose.
    Claims: (1) full: Spearman(end) - Spearman(Phase 1) > -``margin`` (or equivalent within
    ±``margin``); (2) the drop is smaller with the paper's gate than without, precondition: the
    gate opened (mean g >= 0.5 at the end); (3) the same with the gate opened at the start
    (equivalence within ±``margin`` reported: "no protection"); (4, exploratory) the drop is
    smaller with Phase-2 text pairs than without (trivially: training on the skill keeps it).
    Calibrated control for each: the control arm's forgetting (Phase 1 - end) must be > 0 and
    at least ``margin``.
    Need: Phase 1 >= 100 steps, else "too short to test the claim".
    ``vary_world`` (synthetic data): the claims are about the method, not one world, so the four
    arms the claims compare (full, gate open, no gate, no phase-2 text pairs) are trained again
    with seed s on the world of seed s (``world_inclusive``, each at the learning rate it chose on
    the study's world, validated as here, last weights), the skill at the Phase-1 end and at the
    end measured on that world's held-out pairs; each claim is decided on the world-inclusive
    interval of its change difference, the fixed-world (seed-only) one reported beside it
    (``_with_world``), its precondition (the gate opened) evaluated on the gate values of those
    runs. The control (conflicting pairs, which swaps the data at the switch) stays on the
    study's world: it calibrates the measurement, not the method.
    """
    from curvalign.report import plots
    from curvalign.runs import read_log

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 400
    data = (
        data
        or "synthetic:images=2500,val_fraction=0.2,text_pairs=1500,paraphrase_topics=32,"
        "heldout_pairs=1000"
    )
    store, world = load_study_data(data)
    heldout = getattr(world, "heldout_pairs", None)
    if heldout is None:
        raise ConfigError(
            f"dualpath-forgetting needs a synthetic world with paraphrase_topics > 0, got {data!r}"
        )
    switch = max(1, steps // 2)
    base = [
        "model_dim=256",
        "hidden_dim=512",
        "embed_dim=128",
        "schedule_unit=steps",
        f"switch_at={switch}",
        f"gate_warmup={max(1, steps // 8)}",
        f"loss_warmup={switch}",
    ]
    n = len(heldout.scores)
    val_idx, test_idx = torch.arange(0, n, 2), torch.arange(1, n, 2)
    bench = _bench(
        out,
        store,
        data,
        steps,
        overrides,
        notify,
        show_progress,
        validations=4,
        lr_grid=lr_grid,
        lr_cache=lr_cache,
    )
    assert bench.store.pair_b is not None
    conflicting = dataclasses.replace(
        bench.store,
        pair_b=bench.store.pair_b.take(
            torch.randperm(len(store.pair_scores), generator=torch.Generator().manual_seed(0))
        ),
    )

    def skill(recipe: Recipe, idx: torch.Tensor) -> dict[str, float]:
        return _paraphrase_skill(recipe, heldout, idx)

    def val(recipe: Recipe) -> float:
        return 0.5 * (skill(recipe, val_idx)["spearman"] + kit.val_score(recipe, bench.store))

    arms = {
        "full": [f"gate_speed={gate_speed}"],
        "gate open": ["gate_init=0"],
        "no gate": ["gate_init=-30"],
        "no phase-2 text pairs": [f"gate_speed={gate_speed}", "phase2_text_pairs=false"],
        "control (no gate, conflicting pairs)": ["gate_init=-30"],
    }
    measured: dict[str, dict[str, dict[int, float]]] = {}
    conv, logs = {}, {}
    for arm, extra in arms.items():
        runs = {}
        is_control = arm.startswith("control")
        for seed in seed_list:

            def on_mark(step: int, recipe: Recipe, arm: str = arm, seed: int = seed) -> None:
                where = "phase 1" if step == switch else "end"
                for key, value in skill(recipe, test_idx).items():
                    measured.setdefault(f"{arm}|{where}|{key}", {})[seed] = value
                ev = bench.evaluate(recipe)
                measured.setdefault(f"{arm}|{where}|image R@1", {})[seed] = kit.mean_r1(ev)
                gate = recipe.gate_value()
                measured.setdefault(f"{arm}|{where}|gate", {})[seed] = gate

            runs[seed] = bench.train(
                arm,
                DualPath.name,
                base + extra,
                seed,
                marks=(switch, steps),
                on_mark=on_mark,
                val_fn=val,
                select_best=False,
                store_from=(lambda s: conflicting if s >= switch else None) if is_control else None,
            )
            if seed == seed_list[0]:
                logs[arm] = read_log(runs[seed].run_dir)
        conv[arm] = kit.convergence_record(runs)

    def change(arm: str, key: str = "spearman") -> dict[int, float]:
        end, p1 = measured[f"{arm}|end|{key}"], measured[f"{arm}|phase 1|{key}"]
        return {s: end[s] - p1[s] for s in end}

    control = "control (no gate, conflicting pairs)"
    ctrl = _scalar({s: -v for s, v in change(control).items()})
    budget_ok = switch >= 100
    source = (
        "seed 004, Secs. 3.4 and 4.5: 'without degrading', no number; the margin is docs/design.md's "
        "'small margin'"
    )
    claim = functools.partial(
        kit.claim_record,
        control=ctrl,
        control_what="control's forgetting (Phase 1 - end)",
        control_min=margin,
        budget_ok=budget_ok,
        paper_effect=margin,
        paper_source=source,
        delta=margin,
    )

    def gate_opened(arm: str) -> str | None:
        return _gate_opened(measured.get(f"{arm}|end|gate", {}))

    claims = [
        claim(
            f"full method: Spearman after Phase 2 - after Phase 1 > -{margin:g}",
            _scalar(change("full")),
            threshold=-margin,
        ),
        claim(
            "the paper's gate protects the skill: change(full) - change(no gate) > 0",
            kit.difference(change("full"), change("no gate")),
            precondition=gate_opened("full"),
        ),
        claim(
            "the gate, opened (gate_init=0), protects it: change(gate open) - change(no gate) > 0",
            kit.difference(change("gate open"), change("no gate")),
            precondition=gate_opened("gate open"),
        ),
        claim(
            "Phase-2 text pairs protect it: change(full) - change(no text pairs) > 0 (trivial: "
            "training on the skill keeps the skill)",
            kit.difference(change("full"), change("no phase-2 text pairs")),
            role="exploratory",
            delta=None,
        ),
    ]
    world_rows: dict[str, dict[int, float]] = {}
    if vary_world and data.strip().startswith("synthetic"):
        compared = {a: base + e for a, e in arms.items() if a != control}
        claims, world_rows = _dualpath_world_claims(
            bench, data, seed_list, compared, (switch, steps), claims
        )
    rows = {}
    for arm in arms:
        for where in ("phase 1", "end"):
            for key in ("spearman", "t2t@1", "image R@1", "gate"):
                rows[f"{arm} @ {where}: {key}"] = measured.get(f"{arm}|{where}|{key}", {})
    rows |= world_rows
    figures = [
        plots.log_curves(
            logs,
            [
                k
                for k in ("dualpath_gate", "text_info_nce", "image_info_nce")
                if any(k in r for r in logs["full"])
            ],
            out / "dualpath_gate.png",
            title=f"DualPath (seed {seed_list[0]}): gate and losses per arm",
            marks={"switch": switch},
        )
    ]
    setup = (
        f"{data}, {steps} steps, Phase 1 = steps 0-{switch} (text pairs only), gate warm-up "
        f"{max(1, steps // 8)} steps; heads at model_dim 256 / hidden 512 / embed 128 for time; "
        f"gate_speed {gate_speed:g} (learning-rate multiplier of θ); skill on {len(test_idx)} "
        "held-out pairs with the text-pair prefix."
        + (
            " Claims decided on world-inclusive intervals: full, gate open, no gate and no "
            "phase-2 text pairs trained again with seed s on the synthetic world of seed s (each "
            "at the learning rate it chose here), the skill measured on that world's held-out "
            "pairs and the gate-opened precondition on those runs' gate; the seed-only intervals "
            "on this world are reported beside them. The control (conflicting pairs) is trained "
            "on this world only."
            if world_rows
            else ""
        )
    )
    return _result(
        "dualpath-forgetting",
        DUALPATH_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=_metric_table("measure (x100)", rows),
        convergence=conv,
        figures=figures,
        notes=DUALPATH_NOTES,
        val_what="validation mean of (held-out Spearman, image-text mean R@1)",
        switch_step=switch,
    )


def _paraphrase_skill(recipe: Recipe, heldout: Any, idx: torch.Tensor) -> dict[str, float]:
    """The Phase-1 skill on the held-out paraphrase pairs ``idx`` ([P] row ids) of ``heldout``
    (a world's ``heldout_pairs``): Spearman of the cosine of the text-pair embeddings
    (``recipe.embed_text_pairs``) against the pair score, and text-text R@1 (each same-topic
    query a must retrieve a text of its topic first among all P b texts)."""
    with torch.no_grad():
        a = recipe.embed_text_pairs(heldout.a_features[idx].float())
        b = recipe.embed_text_pairs(heldout.b_features[idx].float())
        rho = spearman(recipe.pair_scores(a, b), heldout.scores[idx])
        same = torch.nonzero(heldout.topic_a[idx] == heldout.topic_b[idx]).flatten()
        qa = {k: v[same] for k, v in a.items()}
        s = recipe.scores(qa, b)  # [q, P]: every held-out b text is a candidate
        top = s.argmax(dim=1)
        r1 = float((heldout.topic_b[idx][top] == heldout.topic_a[idx][same]).float().mean())
    return {"spearman": rho, "t2t@1": r1}


def _gate_opened(gates: dict[int, float]) -> str | None:
    """None when the mean end-of-run gate value over the seeds (``gates``: seed -> g) reached
    0.5, else why the gate claim's precondition fails."""
    g = [v for v in kit.per_seed(gates) if math.isfinite(v)]
    mean = sum(g) / len(g) if g else math.nan
    return None if mean >= 0.5 else f"the gate reached g = {mean:.3f} < 0.5: it never opened"


def _dualpath_world_claims(
    bench: kit.Bench,
    data: str,
    seed_list: Sequence[int],
    arms: dict[str, list[str]],
    marks: tuple[int, int],
    claims: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]]]:
    """DualPath-forgetting's four claims re-decided on world-inclusive intervals: every arm
    (``arms``: its full overrides) trained with seed s on the world of seed s
    (``world_inclusive``, validated on that world's held-out pairs and image-text R@1 as on the
    study's world, last weights), the skill, image-text mean R@1 and gate at ``marks`` =
    (Phase-1 end, end) on that world's held-out test pairs. The gate claims' precondition is
    evaluated on those runs' gate; the other inputs (threshold, delta, budget) and the control
    are the claim's own. Returns the claims and the per-world rows for the metric table."""
    switch = marks[0]
    heldouts = {}
    for seed in seed_list:
        spec = f"{data},seed={seed}" if ":" in data else f"{data}:seed={seed}"
        heldout = getattr(load_study_data(spec)[1], "heldout_pairs", None)
        if heldout is None:
            raise ConfigError(f"dualpath-forgetting: the world {spec!r} has no held-out pairs")
        heldouts[spec] = heldout

    def split(wb: kit.Bench) -> tuple[Any, torch.Tensor, torch.Tensor]:
        heldout = heldouts[wb.spec]
        n = len(heldout.scores)
        return heldout, torch.arange(0, n, 2), torch.arange(1, n, 2)

    def val(wb: kit.Bench, recipe: Recipe) -> float:
        heldout, val_idx, _ = split(wb)
        rho = _paraphrase_skill(recipe, heldout, val_idx)["spearman"]
        return 0.5 * (rho + kit.val_score(recipe, wb.store))

    def on_mark(wb: kit.Bench, arm: str, step: int, recipe: Recipe) -> dict[str, float]:
        where = "phase 1" if step == switch else "end"
        heldout, _, test_idx = split(wb)
        values = _paraphrase_skill(recipe, heldout, test_idx)
        values["image R@1"] = kit.mean_r1(wb.evaluate(recipe))
        values["gate"] = recipe.gate_value()
        return {f"{arm}|{where}|{k}": v for k, v in values.items()}

    world = world_inclusive(
        bench,
        data,
        seed_list,
        arms,
        DualPath.name,
        marks=marks,
        on_mark=on_mark,
        select_best=False,
        val_fn=val,
    )

    def change(arm: str) -> dict[int, float]:
        end, p1 = world[f"{arm}|end|spearman"], world[f"{arm}|phase 1|spearman"]
        return {s: end[s] - p1[s] for s in end}

    effects = [
        (_scalar(change("full")), None),
        (kit.difference(change("full"), change("no gate")), "full"),
        (kit.difference(change("gate open"), change("no gate")), "gate open"),
        (kit.difference(change("full"), change("no phase-2 text pairs")), None),
    ]
    decided = []
    for claim, (effect, gated) in zip(claims, effects, strict=True):
        if gated is not None:
            inputs = claim["inputs"] | {"precondition": _gate_opened(world[f"{gated}|end|gate"])}
            claim = claim | {"inputs": inputs}
        decided.append(_with_world(claim, effect if effect.n else None, data))
    rows = {
        f"{arm} @ {where}: {key} (world of its seed)": world.get(f"{arm}|{where}|{key}", {})
        for arm in arms
        for where in ("phase 1", "end")
        for key in ("spearman", "t2t@1", "image R@1", "gate")
    }
    return decided, rows


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
    beside it (``_with_world``). The label-noise control, the sanity row and the orderings stay
    on the study's world.
    """
    from curvalign.report import plots

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 150
    data = data or STUDY_WORLD
    store, _ = load_study_data(data)
    bench = _bench(
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
                    zs.setdefault((recipe, c, kind), {})[seed] = ev.metric(
                        "zeroshot/top1", math.nan
                    )
                    text = ev.metric("ordering/text/chain", math.nan)
                    image = ev.metric("ordering/image/pairs", math.nan)
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
            noisy_arm, ATMG, extra, seed, store_from=_noisy(bench, control_noise)
        )
        ev = bench.evaluate(runs[seed].recipe)
        zs.setdefault((ATMG, low, "noisy"), {})[seed] = ev.metric("zeroshot/top1", math.nan)
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
            kit.difference(avg(ATMG, high), avg(MERU, high)) if high else _nan_interval(),
            paper_effect=ATMG_MERU_DROP,
            paper_source=ATMG_SOURCE,
            regime=ATMG_REGIME,
        ),
        claim(
            f"MERU drops: MERU(c={low:g}) - MERU(c ≥ 0.5) > 0",
            kit.difference(zs[(MERU, low, "trained")], avg(MERU, high))
            if high
            else _nan_interval(),
            paper_effect=ATMG_MERU_DROP,
            paper_source=ATMG_SOURCE,
            regime=ATMG_REGIME,
        ),
        claim(
            f"AtMG almost constant: AtMG(c ≥ 0.5) - AtMG(c={low:g}) > -{stable_margin:g}",
            kit.difference(avg(ATMG, high), zs[(ATMG, low, "trained")])
            if high
            else _nan_interval(),
            threshold=-stable_margin,
            delta=stable_margin,
            paper_effect=ATMG_STABLE,
            paper_source="seed 001, Table 5: AtMG 29.6 at c=0.1, mean 29.05 at c ≥ 0.5",
        ),
    ]
    world_rows: dict[str, dict[int, float]] = {}
    if vary_world and data.strip().startswith("synthetic") and high:
        claims, world_rows = _atmg_world_claims(bench, data, seeds_, curvatures, claims)
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
            text = mean_interval(vals).format(100.0, 1) if vals else "n/a"
            untrained = [order[(r, c, "untrained", key)][s] for c in curvatures for s in seeds_]
            base = sum(untrained) / len(untrained)
            secondary.append(f"| {r}, {key} (untrained {100 * base:.1f}) | {text} |")
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
    return _result(
        "atmg-curvature",
        ATMG_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seeds_,
        timer=timer,
        tables=_metric_table("run (x100)", rows)
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
        return {arm: wb.evaluate(recipe).metric("zeroshot/top1", math.nan)}

    wr = world_inclusive(bench, data, seed_list, arms, recipes, measure=measure)
    low = min(curvatures)
    high = [c for c in curvatures if c >= 0.5]

    def avg(recipe: str, cs: Sequence[float]) -> dict[int, float]:
        return {s: sum(wr[f"{recipe}-c{c:g}"][s] for c in cs) / len(cs) for s in seed_list}

    world_effects = [
        _finite_difference(avg(ATMG, high), avg(MERU, high)),
        _finite_difference(wr[f"{MERU}-c{low:g}"], avg(MERU, high)),
        _finite_difference(avg(ATMG, high), wr[f"{ATMG}-c{low:g}"]),
    ]
    decided = [
        _with_world(c, w if w.n else None, data) for c, w in zip(claims, world_effects, strict=True)
    ]
    rows = {
        f"{recipes[a]} c={c:g} trained: zero-shot top-1 (world of its seed)": wr[a]
        for c in curvatures
        for a in (f"{MERU}-c{c:g}", f"{ATMG}-c{c:g}")
    }
    return decided, rows


def _nan_interval() -> kit.Interval:
    return kit.Interval(math.nan, math.nan, math.nan, 0)


# --- phyclip-factors (seed 002, Table 4, App. D.2) -----------------------------------------------

PHYCLIP_PAPER = (
    "PHyCLIP (seed 002): the ℓ1-product of k Lorentz factors beats a single hyperbolic space of "
    "the same total dimension and the ℓ2-product (Table 4); concept families occupy distinct "
    "factors (Fig. 4); the factor-wise max of two concepts' embeddings retrieves images that "
    "contain both (App. D.2)."
)


def tangent_sum_compose(recipe: Recipe) -> Callable[[Any, Any], dict[str, torch.Tensor]]:
    """The obvious baseline of factor-wise max composition: the sum of the two concepts' tangent
    vectors at the origin, mapped back (``expmap0(logmap0(a) + logmap0(b))`` per factor, with the
    recipe's curvature per factor). Points ``[N, k, d]``; in a k = 1 model it is composition in
    one hyperbolic space."""
    from curvalign.geometry import lorentz

    def compose(a: Any, b: Any) -> dict[str, torch.Tensor]:
        c = recipe.curvature()
        v = lorentz.logmap0(a["point"], c) + lorentz.logmap0(b["point"], c)
        return {"point": lorentz.expmap0(v, c)}

    return compose


def composition_precision(
    recipe: Recipe,
    store: FeatureStore,
    world: Any,
    top: int = 5,
    max_pairs: int = 200,
    compose: Callable[[Any, Any], Any] | None = None,
) -> dict[str, float] | None:
    """Factor-wise max composition (seed 002, App. D.2) on test images with two objects.

    For each distinct (main leaf a, second leaf b) among the test images, the class embeddings of
    a and b are composed by the recipe (``recipe.factor_max_compose``); the composed query ranks
    the test images with the recipe's score. Returns the mean share of the ``top`` images that
    contain both a and b for: the composed query, the better single-concept query, and the
    control (a composed with the b of another pair). ``compose(a, b)``: the composition
    (default: the recipe's factor-wise max). None for recipes without composition or stores
    without the world's ground truth.
    """
    from curvalign.eval import embed, embed_text_part, score_matrix

    if world is None or not hasattr(recipe, "factor_max_compose") or not store.has_classes:
        return None
    test_ids = store.split_image_ids("test")
    leaves_of = [set() for _ in range(store.num_images)]
    for img, leaf in zip(world.object_image.tolist(), world.object_leaf.tolist(), strict=True):
        leaves_of[img].add(leaf)
    node_to_class = {int(n): c for c, n in enumerate(store.class_to_node.tolist())}
    pairs: list[tuple[int, int]] = []
    for img in test_ids.tolist():
        objs = world.object_leaf[world.object_image == img].tolist()
        if len(objs) >= 2 and (objs[0], objs[1]) not in pairs:
            pairs.append((objs[0], objs[1]))
    pairs = pairs[:max_pairs]
    if len(pairs) < 2:
        return None
    with torch.no_grad():
        images = embed(recipe, store.image_features[test_ids].float(), "image")
        prompts = embed_text_part(
            recipe, store, "prompt", torch.arange(store.prompt_features.shape[0])
        )
        p2c = store.prompt_to_class.long()

        def class_emb(leaf: int) -> dict[str, torch.Tensor]:
            idx = torch.nonzero(p2c == node_to_class[leaf]).flatten()
            return recipe.class_embedding({k: v[idx] for k, v in prompts.items()})

        def stack(embs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {k: torch.cat([e[k] for e in embs]) for k in embs[0]}

        ea = stack([class_emb(a) for a, _ in pairs])
        eb = stack([class_emb(b) for _, b in pairs])
        shifted = {k: v.roll(1, dims=0) for k, v in eb.items()}
        contains = torch.tensor(
            [[a in leaves_of[i] and b in leaves_of[i] for i in test_ids.tolist()] for a, b in pairs]
        )

        def precision(query: dict[str, torch.Tensor]) -> torch.Tensor:
            s = score_matrix(recipe, query, images, query="text")
            idx = s.topk(min(top, s.shape[1]), dim=1).indices
            return contains.gather(1, idx).float().mean(dim=1)

        compose = compose or recipe.factor_max_compose
        composed = precision(compose(ea, eb))
        single = torch.maximum(precision(ea), precision(eb))
        control = precision(compose(ea, shifted))
    return {
        "composed": float(composed.mean()),
        "best_single": float(single.mean()),
        "composed_wrong_partner": float(control.mean()),
        "pairs": len(pairs),
        "top": top,
    }


#: seed 002, Table 4: k = 64 vs k = 1 (HyCoCLIP), mean of image (+1.76) and text (+1.20) retrieval
PHYCLIP_K_EFFECT = 0.0148
PHYCLIP_K_SOURCE = (
    "seed 002, Sec. 5 ablation / Table 4: k=64 vs k=1, mean of image and text retrieval"
)
#: seed 002, Table 4: ℓ1 vs ℓ2 at k = 64 on mean retrieval: image +0.28, text -1.20 (ℓ2 better);
#: the ablation's ℓ1 advantage is on classification (ImageNet +0.97, Food-101 +5.37)
PHYCLIP_L1_EFFECT = -0.0046
PHYCLIP_L1_SOURCE = (
    "seed 002, Table 4: ℓ1 - ℓ2 at k=64, mean of image (+0.28) and text (-1.20) retrieval; the "
    "paper's ℓ1 advantage is on classification"
)

PHYCLIP_NOTES = (
    "All arms use the recipe's default scale initialisation (1/sqrt(k·d) per modality). The "
    "world pins two-object images to a few leaf pairs (leaf_pairs), so each test pair has several "
    "images and precision@5 can reach 1. The composition control composes concept a with the "
    "partner b of another pair: if the composed query's precision for the true pair does not "
    "drop, precision@5 cannot tell composition from retrieving a alone. The calibrated control "
    "of the retrieval claims is the largest k at half the total dimension: the metric must "
    "separate it from the full arm, with the study's seeds, by at least the claim's paper effect "
    "(10% label noise did not move these heads in the previous run of this study)."
)


def _phyclip_world_claims(
    bench: kit.Bench,
    data: str,
    seed_list: Sequence[int],
    arms: dict[str, list[str]],
    big: int,
    claims: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, dict[int, float]]]:
    """PHyCLIP's four claims re-decided on world-inclusive intervals (``world_inclusive``: k=1,
    k=``big`` and its ℓ2 variant trained with seed s on the world of seed s), and the per-world
    rows for the metric table."""

    def measure(wb: kit.Bench, w: Any, arm: str, recipe: Recipe) -> dict[str, float]:
        row = {f"{arm}: mean R@1": kit.mean_r1(wb.evaluate(recipe))}
        if arm == "k=1":
            base = composition_precision(recipe, wb.store, w, compose=tangent_sum_compose(recipe))
            row["composition P@5: k=1 tangent sum"] = base["composed"] if base else math.nan
        if arm == f"k={big}":
            comp = composition_precision(recipe, wb.store, w) or {}
            for key in ("composed", "best_single"):
                row[f"composition P@5: {key}"] = comp.get(key, math.nan)
        return row

    wr = world_inclusive(
        bench,
        data,
        seed_list,
        {a: arms[a] for a in ("k=1", f"k={big}", f"k={big} l2")},
        Phyclip.name,
        measure=measure,
    )
    world_effects = [
        _finite_difference(wr[f"k={big}: mean R@1"], wr["k=1: mean R@1"]),
        _finite_difference(wr[f"k={big}: mean R@1"], wr[f"k={big} l2: mean R@1"]),
        _finite_difference(wr["composition P@5: composed"], wr["composition P@5: best_single"]),
        _finite_difference(wr["composition P@5: composed"], wr["composition P@5: k=1 tangent sum"]),
    ]
    decided = [
        _with_world(c, w if w.n else None, data) for c, w in zip(claims, world_effects, strict=True)
    ]
    return decided, {f"{k} (world of its seed)": v for k, v in wr.items()}


def study_phyclip_factors(
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
    total_dim: int = 64,
    factors: Sequence[int] = (1, 4, 16),
    control_noise: float = PHYCLIP_CONTROL_NOISE,
    vary_world: bool = True,
) -> dict[str, Any]:
    """PHyCLIP with k factors of d = total_dim / k at fixed k·d, plus the ℓ2-product at the
    largest k, on a world with several images per leaf pair (``leaf_pairs``).

    Claims: (1) largest k beats k = 1 on mean R@1 (Table 4: +1.5 points at k = 64); (2) ℓ1
    beats ℓ2 at the largest k (Table 4); calibrated control for both: the largest k with
    half the total dimension (``PHYCLIP_CONTROL_NOISE``; plus ``control_noise`` of its train
    captions moved to another image when > 0): full - half > 0 and at least the claim's paper
    effect; sanity row: largest k trained - untrained. (3) factor-wise
    max composition beats the best single concept on precision@5 (App. D.2); (4) it beats the
    obvious baseline, tangent-sum composition in the k = 1 model (``tangent_sum_compose``);
    control for (3)-(4): the composed query with the wrong partner concept, whose precision for
    the true pair must drop. Factor specialisation (distinct top factors per family, relative
    contrast) is reported per seed next to the untrained head.
    ``vary_world`` (synthetic data): every claim is about the method, not one world, so the arms
    it compares (k=1, the largest k, its ℓ2 variant) train again with seed s on the world of seed
    s (``world_inclusive``); each claim is decided on that world-inclusive interval and the
    fixed-world (seed-only) one is reported beside it (``_with_world``).
    """
    from curvalign.report import plots

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 150
    data = data or STUDY_WORLD + ",leaf_pairs=12"
    store, world = load_study_data(data)
    bench = _bench(
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
    big = max(factors)
    arms: dict[str, list[str]] = {}
    for k in factors:
        if total_dim % k:
            raise ConfigError(f"total_dim {total_dim} is not a multiple of k = {k}")
        arms[f"k={k}"] = [f"num_factors={k}", f"factor_dim={total_dim // k}"]
    arms[f"k={big} l2"] = [*arms[f"k={big}"], "product_metric=l2"]
    half = (total_dim // big) // 2
    if half < 1:
        raise ConfigError(f"total_dim {total_dim} / k = {big} cannot be halved for the control")
    handicap = f"half the dimension (k·d={big * half})" + (
        f", {control_noise:.0%} label noise" if control_noise else ""
    )
    noisy_arm = f"control: k={big}, {handicap}"
    arms[noisy_arm] = [f"num_factors={big}", f"factor_dim={half}"]
    r1: dict[str, dict[int, float]] = {}
    extra_rows: dict[str, dict[int, float]] = {}
    conv = {}
    activation = None
    for arm, extra in arms.items():
        runs = {}
        for seed in seed_list:
            runs[seed] = bench.train(
                arm,
                Phyclip.name,
                extra,
                seed,
                store_from=_noisy(bench, control_noise)
                if arm == noisy_arm and control_noise
                else None,
            )
            recipe = runs[seed].recipe
            if arm == "k=1":
                base = composition_precision(
                    recipe, bench.store, world, compose=tangent_sum_compose(recipe)
                )
                extra_rows.setdefault("composition P@5: k=1 tangent sum", {})[seed] = (
                    base["composed"] if base else math.nan
                )
            ev = bench.evaluate(recipe, diagnostics=arm == f"k={big}")
            r1.setdefault(arm, {})[seed] = kit.mean_r1(ev)
            extra_rows.setdefault(f"{arm}: zero-shot top-1", {})[seed] = ev.metric(
                "zeroshot/top1", math.nan
            )
            if arm == f"k={big}":
                comp = composition_precision(recipe, bench.store, world)
                untrained = bench.untrained(Phyclip.name, extra, seed)
                r1.setdefault(f"{arm} untrained", {})[seed] = kit.mean_r1(bench.evaluate(untrained))
                for key in ("composed", "best_single", "composed_wrong_partner"):
                    extra_rows.setdefault(f"composition P@5: {key}", {})[seed] = (
                        comp[key] if comp else math.nan
                    )
                facts = (ev.diagnostics or {}).get("factors") or {}
                u_facts = (bench.evaluate(untrained, diagnostics=True).diagnostics or {}).get(
                    "factors"
                ) or {}
                for label, f in (("trained", facts), ("untrained", u_facts)):
                    extra_rows.setdefault(
                        f"distinct top factors of the families, {label} (count)", {}
                    )[seed] = f.get("distinct_top_factors", math.nan)
                    extra_rows.setdefault(f"relative contrast ({label})", {})[seed] = f.get(
                        "mean_relative_contrast", math.nan
                    )
                if seed == seed_list[0] and facts.get("activation") is not None:
                    activation = facts
        conv[arm] = kit.convergence_record(runs)
    ctrl = kit.difference(r1[f"k={big}"], r1[noisy_arm])
    comp_ok = all(math.isfinite(v) for v in extra_rows["composition P@5: composed"].values())
    base_ok = "k=1" in arms and all(
        math.isfinite(v)
        for v in extra_rows.get("composition P@5: k=1 tangent sum", {0: math.nan}).values()
    )
    retrieval_claim = functools.partial(
        kit.claim_record,
        control=ctrl,
        control_what=f"k={big} at k·d={total_dim} - k={big} at {handicap}",
        budget_ok=steps >= 50,
        sanity=kit.difference(r1[f"k={big}"], r1[f"k={big} untrained"]),
        sanity_what=f"k={big} trained - untrained",
    )
    comp_control = (
        kit.difference(
            extra_rows["composition P@5: composed"],
            extra_rows["composition P@5: composed_wrong_partner"],
        )
        if comp_ok
        else None
    )
    claims = [
        retrieval_claim(
            f"k={big} beats k=1 at k·d={total_dim} (mean R@1)",
            kit.difference(r1[f"k={big}"], r1["k=1"]),
            paper_effect=PHYCLIP_K_EFFECT,
            paper_source=PHYCLIP_K_SOURCE,
            control_min=PHYCLIP_K_EFFECT,
        ),
        retrieval_claim(
            f"ℓ1-product beats ℓ2-product at k={big} (mean R@1)",
            kit.difference(r1[f"k={big}"], r1[f"k={big} l2"]),
            paper_effect=PHYCLIP_L1_EFFECT,
            paper_source=PHYCLIP_L1_SOURCE,
            control_min=abs(PHYCLIP_L1_EFFECT),
        ),
        kit.claim_record(
            f"factor-wise max composition beats the best single concept (P@5, k={big})",
            kit.difference(
                extra_rows["composition P@5: composed"], extra_rows["composition P@5: best_single"]
            )
            if comp_ok
            else _nan_interval(),
            comp_control,
            "composed - composed with the wrong partner",
            budget_ok=steps >= 50 and comp_ok,
            paper_source="seed 002, App. D.2: qualitative (retrieved examples)",
        ),
        kit.claim_record(
            f"factor-wise max composition (k={big}) beats tangent-sum composition in a k=1 model "
            "(P@5)",
            kit.difference(
                extra_rows["composition P@5: composed"],
                extra_rows["composition P@5: k=1 tangent sum"],
            )
            if comp_ok and base_ok
            else _nan_interval(),
            comp_control,
            "composed - composed with the wrong partner",
            budget_ok=steps >= 50 and comp_ok and base_ok,
            paper_source="seed 002, App. D.2: composition attributed to the factorisation; the "
            "paper gives no single-space baseline",
        ),
    ]
    if vary_world and data.strip().startswith("synthetic") and "k=1" in arms:
        claims, world_rows = _phyclip_world_claims(bench, data, seed_list, arms, big, claims)
        extra_rows |= world_rows
    rows = {f"{arm}: mean R@1": v for arm, v in r1.items()} | extra_rows
    figures = [
        plots.line_plot(
            list(factors),
            {"mean R@1": [sum(kit.per_seed(r1[f"k={k}"])) / seeds for k in factors]},
            out / "phyclip_k.png",
            "k (factors)",
            "mean R@1",
            f"PHyCLIP at k·d = {total_dim}",
            logx=True,
        )
    ]
    if activation is not None:
        figures.append(
            plots.heatmap(
                activation["activation"],
                out / "phyclip_family_activation.png",
                activation["family_names"],
                "factor",
                f"PHyCLIP k={big} (seed {seed_list[0]}): mean factor distance to origin per family",
            )
        )
    setup = (
        f"{data}, {steps} steps per run, k·d = {total_dim}, k in {list(factors)}; weights selected "
        "on validation mean R@1; composition over the test images' (main, second) leaf pairs."
    )
    return _result(
        "phyclip-factors",
        PHYCLIP_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=_metric_table("measure (x100)", rows),
        convergence=conv,
        figures=figures,
        notes=PHYCLIP_NOTES,
    )


# --- proclip-product (seed 003, Table 1) ---------------------------------------------------------

PROCLIP_PAPER = (
    "ProCLIP (seed 003), Table 1: the mixed-curvature product H × E × S gives the best "
    "retrieval, above each single geometry at the same total dimension; inputs are L2-normalised "
    "CLIP features (Sec. 3.2), the checkpoint is selected on validation (Sec. 3.3)."
)
#: the paper's effect: "mixed curvature improves retrieval Accuracy@1 by 2-7 percentage points"
#: (seed 003, Sec. 4, text under Table 1); the smallest is what the study must be able to see
PROCLIP_EFFECT = 0.02
PROCLIP_SOURCE = "seed 003, Sec. 4 / Table 1: +2 to +7 R@1 points over single geometries"


PROCLIP_NOTES = (
    "Inputs are L2-normalised in the study (the minimum stand-in until the recipe owns its input "
    "normalisation); each run keeps its best validation checkpoint. The calibrated control is "
    "the product arm trained with a known share of its train captions moved to another image "
    "(label noise): the metric must separate it from the clean product arm, with the study's "
    "seeds, by at least the paper's smallest effect."
)


def study_proclip_product(
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
    part_dim: int = 32,
    control_noise: float = PROCLIP_CONTROL_NOISE,
    vary_world: bool = True,
) -> dict[str, Any]:
    """Product H x E x S (``part_dim`` each) vs each single geometry at 3 x ``part_dim``, on
    L2-normalised inputs, weights selected on validation mean R@1.

    Claim: the product beats every single geometry: per seed, min over singles of (product -
    single) on mean R@1, > 0; the paper's effect is +2 points (``PROCLIP_EFFECT``). Calibrated
    control: the product with ``control_noise`` of its train captions moved to another image;
    clean - noisy must be > 0 and at least the paper's effect. Sanity row: the product trained -
    untrained. Each pairwise difference is reported too.
    ``vary_world`` (synthetic data): the claim is about the method, not one world, so every arm
    is trained again with seed s on the world of seed s (``world_inclusive``): the claim is
    decided on that world-inclusive interval and the fixed-world (seed-only) one is reported
    beside it.
    """
    from curvalign.report import plots

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 150
    data = data or STUDY_WORLD
    store, _ = load_study_data(data)
    bench = _bench(
        out,
        _normalised(store),
        data,
        steps,
        overrides,
        notify,
        show_progress,
        lr_grid=lr_grid,
        lr_cache=lr_cache,
    )
    total = 3 * part_dim
    arms = {
        "product H x E x S": (part_dim, part_dim, part_dim),
        "hyperbolic only": (total, 0, 0),
        "euclidean only": (0, total, 0),
        "sphere only": (0, 0, total),
    }
    r1: dict[str, dict[int, float]] = {}
    conv = {}
    product = "product H x E x S"
    control = f"control: product, {control_noise:.0%} label noise"
    for arm, (h, e, s) in [*arms.items(), (control, arms[product])]:
        extra = [f"hyperbolic_dim={h}", f"euclidean_dim={e}", f"sphere_dim={s}"]
        runs = {}
        for seed in seed_list:
            runs[seed] = bench.train(
                arm,
                Proclip.name,
                extra,
                seed,
                store_from=_noisy(bench, control_noise) if arm == control else None,
            )
            r1.setdefault(arm, {})[seed] = kit.mean_r1(bench.evaluate(runs[seed].recipe))
            if arm == product:
                r1.setdefault("product untrained", {})[seed] = kit.mean_r1(
                    bench.evaluate(bench.untrained(Proclip.name, extra, seed))
                )
        conv[arm] = kit.convergence_record(runs)
    singles = [a for a in arms if a != product]
    margin = {s: min(r1[product][s] - r1[a][s] for a in singles) for s in seed_list}
    seed_only = _scalar(margin)
    world_margin = None
    if vary_world and data.strip().startswith("synthetic"):
        world_r1 = world_inclusive(
            bench,
            data,
            seed_list,
            {
                a: [f"hyperbolic_dim={h}", f"euclidean_dim={e}", f"sphere_dim={s}"]
                for a, (h, e, s) in arms.items()
            },
            Proclip.name,
            prepare=_normalised,
        )
        world_margin = {
            s: min(world_r1[product][s] - world_r1[a][s] for a in singles) for s in seed_list
        }
        r1 |= {f"{a} (world of its seed)": v for a, v in world_r1.items()}
    effect = _scalar(world_margin) if world_margin is not None else seed_only
    claims = [
        kit.claim_record(
            "product beats every single geometry (min over singles of product - single, mean R@1)"
            + (", world-inclusive" if world_margin is not None else ""),
            effect,
            kit.difference(r1[product], r1[control]),
            f"product clean - product with {control_noise:.0%} label noise",
            budget_ok=steps >= 50,
            paper_effect=PROCLIP_EFFECT,
            paper_source=PROCLIP_SOURCE,
            control_min=PROCLIP_EFFECT,
            effect_values=kit.per_seed(margin),
            sanity=kit.difference(r1[product], r1["product untrained"]),
            sanity_what="product trained - untrained",
        )
    ]
    if world_margin is not None:
        claims[0]["seed_only"] = seed_only.as_dict()
        claims[0]["effect_text"] += f"; seed-only (world {data}): {seed_only.format(100.0, 2)}"
    diffs = ["| product - single | mean R@1 difference (95%) |", "|---|---:|"]
    for a in singles:
        diffs.append(f"| {a} | {kit.difference(r1[product], r1[a]).format(100.0, 2)} |")
    figures = [
        plots.line_plot(
            list(range(len(arms))),
            {"mean R@1": [sum(kit.per_seed(r1[a])) / seeds for a in arms]},
            out / "proclip_arms.png",
            "arm: " + ", ".join(f"{i} {a}" for i, a in enumerate(arms)),
            "mean R@1",
            "ProCLIP: product vs single geometries",
        )
    ]
    setup = (
        f"{data}, {steps} steps per run, L2-normalised inputs, {part_dim} x 3 vs {total}; "
        "weights selected on validation mean R@1."
    )
    return _result(
        "proclip-product",
        PROCLIP_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=_metric_table("arm: mean R@1 (x100)", r1) + "\n" + "\n".join(diffs) + "\n",
        convergence=conv,
        figures=figures,
        notes=PROCLIP_NOTES,
    )


# --- wordnet-dimensions (real data; the claim seed 002 cites from Nickel & Kiela) ----------------

WORDNET_PAPER = (
    "PHyCLIP (seed 002, Sec. 1): 'Euclidean geometry struggles to faithfully represent such trees, "
    "whereas hyperbolic geometry aligns well with this growth', citing Nickel & Kiela (2017), "
    "whose Table 1 measures it as WordNet reconstruction (mean rank and MAP of the taxonomy's "
    "edges ranked by embedding distance) at low dimension. Tested here with that metric on "
    "wordnet:mammal.n.01: the heads' embeddings of all synset names, hyperbolic vs Euclidean vs "
    "spherical at equal degrees of freedom."
)
#: Nickel & Kiela 2017, Table 1 (WordNet nouns reconstruction, d = 5): MAP 0.823 (Poincaré) vs
#: 0.024 (Euclidean), as remembered: not a seed file (seed 002 Sec. 1 cites the paper, not the
#: numbers), and no reachable copy of the table was found to check them against. What could be
#: checked (a reproduction's introduction, deepai.org/publication/comparing-euclidean-and-
#: hyperbolic-embeddings-on-the-wordnet-nouns-hypernymy-graph): Table 1 spans d = 5 to 200 and
#: the Poincaré MAP beats the Euclidean one at every d (about 5x at d = 200); that reproduction
#: finds Euclidean embeddings as good from d = 50 on
WORDNET_EFFECT = 0.8
WORDNET_SOURCE = (
    "Nickel & Kiela 2017, Table 1, cited by seed 002 Sec. 1: reconstruction MAP at d=5, "
    "Poincaré 0.823 vs Euclidean 0.024 — quoted from memory, unverified (the direction, Poincaré "
    "above Euclidean at every d from 5 to 200, is confirmed by a published reproduction)"
)
WORDNET_NOTES = (
    "Reconstruction as Nickel & Kiela measure it: every synset's name (view A) is embedded by the "
    "head; for every pair (u, v) of the taxonomy's transitive closure, v is ranked among the "
    "synsets not related to u by the recipe's own score; mean rank and mean average precision "
    "over u. Dimensions count degrees of freedom: a d-dimensional hyperbolic or Euclidean factor "
    "has d, a sphere in R^(d+1) has d (sphere_dim = d + 1). The heads are trained for name <-> "
    "gloss alignment (not for reconstruction, as in the paper): geometries are compared only "
    "where both arms are at least as good as the frozen features ranked by cosine "
    "(precondition), otherwise the claim is 'not reproduced in this regime'."
)


def reconstruction(recipe: Recipe, store: FeatureStore) -> dict[str, float] | None:
    """Graph reconstruction (Nickel & Kiela 2017, Sec. 4.1) of the store's taxonomy from the
    embeddings of its view-A items ("images", one per class node): for every node u and every
    v in the transitive closure of u (its ancestors and descendants), the rank of v among the
    nodes unrelated to u by ``recipe``'s score (higher = nearer), and the average precision of
    u's related nodes among all others. Returns ``{"mean_rank", "map", "nodes"}``; None for a
    store without a taxonomy or image labels."""
    from curvalign.eval import embed, score_matrix

    if store.taxonomy_parents is None or store.image_labels is None or store.class_to_node is None:
        return None
    parents = store.taxonomy_parents.long().tolist()
    node_of_image = store.class_to_node.long()[store.image_labels.long()]
    keep = torch.nonzero(store.image_labels.long() >= 0).flatten()
    nodes = node_of_image[keep].tolist()
    index = {n: i for i, n in enumerate(nodes)}
    ancestors: list[set[int]] = []
    for n in nodes:
        up, p = set(), parents[n]
        while p >= 0:
            if p in index:
                up.add(index[p])
            p = parents[p]
        ancestors.append(up)
    related = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for i, up in enumerate(ancestors):
        for j in up:
            related[i, j] = related[j, i] = True
    with torch.no_grad():
        emb = embed(recipe, store.image_features[keep].float(), "image")
        scores = score_matrix(recipe, emb, emb, query="text")
    ranks, precisions = [], []
    eye = torch.eye(len(nodes), dtype=torch.bool)
    for i in range(len(nodes)):
        rel = related[i]
        if not rel.any():
            continue
        row = scores[i].masked_fill(eye[i], -math.inf)
        unrelated = row[~rel & ~eye[i]]
        # rank of each related v among the unrelated nodes (1 = nearer than all of them)
        ranks.append(1.0 + (unrelated[None, :] > row[rel][:, None]).sum(1).float())
        order = torch.argsort(row, descending=True)[: len(nodes) - 1]
        hits = rel[order].float()
        cum = hits.cumsum(0) / torch.arange(1, len(hits) + 1)
        precisions.append(float((cum * hits).sum() / hits.sum()))
    if not ranks:
        return None
    return {
        "mean_rank": float(torch.cat(ranks).mean()),
        "map": sum(precisions) / len(precisions),
        "nodes": len(nodes),
    }


def study_wordnet_dimensions(
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
    dims: Sequence[int] = (2, 4, 8, 16),
    low_dims: Sequence[int] = (2, 4),
    control_noise: float = CONTROL_NOISE,
) -> dict[str, Any]:
    """Single-geometry ProCLIP heads (hyperbolic / Euclidean / spherical, one factor with d
    degrees of freedom) on WordNet mammals, per d: graph reconstruction MAP and mean rank
    (``reconstruction``) and mean R@1 (name <-> gloss).

    Claims: at d in ``low_dims`` (mean), hyperbolic beats Euclidean and beats spherical on
    reconstruction MAP; precondition: both arms' MAP at least the frozen features' (cosine on
    the input features); paper effect (Euclidean): ``WORDNET_EFFECT``. Calibrated control:
    hyperbolic at the smallest d with ``control_noise`` of its train captions moved to another
    synset (clean - noisy > 0 on MAP). Sanity row: hyperbolic at the smallest d, trained -
    untrained.
    """
    from curvalign.report import plots

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 150
    data = data or "wordnet:mammal.n.01"
    store, _ = load_study_data(data)
    bench = _bench(
        out,
        _normalised(store),
        data,
        steps,
        overrides,
        notify,
        show_progress,
        lr_grid=lr_grid,
        lr_cache=lr_cache,
    )
    geometries = {
        "hyperbolic": "hyperbolic_dim",
        "euclidean": "euclidean_dim",
        "sphere": "sphere_dim",
    }

    def extra_for(g: str, d: int) -> list[str]:
        ambient = d + 1 if g == "sphere" else d  # d degrees of freedom
        return [f"{k}={ambient if k == geometries[g] else 0}" for k in geometries.values()]

    rec_map: dict[tuple[str, int], dict[int, float]] = {}
    rec_rank: dict[tuple[str, int], dict[int, float]] = {}
    r1: dict[tuple[str, int], dict[int, float]] = {}
    noisy: dict[int, float] = {}
    untrained: dict[int, float] = {}
    conv = {}
    small = min(dims)

    def measure(key: tuple[str, int], seed: int, model: Any) -> None:
        rec = reconstruction(model, bench.store) or {"map": math.nan, "mean_rank": math.nan}
        rec_map.setdefault(key, {})[seed] = rec["map"]
        rec_rank.setdefault(key, {})[seed] = rec["mean_rank"]
        r1.setdefault(key, {})[seed] = kit.mean_r1(bench.evaluate(model))

    for d in dims:
        for g in geometries:
            runs = {}
            for seed in seed_list:
                runs[seed] = bench.train(f"{g}-d{d}", Proclip.name, extra_for(g, d), seed)
                measure((g, d), seed, runs[seed].recipe)
                if g == "hyperbolic" and d == small:
                    model = bench.untrained(Proclip.name, extra_for(g, d), seed)
                    untrained[seed] = (reconstruction(model, bench.store) or {}).get(
                        "map", math.nan
                    )
            conv[f"{g} d={d}"] = kit.convergence_record(runs)
    runs = {}
    for seed in seed_list:
        runs[seed] = bench.train(
            f"control-hyperbolic-d{small}",
            Proclip.name,
            extra_for("hyperbolic", small),
            seed,
            store_from=_noisy(bench, control_noise),
        )
        noisy[seed] = (reconstruction(runs[seed].recipe, bench.store) or {}).get("map", math.nan)
    conv[f"control: hyperbolic d={small}, {control_noise:.0%} label noise"] = (
        kit.convergence_record(runs)
    )
    lows = [d for d in low_dims if d in dims] or [small]

    def low_avg(g: str) -> dict[int, float]:
        return {s: sum(rec_map[(g, d)][s] for d in lows) / len(lows) for s in seed_list}

    frozen = _frozen_baseline(bench)
    frozen_map = frozen.get("reconstruction MAP", math.nan)

    def precondition(g: str) -> str | None:
        below = [
            f"{name} {100 * sum(kit.per_seed(low_avg(name))) / seeds:.1f}"
            for name in ("hyperbolic", g)
            if not sum(kit.per_seed(low_avg(name))) / seeds >= frozen_map
        ]
        if not math.isfinite(frozen_map):
            return None
        return (
            None
            if not below
            else f"arms below the frozen features' reconstruction MAP {100 * frozen_map:.1f} "
            f"(x100) at d in {lows}: " + ", ".join(below)
        )

    ctrl = _finite_difference(rec_map[("hyperbolic", small)], noisy)
    claims = [
        kit.claim_record(
            f"hyperbolic beats {name} at d in {lows} (reconstruction MAP)",
            _finite_difference(low_avg("hyperbolic"), low_avg(other)),
            ctrl,
            f"hyperbolic d={small} clean - {control_noise:.0%} label noise (MAP)",
            budget_ok=steps >= 50,
            paper_effect=WORDNET_EFFECT if other == "euclidean" else None,
            paper_source=WORDNET_SOURCE
            if other == "euclidean"
            else "Nickel & Kiela 2017 compare no spherical embedding",
            precondition=precondition(other),
            sanity=_finite_difference(rec_map[("hyperbolic", small)], untrained),
            sanity_what=f"hyperbolic d={small} trained - untrained (MAP)",
        )
        for name, other in (("Euclidean", "euclidean"), ("spherical", "sphere"))
    ]
    rows = {f"{g} d={d}: reconstruction MAP": rec_map[(g, d)] for d in dims for g in geometries}
    rows |= {
        f"{g} d={d}: reconstruction mean rank (count)": rec_rank[(g, d)]
        for d in dims
        for g in geometries
    }
    rows |= {f"{g} d={d}: mean R@1": r1[(g, d)] for d in dims for g in geometries}
    rows[f"hyperbolic d={small} untrained: reconstruction MAP"] = untrained
    rows[f"hyperbolic d={small} {control_noise:.0%} label noise: reconstruction MAP"] = noisy
    figures = [
        plots.line_plot(
            list(dims),
            {g: [sum(kit.per_seed(rec_map[(g, d)])) / seeds for d in dims] for g in geometries},
            out / "wordnet_dims.png",
            "degrees of freedom d",
            "reconstruction MAP",
            "WordNet mammals: geometry vs dimension",
            logx=True,
        )
    ]
    setup = (
        f"{data}, {steps} steps per run, ProCLIP heads with one geometry of d degrees of freedom, "
        f"d in {list(dims)}, L2-normalised MiniLM inputs; weights selected on validation mean R@1; "
        "reconstruction over all synsets."
    )
    return _result(
        "wordnet-dimensions",
        WORDNET_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=_metric_table("head (x100)", rows) + "\n" + _frozen_text(frozen),
        convergence=conv,
        figures=figures,
        notes=WORDNET_NOTES,
        frozen=frozen,
    )


def world_inclusive(
    bench: kit.Bench,
    data: str,
    seed_list: Sequence[int],
    arms: dict[str, list[str]],
    recipe: str | dict[str, str],
    prepare: Callable[[FeatureStore], FeatureStore] = lambda s: s,
    measure: Callable[[kit.Bench, Any, str, Any], dict[str, float]] | None = None,
    *,
    marks: Sequence[int] = (),
    on_mark: Callable[[kit.Bench, str, int, Any], dict[str, float]] | None = None,
    select_best: bool = True,
    val_fn: Callable[[kit.Bench, Any], float] | None = None,
) -> dict[str, dict[int, float]]:
    """Mean R@1 of every arm when seed s trains and is evaluated on the synthetic world of seed
    s (``data`` + ``,seed=s``): per-seed values whose spread includes the world's, so a paired
    interval over them is *world-inclusive*. Each arm keeps the learning rate ``bench`` chose on
    its own world (no new tuning). ``recipe``: the recipe every arm trains, or arm -> recipe.
    ``measure(world_bench, world, arm, recipe)`` -> {row: value} replaces the default
    {arm: mean R@1} (a claim measured on another metric). A statistic measured during training
    (``Bench.train``'s ``marks``): ``on_mark(world_bench, arm, step, recipe)`` -> {row: value} at
    each of ``marks``, its rows recorded like ``measure``'s (with ``on_mark`` and no ``measure``
    there is no default mean R@1, so no extra evaluation); ``select_best=False`` keeps the last
    weights (as the arm's run on the study's own world does). ``val_fn(world_bench, recipe)``:
    the validation value on that world (default: mean R@1 on its "val" split), as the arm's
    ``Bench.train`` on the study's world had it (it drives the plateau extension)."""
    out: dict[str, dict[int, float]] = {}
    for seed in seed_list:
        spec = f"{data},seed={seed}" if ":" in data else f"{data}:seed={seed}"
        store, world = load_study_data(spec)
        world_bench = kit.Bench(
            bench.out / f"world-{seed}",
            prepare(store),
            spec,
            bench.steps,
            [o for o in bench.overrides if o not in kit.COMMON_OVERRIDES],
            val_every=bench.val_every,
            plateau_tol=bench.plateau_tol,
            lr_scale=bench.lr_scale,
            max_steps=bench.max_steps,
            notify=bench.notify,
        )
        for arm, extra in arms.items():
            chosen = bench.lr_choice.get(arm, {}).get("chosen")
            lr = [f"lr={chosen:g}"] if chosen is not None else []
            marked: dict[str, float] = {}

            def record(
                step: int,
                model: Any,
                arm: str = arm,
                wb: kit.Bench = world_bench,
                marked: dict[str, float] = marked,
            ) -> None:
                assert on_mark is not None
                marked.update(on_mark(wb, arm, step, model))

            run = world_bench.train(
                arm,
                recipe if isinstance(recipe, str) else recipe[arm],
                [*extra, *lr],
                seed,
                select_best=select_best,
                marks=marks if on_mark is not None else (),
                on_mark=record if on_mark is not None else None,
                val_fn=((lambda r, wb=world_bench: val_fn(wb, r)) if val_fn is not None else None),
            )
            if measure is not None:
                values = marked | measure(world_bench, world, arm, run.recipe)
            elif on_mark is not None:
                values = marked
            else:
                values = {arm: kit.mean_r1(world_bench.evaluate(run.recipe))}
            for row, value in values.items():
                out.setdefault(row, {})[seed] = value
    return out


def _with_world(
    claim: dict[str, Any],
    world_effect: kit.Interval | None,
    data: str,
    world_control: kit.Interval | None = None,
) -> dict[str, Any]:
    """``claim`` (decided on its fixed-world, seed-only interval) re-decided on the
    world-inclusive interval where there is one, with every other input of its decision (the
    ``inputs`` of ``kit.claim_record``: threshold, delta, budget, paper effect, control size,
    precondition, regime) and its unit, role and paper source kept; the seed-only interval is
    kept beside it (``seed_only``, and in ``effect_text``). ``world_control``: where the control
    compares arms that were trained on the world of each seed too, its world-inclusive interval,
    which then decides (the seed-only control is kept in ``seed_only_control``); None: the
    claim's own control. The Holm correction (``_result``) reads the world-inclusive ones."""
    if world_effect is None:
        return claim
    inputs = dict(claim["inputs"])
    seed_only = kit.Interval(**{k: claim["effect"][k] for k in ("mean", "low", "high", "n")})
    control = claim["control"]
    control_iv = (
        None
        if control is None
        else kit.Interval(**{k: control[k] for k in ("mean", "low", "high", "n")})
    )
    scale = inputs["scale"]
    again = kit.claim_record(
        claim["claim"] + ", world-inclusive",
        world_effect,
        world_control if world_control is not None else control_iv,
        claim["control_what"] + (", world-inclusive" if world_control is not None else ""),
        paper_source=claim.get("paper_source", ""),
        role=claim["role"],
        unit=claim.get("unit", "points"),
        **inputs,
    )
    again["sanity"], again["sanity_text"] = claim["sanity"], claim["sanity_text"]
    again["seed_only"] = seed_only.as_dict()
    again["effect_text"] += (
        f"; seed-only (world {data}): {seed_only.format(scale, 2)} "
        f"(95% [{seed_only.low * scale:.2f}, {seed_only.high * scale:.2f}])"
        + (
            ""
            if claim["verdict"] == again["verdict"]
            else f", which alone gives {claim['outcome']}"
        )
    )
    if world_control is not None:
        again["seed_only_control"] = control
        again["control_text"] += f"; seed-only (world {data}): " + (
            "none" if control_iv is None else control_iv.format(scale, 2)
        )
    return again


def _frozen_baseline(bench: kit.Bench) -> dict[str, Any]:
    """The frozen-features baseline (``curvalign.eval.frozen``) on the study's store: the input
    features ranked by cosine, nothing trained, so one value (no seeds). Its validation and test
    mean R@1 and test hierarchy J, the metrics the arms report; ``absent`` (why) where the two
    sides do not share one space."""
    from curvalign.eval.frozen import ROW_NAME, FrozenFeatures, shared_space_reason

    reason = shared_space_reason(bench.store)
    if reason is not None:
        return {"row": ROW_NAME, "absent": reason}
    model = FrozenFeatures(bench.store.image_dim, bench.store.text_dim)
    ev = bench.evaluate(model)
    rec = reconstruction(model, bench.store) or {}
    return {
        "row": ROW_NAME,
        "val mean R@1": kit.val_score(model, bench.store),
        "test mean R@1": kit.mean_r1(ev),
        "test hierarchy J": ev.metric("hierarchy/J", math.nan),
        "reconstruction MAP": rec.get("map", math.nan),
        "reconstruction mean rank": rec.get("mean_rank", math.nan),
    }


def _frozen_text(frozen: dict[str, Any]) -> str:
    if "absent" in frozen:
        return f"Baseline '{frozen['row']}': absent ({frozen['absent']}).\n"
    return (
        f"Baseline '{frozen['row']}' (the input features ranked by cosine; nothing trained, one "
        f"value, no seeds; x100): test mean R@1 {100 * frozen['test mean R@1']:.1f}, "
        f"hierarchy J {100 * frozen['test hierarchy J']:.1f}; validation mean R@1 "
        f"{100 * frozen['val mean R@1']:.1f}; reconstruction MAP "
        f"{100 * frozen.get('reconstruction MAP', math.nan):.1f}, mean rank "
        f"{frozen.get('reconstruction mean rank', math.nan):.1f}.\n"
    )


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
