"""Schedules: AGR's four phases, DualPath's curriculum, the learning-rate multiplier."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from curvalign.schedules import (
    AGRCurriculum,
    DualPathCurriculum,
    agr_alpha,
    agr_beta,
    agr_entropy_weight,
    agr_phase,
    agr_phase_index,
    agr_warmup_end_step,
    dualpath_gate_warmup,
    dualpath_loss_weights,
    dualpath_phase,
    dualpath_switch_step,
    warmup_cosine,
)

PAPER_TOTAL = 120_000


@pytest.mark.parametrize(
    "cfg", [AGRCurriculum(), AGRCurriculum.paper_steps()], ids=["fraction", "steps"]
)
@pytest.mark.parametrize(
    "step, alpha, beta, phase",
    [
        (0, 0.0, 0.0, "Isolation"),
        (2_500, 0.0, 0.0, "Isolation"),
        (2_501, 1 / 2_500, 0.0, "Shadow"),
        (3_750, 0.5, 0.0, "Shadow"),
        (5_000, 1.0, 0.0, "Shadow"),
        (5_001, 1.0, 1 / 5_000, "Soft Launch"),
        (7_500, 1.0, 0.5, "Soft Launch"),
        (10_000, 1.0, 1.0, "Soft Launch"),
        (10_001, 1.0, 1.0, "Adaptive"),
        (119_999, 1.0, 1.0, "Adaptive"),
    ],
)
def test_agr_paper_boundaries(cfg, step, alpha, beta, phase):
    # On the paper's 120K-step run both boundary styles read Eqs. 19-20 exactly.
    assert agr_alpha(step, PAPER_TOTAL, cfg) == pytest.approx(alpha, abs=1e-9)
    assert agr_beta(step, PAPER_TOTAL, cfg) == pytest.approx(beta, abs=1e-9)
    assert agr_phase(step, PAPER_TOTAL, cfg) == phase


def test_agr_fractions_scale_with_the_run():
    cfg = AGRCurriculum()
    total = 1_200  # a hundredth of the paper's run: boundaries at 25, 50, 50, 100
    assert agr_alpha(25, total, cfg) == 0.0
    assert agr_alpha(50, total, cfg) == pytest.approx(1.0)
    assert agr_alpha(30, total, cfg) == pytest.approx(5 / 25)
    assert agr_beta(75, total, cfg) == pytest.approx(0.5)
    assert [agr_phase(s, total, cfg) for s in (25, 26, 50, 51, 100, 101)] == [
        "Isolation",
        "Shadow",
        "Shadow",
        "Soft Launch",
        "Soft Launch",
        "Adaptive",
    ]
    assert [agr_phase_index(s, total, cfg) for s in (0, 26, 51, 101)] == [1, 2, 3, 4]
    # the same run in steps does not scale: routing stays off
    assert agr_alpha(1_199, total, AGRCurriculum.paper_steps()) == 0.0


def test_agr_single_schedule_ramps_both_from_zero():
    cfg = AGRCurriculum.paper_steps(single_schedule=True)
    for step in (0, 1_000, 2_500, 5_000, 9_000):
        a, b = agr_alpha(step, PAPER_TOTAL, cfg), agr_beta(step, PAPER_TOTAL, cfg)
        assert a == b == pytest.approx(min(1.0, step / 5_000))
    assert agr_beta(1_000, PAPER_TOTAL, cfg) > 0  # Euclidean visible from the start
    assert agr_phase(5_000, PAPER_TOTAL, cfg) == "Warmup"
    assert agr_phase(5_001, PAPER_TOTAL, cfg) == "Adaptive"
    assert agr_phase_index(0, PAPER_TOTAL, cfg) == 0


def test_agr_entropy_weight_anneals_linearly_to_zero():
    cfg = AGRCurriculum.paper_steps()
    assert agr_entropy_weight(0, PAPER_TOTAL, cfg) == pytest.approx(0.01)
    assert agr_entropy_weight(25_000, PAPER_TOTAL, cfg) == pytest.approx(0.005)
    assert agr_entropy_weight(50_000, PAPER_TOTAL, cfg) == 0.0
    assert agr_entropy_weight(90_000, PAPER_TOTAL, cfg) == 0.0
    assert agr_warmup_end_step(PAPER_TOTAL, cfg) == 5_000
    assert agr_warmup_end_step(1_200, AGRCurriculum()) == 50


@given(st.integers(0, 20_000), st.integers(1, 20_000))
def test_agr_values_in_unit_interval_and_monotone(step, total):
    cfg = AGRCurriculum()
    a0, b0 = agr_alpha(step, total, cfg), agr_beta(step, total, cfg)
    a1, b1 = agr_alpha(step + 1, total, cfg), agr_beta(step + 1, total, cfg)
    assert 0.0 <= a0 <= a1 <= 1.0 and 0.0 <= b0 <= b1 <= 1.0
    # beta never leads alpha under the four-phase schedule: the router sees E only once active
    assert b0 <= a0 or a0 == 1.0


def test_agr_config_validation():
    with pytest.raises(ValueError, match="start <= end"):
        AGRCurriculum(alpha_start=0.5, alpha_end=0.1)
    with pytest.raises(ValueError, match="unit"):
        AGRCurriculum(unit="epochs")
    with pytest.raises(ValueError, match="total"):
        agr_alpha(0, 0, AGRCurriculum())


def test_warmup_cosine_shape():
    assert warmup_cosine(0, 100, 10) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(10, 100, 10) == pytest.approx(1.0)
    mid = 10 + (100 - 1 - 10) / 2
    assert warmup_cosine(int(mid), 100, 10) == pytest.approx(
        0.5 + 0.5 * math.cos(math.pi * int(mid - 10) / 89)
    )
    assert warmup_cosine(99, 100, 10, min_ratio=0.01) == pytest.approx(0.01)
    assert warmup_cosine(150, 100, 10, min_ratio=0.01) == pytest.approx(0.01)
    values = [warmup_cosine(s, 100, 10) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert warmup_cosine(0, 100, 0) == 1.0
    with pytest.raises(ValueError):
        warmup_cosine(0, 100, 10, min_ratio=2.0)


def test_dualpath_curriculum():
    cfg = DualPathCurriculum(unit="steps", switch_at=1953, gate_warmup=1000, loss_warmup=1953)
    total = 14_648
    assert dualpath_switch_step(total, cfg) == 1953
    assert dualpath_phase(1952, total, cfg) == 1 and dualpath_phase(1953, total, cfg) == 2
    assert dualpath_gate_warmup(1953, total, cfg) == 0.0
    assert dualpath_gate_warmup(2453, total, cfg) == pytest.approx(0.5)
    assert dualpath_gate_warmup(3000, total, cfg) == 1.0
    w0, w_end = dualpath_loss_weights(0, total, cfg), dualpath_loss_weights(5000, total, cfg)
    assert (w0.temperature, w0.score_weight, w0.rank_weight) == pytest.approx((0.1, 0.5, 0.1))
    assert (w_end.temperature, w_end.score_weight, w_end.rank_weight) == pytest.approx(
        (0.07, 3.0, 1.0)
    )
    half = dualpath_loss_weights(int(1953 / 2), total, cfg)
    assert 0.07 < half.temperature < 0.1 and 0.5 < half.score_weight < 3.0


def test_dualpath_fraction_defaults_match_the_paper():
    cfg = DualPathCurriculum()
    assert cfg.steps("switch_at", 14_648) == pytest.approx(1953, abs=1)
    assert cfg.steps("gate_warmup", 14_648) == pytest.approx(1000, abs=1)
    assert dualpath_switch_step(300, cfg) == 40
    with pytest.raises(ValueError, match="temperatures"):
        DualPathCurriculum(temperature_end=0.0)
