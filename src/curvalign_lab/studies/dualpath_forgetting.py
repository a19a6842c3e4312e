"""dualpath-forgetting: DualPath's text-pair protection against forgetting (seed 004).

A declared study (``declare.Study``) in two phases (``declare.Phases``): Phase 1 (up to the
switch, half the budget) trains the text-pair skill, Phase 2 adds image-text alignment. The skill
is measured at the end of Phase 1 and at the end of the run on held-out paraphrase pairs whose
topics no image carries. The control is the full method with forced forgetting of a dose-sized
share: that share of the text pairs' partners shuffled from the end of Phase 1 on, the dose read
off a pilot's scan so that it costs as much skill as the claim's margin.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.base import Recipe
from curvalign.recipes.dualpath import DualPath
from curvalign.stats import Interval, t_quantile_975
from curvalign_lab import kit, rules
from curvalign_lab.common import spearman
from curvalign_lab.declare import (
    QUICK_WORLD,
    Arm,
    Claim,
    Control,
    Handicap,
    Measured,
    Phases,
    Study,
    Trained,
)

#: docs/design.md's "small margin" of the paper's "without degrading" (Spearman units)
MARGIN = 0.02
#: the learning-rate multiplier of θ that lets the gate move in a short run
GATE_SPEED = 50.0
#: resamples of the held-out test pairs in the two-level interval
REPLICATES = 200
PHASE1 = "phase 1"
FULL, GATE_OPEN, NO_GATE, NO_PAIRS = "full", "gate open", "no gate", "no phase-2 text pairs"
SOURCE = (
    "seed 004, Secs. 3.4 and 4.5: 'without degrading', no number; the margin is docs/design.md's "
    "'small margin'"
)


def switch_step(steps: int) -> int:
    """The phase switch at a budget of ``steps``: half of it."""
    return max(1, steps // 2)


def _schedule(steps: int) -> tuple[str, ...]:
    """Every arm's curriculum in steps: the switch at half the budget, the gate warm-up over
    an eighth of it, the image loss warmed up over Phase 1's length."""
    switch = switch_step(steps)
    return (
        "schedule_unit=steps",
        f"switch_at={switch}",
        f"gate_warmup={max(1, steps // 8)}",
        f"loss_warmup={switch}",
    )


def _heldout(world: Any) -> Any:
    heldout = getattr(world, "heldout_pairs", None)
    if heldout is None:
        raise ConfigError(
            "dualpath-forgetting needs a synthetic world with paraphrase_topics > 0 and "
            "heldout_pairs > 0 (e.g. synthetic:...,paraphrase_topics=32,heldout_pairs=1000)"
        )
    return heldout


def _split(world: Any, part: int) -> tuple[Any, torch.Tensor]:
    """The held-out pairs and the rows of one half: 0 validation, 1 test (alternating rows)."""
    heldout = _heldout(world)
    return heldout, torch.arange(part, len(heldout.scores), 2)


def paraphrase_skill(recipe: Recipe, heldout: Any, idx: torch.Tensor) -> dict[str, Any]:
    """The Phase-1 skill on the held-out paraphrase pairs ``idx`` ([P] row ids) of ``heldout``
    (a world's ``heldout_pairs``): Spearman of the text-pair embeddings' score
    (``recipe.embed_text_pairs``, ``recipe.pair_scores``) against the pair score, the [P] scores
    themselves ("pair_scores", for the interval over test pairs), and text-text R@1 (each
    same-topic query a must retrieve a text of its topic first among all P b texts)."""
    with torch.no_grad():
        a = recipe.embed_text_pairs(heldout.a_features[idx].float())
        b = recipe.embed_text_pairs(heldout.b_features[idx].float())
        scores = recipe.pair_scores(a, b).double()
        rho = spearman(scores, heldout.scores[idx])
        same = torch.nonzero(heldout.topic_a[idx] == heldout.topic_b[idx]).flatten()
        qa = {k: v[same] for k, v in a.items()}
        s = recipe.scores(qa, b)  # [q, P]: every held-out b text is a candidate
        top = s.argmax(dim=1)
        r1 = float((heldout.topic_b[idx][top] == heldout.topic_a[idx][same]).float().mean())
    return {"spearman": rho, "t2t@1": r1, "pair_scores": scores}


def _gate(recipe: Recipe) -> float:
    """The recipe's gate value sigma(theta) (``nan`` where it has none)."""
    gate_value = getattr(recipe, "gate_value", None)
    value = gate_value() if gate_value is not None else None
    return math.nan if value is None else float(value)


def probe(recipe: Recipe, world: Any) -> dict[str, Any]:
    """The skill on the held-out test pairs and the gate value (``Phases.probe``)."""
    heldout, test = _split(world, 1)
    return paraphrase_skill(recipe, heldout, test) | {"gate": _gate(recipe)}


