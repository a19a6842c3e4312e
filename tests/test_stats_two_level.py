"""The two-level interval of a paired difference (seeds, then test items), against cases with a
known answer."""

import math

import numpy as np
import pytest

from curvalign.stats import (
    ItemTotals,
    paired_difference,
    t_quantile,
    two_level_difference,
)


def _constant(value: float, n: int = 50) -> ItemTotals:
    return ItemTotals.from_values(np.full(n, value))


def test_no_item_noise_is_exactly_the_paired_seed_interval():
    # every item of a seed scores the same: only the seeds vary
    a = [_constant(v) for v in (0.50, 0.56, 0.47)]
    b = [_constant(v) for v in (0.40, 0.41, 0.39)]
    got = two_level_difference(a, b, replicates=200)
    want = paired_difference([0.50, 0.56, 0.47], [0.40, 0.41, 0.39])
    assert got.mean == pytest.approx(want.mean, abs=1e-12)
    assert got.low == pytest.approx(want.low, abs=1e-12)
    assert got.high == pytest.approx(want.high, abs=1e-12)
    assert got.item_se == 0.0 and got.df == 2


def test_identical_rows_give_a_zero_width_interval_at_zero():
    rng = np.random.default_rng(1)
    a = [ItemTotals.from_values(rng.integers(0, 2, 80)) for _ in range(3)]
    got = two_level_difference(a, a, replicates=200)
    assert got.mean == 0.0 and got.low == 0.0 and got.high == 0.0


def test_no_seed_noise_is_the_item_bootstrap_of_the_paired_differences():
    # the same item values on every seed: the seed level adds nothing, and the standard error
    # is the bootstrap's of the n paired item differences, sd(d) / sqrt(n), with the seeds' t
    rng = np.random.default_rng(2)
    n = 400
    x = rng.integers(0, 2, n).astype(float)
    y = np.where(rng.random(n) < 0.3, 1 - x, x)  # the baseline differs on ~30% of the items
    a = [ItemTotals.from_values(x)] * 3
    got = two_level_difference(a, [ItemTotals.from_values(y)], replicates=4000)
    d = x - y
    assert got.mean == pytest.approx(d.mean(), abs=1e-12)
    assert got.seed_se == 0.0 and got.df == 2
    assert got.item_se == pytest.approx(d.std(ddof=0) / math.sqrt(n), rel=0.08)
    assert (got.high - got.low) / 2 == pytest.approx(t_quantile(0.975, 2) * got.item_se)


def test_a_single_baseline_adds_its_item_noise_to_the_seed_interval():
    # a trained row against a baseline evaluated once on the same items: the t interval over
    # the per-seed values alone ("against the single value") ignores the baseline's sampling
    # noise; the two-level interval is wider and still centred on the same difference
    rng = np.random.default_rng(3)
    n = 200
    base = rng.integers(0, 2, n).astype(float)
    seeds = [np.where(rng.random(n) < 0.4, rng.integers(0, 2, n), base) for _ in range(3)]
    a = [ItemTotals.from_values(s) for s in seeds]
    b = [ItemTotals.from_values(base)]
    got = two_level_difference(a, b, replicates=1000)
    seed_only = paired_difference([s.mean() for s in seeds], [base.mean()] * 3)
    assert got.mean == pytest.approx(seed_only.mean, abs=1e-12)
    assert got.item_se > 0 and got.high - got.low > seed_only.high - seed_only.low


def test_clusters_take_their_items_with_them():
    # two parts over the same clusters: the statistic is the mean of the two part means,
    # each a ratio of sums (captions per image differ)
    sums = np.array([[2.0, 0.0, 1.0], [1.0, 0.0, 1.0]])
    counts = np.array([[3.0, 1.0, 2.0], [1.0, 1.0, 1.0]])
    totals = ItemTotals(sums, counts)
    assert totals.statistic() == pytest.approx(0.5 * (3 / 6 + 2 / 3))
    weights = np.array([[3, 0, 0], [0, 0, 3]])
    assert totals.statistic(weights) == pytest.approx([0.5 * (2 / 3 + 1), 0.5 * (1 / 2 + 1)])


def test_one_seed_has_no_interval_and_mismatched_items_are_refused():
    one = two_level_difference([_constant(0.5)], [_constant(0.4)])
    assert one.mean == pytest.approx(0.1) and math.isnan(one.low)
    with pytest.raises(ValueError, match="same test items"):
        two_level_difference([_constant(0.5, 10)] * 2, [_constant(0.5, 11)])
    with pytest.raises(ValueError, match="one per seed"):
        two_level_difference([_constant(0.5)] * 3, [_constant(0.5)] * 2)


def test_random_ranking_ap_matches_enumeration_and_the_positive_share():
    import itertools

    from curvalign.stats import random_ranking_ap

    def ap(order, relevant):
        hits, total = 0, 0.0
        for rank, item in enumerate(order, 1):
            if item in relevant:
                hits += 1
                total += hits / rank
        return total / len(relevant)

    for n, p in ((4, 1), (5, 2), (6, 3)):
        relevant = set(range(p))
        perms = list(itertools.permutations(range(n)))
        exact = sum(ap(o, relevant) for o in perms) / len(perms)
        assert random_ranking_ap(p, n) == pytest.approx(exact, abs=1e-12)
    assert random_ranking_ap(100, 10_000) == pytest.approx(0.01, rel=0.1)
    assert random_ranking_ap(3, 3) == pytest.approx(1.0)
