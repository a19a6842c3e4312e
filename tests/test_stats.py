"""The interval arithmetic behind every multi-seed table and study verdict."""

import math

import pytest

from curvalign.stats import Interval, mean_interval, paired_difference, t_quantile_975


def test_interval_matches_hand_computation():
    # values 1, 2, 3: mean 2, s = 1, se = 1/sqrt(3), t_{0.975,2} = 4.302653
    iv = mean_interval([1.0, 2.0, 3.0])
    half = 4.302653 / math.sqrt(3)
    assert iv.mean == pytest.approx(2.0)
    assert iv.low == pytest.approx(2.0 - half, abs=1e-6)
    assert iv.high == pytest.approx(2.0 + half, abs=1e-6)
    assert iv.n == 3
    assert iv.format(digits=2) == f"2.00 ± {half:.2f}"


def test_single_value_has_no_interval():
    iv = mean_interval([0.4])
    assert iv.mean == 0.4 and math.isnan(iv.low) and math.isnan(iv.high)
    assert not iv.excludes_zero()
    assert iv.format(scale=100) == "40.0"


def test_paired_difference_uses_per_seed_differences():
    # arms differ by exactly 1 on every seed: the paired interval is [1, 1] although the arms'
    # own intervals overlap widely
    a, b = [10.0, 20.0, 30.0], [9.0, 19.0, 29.0]
    d = paired_difference(a, b)
    assert (
        d.mean == pytest.approx(1.0)
        and d.low == pytest.approx(1.0)
        and d.high == pytest.approx(1.0)
    )
    assert d.excludes_zero()
    assert not mean_interval(a).separates_from(mean_interval(b))


def test_separation_and_zero():
    assert Interval(1.0, 0.5, 1.5, 3).separates_from(Interval(0.0, -0.2, 0.4, 3))
    assert not Interval(1.0, 0.3, 1.5, 3).separates_from(Interval(0.0, -0.2, 0.4, 3))
    assert Interval(-1.0, -2.0, -0.1, 3).excludes_zero()
    assert not Interval(0.1, -0.1, 0.3, 3).excludes_zero()


def test_t_quantiles_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 9, 29, 30, 31, 60, 200):
        assert t_quantile_975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=2e-3)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        mean_interval(bad)


def test_paired_needs_equal_lengths():
    with pytest.raises(ValueError, match="as many values"):
        paired_difference([1.0, 2.0], [1.0])
