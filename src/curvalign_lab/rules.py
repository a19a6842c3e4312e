"""The studies' decision rules as pure functions: power planned on a pilot, stability across seed
bases, the Holm family, and the dose of a control sized by a dose-response scan.

Power (``power``, ``minimal_detectable``): a claim's paired per-seed differences ``d_s`` (n
seeds, standard deviation ``sd``) are tested with a t statistic ``T = mean(d) / (sd / sqrt(n))``
on ``n - 1`` degrees of freedom. At a true mean difference ``effect`` it follows a *noncentral*
t distribution with noncentrality ``delta = effect sqrt(n) / sd``, so the power is exact:

    two-sided test (superiority, "a differs from b"):   P(T > t_{1-a/2}) + P(T < -t_{1-a/2})
    one-sided test (non-inferiority, TOST's halves):     P(T > t_{1-a'})

with ``a = 0.05`` and ``a' = a / 2``: every claim is decided by its 95% interval (a margin claim
by that interval's bound beyond the margin, a one-sided test at 0.025), so every plan is made at
that level too (``plan_alpha``). The minimal detectable effect (MDE) at n seeds is the smallest ``effect`` whose power
reaches 80%. (The textbook ``(t_{1-a/2} + t_{0.8}) sd / sqrt(n)`` replaces the noncentral t by
a shifted central one; at n = 3 it is about 5% too small.) The noncentral t CDF
(``noncentral_t_cdf``) is integrated over the chi distribution of the SD estimate; the tests
check it against scipy's.

The plan (``plan_claim``): a *pilot* on a seed base disjoint from the confirmatory one gives each
claim's per-seed SD; the claim needs the fewest seeds whose MDE is at most its *target*:

    superiority       the paper's effect |e|
    non-inferiority   the distance from the paper's effect to the margin, m - |e| (a drop of 0.55
    / equivalence     points against a 2-point margin needs an MDE of 1.45, not 0.55)

up to a stated ``cap``; a claim whose target needs more than the cap is *underpowered by plan*.
A study tests its claims as one Holm family of ``m``, so each plan is made at the level of Holm's
first step, ``alpha / m`` (``plan_for_target``'s ``family``): planned at the unadjusted level, a
claim would come back "inconclusive after Holm" at the very seeds its plan promised. Where the
claim's interval counts its fixed test items too (a two-level interval), the plan counts their
standard error as well: seeds do not shrink it, so it sets a floor under the MDE, and a target
below that floor is underpowered at any cap (the fix is a larger test set, not more seeds).
That label comes from the plan alone, never from the confirmatory run's own SD (with 2 degrees
of freedom that SD lies between 0.32x and 1.52x the true one in 80% of repetitions).

Stability (``across_bases``): a claim decided on two disjoint seed bases keeps its verdict only
when both bases agree on the verdict's class; any other pair, "holds" on one base and
"underpowered" on the other included, is "unstable across seed bases".

Control doses (``dose_for_effect``): the pilot trains the control arm at each dose of its
handicap (a share of shuffled captions, a cut of the dimension, forced forgetting); the dose
whose effect equals the claim's size is read off the monotone (isotonic) fit of the scan by
linear interpolation, so the control is as large as the claim, neither a sure failure nor a
sure pass.

Control seeds (``plan_control``): a calibrated control separates when its interval lies above 0
and is narrower than the claim's size. Its seeds are planned like a superiority claim whose
effect is that size, on the control's own noise: the per-seed SD of the scan's effects at the
doses that bracket the chosen one, pooled, taken at its 80% upper confidence limit
(``sd_upper_limit``, Browne's rule): a pilot of a few seeds gives that SD on 2 to 5 degrees of
freedom, where it falls below the true SD more often than not (in 59% of pilots on 4), and a
control planned at a low SD misses, which leaves every claim of its study undecided; the 80%
limit lies above the true SD in 4 pilots out of 5. At the planned n an effect of
the claim's size is detected with 80% power, and the 95% interval's half-width is then about 0.7
times the size. The run takes the most seeds any plan asks (``study_seeds``): the cap where a
plan is underpowered.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from curvalign.stats import t_quantile

#: the power every plan asks for
POWER = 0.8
#: the test level: two-sided for superiority; a margin's one-sided test (and each half of TOST)
#: runs at ALPHA / 2, so that both read the claim's 95% interval (``plan_alpha``)
ALPHA = 0.05
#: the kinds of claim a study states
SUPERIORITY = "superiority"
NON_INFERIORITY = "non-inferiority"
EQUIVALENCE = "equivalence"
KINDS = (SUPERIORITY, NON_INFERIORITY, EQUIVALENCE)
#: roles that a claim can have; only ``TESTED_ROLES`` enter the Holm family
TESTED_ROLES = ("primary", "secondary", "exploratory")
OUTSIDE_ROLES = ("precondition", "regime", "sanity")

#: verdict classes this module speaks of (the same strings as ``kit``)
UNDERPOWERED = "underpowered"
UNSTABLE = "unstable across seed bases"


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def noncentral_t_cdf(t: float, df: float, delta: float, points: int = 801) -> float:
    """``P(T <= t)`` for ``T`` noncentral t with ``df`` degrees of freedom and noncentrality
    ``delta``: ``T = (Z + delta) / S`` with ``S = sqrt(V / df)``, ``V`` chi-squared(df), so

        P(T <= t) = integral_0^inf Phi(t s - delta) f_S(s) ds,
        f_S(s) = 2 df^(df/2) s^(df-1) exp(-df s^2 / 2) / (2^(df/2) Gamma(df/2)),

    integrated by Simpson's rule over ``points`` nodes on [0, s_max], where s_max lies 12
    standard deviations of ``S`` beyond its mode (the density left out is below 1e-30).
    Accurate to about 1e-6 for df >= 1 (checked against scipy.stats.nct in the tests)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    nodes, weights = _chi_nodes(float(df), points + (points % 2 == 0))
    total = float((weights * torch.special.ndtr(t * nodes - delta)).sum())
    return min(1.0, max(0.0, total))


