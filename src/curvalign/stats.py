"""Statistics for comparisons over seeds: mean with a Student-t interval, paired differences.

A benchmark or a study trains every arm with the same seeds, so two arms are compared by the
per-seed *differences* (a paired test), not by two overlapping intervals. With n seeds the
95% interval of a mean is ``mean ± t_{0.975, n-1} · s / sqrt(n)`` (``s`` the sample standard
deviation); with one seed there is no interval (``low = high = nan``), never a fake zero width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

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
