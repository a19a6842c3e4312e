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
from typing import Any

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
    the noise bound both were held to}."""
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
    out.update(gain=gain, rise=rise, bound=bound)
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