@functools.lru_cache(maxsize=256)
def _chi_nodes(df: float, points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Simpson nodes ``s`` [points] and weights (the density f_S(s) times Simpson's weights)
    of ``noncentral_t_cdf``'s integral, float64; cached per degrees of freedom."""
    spread = 1.0 / math.sqrt(2.0 * df)
    s_max = max(1.0, math.sqrt(max(df - 1.0, 0.0) / df)) + 12.0 * max(spread, 0.6)
    s = torch.linspace(0.0, s_max, points, dtype=torch.float64)
    h = s_max / (points - 1)
    log_norm = (df / 2.0) * math.log(df) - (df / 2.0 - 1.0) * math.log(2.0) - math.lgamma(df / 2)
    density = torch.exp(log_norm + (df - 1.0) * torch.log(s.clamp_min(1e-300)) - df * s * s / 2)
    density[0] = math.exp(log_norm) if df == 1.0 else 0.0  # df = 1: f_S(0) = sqrt(2/pi)
    simpson = torch.full((points,), 2.0, dtype=torch.float64)
    simpson[1::2] = 4.0
    simpson[0] = simpson[-1] = 1.0
    return s, density * simpson * (h / 3.0)


def power(effect: float, sd: float, n: int, *, sided: int = 2, alpha: float = ALPHA) -> float:
    """The exact power of the paired t test at ``n`` seeds when the true mean difference is
    ``effect`` and the per-seed differences have SD ``sd`` (``sided`` 2: two-sided level
    ``alpha``; 1: one-sided, rejecting towards positive effects). ``nan`` below 2 seeds."""
    if n < 2 or not math.isfinite(sd) or not math.isfinite(effect):
        return math.nan
    if sided not in (1, 2):
        raise ValueError(f"sided must be 1 or 2, got {sided}")
    df = n - 1
    if sd == 0.0:
        return 1.0 if effect != 0.0 else alpha
    delta = effect * math.sqrt(n) / abs(sd)
    crit = t_quantile(1.0 - alpha / sided, df)
    upper = 1.0 - noncentral_t_cdf(crit, df, delta)
    if sided == 1:
        return upper
    return upper + noncentral_t_cdf(-crit, df, delta)


def minimal_detectable(
    sd: float, n: int, *, sided: int = 2, alpha: float = ALPHA, target_power: float = POWER
) -> float:
    """The smallest true mean difference that ``n`` seeds detect with ``target_power`` (exact
    noncentral t, ``power``); ``nan`` below 2 seeds or for an unknown SD; 0 for a zero SD."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    sd = abs(sd)
    if sd == 0.0:
        return 0.0
    lo, hi = 0.0, sd
    while power(hi, sd, n, sided=sided, alpha=alpha) < target_power:
        hi *= 2.0
        if hi > 1e6 * sd:
            return math.inf
    for _ in range(45):  # bisection to ~3e-14 of the bracket
        mid = 0.5 * (lo + hi)
        if power(mid, sd, n, sided=sided, alpha=alpha) < target_power:
            lo = mid
        else:
            hi = mid
    return hi


def planning_target(kind: str, paper_effect: float | None, margin: float | None) -> float:
    """The effect a claim's plan must be able to detect: the paper's effect for a superiority
    claim; the distance from the paper's effect to the margin for a non-inferiority or
    equivalence claim (``nan`` where that is not positive: the paper's own effect lies at or
    beyond the margin, so no n can show the claim). ``nan`` without a paper effect.

    A non-inferiority claim (effect > -margin) takes the paper's *signed* effect on the claim's
    statistic: a 0.55-point drop is -0.0055 (distance 0.02 - 0.0055), a 65-point advantage
    +0.65 (distance 0.65 + 0.05). An equivalence claim (|effect| < margin) takes its size."""
    if kind not in KINDS:
        raise ValueError(f"claim kind must be one of {KINDS}, got {kind!r}")
    if paper_effect is None or not math.isfinite(paper_effect):
        return math.nan
    if kind == SUPERIORITY:
        return abs(paper_effect)
    if margin is None or not math.isfinite(margin):
        raise ValueError(f"a {kind} claim needs its margin")
    if kind == NON_INFERIORITY:
        distance = paper_effect + abs(margin)
    else:
        distance = abs(margin) - abs(paper_effect)
    return distance if distance > 0 else math.nan


def sided(kind: str) -> int:
    """The sides of a claim's test: 2 for superiority, 1 for a margin (non-inferiority, and each
    half of TOST)."""
    return 2 if kind == SUPERIORITY else 1


def plan_alpha(side: int) -> float:
    """The level a plan uses for a test with ``side`` sides: ``ALPHA`` two-sided, ``ALPHA / 2``
    one-sided. Either way the critical value is the 95% interval's, the interval the claim is
    decided by (``kit.decide``): planning a margin claim at a one-sided 0.05 would promise 80%
    power for a test it does not run."""
    return ALPHA if side == 2 else ALPHA / 2


#: the fewest seeds a confirmatory run has, whatever its plans say: a control's 95% interval on
#: 2 seeds (1 degree of freedom, t = 12.7) is three times as wide as on 3 (t = 4.3), wide
#: enough that a control of the claim's size cannot separate even where its pilot (a few seeds)
#: happened to look quiet
MIN_SEEDS = 3
#: the confidence of the upper limit of the pilot SD a control's seeds are planned at
#: (``plan_control``; Browne 1995's rule for pilot-based sample sizes)
CONTROL_SD_CONFIDENCE = 0.8
#: a pilot SD at or below this is identical per-seed effects up to rounding (metrics are fractions)
ZERO_SD = 1e-12


@dataclass(frozen=True)
class Plan:
    """One claim's seeds, planned on a pilot: ``pilot_sd`` (per-seed SD of the claim's effect on
    ``pilot_n`` seeds of a disjoint base), ``target`` (``planning_target``), ``n`` the fewest
    seeds whose MDE is at most the target, or ``cap`` when none is (``underpowered`` True),
    ``mde`` the MDE at ``n``; ``family`` the size of the Holm family the claim is tested in (its
    test runs at the family's level, so the plan does too: ``plan_for_target``); ``item_se`` the
    standard error the pilot's fixed test items add to the claim's interval (0: an interval over
    seeds only), which more seeds do not shrink."""

    pilot_sd: float
    pilot_n: int
    target: float
    n: int
    cap: int
    mde: float
    underpowered: bool
    family: int = 1
    item_se: float = 0.0
    #: the SD the seeds were planned at where it is not ``pilot_sd`` (a control's: the pilot
    #: SD's upper confidence limit, ``plan_control``); nan: the pilot's SD itself
    planned_sd: float = math.nan

    @property
    def level(self) -> str:
        """The level the plan was made at and the test items' share, for its texts (empty for
        a claim tested alone over seeds only)."""
        items = f", test items' SE {self.item_se:.3g}" if self.item_se > 0 else ""
        holm = f", at Holm's level for {self.family} claims" if self.family > 1 else ""
        return items + holm

    @property
    def item_floor(self) -> float:
        """The MDE that no number of seeds goes below: the test items' SE alone, at the plan's
        level and power (normal quantiles, the limit of the t test's many degrees of freedom);
        0 for an interval over seeds only."""
        if self.item_se <= 0:
            return 0.0
        z = torch.distributions.Normal(0.0, 1.0)
        alpha = ALPHA / self.family  # two-sided superiority and a one-sided margin alike
        return float(z.icdf(torch.tensor(1 - alpha / 2)) + z.icdf(torch.tensor(POWER))) * (
            self.item_se
        )

    @property
    def reason(self) -> str:
        """Why the plan says what it says, one short sentence."""
        if not math.isfinite(self.target):
            return "no target to plan for (no paper effect, or the effect lies beyond the margin)"
        if not math.isfinite(self.pilot_sd):
            return f"the pilot ({self.pilot_n} seeds) gave no SD"
        if self.pilot_sd <= ZERO_SD:
            return (
                f"the pilot's {self.pilot_n} seeds gave identical effects (SD 0): nothing to plan "
                f"from, so the cap of {self.cap} seeds"
            )
        if self.underpowered:
            floor = self.item_floor
            return (
                f"MDE {self.mde:.3g} at the cap of {self.cap} seeds exceeds the target "
                f"{self.target:.3g} (pilot SD {self.pilot_sd:.3g}{self.level}{self._upper})"
                + (
                    f"; no number of seeds reaches it: the test items alone give {floor:.3g}"
                    if floor > self.target
                    else ""
                )
            )
        return (
            f"{self.n} seeds give MDE {self.mde:.3g} <= target {self.target:.3g} "
            f"(pilot SD {self.pilot_sd:.3g}, {self.pilot_n} seeds{self.level}{self._upper})"
        )

    @property
    def _upper(self) -> str:
        if not math.isfinite(self.planned_sd):
            return ""
        return f"; planned at its upper confidence limit {self.planned_sd:.3g}"

    def as_dict(self) -> dict[str, float | int | bool | str]:
        return {
            "pilot_sd": self.pilot_sd,
            "pilot_n": self.pilot_n,
            "target": self.target,
            "n": self.n,
            "cap": self.cap,
            "mde": self.mde,
            "underpowered": self.underpowered,
            "reason": self.reason,
            "family": self.family,
            "item_se": self.item_se,
            **({"planned_sd": self.planned_sd} if math.isfinite(self.planned_sd) else {}),
        }


def plan_claim(
    pilot_values: Sequence[float],
    *,
    kind: str,
    paper_effect: float | None,
    margin: float | None = None,
    cap: int = 10,
    family: int = 1,
    item_se: float = 0.0,
) -> Plan:
    """The plan of one claim from its pilot's per-seed effects (``pilot_values``, a seed base
    disjoint from the confirmatory one): n = the fewest seeds (at least ``MIN_SEEDS``) whose exact MDE at the
    pilot's SD reaches the claim's ``planning_target``, at most ``cap``."""
    values = [float(v) for v in pilot_values if math.isfinite(float(v))]
    return plan_for_sd(
        _sd(values),
        len(values),
        kind=kind,
        paper_effect=paper_effect,
        margin=margin,
        cap=cap,
        family=family,
        item_se=item_se,
    )


def plan_for_sd(
    sd: float,
    pilot_n: int,
    *,
    kind: str,
    paper_effect: float | None,
    margin: float | None = None,
    cap: int = 10,
    family: int = 1,
    item_se: float = 0.0,
) -> Plan:
    """``plan_claim`` from the pilot's per-seed SD ``sd`` (on ``pilot_n`` seeds) directly."""
    if cap < 2:
        raise ValueError(f"the seed cap must be >= 2, got {cap}")
    return plan_for_target(
        sd,
        pilot_n,
        kind=kind,
        target=planning_target(kind, paper_effect, margin),
        cap=cap,
        family=family,
        item_se=item_se,
    )


