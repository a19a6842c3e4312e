"""Statistics for comparisons over seeds: mean with a Student-t interval, paired differences.

A benchmark or a study trains every arm with the same seeds, so two arms are compared by the
per-seed *differences* (a paired test), not by two overlapping intervals. With n seeds the
95% interval of a mean is ``mean ± t_{0.975, n-1} · s / sqrt(n)`` (``s`` the sample standard
deviation); with one seed there is no interval (``low = high = nan``), never a fake zero width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    import numpy as np

# Two-sided 95% quantiles t_{0.975, df} of Student's t distribution, df = 1..30 (standard
# tables; checked against scipy.stats.t.ppf in the tests). Beyond 30 the normal 1.959964 is
# within 2% and the table interpolates in 1/df towards it.
_T975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """``t_{0.975, df}``: the multiplier of the standard error in a two-sided 95% interval."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    # t_{0.975,df} - z is close to linear in 1/df for large df
    slope = (_T975[-1] - _Z975) * len(_T975)
    return _Z975 + slope / df


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and its two-sided 95% Student-t interval ``[low, high]``."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of 0 (nan intervals never do)."""
        return self.low > 0 or self.high < 0

    def separates_from(self, other: Interval) -> bool:
        """True when the two intervals do not overlap."""
        return self.low > other.high or other.low > self.high

    def as_dict(self) -> dict:
        return asdict(self)

    def format(self, scale: float = 1.0, digits: int = 1) -> str:
        """``"48.2 ± 1.3"`` (values times ``scale``); ``"48.2"`` with one value."""
        if self.n < 2 or math.isnan(self.low):
            return f"{self.mean * scale:.{digits}f}"
        return f"{self.mean * scale:.{digits}f} ± {self.half_width * scale:.{digits}f}"


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean and 95% interval of ``values`` (finite numbers, one per seed)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_interval needs at least one value")
    bad = [v for v in xs if not math.isfinite(v)]
    if bad:
        raise ValueError(f"mean_interval got non-finite values {bad}")
    n = len(xs)
    mean = math.fsum(xs) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    var = math.fsum((v - mean) ** 2 for v in xs) / (n - 1)
    half = t_quantile_975(n - 1) * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Interval of the mean of ``a[i] - b[i]`` (the same seed ``i`` in both arms)."""
    if len(a) != len(b):
        raise ValueError(
            f"paired_difference needs as many values in each arm, got {len(a)} and {len(b)}"
        )
    return mean_interval([x - y for x, y in zip(a, b, strict=True)])


# --- how small a difference the seeds can resolve ---------------------------------------------

# One-sided 80% quantiles t_{0.80, df}, df = 1..30 (checked against scipy.stats.t.ppf in the
# tests): the power term of a minimal detectable effect at 80% power.
_T80 = (
    1.376382,
    1.060660,
    0.978472,
    0.940965,
    0.919544,
    0.905703,
    0.896030,
    0.888890,
    0.883404,
    0.879058,
    0.875530,
    0.872609,
    0.870152,
    0.868055,
    0.866245,
    0.864667,
    0.863279,
    0.862049,
    0.860951,
    0.859964,
    0.859074,
    0.858266,
    0.857530,
    0.856855,
    0.856236,
    0.855665,
    0.855137,
    0.854647,
    0.854192,
    0.853767,
)
_Z80 = 0.841621


def t_quantile_80(df: int) -> float:
    """``t_{0.80, df}`` (one-sided), interpolated in 1/df towards the normal beyond df 30."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T80):
        return _T80[df - 1]
    return _Z80 + (_T80[-1] - _Z80) * len(_T80) / df


def minimal_detectable_effect(sd: float, n: int) -> float:
    """The smallest true paired difference that ``n`` seeds detect with a 95% two-sided interval
    excluding 0 in 80% of repetitions, when the per-seed differences have standard deviation
    ``sd``: ``(t_{0.975, n-1} + t_{0.80, n-1}) * sd / sqrt(n)``. ``nan`` with fewer than 2 seeds
    (nothing can be resolved without a spread)."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    return (t_quantile_975(n - 1) + t_quantile_80(n - 1)) * abs(sd) / math.sqrt(n)


def sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1); ``nan`` for fewer than two values."""
    xs = [float(v) for v in values]
    if len(xs) < 2:
        return math.nan
    mean = math.fsum(xs) / len(xs)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in xs) / (len(xs) - 1))


# --- convergence: one rule for the benchmark, tuning trials, studies and `train` ---------------