def validate(recipe: Recipe, store: FeatureStore, world: Any) -> float:
    """Validation: the mean of the held-out validation pairs' Spearman and image-text R@1."""
    heldout, val = _split(world, 0)
    rho = paraphrase_skill(recipe, heldout, val)["spearman"]
    return 0.5 * (rho + kit.val_score(recipe, store))


def change(trained: Trained, label: str, seed: int) -> float:
    """Spearman at the end - at the end of Phase 1 (the skill kept; negative: forgotten)."""
    at = trained.probes[label][seed]
    return float(at["end"]["spearman"]) - float(at[PHASE1]["spearman"])


def shuffled_partners(store: FeatureStore, dose: float, seed: int) -> FeatureStore:
    """Forced forgetting of a dose-sized share: the partners (``pair_b``) of a random ``dose``
    share of the text pairs permuted among themselves, their scores kept, so that share of the
    pairs teaches conflicting similarities."""
    if store.pair_b is None or store.pair_scores is None:
        raise ConfigError("dualpath-forgetting's control needs a store with text pairs")
    if not 0.0 <= dose <= 1.0:
        raise ConfigError(f"the share of shuffled text pairs must lie in [0, 1], got {dose}")
    n = len(store.pair_scores)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(n, generator=g)[: int(round(dose * n))]
    order = torch.arange(n)
    order[chosen] = chosen[torch.randperm(len(chosen), generator=g)]
    return dataclasses.replace(store, pair_b=store.pair_b.take(order))