def plan_for_target(
    sd: float,
    pilot_n: int,
    *,
    kind: str,
    target: float,
    cap: int = 10,
    family: int = 1,
    item_se: float = 0.0,
) -> Plan:
    """``plan_for_sd`` from the claim's ``target`` (``planning_target``) directly.

    ``family``: the size of the Holm family the claim is tested in. Holm's first step tests at
    ``ALPHA / family``, so the plan asks for 80% power at that level (Bonferroni's, the
    conservative end of Holm's): a plan at the unadjusted level promises power the corrected
    test does not have, and its claims come back "inconclusive after Holm".

    ``item_se``: the standard error the claim's fixed test items add to its interval (the
    two-level interval's ``item_se`` on the pilot). Seeds shrink only the seeds' share, so at
    ``n`` seeds the mean's variance is ``sd^2 / n + item_se^2``: the MDE at ``n`` is the exact
    one at the per-seed SD ``sqrt(sd^2 + n item_se^2)``, which falls towards the items' floor
    (``Plan.item_floor``) and never below it; a target under that floor is underpowered at any
    cap. Planned on seeds alone, such a claim was promised power its interval cannot have."""
    if cap < 2:
        raise ValueError(f"the seed cap must be >= 2, got {cap}")
    if family < 1:
        raise ValueError(f"a claim's Holm family has at least 1 member, got {family}")
    item_se = item_se if math.isfinite(item_se) and item_se > 0 else 0.0
    side = sided(kind)

    def mde_at(n: int) -> float:
        spread = math.sqrt(sd * sd + n * item_se * item_se)
        return minimal_detectable(spread, n, sided=side, alpha=plan_alpha(side) / family)

    def plan(n: int, mde: float, underpowered: bool) -> Plan:
        return Plan(sd, pilot_n, target, n, cap, mde, underpowered, family, item_se)

    if not math.isfinite(target) or not math.isfinite(sd):
        return plan(cap, mde_at(cap), True)
    if sd <= ZERO_SD:
        # identical per-seed effects on a few seeds say nothing about the spread the
        # confirmatory run will see (a discrete metric, a saturated one): run at the cap
        return plan(cap, 0.0, False)
    for n in range(min(MIN_SEEDS, cap), cap + 1):
        mde = mde_at(n)
        if mde <= target:
            return plan(n, mde, False)
    return plan(cap, mde_at(cap), True)