#: share of a validation curve, at its end, that the convergence rule reads as "the tail"
CONVERGENCE_TAIL = 1 / 3
#: a rise counts only when it exceeds this many noise units (the curve's own noise)
CONVERGENCE_Z = 2.0


def curve_noise(values: Sequence[float]) -> float:
    """Noise of a validation curve's points: the SD of successive differences over sqrt(2). A
    steady trend has near-constant differences, so it does not count as noise (the SD of the raw
    points would); independent noise of SD s gives differences of SD s*sqrt(2). ``nan`` with
    fewer than three points (fewer than two differences)."""
    diffs = [b - a for a, b in zip(values[:-1], values[1:], strict=True)]
    return sample_sd(diffs) / math.sqrt(2) if len(diffs) >= 2 else math.nan


def curve_convergence(
    history: Sequence[tuple[int, float]], min_gain: float = 0.005
) -> dict[str, Any]:
    """``curve_converged`` with its reasons: {"converged": bool | None, "why": one line, "gain":
    the tail's best minus the best before it, "rise": the tail's least-squares rise, "bound":
    the noise bound both were held to, "tail_start": the step of the tail's first point}."""
    out: dict[str, Any] = {"converged": None, "why": "fewer than 3 validations", "gain": None}
    out.update(rise=None, bound=None)
    if len(history) < 3:
        return out
    values = [float(v) for _, v in history]
    best = max(range(len(values)), key=lambda i: (values[i], -i))  # earliest of equal bests
    k = min(len(values) - 1, max(2, math.ceil(CONVERGENCE_TAIL * len(values))))
    tail, before = values[-k:], values[:-k]
    noise = curve_noise(tail)
    bound = max(min_gain, CONVERGENCE_Z * noise) if math.isfinite(noise) else min_gain
    mean_x, mean_y = (k - 1) / 2, math.fsum(tail) / k
    slope = math.fsum((i - mean_x) * (v - mean_y) for i, v in enumerate(tail)) / math.fsum(
        (i - mean_x) ** 2 for i in range(k)
    )
    gain, rise = max(tail) - max(before), slope * (k - 1)
    out.update(gain=gain, rise=rise, bound=bound, tail_start=int(history[-k][0]))
    if best == len(values) - 1:
        return {**out, "converged": False, "why": "the best validation is the last one"}
    if gain > bound:
        why = f"the last {k} validations beat the earlier best by {gain:.4f} (> {bound:.4f})"
        return {**out, "converged": False, "why": why}
    if rise > bound:
        why = f"the last {k} validations still rise by {rise:.4f} (> {bound:.4f}, their noise)"
        return {**out, "converged": False, "why": why}
    return {**out, "converged": True, "why": "the end of the curve is flat within its noise"}


def curve_converged(history: Sequence[tuple[int, float]], min_gain: float = 0.005) -> bool | None:
    """Whether a validation curve [(step, value)] (higher is better) had stopped rising, read
    against its own noise.

    The curve's tail is its last third of points (at least two); its noise is ``curve_noise`` of
    the tail (``min_gain`` at least: quantised recalls can repeat exactly). The run has *not*
    converged when (1) its best point is its last one (the curve may still be rising), (2) the
    tail's best beats the best before the tail by more than ``CONVERGENCE_Z`` noise units, or
    (3) the tail's least-squares rise from its first to its last point exceeds that bound (a
    curve climbing back after a dip is still moving). Otherwise it converged (a flat or falling
    end). None with fewer than three points. ``curve_convergence`` gives the reasons.
    """
    return curve_convergence(history, min_gain)["converged"]


# --- claim studies: p-values, Holm, equivalence (TOST), seeds for a target effect --------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta ``I_x(a, b)`` for ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    """``P(T <= x)`` for Student's t with ``df`` degrees of freedom (through the incomplete beta
    function: ``P(|T| > |x|) = I_{df/(df+x^2)}(df/2, 1/2)``)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on ``t_cdf``), ``0 < p < 1``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return 0.5 * (lo + hi)


def interval_sd(interval: Interval) -> float:
    """The per-seed standard deviation behind a 95% ``mean_interval`` (its half width is
    ``t_{0.975, n-1} sd / sqrt(n)``); ``nan`` with fewer than two values."""
    if interval.n < 2 or not math.isfinite(interval.half_width):
        return math.nan
    return interval.half_width * math.sqrt(interval.n) / t_quantile_975(interval.n - 1)