def _changes_interval(trained: Trained, a: str, b: str | None) -> Interval:
    """95% interval of change(a) - change(b) (``b`` None: change(a)) over seeds and the held-out
    test pairs, as ``stats.two_level_difference`` does for item totals: the seed component is
    the paired t interval's, the item component a paired bootstrap of the test pairs (the same
    draw for every row and every seed: the pairs are fixed), Spearman recomputed per draw; the
    seeds' degrees of freedom."""
    seeds = trained.seeds
    heldout, test = _split(trained.world, 1)
    truth = heldout.scores[test].double()

    def rows(label: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = trained.probes[label][seed]
        return at["end"]["pair_scores"], at[PHASE1]["pair_scores"]

    def d(seed: int, idx: torch.Tensor | None = None) -> float:
        def rho(x: torch.Tensor) -> float:
            return spearman(x if idx is None else x[idx], truth if idx is None else truth[idx])

        end, p1 = rows(a, seed)
        value = rho(end) - rho(p1)
        if b is not None:
            end_b, p1_b = rows(b, seed)
            value -= rho(end_b) - rho(p1_b)
        return value

    diffs = [d(s) for s in seeds]
    n = len(diffs)
    mean = math.fsum(diffs) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    g = torch.Generator().manual_seed(0)
    means = []
    for _ in range(REPLICATES):
        idx = torch.randint(len(truth), (len(truth),), generator=g)
        means.append(sum(d(s, idx) for s in seeds) / n)
    seed_var = float(np.var(diffs, ddof=1)) / n
    item_var = float(np.var(means, ddof=1))
    half = t_quantile_975(n - 1) * math.sqrt(seed_var + item_var)
    return Interval(mean, mean - half, mean + half, n)


def _gate_opened(trained: Trained, arm: str) -> str | None:
    """None when the mean end-of-run gate value over the seeds reached 0.5, else why the gate
    claims' precondition fails."""
    g = [float(trained.probes[arm][s]["end"]["gate"]) for s in trained.seeds]
    g = [v for v in g if math.isfinite(v)]
    mean = sum(g) / len(g) if g else math.nan
    return None if mean >= 0.5 else f"the gate reached g = {mean:.3f} < 0.5: it never opened"


def measure(trained: Trained) -> dict[str, Measured]:
    """Each claim's per-seed change (difference) with its interval over seeds and test pairs;
    the gate claims' precondition: the gate opened (mean g >= 0.5 at the end)."""

    def compared(a: str, b: str | None) -> Measured:
        effect = {
            s: change(trained, a, s) - (change(trained, b, s) if b is not None else 0.0)
            for s in trained.seeds
        }
        return Measured(effect, interval=_changes_interval(trained, a, b))

    out = {
        "kept": compared(FULL, None),
        "gate": compared(FULL, NO_GATE),
        "opened": compared(GATE_OPEN, NO_GATE),
        "pairs": compared(FULL, NO_PAIRS),
    }
    out["gate"].precondition = _gate_opened(trained, FULL)
    out["opened"].precondition = _gate_opened(trained, GATE_OPEN)
    gates = {
        arm: sum(float(trained.probes[arm][s]["end"]["gate"]) for s in trained.seeds)
        / len(trained.seeds)
        for arm in (FULL, GATE_OPEN, NO_GATE)
    }
    out["kept"].note = "mean end-of-run gate: " + ", ".join(
        f"{arm} {g:.3f}" for arm, g in gates.items()
    )
    return out


HEAD = ("model_dim=256", "hidden_dim=512", "embed_dim=128")

STUDY = Study(
    name="dualpath-forgetting",
    paper=(
        "viPolyQwen (seed 004), Secs. 3.4 and 4.5: the dual-path projection with its gate "
        "g = sigmoid(θ) (θ₀ = -5, logged 0.01 at step 2000 and 0.15 at 5000) lets Phase 2 add "
        'image-text alignment "without degrading" the text-similarity skill learnt in Phase 1; '
        "docs/design.md's reading: text-text ability after Phase 2 stays within a small margin "
        "of Phase 1."
    ),
    claims=(
        Claim(
            "kept",
            f"full method: Spearman after Phase 2 - after Phase 1 > -{MARGIN:g}",
            words="without degrading",
            source=SOURCE,
            effect=0.0,
            kind=rules.NON_INFERIORITY,
            margin=MARGIN,
            report_equivalence=True,
            min_steps=200,
        ),
        Claim(
            "gate",
            "the paper's gate protects the skill: change(full) - change(no gate) > 0",
            words="without degrading",
            source=SOURCE,
            effect=MARGIN,
            margin=MARGIN,
            report_equivalence=True,
            min_steps=200,
        ),
        Claim(
            "opened",
            "the gate, opened (gate_init=0), protects it: change(gate open) - change(no gate) > 0",
            words="without degrading",
            source=SOURCE,
            effect=MARGIN,
            margin=MARGIN,
            report_equivalence=True,
            min_steps=200,
        ),
        Claim(
            "pairs",
            "Phase-2 text pairs protect it: change(full) - change(no text pairs) > 0 (trivial: "
            "training on the skill keeps the skill)",
            words="without degrading",
            source=SOURCE,
            effect=MARGIN,
            role="exploratory",
            min_steps=200,
        ),
    ),
    arms=(
        Arm(FULL, DualPath.name, (*HEAD, f"gate_speed={GATE_SPEED:g}")),
        Arm(GATE_OPEN, DualPath.name, (*HEAD, "gate_init=0")),
        Arm(NO_GATE, DualPath.name, (*HEAD, "gate_init=-30")),
        Arm(
            NO_PAIRS,
            DualPath.name,
            (*HEAD, f"gate_speed={GATE_SPEED:g}", "phase2_text_pairs=false"),
        ),
    ),
    measure=measure,
    control=Control(
        FULL,
        Handicap(
            "{dose} of the text pairs' partners shuffled from the end of Phase 1 on",
            doses=(0.02, 0.05, 0.15, 0.4),
            dose=0.05,
            apply=shuffled_partners,
            start=switch_step,
        ),
        "kept",
        metric=change,
    ),
    data=(
        "synthetic:images=2500,val_fraction=0.2,text_pairs=1500,paraphrase_topics=32,"
        "heldout_pairs=1000"
    ),
    steps=400,
    validations=4,
    phases=Phases(
        marks=lambda steps: {PHASE1: switch_step(steps)},
        probe=probe,
        options=_schedule,
        validate=validate,
        select_best=False,
    ),
    baselines=("the same method without its gate (gate_init=-30)", "no Phase-2 text pairs"),
    preconditions=("the gate opened (mean g >= 0.5 at the end) for the gate claims",),
    notes=(
        "The skill is what Phase 1 trains: texts embedded with the text-pair prefix "
        "(recipe.embed_text_pairs), Spearman of the pair score against the true score on "
        "held-out paraphrase pairs (every other pair validates, the rest test), measured at the "
        "end of Phase 1 and at the end of the run on the last weights; each interval counts the "
        "seeds and the test pairs (a paired bootstrap of the pairs, Spearman recomputed). The "
        "paraphrases' topics are carried by no image, so Phase 2's image-caption loss cannot "
        "train the skill. In this architecture the gate mixes the two paths for image inputs "
        "only: a text input's embedding does not depend on θ, so the gate cannot by itself "
        "protect a text-text skill (the 'no gate' arm differs from 'full' only through the image "
        "side). The control is the full method with a share of the text pairs' partners "
        "shuffled from the end of Phase 1 on (forced forgetting), the share read off a pilot's "
        "scan so that its forgetting equals the margin; the claims' arms are not varied across "
        "worlds."
    ),
    quick_data=QUICK_WORLD + ",paraphrase_topics=8,heldout_pairs=40",
    quick_steps=4,
    quick_overrides=("model_dim=32", "hidden_dim=64", "embed_dim=16"),
)