def _sd(values: Sequence[float]) -> float:
    if len(values) < 2:
        return math.nan
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def study_seeds(plans: Sequence[Plan], floor: int = MIN_SEEDS) -> int:
    """The confirmatory run's seeds: the most any plan asks, at least ``floor``
    (``MIN_SEEDS``). A plan underpowered by its pilot asks for its cap: its label stays
    "underpowered" unless the interval decides anyway (significant, equivalent, or the paper's
    effect excluded), and a control that needs more than the cap separates, if at all, only
    at the most seeds the study may spend."""
    return max([floor, *(p.n for p in plans)])


def control_sd(
    effects: Mapping[float, Mapping[int, float]], dose: float | None
) -> tuple[float, int]:
    """The control's per-seed SD near ``dose``, from a pilot's scan (``effects``: dose -> seed
    -> effect): the SD pooled over the scanned doses that bracket ``dose`` (the nearest one
    where ``dose`` lies outside the scan; the largest when ``dose`` is None: no dose reached
    the target, so the control runs at its largest). Returns (SD, the seeds it pools); (nan, n)
    when fewer than two seeds share a dose."""
    sd, seeds, _ = _pooled_sd(effects, dose)
    return sd, seeds


def _pooled_sd(
    effects: Mapping[float, Mapping[int, float]], dose: float | None
) -> tuple[float, int, int]:
    """``control_sd`` and the pooled SD's degrees of freedom."""
    doses = sorted(d for d in effects if len(effects[d]) > 0)
    if not doses:
        return math.nan, 0, 0
    if dose is None:
        near = [doses[-1]]
    else:
        below = [d for d in doses if d <= dose]
        above = [d for d in doses if d >= dose]
        near = sorted({*(below[-1:]), *(above[:1])})
    squares, df, seeds = 0.0, 0, 0
    for d in near:
        values = [float(v) for v in effects[d].values() if math.isfinite(float(v))]
        seeds += len(values)
        if len(values) < 2:
            continue
        mean = math.fsum(values) / len(values)
        squares += math.fsum((v - mean) ** 2 for v in values)
        df += len(values) - 1
    return (math.sqrt(squares / df) if df > 0 else math.nan), seeds, df


