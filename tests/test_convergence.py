"""The one convergence rule (curvalign.stats.curve_converged) on hand-made validation curves, and
the minimal detectable effect that benchmark tables quote."""

from __future__ import annotations

import math

import pytest

from curvalign.stats import curve_converged, curve_noise, minimal_detectable_effect, t_quantile_80


def curve(values, every=10):
    return [(i * every, v) for i, v in enumerate(values)]


def test_rising_to_the_last_point_is_never_converged():
    # best at the last validation, however small the last gain
    assert curve_converged(curve([0.1, 0.3, 0.40, 0.40, 0.401])) is False
    assert curve_converged(curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])) is False


def test_steady_rise_in_the_tail_beyond_its_noise_is_not_converged():
    # the best is one step before the end, but the tail climbs steadily well above its noise
    values = [0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.45, 0.50, 0.499]
    assert curve_converged(curve(values)) is False


def test_noisy_plateau_is_converged():
    values = [0.10, 0.30, 0.40, 0.42, 0.38, 0.43, 0.39, 0.42, 0.40, 0.41]
    assert curve_converged(curve(values)) is True


def test_plateau_whose_tail_gain_is_within_its_noise_is_converged():
    # the tail's best beats the earlier best by 0.01, inside the tail's own noise (about 0.03)
    values = [0.1, 0.3, 0.40, 0.37, 0.40, 0.36, 0.41, 0.35]
    assert curve_converged(curve(values)) is True


def test_same_gain_on_a_quiet_curve_is_not_converged():
    # a 0.03 gain in the tail of a curve whose points barely move is a real rise
    values = [0.1, 0.3, 0.400, 0.401, 0.400, 0.415, 0.430, 0.429]
    assert curve_converged(curve(values)) is False


def test_falling_end_is_converged_and_short_curves_are_unknown():
    assert curve_converged(curve([0.1, 0.5, 0.45, 0.40, 0.35])) is True
    assert curve_converged(curve([0.1, 0.2])) is None
    assert curve_converged([]) is None


def test_min_gain_is_the_floor():
    values = [0.1, 0.4, 0.40, 0.405, 0.404]
    assert curve_converged(curve(values), min_gain=0.01) is True
    assert curve_converged(curve(values), min_gain=0.001) is False


def test_noise_ignores_a_steady_trend():
    assert curve_noise([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.0, abs=1e-12)
    assert curve_noise([0.0, 1.0, 0.0, 1.0]) > 0.5
    assert math.isnan(curve_noise([0.1, 0.2]))


def test_t80_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 30, 60, 200):
        assert t_quantile_80(df) == pytest.approx(float(scipy_stats.t.ppf(0.8, df)), rel=2e-3)


def test_mde_shrinks_with_seeds_and_grows_with_sd():
    m3, m5 = minimal_detectable_effect(0.02, 3), minimal_detectable_effect(0.02, 5)
    assert m5 < m3
    assert minimal_detectable_effect(0.04, 5) == pytest.approx(2 * m5)
    # (t_.975,4 + t_.80,4) * sd / sqrt(5)
    assert m5 == pytest.approx((2.776445 + 0.940965) * 0.02 / math.sqrt(5))
    assert math.isnan(minimal_detectable_effect(0.02, 1))


def test_benchmark_health_uses_the_same_rule():
    from curvalign.eval.health import health
    from curvalign_lab.kit import converged as study_converged

    rising = curve([0.10, 0.20, 0.30, 0.40, 0.50, 0.60], every=20)
    plateau = curve([0.10, 0.30, 0.40, 0.42, 0.38, 0.43, 0.39, 0.42, 0.40, 0.41], every=10)
    out = health([], rising, last_step=100, bounds=set())
    assert out.converged is False and any("still rising" in w for w in out.warnings)
    assert health([], plateau, last_step=90, bounds=set()).converged is True
    for history in (rising, plateau):
        assert study_converged(history, tol=0.005) == curve_converged(history)
        assert health([], history, history[-1][0], set()).converged == curve_converged(history)


def test_a_curve_climbing_back_after_a_dip_is_still_moving_and_says_why():
    from curvalign.stats import curve_convergence

    values = [0.30, 0.40, 0.35, 0.30, 0.31, 0.33, 0.35, 0.37]  # best early, rising again at the end
    reading = curve_convergence(curve(values))
    assert reading["converged"] is False and "still rise" in reading["why"]
    assert reading["gain"] < 0 < reading["bound"] < reading["rise"]
    assert curve_convergence(curve([0.1, 0.2, 0.3]))["why"] == "the best validation is the last one"
