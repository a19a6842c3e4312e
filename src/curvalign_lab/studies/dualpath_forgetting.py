"""dualpath-forgetting: DualPath's text-pair protection against forgetting (seed 004)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.errors import ConfigError
from curvalign.recipes.base import Recipe
from curvalign.recipes.dualpath import DualPath
from curvalign_lab import kit
from curvalign_lab.common import (
    Notify,
    load_study_data,
    make_bench,
    metric_table,
    seed_interval,
    spearman,
    study_result,
    with_world,
    world_inclusive,
)
from curvalign_lab.declare import QUICK_WORLD, Scripted

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
    (``with_world``), its precondition (the gate opened) evaluated on the gate values of those
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
    bench = make_bench(
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
    assert bench.store.pair_b is not None and store.pair_scores is not None
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
    measured: dict[str, dict[int, float]] = {}
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
                measured.setdefault(f"{arm}|{where}|gate", {})[seed] = _gate(recipe)

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
    ctrl = seed_interval({s: -v for s, v in change(control).items()})
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
            seed_interval(change("full")),
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
    return study_result(
        "dualpath-forgetting",
        DUALPATH_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=metric_table("measure (x100)", rows),
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


def _gate(recipe: Any) -> float:
    """The recipe's gate value sigma(theta) (``nan`` where it has none)."""
    value = recipe.gate_value()
    return math.nan if value is None else float(value)


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
        values["gate"] = _gate(recipe)
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
        (seed_interval(change("full")), None),
        (kit.difference(change("full"), change("no gate")), "full"),
        (kit.difference(change("gate open"), change("no gate")), "gate open"),
        (kit.difference(change("full"), change("no phase-2 text pairs")), None),
    ]
    decided = []
    for claim, (effect, gated) in zip(claims, effects, strict=True):
        if gated is not None:
            inputs = claim["inputs"] | {"precondition": _gate_opened(world[f"{gated}|end|gate"])}
            claim = claim | {"inputs": inputs}
        decided.append(with_world(claim, effect if effect.n else None, data))
    rows = {
        f"{arm} @ {where}: {key} (world of its seed)": world.get(f"{arm}|{where}|{key}", {})
        for arm in arms
        for where in ("phase 1", "end")
        for key in ("spearman", "t2t@1", "image R@1", "gate")
    }
    return decided, rows


#: the study as its runner sees it (``runner.run_study``); ``quick``: the smoke run's options
STUDY = Scripted(
    "dualpath-forgetting",
    study_dualpath_forgetting,
    quick={},
    quick_data=QUICK_WORLD + ",paraphrase_topics=8,heldout_pairs=40",
    quick_steps=4,
)