def chi2_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of the chi-square distribution on ``df`` degrees of freedom (its CDF,
    the regularised lower incomplete gamma ``P(df/2, x/2)``, inverted by bisection)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"chi2_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")

    def cdf(x: float) -> float:
        a = torch.tensor(df / 2.0, dtype=torch.float64)
        return float(torch.special.gammainc(a, torch.tensor(x / 2.0, dtype=torch.float64)))

    low, high = 0.0, float(df)
    while cdf(high) < p:
        high *= 2.0
    for _ in range(100):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return 0.5 * (low + high)


def sd_upper_limit(sd: float, df: int, confidence: float = CONTROL_SD_CONFIDENCE) -> float:
    """The one-sided ``confidence`` upper limit of a normal SD estimated as ``sd`` on ``df``
    degrees of freedom: ``sd sqrt(df / chi2_{1 - confidence}(df))`` (``(df) s^2 / sigma^2``
    is chi-square on ``df``). nan where there is no SD to bound."""
    if not math.isfinite(sd) or df < 1:
        return math.nan
    return sd * math.sqrt(df / chi2_quantile(1.0 - confidence, df))


def plan_control(
    effects: Mapping[float, Mapping[int, float]],
    dose: float | None,
    size: float,
    cap: int = 10,
    confidence: float = CONTROL_SD_CONFIDENCE,
) -> Plan:
    """The seeds a calibrated control needs to separate (module docstring): ``plan_for_sd`` for
    a superiority effect of the claim's ``size`` at the ``confidence`` upper limit of the
    control's pilot SD near ``dose`` (``control_sd``, ``sd_upper_limit``; ``confidence`` 0
    plans at the point estimate). The plan keeps the pilot's SD as ``pilot_sd`` and the limit
    as ``planned_sd``."""
    sd, n, df = _pooled_sd(effects, dose)
    if confidence <= 0 or not math.isfinite(sd) or sd <= ZERO_SD:
        return plan_for_sd(sd, n, kind=SUPERIORITY, paper_effect=size, cap=cap)
    upper = sd_upper_limit(sd, df, confidence)
    plan = plan_for_sd(upper, n, kind=SUPERIORITY, paper_effect=size, cap=cap)
    return dataclasses.replace(plan, pilot_sd=sd, planned_sd=upper)