def t_test_p(interval: Interval, threshold: float = 0.0) -> float:
    """Two-sided p-value of the one-sample (paired) t test of ``mean == threshold``, from the
    95% interval of the per-seed values (``mean_interval`` or ``paired_difference``). ``nan``
    with fewer than two values; 0 when every value is equal and differs from the threshold."""
    sd = interval_sd(interval)
    if not math.isfinite(sd) or not math.isfinite(interval.mean):
        return math.nan
    gap = interval.mean - threshold
    if sd == 0.0:
        return 1.0 if gap == 0.0 else 0.0
    t = gap / (sd / math.sqrt(interval.n))
    return min(1.0, 2.0 * t_cdf(-abs(t), interval.n - 1))


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down procedure over a family of tests: ``rejected[i]`` is True when test ``i``
    is rejected at family-wise error ``alpha``. The smallest p is compared with ``alpha / m``,
    the next with ``alpha / (m - 1)``, ... and the procedure stops at the first that fails;
    ``nan`` p-values (no test) are never rejected but count in ``m``."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: (math.isnan(p_values[i]), p_values[i]))
    rejected = [False] * m
    for rank, i in enumerate(order):
        p = p_values[i]
        if math.isnan(p) or p > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def tost_interval(interval: Interval, alpha: float = 0.025) -> tuple[float, float]:
    """The ``1 - 2 alpha`` interval (``mean ± t_{1-alpha, n-1} sd / sqrt(n)``) that two one-sided
    tests at level ``alpha`` each read: the mean is *equivalent to 0 within ±delta* when it lies
    inside ``(-delta, delta)`` (Schuirmann's TOST). The default 0.025 reads the 95% interval,
    the level of a claim decided by its own 95% interval (a margin claim is one-sided 0.025); a
    family of ``m`` claims under Bonferroni or Holm passes ``0.025 / m``. ``sd`` is the per-seed
    SD behind the 95% interval (``interval_sd``). ``(nan, nan)`` with fewer than two values."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"each one-sided test's level must be in (0, 0.5), got {alpha}")
    sd = interval_sd(interval)
    if not math.isfinite(sd):
        return math.nan, math.nan
    half = t_quantile(1.0 - alpha, interval.n - 1) * sd / math.sqrt(interval.n)
    return interval.mean - half, interval.mean + half


def equivalent_within(interval: Interval, delta: float, alpha: float = 0.025) -> bool:
    """TOST with each one-sided test at level ``alpha``: the ``1 - 2 alpha`` interval
    (``tost_interval``) lies strictly inside ``(-delta, delta)``."""
    low, high = tost_interval(interval, alpha)
    return math.isfinite(low) and -delta < low and high < delta


def seeds_for_effect(sd: float, effect: float, max_seeds: int = 50) -> int | None:
    """The fewest seeds (>= 2) whose ``minimal_detectable_effect`` at per-seed SD ``sd`` is at
    most ``|effect|`` (80% power, alpha 0.05, paired t); None when even ``max_seeds`` is not
    enough or the SD is unknown. A zero SD needs two seeds (the least that gives an interval)."""
    if not math.isfinite(sd) or not math.isfinite(effect) or effect == 0.0:
        return None
    for n in range(2, max_seeds + 1):
        if minimal_detectable_effect(sd, n) <= abs(effect):
            return n
    return None


# --- two-level intervals: seeds and test items -------------------------------------------------


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (a cache key)
class ItemTotals:
    """One evaluation's per-item results, grouped in resampling units (clusters).

    sums, counts   [P, n] float arrays: for each of ``P`` parts (e.g. text->image and
                   image->text recall) and each of ``n`` clusters (e.g. test images), the sum of
                   the item values (hits) and the number of items the cluster holds in that part
    The statistic is the mean over parts of ``sum(sums[p]) / sum(counts[p])``: with one part and
    counts of 1 a plain mean of ``n`` item values; mean R@1 is two parts over the test images
    (each image with its captions' text->image hits, and its own image->text hit), so resampling
    an image takes its captions with it.
    """

    sums: Any
    counts: Any

    def __post_init__(self) -> None:
        import numpy as np

        sums = np.atleast_2d(np.asarray(self.sums, dtype=np.float64))
        counts = np.atleast_2d(np.asarray(self.counts, dtype=np.float64))
        if sums.shape != counts.shape or sums.ndim != 2:
            raise ValueError(
                f"ItemTotals needs sums and counts of one [P, n] shape, got {sums.shape} and "
                f"{counts.shape}"
            )
        if not (counts.sum(axis=1) > 0).all():
            raise ValueError("ItemTotals: every part needs at least one item")
        object.__setattr__(self, "sums", sums)
        object.__setattr__(self, "counts", counts)

    @classmethod
    def from_values(cls, values: Sequence[float]) -> ItemTotals:
        """One part, one item per cluster: the statistic is the mean of ``values`` [n]."""
        import numpy as np

        x = np.asarray(values, dtype=np.float64).reshape(1, -1)
        return cls(x, np.ones_like(x))

    @property
    def size(self) -> int:
        """Number of clusters ``n`` (the resampling units)."""
        return int(self.sums.shape[1])

    @overload
    def statistic(self, weights: None = None) -> float: ...
    @overload
    def statistic(self, weights: np.ndarray) -> np.ndarray: ...
    def statistic(self, weights: np.ndarray | None = None) -> float | np.ndarray:
        """The statistic, or with bootstrap ``weights`` [R, n] (how often each cluster is drawn)
        the [R] statistics of the R resamples."""
        import numpy as np

        if weights is None:
            return float(np.mean(self.sums.sum(axis=1) / self.counts.sum(axis=1)))
        num, den = weights @ self.sums.T, weights @ self.counts.T  # [R, P]
        ratio = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
        return ratio.mean(axis=1)


@dataclass(frozen=True)
class TwoLevelInterval(Interval):
    """An ``Interval`` of a paired difference whose width counts the seeds and the test items:
    ``seed_se`` and ``item_se`` the two standard-error components, ``df`` the degrees of freedom
    of the t quantile (the seeds'), ``items`` the number of resampled test clusters."""

    seed_se: float = math.nan
    item_se: float = math.nan
    df: float = math.nan
    items: int = 0


def _bootstrap_weights(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """[size, n] counts of how often each of ``n`` clusters is drawn in ``size`` resamples of
    ``n`` draws with replacement (one ``bincount`` over offset indices: a multinomial draw per
    resample is several times slower)."""
    import numpy as np

    idx = rng.integers(0, n, size=(size, n)) + (np.arange(size) * n)[:, None]
    return np.bincount(idx.ravel(), minlength=size * n).reshape(size, n).astype(np.float64)


def bootstrap_statistics(
    totals: Sequence[ItemTotals], replicates: int = 1000, seed: int = 0, chunk: int = 100
) -> dict[ItemTotals, Any]:
    """{totals: [replicates] statistics} of every ``totals`` (all over the same ``n`` clusters)
    under the *same* bootstrap draws of the clusters: one pass over the draws for any number of
    evaluations, so that every paired comparison of a table reads the same resamples."""
    import numpy as np

    unique = list(dict.fromkeys(totals))
    if not unique:
        return {}
    sizes = {t.size for t in unique}
    if len(sizes) != 1:
        raise ValueError(f"bootstrap_statistics needs one number of clusters, got {sorted(sizes)}")
    n = sizes.pop()
    sums = np.concatenate([t.sums for t in unique])
    counts = np.concatenate([t.counts for t in unique])
    bounds = np.cumsum([0] + [t.sums.shape[0] for t in unique])
    rng = np.random.default_rng(seed)
    parts: list[list[Any]] = [[] for _ in unique]
    for start in range(0, replicates, chunk):
        weights = _bootstrap_weights(rng, n, min(chunk, replicates - start))
        num, den = weights @ sums.T, weights @ counts.T
        ratio = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
        for k in range(len(unique)):
            parts[k].append(ratio[:, bounds[k] : bounds[k + 1]].mean(axis=1))
    return {t: np.concatenate(p) for t, p in zip(unique, parts, strict=True)}


def two_level_difference(
    a: Sequence[ItemTotals],
    b: Sequence[ItemTotals],
    replicates: int = 1000,
    seed: int = 0,
    resampled: Mapping[ItemTotals, Any] | None = None,
) -> TwoLevelInterval:
    """95% interval of ``statistic(a) - statistic(b)`` over seeds *and* test items: a paired
    two-level procedure.

    ``a`` holds one ``ItemTotals`` per seed of a trained row; ``b`` either one per seed (the same
    seeds, e.g. the row's own step-0 head: paired over seeds) or a single one (a deterministic
    baseline evaluated once, e.g. the ridge map or the frozen features, compared with every seed).

    Level 1, seeds: the per-seed differences ``d_s = stat(a_s) - stat(b_s)`` give the estimate
    (their mean, identical to the difference of the table's means) and the seed component
    ``seed_se^2 = var(d_s) / S`` of the paired t interval (``paired_difference``).
    Level 2, test items: a paired bootstrap of the test clusters inside each seed: each of
    ``replicates`` resamples draws the ``n`` clusters with replacement, applies the *same* draw
    to both rows (paired across the rows compared) and, when every evaluation holds the same
    items (a fixed test split), to every seed too, since an item that is hard is hard for every
    seed, and independent draws per seed would understate the item noise up to S times; the
    variance of the resampled mean difference is ``item_se^2``. The baseline's own sampling
    noise (a single ridge or frozen evaluation on the same finite test set) enters here: the
    seed level cannot see it.
    The interval is ``mean +- t_{0.975, S-1} sqrt(seed_se^2 + item_se^2)``: the seeds' degrees
    of freedom, never more (a Welch-Satterthwaite df grows with the items and, with 3 seeds,
    can make the interval narrower than the seeds' own), so it is never narrower than the
    paired t interval over seeds. The seed level stays a t interval rather than a bootstrap of
    the seeds: with 3 seeds a bootstrap has 10 distinct resamples and a percentile interval
    about half as wide as the t interval every other cell of the table uses. Both components
    hold the seed-by-item noise once, so the sum slightly overstates the variance
    (conservative).

    Known answers: with no item noise (every item of a seed has the same value) the interval is
    exactly ``paired_difference`` of the per-seed statistics; identical rows give ``[0, 0]``;
    with one seed the seed variance is unknown and the interval is nan (no verdict), as for the
    other cells of a one-seed table. ``seed`` fixes the bootstrap draws (reproducible tables);
    ``resampled`` ({totals: [R] statistics}, ``bootstrap_statistics``) reuses draws already
    made for a whole table.
    """
    import numpy as np

    if not a:
        raise ValueError("two_level_difference needs at least one seed in a")
    if len(b) not in (1, len(a)):
        raise ValueError(
            f"two_level_difference: b must hold one evaluation or one per seed of a ({len(a)}), "
            f"got {len(b)}"
        )
    pairs = [(x, b[0] if len(b) == 1 else b[s]) for s, x in enumerate(a)]
    for s, (x, y) in enumerate(pairs):
        if x.sums.shape != y.sums.shape:
            raise ValueError(
                f"two_level_difference: seed {s} compares {x.sums.shape} with {y.sums.shape} "
                "item totals; paired rows need the same test items"
            )
    diffs = [x.statistic() - y.statistic() for x, y in pairs]
    n_seeds = len(diffs)
    mean = math.fsum(diffs) / n_seeds
    n_items = min(x.size for x, _ in pairs)
    if n_seeds < 2:
        return TwoLevelInterval(mean, math.nan, math.nan, 1, items=n_items)
    seed_var = sample_sd(diffs) ** 2 / n_seeds
    if len({x.size for x, _ in pairs}) == 1:  # one test set: the same draws for every seed
        if resampled is None or any(t not in resampled for pair in pairs for t in pair):
            resampled = bootstrap_statistics([t for pair in pairs for t in pair], replicates, seed)
        boot = sum(resampled[x] - resampled[y] for x, y in pairs) / n_seeds
    else:  # each seed its own test items: independent draws per seed
        boot = 0.0
        for s, (x, y) in enumerate(pairs):
            own = bootstrap_statistics([x, y], replicates, seed + s)
            boot = boot + (own[x] - own[y]) / n_seeds
    item_var = float(np.var(boot, ddof=1)) if replicates > 1 else 0.0
    # a statistic whose items never differ between rows resamples to exact zeros: keep it zero
    item_var = 0.0 if item_var < 1e-30 else item_var
    # with no item noise this is exactly the paired t interval over seeds
    half = t_quantile_975(n_seeds - 1) * math.sqrt(seed_var + item_var)
    return TwoLevelInterval(
        mean,
        mean - half,
        mean + half,
        n_seeds,
        math.sqrt(seed_var),
        math.sqrt(item_var),
        float(n_seeds - 1),
        n_items,
    )


def random_ranking_ap(positives: int, n: int) -> float:
    """Expected average precision of a uniformly random ranking of ``n`` items of which
    ``positives`` are relevant (no ties): ``H_n / n + (P - 1)(n - H_n) / (n (n - 1))`` with
    ``H_n`` the n-th harmonic number. (AP is the mean over positives of the precision at each;
    a positive at rank r contributes 1/r for itself, and each other positive lies above it with
    probability (r - 1)/(n - 1).) About the share of positives ``P / n`` for large ``n``."""
    if not 0 < positives <= n:
        raise ValueError(f"random_ranking_ap needs 0 < positives <= n, got {positives} and {n}")
    harmonic = math.fsum(1.0 / r for r in range(1, n + 1))
    if n == 1:
        return 1.0
    return harmonic / n + (positives - 1) * (n - harmonic) / (n * (n - 1))
