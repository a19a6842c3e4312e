"""Schedules: pure functions of (step, total, config) -> float.

Nothing here holds state, so a resumed run reads exactly the values it would have read.
``step`` counts from 0 (as ``recipes.base.Progress``) and ``total`` is the run's length in steps.

Contents
    ``warmup_cosine``       learning-rate multiplier: linear warm-up, then cosine decay.
    ``AGRCurriculum``       AGR's four phases (seed 000, Sec. 4.4.1, Eqs. 19-21, 22; Algorithm 1):
                            router activation ``alpha(t)``, Euclidean visibility ``beta(t)``, the
                            phase name, the ``single_schedule`` ablation, the annealed entropy weight.
    ``DualPathCurriculum``  DualPath's two phases (seed 004, Secs. 3.4, 4.4, 4.5): the switch from
                            text pairs to mixed training, the gate warm-up after the switch, and the
                            temperature / loss-weight warm-up of Sec. 4.4.

Boundaries are given either in steps (``unit="steps"``) or as fractions of the run
(``unit="fraction"``, the default: the paper's step counts divided by the paper's run length, so a
run of the paper's length reads the paper's steps and a shorter run keeps the same proportions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Unit = Literal["steps", "fraction"]

# AGR trains 120K iterations (seed 000, Sec. 6.1); its curriculum boundaries are given in steps.
AGR_PAPER_STEPS = 120_000
# DualPath switches after 1M of 7.5M samples (Sec. 4.5) at step 1953 (Sec. 3.4), i.e. 512 samples a
# step, and warms the gate up for 1000 steps after the switch.
DUALPATH_PAPER_SAMPLES = 7_500_000
DUALPATH_PAPER_SAMPLES_PER_STEP = 512


def _check_progress(step: int, total: int) -> None:
    if total < 1:
        raise ValueError(f"total (the run's length in steps) must be >= 1, got {total}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")


def ramp(t: float, start: float, end: float) -> float:
    """``clip((t - start) / (end - start), 0, 1)``; a step from 0 to 1 just after ``start`` when
    ``end == start`` (the ramp has zero length)."""
    if end < start:
        raise ValueError(f"ramp end ({end}) must not precede its start ({start})")
    if end == start:
        return 0.0 if t <= start else 1.0
    return min(1.0, max(0.0, (t - start) / (end - start)))


def _to_steps(value: float, unit: Unit, total: int) -> float:
    if unit == "steps":
        return float(value)
    if unit == "fraction":
        return float(value) * total
    raise ValueError(f"unit must be 'steps' or 'fraction', got {unit!r}")


# --- learning rate ----------------------------------------------------------------------------


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier: ``(step + 1) / warmup_steps`` during the warm-up (so step 0 already
    moves), then a half cosine from 1 down to ``min_ratio`` at ``total_steps - 1``, and ``min_ratio``
    after it. AGR's "cosine decay to 1e-6" from 1e-4 is ``min_ratio=0.01``."""
    _check_progress(step, total_steps)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must lie in [0, 1], got {min_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:
        return 1.0 if step < total_steps else min_ratio
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --- AGR ----------------------------------------------------------------------------------------

AGR_PHASES = ("Isolation", "Shadow", "Soft Launch", "Adaptive")


@dataclass
class AGRCurriculum:
    """AGR's curriculum (seed 000, Eqs. 19-20): ``alpha`` ramps from ``alpha_start`` to
    ``alpha_end`` (router activation), ``beta`` from ``beta_start`` to ``beta_end`` (Euclidean
    visibility to the router). Defaults: the paper's 2.5K / 5K / 5K / 10K steps and the entropy
    anneal over 50K steps, as fractions of its 120K-step run.

    ``single_schedule`` is the ablation of Theorem 5.3: ``alpha(t) = beta(t) = min(1, t / T_w)``
    with the warm-up ``T_w = alpha_end`` (Table 7: "Warmup T_w 5K"), both geometries visible from
    step 0; its phases are called "Warmup" (``t <= T_w``) and "Adaptive".
    """

    alpha_start: float = 2_500 / AGR_PAPER_STEPS
    alpha_end: float = 5_000 / AGR_PAPER_STEPS
    beta_start: float = 5_000 / AGR_PAPER_STEPS
    beta_end: float = 10_000 / AGR_PAPER_STEPS
    entropy_weight: float = 0.01
    entropy_anneal_end: float = 50_000 / AGR_PAPER_STEPS
    unit: Unit = "fraction"
    single_schedule: bool = False

    def __post_init__(self) -> None:
        if self.unit not in ("steps", "fraction"):
            raise ValueError(f"AGRCurriculum.unit must be 'steps' or 'fraction', got {self.unit!r}")
        for name in (
            "alpha_start",
            "alpha_end",
            "beta_start",
            "beta_end",
            "entropy_anneal_end",
            "entropy_weight",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"AGRCurriculum.{name} must be >= 0, got {getattr(self, name)}")
        if self.alpha_end < self.alpha_start or self.beta_end < self.beta_start:
            raise ValueError(
                "AGRCurriculum: each ramp needs start <= end, got "
                f"alpha {self.alpha_start}..{self.alpha_end}, "
                f"beta {self.beta_start}..{self.beta_end}"
            )

    @classmethod
    def paper_steps(cls, **overrides: float) -> AGRCurriculum:
        """The paper's boundaries in absolute steps (for a run of 120K steps or any other)."""
        values: dict = dict(
            alpha_start=2_500,
            alpha_end=5_000,
            beta_start=5_000,
            beta_end=10_000,
            entropy_anneal_end=50_000,
            unit="steps",
        )
        values.update(overrides)
        return cls(**values)

    def steps(self, name: str, total: int) -> float:
        """Boundary ``name`` (a field) in steps for a run of ``total`` steps."""
        return _to_steps(getattr(self, name), self.unit, total)


def agr_alpha(step: int, total: int, cfg: AGRCurriculum) -> float:
    """Router activation ``alpha(t)`` (Eq. 19): 0 up to ``alpha_start``, linear to 1 at ``alpha_end``."""
    _check_progress(step, total)
    if cfg.single_schedule:
        return ramp(step, 0.0, cfg.steps("alpha_end", total))
    return ramp(step, cfg.steps("alpha_start", total), cfg.steps("alpha_end", total))


def agr_beta(step: int, total: int, cfg: AGRCurriculum) -> float:
    """Euclidean visibility ``beta(t)`` (Eqs. 20-21): ``S_E^route = beta(t) S_E``."""
    _check_progress(step, total)
    if cfg.single_schedule:
        return ramp(step, 0.0, cfg.steps("alpha_end", total))
    return ramp(step, cfg.steps("beta_start", total), cfg.steps("beta_end", total))


def agr_phase(step: int, total: int, cfg: AGRCurriculum) -> str:
    """Phase name at ``step``, with the paper's boundary convention (a boundary step belongs to the
    earlier phase: Isolation ``t <= 2.5K``, Shadow ``2.5K < t <= 5K``, Soft Launch
    ``5K < t <= 10K``, Adaptive ``t > 10K``). A gap between ``alpha_end`` and ``beta_start``
    (alpha = 1, beta = 0) counts as Shadow: the router acts on hyperbolic signals only."""
    _check_progress(step, total)
    if cfg.single_schedule:
        return "Warmup" if step <= cfg.steps("alpha_end", total) else "Adaptive"
    if step <= cfg.steps("alpha_start", total):
        return "Isolation"
    if step <= max(cfg.steps("alpha_end", total), cfg.steps("beta_start", total)):
        return "Shadow"
    if step <= cfg.steps("beta_end", total):
        return "Soft Launch"
    return "Adaptive"


def agr_phase_index(step: int, total: int, cfg: AGRCurriculum) -> int:
    """Phase as a number for logs: 1 Isolation, 2 Shadow, 3 Soft Launch, 4 Adaptive; under
    ``single_schedule`` 0 Warmup, 4 Adaptive."""
    name = agr_phase(step, total, cfg)
    return 0 if name == "Warmup" else AGR_PHASES.index(name) + 1


def agr_entropy_weight(step: int, total: int, cfg: AGRCurriculum) -> float:
    """``lambda_ent(t)``: ``entropy_weight`` annealed linearly to 0 at ``entropy_anneal_end``
    (Sec. 4.4, "0.01 annealed to 0 over 50K steps")."""
    _check_progress(step, total)
    end = cfg.steps("entropy_anneal_end", total)
    if end <= 0:
        return 0.0
    return cfg.entropy_weight * max(0.0, 1.0 - step / end)


def agr_warmup_end_step(total: int, cfg: AGRCurriculum) -> int:
    """First step at or after the end of the router warm-up ``T_w = alpha_end`` (Definition 5.2
    measures the mean routing weight there to diagnose geometry dominance)."""
    return int(math.ceil(cfg.steps("alpha_end", total)))


# --- DualPath -----------------------------------------------------------------------------------


@dataclass
class DualPathCurriculum:
    """DualPath's curriculum (seed 004).

    ``switch_at``      Phase 1 (text pairs only) ends here; Phase 2 adds image-text pairs and the
                       multimodal path is copied from the text path (Secs. 3.4, 4.5: after 1M of
                       7.5M samples).
    ``gate_warmup``    length of the gate warm-up after the switch (Sec. 4.5: 1000 steps, i.e.
                       1000 x 512 samples of 7.5M).
    ``loss_warmup``    length of the temperature / weight warm-up of Sec. 4.4 from step 0. The paper
                       gives the end values, not the length; the project ends it at the switch, so
                       that the text losses are at full strength when images arrive.
    temperature, score and rank weights ramp linearly from ``*_start`` to ``*_end``.
    """

    switch_at: float = 1_000_000 / DUALPATH_PAPER_SAMPLES
    gate_warmup: float = 1_000 * DUALPATH_PAPER_SAMPLES_PER_STEP / DUALPATH_PAPER_SAMPLES
    loss_warmup: float = 1_000_000 / DUALPATH_PAPER_SAMPLES
    unit: Unit = "fraction"
    temperature_start: float = 0.1
    temperature_end: float = 0.07
    score_weight_start: float = 0.5
    score_weight_end: float = 3.0
    rank_weight_start: float = 0.1
    rank_weight_end: float = 1.0

    def __post_init__(self) -> None:
        if self.unit not in ("steps", "fraction"):
            raise ValueError(
                f"DualPathCurriculum.unit must be 'steps' or 'fraction', got {self.unit!r}"
            )
        for name in ("switch_at", "gate_warmup", "loss_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"DualPathCurriculum.{name} must be >= 0, got {getattr(self, name)}"
                )
        if min(self.temperature_start, self.temperature_end) <= 0:
            raise ValueError(
                "DualPathCurriculum temperatures must be > 0, got "
                f"{self.temperature_start} -> {self.temperature_end}"
            )

    def steps(self, name: str, total: int) -> float:
        return _to_steps(getattr(self, name), self.unit, total)


@dataclass(frozen=True)
class DualPathLossWeights:
    """Sec. 4.4's curriculum values at one step."""

    temperature: float
    score_weight: float
    rank_weight: float


def dualpath_switch_step(total: int, cfg: DualPathCurriculum) -> int:
    """First step of Phase 2 (the step whose start copies the multimodal path from the text path)."""
    return int(math.ceil(cfg.steps("switch_at", total)))


def dualpath_phase(step: int, total: int, cfg: DualPathCurriculum) -> int:
    """1 (text pairs only) before the switch step, 2 (text pairs + image-text pairs) from it on."""
    _check_progress(step, total)
    return 1 if step < dualpath_switch_step(total, cfg) else 2


def dualpath_gate_warmup(step: int, total: int, cfg: DualPathCurriculum) -> float:
    """Gate warm-up factor in [0, 1]: 0 up to the switch, linear to 1 over ``gate_warmup`` steps."""
    _check_progress(step, total)
    start = float(dualpath_switch_step(total, cfg))
    length = cfg.steps("gate_warmup", total)
    if length <= 0:
        return 1.0 if step >= start else 0.0
    return ramp(step, start, start + length)


def dualpath_loss_weights(step: int, total: int, cfg: DualPathCurriculum) -> DualPathLossWeights:
    """Temperature 0.1 -> 0.07, score weight 0.5 -> 3.0, rank weight 0.1 -> 1.0 (Sec. 4.4),
    linear over ``loss_warmup`` from step 0."""
    _check_progress(step, total)
    r = ramp(step, 0.0, cfg.steps("loss_warmup", total))

    def lerp(a: float, b: float) -> float:
        return a + (b - a) * r

    return DualPathLossWeights(
        temperature=lerp(cfg.temperature_start, cfg.temperature_end),
        score_weight=lerp(cfg.score_weight_start, cfg.score_weight_end),
        rank_weight=lerp(cfg.rank_weight_start, cfg.rank_weight_end),
    )


__all__ = [
    "AGRCurriculum",
    "AGR_PHASES",
    "DualPathCurriculum",
    "DualPathLossWeights",
    "agr_alpha",
    "agr_beta",
    "agr_entropy_weight",
    "agr_phase",
    "agr_phase_index",
    "agr_warmup_end_step",
    "dualpath_gate_warmup",
    "dualpath_loss_weights",
    "dualpath_phase",
    "dualpath_switch_step",
    "ramp",
    "warmup_cosine",
]