def in_holm_family(role: str, precondition: str | None, regime: str | None) -> bool:
    """Whether a claim is one of its study's tested hypotheses: a primary or secondary claim
    whose precondition holds and whose mechanism is present. Precondition and regime claims
    (and claims blocked by either) are decided outside a test and do not cost the others
    power."""
    return role in TESTED_ROLES and precondition is None and regime is None


def across_bases(a: tuple[str, str], b: tuple[str, str]) -> tuple[str, str]:
    """The verdict of one claim decided on two disjoint seed bases, each as (class, text): the
    shared verdict where both classes agree (``a``'s text); otherwise ``UNSTABLE``, whatever
    the two labels are ("holds" on one base and "underpowered" on the other is a flip too: the
    label underpowered comes from the plan, so it cannot absorb a disagreement)."""
    if a[0] == b[0]:
        return a
    return UNSTABLE, f"{UNSTABLE} (one base: {a[1]}; the other: {b[1]})"


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (pool adjacent
    violators): a dose-response scan's noise must not make a larger handicap look smaller."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * int(c)
    return out


def dose_for_effect(
    doses: Sequence[float], effects: Sequence[float], target: float
) -> float | None:
    """The handicap dose whose effect equals ``target`` (the claim's size), from a pilot's scan:
    ``effects[i]`` the control's mean effect at ``doses[i]`` (oriented: a larger handicap, a
    larger effect). The scan is fitted monotone (``isotonic``) and the crossing of ``target``
    interpolated between the bracketing doses: in log effect where both bracketing effects are
    positive, linearly otherwise (from 0 effect at dose 0 when the first dose already exceeds
    it, where the response is known to pass through the origin).

    Why log: a handicap's cost usually grows faster than its dose over a scan (a little label
    noise costs almost nothing, more costs more than in proportion), and on such a convex
    response the chord of a linear interpolation lies above the curve, so the linear dose
    undershoots: its effect falls short of the target and the control, planned for the target,
    misses. An exponential segment through the two bracketing effects is convex; where the
    response is concave it overshoots instead, towards a control somewhat larger than the
    claim's size, which separates more easily rather than less. None when no dose reaches the
    target: that control cannot show an effect of the claim's size and must be replaced."""
    if len(doses) != len(effects) or not doses:
        raise ValueError("dose_for_effect needs one effect per dose")
    pairs = sorted((float(d), float(e)) for d, e in zip(doses, effects, strict=True))
    ds = [0.0] + [d for d, _ in pairs] if pairs[0][0] > 0 else [d for d, _ in pairs]
    es = isotonic(([0.0] if pairs[0][0] > 0 else []) + [e for _, e in pairs])
    if es[-1] < target:
        return None
    for i in range(1, len(ds)):
        if es[i] >= target:
            if es[i] == es[i - 1]:
                return ds[i]
            if es[i - 1] > 0 and target > 0:
                share = math.log(target / es[i - 1]) / math.log(es[i] / es[i - 1])
            else:
                share = (target - es[i - 1]) / (es[i] - es[i - 1])
            return ds[i - 1] + max(0.0, min(1.0, share)) * (ds[i] - ds[i - 1])
    return ds[0]


__all__ = [
    "ALPHA",
    "CONTROL_SD_CONFIDENCE",
    "EQUIVALENCE",
    "KINDS",
    "MIN_SEEDS",
    "NON_INFERIORITY",
    "POWER",
    "SUPERIORITY",
    "UNSTABLE",
    "Plan",
    "across_bases",
    "chi2_quantile",
    "control_sd",
    "dose_for_effect",
    "in_holm_family",
    "isotonic",
    "minimal_detectable",
    "noncentral_t_cdf",
    "plan_claim",
    "plan_control",
    "plan_for_sd",
    "planning_target",
    "power",
    "sd_upper_limit",
    "sided",
    "study_seeds",
]
