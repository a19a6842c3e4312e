"""Studies: the verdict rule on hand-made numbers, the machinery, each study tiny, the generator."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from curvalign.errors import InputError
from curvalign.stats import Interval, mean_interval, paired_difference
from curvalign_lab import kit
from curvalign_lab.records import ClaimResult, StudyResult

# --- the verdict rule, every outcome (hand-made numbers) -------------------------------------

# a calibrated control that separated: above 0 and 20 points on average
MOVED = paired_difference([0.30, 0.32, 0.35], [0.10, 0.12, 0.11])
STILL = paired_difference([0.30, 0.12, 0.35], [0.31, 0.30, 0.20])  # contains 0
WRONG_SIGN = paired_difference([0.10, 0.12, 0.11], [0.30, 0.32, 0.35])  # separated, wrong way
CLEAR_GAIN = paired_difference([0.50, 0.52, 0.55], [0.40, 0.41, 0.43])  # +11 points, tight


def test_holds_when_the_interval_is_above_zero_and_the_control_separated():
    assert CLEAR_GAIN.low > 0 and MOVED.low > 0
    v = kit.decide(CLEAR_GAIN, MOVED)
    assert (v.kind, v.text) == (kit.HOLDS, kit.HOLDS)


def test_does_not_hold_when_the_interval_is_below_zero():
    effect = paired_difference([0.40, 0.41, 0.43], [0.50, 0.52, 0.55])
    assert kit.decide(effect, MOVED).kind == kit.DOES_NOT_HOLD


def test_inconclusive_when_the_interval_contains_the_threshold():
    effect = paired_difference([0.50, 0.40, 0.55], [0.45, 0.47, 0.50])
    assert effect.low < 0 < effect.high
    v = kit.decide(effect, MOVED)
    assert v.kind == kit.INCONCLUSIVE_KIND and v.text == kit.INCONCLUSIVE


def test_control_is_checked_for_sign_and_size_not_only_excluding_zero():
    # the claim's interval is clear, but the control does not separate: never holds
    assert not STILL.excludes_zero()
    assert kit.decide(CLEAR_GAIN, STILL).text == kit.UNDETECTABLE
    assert kit.decide(CLEAR_GAIN, None).text == kit.UNDETECTABLE
    # excluding 0 on the wrong side is a failed control now (it passed the old rule)
    assert WRONG_SIGN.excludes_zero()
    assert kit.decide(CLEAR_GAIN, WRONG_SIGN).text == kit.UNDETECTABLE
    # right sign, but its half-width (5.7 points) is not below the claim's size (5 points): at
    # this noise an effect of the claim's size would not separate, so it fails
    assert kit.decide(CLEAR_GAIN, MOVED, control_min=0.05).text == kit.UNDETECTABLE
    # half-width below the claim's size: it separates, whatever its mean against the size
    assert kit.decide(CLEAR_GAIN, MOVED, control_min=0.06).kind == kit.HOLDS
    assert kit.decide(CLEAR_GAIN, MOVED, control_min=0.25).kind == kit.HOLDS


def test_equivalent_within_delta_by_tost():
    # per-seed differences around 0 with SD ~0.2 points: the 90% interval is inside ±1 point
    tiny = mean_interval([0.001, -0.002, 0.0015, -0.001, 0.0005])
    assert tiny.low < 0 < tiny.high
    v = kit.decide(tiny, MOVED, delta=0.01)
    assert v.kind == kit.EQUIVALENT and "±1" in v.text
    # the same numbers with a margin the interval does not fit in: not equivalent
    assert kit.decide(tiny, MOVED, delta=0.001).kind == kit.INCONCLUSIVE_KIND
    # an equivalence needs a metric that can see an effect: no control, no equivalence
    assert kit.decide(tiny, None, delta=0.01).kind == kit.INCONCLUSIVE_KIND


def test_equivalence_is_never_granted_below_the_claims_own_level():
    from curvalign.stats import t_test_p, tost_interval

    # a non-inferiority claim (margin 2 points) with SD 1.8 points on 5 seeds: its 90% interval
    # fits inside ±2, its 95% interval does not, and its own test (p 0.07) fails; calling it
    # "equivalent", the stronger statement, would grant at 90% what the claim was refused at 95%
    wide = mean_interval([-0.0228, -0.0114, 0.0, 0.0114, 0.0228])
    low90, high90 = tost_interval(wide, alpha=0.05)
    assert -0.02 < low90 and high90 < 0.02
    assert wide.low < -0.02 and t_test_p(wide, -0.02) > 0.05
    verdict = kit.decide(wide, MOVED, threshold=-0.02, delta=0.02)
    assert verdict.kind == kit.INCONCLUSIVE_KIND
    # SD 1.3 points: the 95% interval fits, so alone it is non-inferior (p 0.026)
    tight = mean_interval([-0.0164, -0.0082, 0.0, 0.0082, 0.0164])
    assert -0.02 < tight.low and tight.high < 0.02 and 0.02 < t_test_p(tight, -0.02) < 0.05
    alone = kit.claim_record("kept", tight, MOVED, "c", threshold=-0.02, delta=0.02)
    assert alone.verdict == kit.HOLDS
    # in a Holm family of 3 its test fails (0.026 > 0.05/3), and its equivalence is read at
    # the family's level too: the 1 - 0.05/3 interval is wider than ±2, so not "equivalent"
    others = [kit.claim_record(k, mean_interval([0.1, -0.1, 0.05]), MOVED, "c") for k in "ab"]
    family = kit.apply_holm([alone, *others])
    assert family[0].holm_family == 3 and family[0].holm_significant is False
    assert family[0].holm_verdict == kit.INCONCLUSIVE_KIND
    low, high = tost_interval(tight, alpha=0.025 / 3)
    assert low < -0.02 < high
    # a family of one reads the 95% interval: equivalent, and the text names that level
    solo = kit.decide(tight, MOVED, threshold=-0.02, delta=0.02, significant=False)
    assert solo.kind == kit.EQUIVALENT and "95% interval" in solo.text
    # a family tested at a stricter level reads its equivalence at that level too
    strict = kit.apply_holm([alone], alpha=0.01)
    assert strict[0].holm_significant is False and strict[0].holm_verdict != kit.EQUIVALENT
    assert tost_interval(tight, alpha=0.005)[0] < -0.02
    with pytest.raises(ValueError, match="family"):
        kit.decide(tight, MOVED, delta=0.02, family=0)


UNDER_PLAN = {"underpowered": True, "cap": 10, "reason": "MDE 5 at the cap of 10 seeds"}
POWERED_PLAN = {"underpowered": False, "cap": 10, "reason": "4 seeds give MDE 1.9 <= 2"}


def test_underpowered_comes_from_the_plan_never_from_the_runs_own_sd():
    # seed SD ~ 8 points: at 3 seeds the run's own MDE is ~29 points, the paper claims 2; with
    # no plan that is not a verdict of "underpowered" (the run's SD cannot judge itself)
    noisy = mean_interval([0.10, -0.05, 0.08])
    assert kit.decide(noisy, MOVED, paper_effect=0.02).text == kit.INCONCLUSIVE
    v = kit.decide(noisy, MOVED, paper_effect=0.02, plan=UNDER_PLAN)
    assert v.kind == kit.UNDERPOWERED and "by plan" in v.text and "n > 10" in v.text
    # a powered plan: the same interval contains the paper's effect, so plain inconclusive
    assert kit.decide(noisy, MOVED, paper_effect=0.02, plan=POWERED_PLAN).text == kit.INCONCLUSIVE
    # a clear effect is decided even when the plan says the design is weak
    assert kit.decide(CLEAR_GAIN, MOVED, paper_effect=0.001, plan=UNDER_PLAN).kind == kit.HOLDS
    # a powered plan whose interval lies below the paper's effect: the effect is excluded
    flat = mean_interval([0.001, -0.002, 0.0])
    v = kit.decide(flat, MOVED, paper_effect=0.02, plan=POWERED_PLAN)
    assert v.kind == kit.DOES_NOT_HOLD and "paper's effect (2) is excluded" in v.text


def test_underpowered_says_when_the_control_did_not_separate_either():
    noisy = mean_interval([0.10, -0.05, 0.08])
    v = kit.decide(noisy, STILL, paper_effect=0.02, control_min=0.02, plan=UNDER_PLAN)
    assert v.kind == kit.UNDERPOWERED and v.text.endswith(kit.CONTROL_FAILED)
    # a control too wide for the claim's size (half-width 5.7 points against 5) is named the same
    v = kit.decide(noisy, MOVED, paper_effect=0.02, control_min=0.05, plan=UNDER_PLAN)
    assert v.kind == kit.UNDERPOWERED and kit.CONTROL_FAILED in v.text
    # with a control that separated the text is the plain underpowered one
    v = kit.decide(noisy, MOVED, paper_effect=0.02, plan=UNDER_PLAN)
    assert kit.CONTROL_FAILED not in v.text


def test_verdict_across_two_seed_bases():
    holds, fails = kit.Verdict(kit.HOLDS, kit.HOLDS), kit.Verdict(kit.DOES_NOT_HOLD, "does not")
    under = kit.Verdict(kit.UNDERPOWERED, "underpowered by plan (n > 10)")
    inconclusive = kit.Verdict(kit.INCONCLUSIVE_KIND, kit.INCONCLUSIVE)
    assert kit.across_seed_bases(holds, holds) == holds
    # the same class with different numbers in the text is an agreement (base A's text kept)
    other = kit.Verdict(kit.UNDERPOWERED, "underpowered by plan (n > 12)")
    assert kit.across_seed_bases(under, other) == under
    # holds on one base, underpowered on the other: a flip, shown as a flip
    for a, b in ((holds, under), (under, fails), (holds, inconclusive), (holds, fails)):
        flip = kit.across_seed_bases(a, b)
        assert flip.kind == kit.UNSTABLE and a.text in flip.text and b.text in flip.text


def test_lr_grid_climb_finds_an_interior_optimum_on_hand_made_curves():
    grid = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
    calls: list[float] = []

    def curve(values):
        table = dict(zip(grid, values, strict=True))

        def score(lr):
            calls.append(lr)
            return table[lr]

        return score

    # peak at 1e-2, above the start: scores the start's neighbours, then one step up
    chosen, seen = kit.climb_grid(grid, 3e-3, curve([0.1, 0.2, 0.3, 0.4, 0.35]))
    assert chosen == 1e-2 and list(seen) == [1e-3, 3e-3, 1e-2, 3e-2]
    assert kit.grid_interior(grid, chosen) and len(calls) == 4
    # peak at the start: three runs only
    calls.clear()
    chosen, seen = kit.climb_grid(grid, 3e-3, curve([0.1, 0.2, 0.5, 0.4, 0.3]))
    assert chosen == 3e-3 and len(calls) == 3 and list(seen) == [1e-3, 3e-3, 1e-2]
    # rising to the top: the top is chosen and is not interior (an edge, said as such)
    chosen, _ = kit.climb_grid(grid, 3e-3, curve([0.1, 0.2, 0.3, 0.4, 0.5]))
    assert chosen == 3e-2 and not kit.grid_interior(grid, chosen)
    # falling: walks down to the bottom
    chosen, seen = kit.climb_grid(grid, 3e-3, curve([0.5, 0.4, 0.3, 0.2, 0.1]))
    assert chosen == 3e-4 and 3e-2 not in seen
    # a diverged run (nan) is -inf, never chosen; equal scores: the lower rate
    chosen, seen = kit.climb_grid(grid, 3e-3, curve([0.1, 0.3, 0.3, math.nan, 0.9]))
    assert chosen == 1e-3 and seen[1e-2] == -math.inf
    # a two-point grid: both are scored, neither is interior
    chosen, seen = kit.climb_grid((1e-3, 3e-3), 3e-3, lambda lr: lr)
    assert chosen == 3e-3 and len(seen) == 2 and not kit.grid_interior((1e-3, 3e-3), chosen)


def test_mde_is_the_exact_noncentral_t_one():
    from curvalign.stats import interval_sd, minimal_detectable_effect, sample_sd
    from curvalign_lab import rules

    values = [0.10, -0.05, 0.08]
    iv = mean_interval(values)
    assert interval_sd(iv) == pytest.approx(sample_sd(values))
    exact = kit.minimal_detectable(iv)
    assert exact == pytest.approx(rules.minimal_detectable(sample_sd(values), 3))
    # at that effect the two-sided paired t test has 80% power (by construction) ...
    assert rules.power(exact, sample_sd(values), 3) == pytest.approx(0.8, abs=1e-9)
    # ... and the textbook shifted-central-t formula is about 5% too small at 3 seeds
    approx = minimal_detectable_effect(sample_sd(values), 3)
    assert 1.03 < exact / approx < 1.08


def test_not_reproduced_in_this_regime_wins_over_everything():
    v = kit.decide(CLEAR_GAIN, MOVED, regime="encoder training absent")
    assert v.kind == kit.NOT_REPRODUCED and "encoder training absent" in v.text
    v = kit.decide(CLEAR_GAIN, MOVED, precondition="lambda_E/lambda_H = 1.1, need > 2")
    assert v.kind == kit.NOT_REPRODUCED and "precondition not met" in v.text


def test_too_short_is_inconclusive_whatever_the_numbers():
    assert kit.decide(CLEAR_GAIN, MOVED, budget_ok=False).text == kit.TOO_SHORT
    assert kit.decide(CLEAR_GAIN, STILL, budget_ok=False).kind == kit.INCONCLUSIVE_KIND


def test_non_inferiority_threshold():
    small_drop = mean_interval([-0.005, -0.010, -0.008])  # within a 0.02 margin
    big_drop = mean_interval([-0.10, -0.12, -0.09])
    assert kit.decide(small_drop, MOVED, threshold=-0.02).kind == kit.HOLDS
    assert kit.decide(big_drop, MOVED, threshold=-0.02).kind == kit.DOES_NOT_HOLD
    assert kit.decide(small_drop, MOVED, threshold=0.0).kind == kit.DOES_NOT_HOLD


def test_every_verdict_class_is_reachable():
    reached = {
        kit.decide(CLEAR_GAIN, MOVED).kind,
        kit.decide(paired_difference([0.40, 0.41, 0.43], [0.50, 0.52, 0.55]), MOVED).kind,
        kit.decide(mean_interval([0.001, -0.002, 0.0015, -0.001]), MOVED, delta=0.01).kind,
        kit.decide(mean_interval([0.10, -0.05, 0.08]), MOVED).kind,
        kit.decide(
            mean_interval([0.10, -0.05, 0.08]), MOVED, paper_effect=0.02, plan=UNDER_PLAN
        ).kind,
        kit.decide(CLEAR_GAIN, MOVED, regime="x").kind,
    }
    assert reached == set(kit.VERDICTS)


def test_claim_record_carries_intervals_power_and_the_paper_effect():
    effect = Interval(0.05, 0.01, 0.09, 3)
    rec = kit.claim_record(
        "x beats y",
        effect,
        MOVED,
        "control - x",
        paper_effect=0.02,
        paper_source="seed 003, Sec. 4",
        control_min=0.2,
    )
    assert rec.verdict == kit.HOLDS and rec.outcome == kit.HOLDS
    assert rec.effect == effect and "[1.00, 9.00]" in rec.effect_text
    assert rec.control is not None and rec.control.n == 3 and rec.control_what == "control - x"
    assert rec.control_ok and "half-width below the claim's size 20" in rec.control_text
    assert rec.paper_effect_text == "2 points (seed 003, Sec. 4)"
    assert rec.mde == pytest.approx(kit.minimal_detectable(effect))
    assert 0 < rec.p_value < 0.05
    data = rec.to_json()
    assert data["effect"] == effect.as_dict() and data["inputs"]["plan"] is None
    # not yet Holm-corrected: no Holm keys, and the record reads back equal
    assert "holm_verdict" not in data and "holm_family" not in data
    assert ClaimResult.from_json(json.loads(json.dumps(data))) == rec


def test_a_calibrated_control_separates_when_the_claims_size_would_separate_at_its_noise():
    """The pilot doses the control to the claim's size, so the confirmatory control is about that
    size: it separates when its interval is above 0 and its half-width below the size (a mean a
    little below the size included, which "mean >= size" made a coin toss); a large control
    with a wide interval (31 [26, 36] points against a 2-point claim) separates at any noise
    and fails; one that does not leave 0 fails."""
    size = 0.02
    assert kit.control_separates(Interval(0.019, 0.012, 0.026, 6), size)  # just under the size
    assert kit.control_separates(Interval(0.010, 0.004, 0.016, 6), size)  # smaller, detected
    assert kit.control_separates(Interval(0.03, 0.029, 0.031, 4), size)  # larger, but tight
    assert not kit.control_separates(Interval(0.31, 0.26, 0.36, 3), size)  # wide: says nothing
    assert not kit.control_separates(Interval(0.02, -0.01, 0.05, 3), size)  # not detected
    assert not kit.control_separates(None, size)
    # a claim without a size: the sign alone
    assert kit.control_separates(Interval(0.31, 0.26, 0.36, 3), 0.0)


def _older_run(control: Interval, power_plan=None) -> StudyResult:
    """A run recorded under an earlier rule: one calibrated claim (size 2 points) decided
    "holds" whatever its control showed, and one claim the control does not calibrate."""
    effect = Interval(0.05, 0.03, 0.07, 3)
    claims = []
    for key, size in (("calibrated", 0.02), ("other", 0.0)):
        rec = kit.claim_record(key, effect, control, "c", paper_effect=0.02, control_min=size)
        claims.append(
            dataclasses.replace(rec, key=key, verdict=kit.HOLDS, outcome=kit.HOLDS, control_ok=True)
        )
    return StudyResult(
        name="older",
        paper="p",
        setup="s",
        claims=tuple(kit.apply_holm(claims)),
        verdict="",
        holds=True,
        seeds=(0, 1, 2),
        rule="an earlier rule",
        power_plan=power_plan,
    )


def test_redecide_keeps_a_result_of_this_rule_and_applies_it_to_an_older_one():
    # a control far larger than the claim, and wide: it separates from 0 but says nothing
    # about an effect of 2 points (half-width 5 points)
    older = _older_run(Interval(0.31, 0.26, 0.36, 3))
    once = kit.redecide(older)
    assert kit.redecide(once) == once and once.rule == kit.RULE
    for before, after in zip(older.claims, once.claims, strict=True):
        assert after.control_ok == kit.control_separates(after.control, after.inputs.control_min)
        assert (after.effect, after.control, after.p_value) == (
            before.effect,
            before.control,
            before.p_value,
        )
    calibrated, other = once.claims
    assert not calibrated.control_ok and calibrated.outcome == kit.UNDETECTABLE
    # the claim it does not calibrate needs only its sign
    assert other.control_ok and other.verdict == kit.HOLDS


def test_redecide_reads_the_controls_plan_from_the_power_plan_of_an_older_run():
    from curvalign_lab import rules
    from curvalign_lab.records import PlanRecord, PowerPlan

    beyond = rules.plan_control({0.5: {0: -0.1, 1: 0.02, 2: 0.14}}, 0.5, 0.02, cap=6)
    plan = PowerPlan(
        per_claim={},
        seeds=3,
        max_seeds=6,
        pilot_seeds=3,
        out_of_budget=(),
        pilot_wall_s=0.0,
        controls={"calibrated": PlanRecord.from_plan(beyond, kind="control")},
    )
    failed = Interval(0.018, -0.001, 0.036, 3)  # not above 0
    older = _older_run(failed, plan)
    assert all(c.inputs.control_plan is None for c in older.claims)
    once = kit.redecide(older)
    calibrated, other = once.claims
    assert (
        not calibrated.control_ok and calibrated.inputs.control_plan == plan.controls["calibrated"]
    )
    assert (
        calibrated.verdict == kit.UNDERPOWERED and "its control needs n > 6" in calibrated.outcome
    )
    # the plan belongs to the claim the control calibrates, not to the others sharing it
    assert other.inputs.control_plan is None and other.outcome == kit.UNDETECTABLE
    # written with its plan, it is read and decided again the same way
    assert kit.redecide(once) == once
    assert StudyResult.from_json(json.loads(json.dumps(once.to_json()))) == once


# --- statistics behind the rule, on hand-made numbers -----------------------------------------


def test_t_distribution_against_tables():
    from curvalign.stats import t_cdf, t_quantile, t_quantile_975

    # t_{0.975, df} from the tables the intervals use, t_{0.95, 2} = 2.919986, t_{0.95, 4} =
    # 2.131847 (standard tables)
    for df in (1, 2, 5, 12, 30):
        assert t_cdf(t_quantile_975(df), df) == pytest.approx(0.975, abs=1e-6)
    assert t_quantile(0.95, 2) == pytest.approx(2.919986, abs=1e-5)
    assert t_quantile(0.95, 4) == pytest.approx(2.131847, abs=1e-5)
    assert t_cdf(0.0, 3) == pytest.approx(0.5)
    assert t_cdf(-1.0, 1) == pytest.approx(0.25)  # Cauchy: 1/2 + atan(-1)/pi


def test_paired_t_p_value():
    from curvalign.stats import t_test_p

    # differences 0.10, 0.11, 0.12: mean 0.11, sd 0.01, t = 0.11 / (0.01/sqrt 3) = 19.05, df 2:
    # two-sided p = 2 * (1 - F(19.05)) = 0.002743
    iv = paired_difference([0.5, 0.52, 0.55], [0.40, 0.41, 0.43])
    assert t_test_p(iv) == pytest.approx(0.0027435, rel=1e-3)
    assert t_test_p(iv, threshold=0.11) == pytest.approx(1.0)
    # the 95% interval excludes 0 exactly when p < 0.05
    for values in ([0.1, -0.05, 0.08], [0.02, 0.03, 0.01, 0.025], [0.01, -0.01, 0.0]):
        iv = mean_interval(values)
        assert iv.excludes_zero() == (t_test_p(iv) < 0.05)
    assert math.isnan(t_test_p(mean_interval([0.3])))


def test_holm_step_down():
    from curvalign.stats import holm

    # m = 3: 0.01 <= 0.05/3 rejected; 0.03 > 0.05/2 stops there, so 0.04 is not rejected either
    assert holm([0.01, 0.04, 0.03]) == [True, False, False]
    # 0.01 <= 0.0167, 0.02 <= 0.025, 0.03 <= 0.05: all rejected (Bonferroni would keep only 1)
    assert holm([0.03, 0.01, 0.02]) == [True, True, True]
    assert holm([0.2, float("nan"), 0.001]) == [False, False, True]
    assert holm([]) == []


def test_holm_changes_the_verdicts_table():
    # two claims each "holds" alone at p = 0.034; under Holm (0.034 > 0.05/2) neither survives,
    # while the claim with p = 0.0027 (< 0.05/3) does
    def rec(values, name):
        return kit.claim_record(name, mean_interval(values), MOVED, "c")

    claims = [
        rec([0.02, 0.04, 0.035], "a"),  # p = 0.034
        rec([0.10, 0.11, 0.12], "strong"),  # p = 0.0027
        rec([0.04, 0.02, 0.035], "b"),
    ]
    assert all(c.verdict == kit.HOLDS for c in claims)
    claims = kit.apply_holm(claims)
    assert [c.holm_verdict for c in claims] == [
        kit.INCONCLUSIVE_KIND,
        kit.HOLDS,
        kit.INCONCLUSIVE_KIND,
    ]
    assert claims[0].holm_outcome == kit.NOT_SIGNIFICANT
    assert all(c.holm_family == 3 for c in claims)
    # the verdict before Holm is kept beside the Holm-adjusted one
    assert claims[0].verdict == kit.HOLDS and claims[0].final_verdict == kit.INCONCLUSIVE_KIND
    # a claim not testable in this regime is outside the family
    claims.append(
        kit.claim_record("r", mean_interval([0.1, 0.2, 0.3]), MOVED, "c", regime="no encoder")
    )
    claims = kit.apply_holm(claims)
    assert claims[-1].holm_verdict == kit.NOT_REPRODUCED and claims[0].holm_family == 3
    # so is a claim whose precondition is not met, and a precondition claim itself (decided by
    # its own interval, not costing the others power)
    claims.append(
        kit.claim_record("p", mean_interval([0.1, 0.2, 0.3]), MOVED, "c", precondition="shut")
    )
    claims.append(
        kit.claim_record("gate", mean_interval([0.10, 0.11, 0.12]), MOVED, "c", role="precondition")
    )
    claims = kit.apply_holm(claims)
    assert claims[0].holm_family == 3 and "holm_family" not in claims[-1].to_json()
    assert claims[-1].holm_significant is None
    assert claims[-2].holm_verdict == kit.NOT_REPRODUCED
    assert claims[-1].holm_verdict == kit.HOLDS


def test_seeds_for_effect_and_the_pilot_plan():
    from curvalign.stats import minimal_detectable_effect, seeds_for_effect
    from curvalign_lab import rules

    n = seeds_for_effect(0.05, 0.04)
    assert minimal_detectable_effect(0.05, n) <= 0.04 < minimal_detectable_effect(0.05, n - 1)
    assert seeds_for_effect(0.05, 0.001, max_seeds=20) is None
    assert seeds_for_effect(0.0, 0.01) == 2
    pilot = [
        kit.claim_record("big", mean_interval([0.10, 0.15, 0.12]), MOVED, "c", paper_effect=0.1),
        kit.claim_record("small", mean_interval([0.01, 0.03, 0.0]), MOVED, "c", paper_effect=0.02),
        kit.claim_record("tiny", mean_interval([0.2, -0.2, 0.1]), MOVED, "c", paper_effect=1e-3),
        kit.claim_record("none", mean_interval([0.2, -0.2, 0.1]), MOVED, "c"),
        # non-inferiority (threshold -margin): planned against the distance to the margin
        kit.claim_record(
            "flat",
            mean_interval([-0.01, 0.0, -0.005]),
            MOVED,
            "c",
            threshold=-0.02,
            paper_effect=-0.0055,
        ),
        # a precondition claim is not planned (and is outside the Holm family)
        kit.claim_record(
            "pre",
            mean_interval([0.2, -0.2, 0.1]),
            MOVED,
            "c",
            paper_effect=1e-3,
            role="precondition",
        ),
    ]
    plan = kit.plan_seeds(pilot, max_seeds=12)
    small_sd = kit.interval_sd(mean_interval([0.01, 0.03, 0.0]))
    # five claims form the Holm family (the one without a paper effect counts, the precondition
    # claim does not), so each plan is made at Holm's first level, 0.05 / 5
    small = rules.plan_for_sd(small_sd, 3, kind="superiority", paper_effect=0.02, cap=12, family=5)
    assert plan["per_claim"]["small"].n == small.n and not small.underpowered
    assert plan["per_claim"]["small"].family == 5 and "Holm's level for 5" in small.reason
    assert rules.minimal_detectable(small_sd, small.n, alpha=0.01) <= 0.02
    assert rules.minimal_detectable(small_sd, small.n - 1, alpha=0.01) > 0.02
    alone = rules.plan_for_sd(small_sd, 3, kind="superiority", paper_effect=0.02, cap=12)
    assert alone.n < small.n and alone.family == 1 and "Holm" not in alone.reason
    flat = plan["per_claim"]["flat"]
    assert flat.kind == "non-inferiority" and flat.target == pytest.approx(0.0145)
    # the run takes the most seeds any plan asks, the cap for the underpowered "tiny"
    assert plan["seeds"] == max(p.n for p in plan["per_claim"].values()) == 12
    assert plan["out_of_budget"] == ["tiny"]
    assert "none" not in plan["per_claim"] and "pre" not in plan["per_claim"]
    # the plan, not the run, says "underpowered"; re-deciding keeps every other field
    tiny = kit.with_plan(pilot[2], plan["per_claim"]["tiny"])
    assert tiny.verdict == kit.UNDERPOWERED and (tiny.planned_n_text or "").startswith("> 12")
    assert tiny.inputs.plan == tiny.plan == plan["per_claim"]["tiny"]
    assert tiny.effect == pilot[2].effect and pilot[2].verdict != kit.UNDERPOWERED
    assert tiny.to_json()["inputs"]["plan"]["kind"] == "superiority"


# --- machinery ---------------------------------------------------------------------------------


def test_convergence_plateau():
    assert kit.converged([(1, 0.1), (2, 0.3), (3, 0.305), (4, 0.3)], tol=0.01) is True
    # best at the last validation: never converged (curvalign.stats.curve_converged)
    assert kit.converged([(1, 0.1), (2, 0.3), (3, 0.305)], tol=0.01) is False
    assert kit.converged([(1, 0.1), (2, 0.2), (3, 0.4)], tol=0.01) is False
    assert kit.converged([(1, 0.1), (2, 0.2)], tol=0.01) is None


def test_spearman_with_ties():
    from curvalign_lab.common import spearman

    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x * 10) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    # ties get average ranks: y ranks (1.5, 1.5, 3, 4) against 1..4
    y = torch.tensor([0.0, 0.0, 1.0, 2.0])
    rx = torch.tensor([1.0, 2, 3, 4]) - 2.5
    ry = torch.tensor([1.5, 1.5, 3, 4]) - 2.5
    expected = float((rx * ry).sum() / (rx.square().sum() * ry.square().sum()).sqrt())
    assert spearman(x, y) == pytest.approx(expected)


def test_val_split_is_carved_from_train_only():
    from curvalign.data.synthetic import config_from_spec, make_world

    world = make_world(config_from_spec("images=200,text_pairs=0"))
    assert kit.with_val_split(world) is world  # the world's own val split is used as it is
    # a store with only train/test (e.g. a feature store) gets a seeded hold-out
    import dataclasses

    is_val = world.image_split == world.split_names.index("val")
    store = dataclasses.replace(
        world,
        image_split=torch.where(is_val, 0, world.image_split),
        split_names=["train", "test"],
    )
    split = kit.with_val_split(store, 0.1, seed=0)
    again = kit.with_val_split(store, 0.1, seed=0)
    assert split.split_names == ["train", "test", "val"]
    assert torch.equal(split.image_split, again.image_split)
    val = split.split_image_ids("val")
    assert len(val) >= 8
    assert set(val.tolist()) <= set(store.split_image_ids("train").tolist())
    assert torch.equal(split.split_image_ids("test"), store.split_image_ids("test"))
    assert kit.with_val_split(split) is split


def test_arms_train_on_until_the_plateau_up_to_the_max(tmp_path, one_thread):
    world = _tiny_world()

    def arm(tol: float, name: str) -> dict:
        bench = kit.Bench(
            tmp_path / name,
            world,
            "synthetic",
            4,
            ["batch_size=16"],
            val_every=1,
            plateau_tol=tol,
            max_steps=6,
        )
        assert bench.max_steps == 6
        return bench.train("clip", "clip", [], 0)

    # without max_steps the most an arm trains is MAX_STEPS_FACTOR x its budget
    default = kit.Bench(tmp_path / "d", world, "synthetic", 4, [], val_every=1)
    assert default.max_steps == int(4 * kit.MAX_STEPS_FACTOR) == 12

    flat = arm(1.0, "flat")  # any curve is flat within 1.0: stops at the budget
    assert flat.last_step == 4 and [s for s, _ in flat.val_history] == [1, 2, 3, 4]
    climbing = arm(-1.0, "climbing")  # never flat: trains on, one segment at a time, to the max
    assert climbing.last_step == 6 and [s for s, _ in climbing.val_history] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    assert climbing.converged is False and climbing.budget == 4


def _segmented_arm(bench, recipe, seed, marks, on_mark, store_from, steps, max_steps):
    """The pre-hooks Bench.train, written out as a reference: train to each stop with
    ``stop_at``, read the run back, validate it, resume with a new Trainer (more ``steps`` when
    the curve is not flat at the budget)."""
    from curvalign.runs import load_run
    from curvalign.train.trainer import train

    overrides = [*bench.overrides, *bench.lr_override(recipe, []), f"seed={seed}"]
    run_dir = bench.out / "reference"
    stops = sorted({*range(bench.val_every, steps, bench.val_every), *marks} | {steps})
    history, previous, target = [], 0, steps
    while stops:
        step = stops.pop(0)
        train(
            recipe,
            store_from(previous) or bench.store,
            run_dir,
            steps=target,
            overrides=overrides,
            overwrite=previous == 0,
            resume=previous > 0,
            show_progress=False,
            stop_at=step if step < target else None,
        )
        previous = step
        loaded = load_run(run_dir, weights="last")
        history.append((step, kit.val_score(loaded.recipe, bench.store)))
        if step == target and not kit.converged(history, bench.plateau_tol) and target < max_steps:
            target = min(max_steps, target + bench.val_every)
            stops.append(target)
        if step in marks:
            on_mark(step, loaded.recipe)
    return history, load_run(run_dir, weights="last")


def test_an_arm_in_one_fit_equals_the_old_stop_and_resume_cycle(tmp_path, one_thread):
    """Same validation values, extension, marks, data swap and weights as the segments through
    the disk that Bench.train ran before the trainer had hooks."""

    from safetensors.torch import load_file

    world = _tiny_world()
    bench = kit.Bench(
        tmp_path,
        world,
        "synthetic",
        6,
        ["batch_size=16"],
        val_every=2,
        plateau_tol=-1.0,
        max_steps=9,
    )
    swapped = bench.store.with_fields(text_features=bench.store.text_features.flip(0))

    def store_from(step):
        return swapped if step >= 3 else None

    marked: dict[str, dict[int, float]] = {"new": {}, "old": {}}

    def mark(which):
        return lambda step, recipe: marked[which].__setitem__(
            step, kit.val_score(recipe, bench.store)
        )

    arm = bench.train(
        "clip",
        "clip",
        [],
        0,
        marks=(3,),
        on_mark=mark("new"),
        store_from=store_from,
        select_best=False,
    )
    history, last = _segmented_arm(bench, "clip", 0, (3,), mark("old"), store_from, 6, 9)
    assert [s for s, _ in history] == [2, 3, 4, 6, 8, 9]  # never flat: extended to the max
    assert list(arm.val_history) == history and arm.last_step == 9
    assert marked["new"] == marked["old"] and list(marked["new"]) == [3]
    new_weights = load_file(str(arm.run_dir / "model.safetensors"))
    old_weights = load_file(str(last.run_dir / "model.safetensors"))
    assert all(torch.equal(new_weights[k], old_weights[k]) for k in new_weights)
    best = max(history, key=lambda item: item[1])
    assert arm.best_step == best[0] and arm.best_val == best[1]
    assert not (arm.run_dir / "study_best.safetensors").exists()  # one best-weights file


def test_study_learning_rate_is_a_stated_multiple_of_the_paper_rate(tmp_path):
    from curvalign.config import recipe_class, recipe_train_defaults

    bench = kit.Bench(tmp_path, _tiny_world(), "synthetic", 10, [], val_every=5)
    paper = recipe_train_defaults(recipe_class("proclip"))["lr"]
    assert bench.lr_override("proclip", []) == [f"lr={paper * kit.STUDY_LR_SCALE:g}"]
    assert bench.lr_override("proclip", ["lr=3e-3"]) == []  # a study's own lr wins
    assert bench.lr_override("proclip", ["train.lr=3e-3"]) == []  # in either spelling
    user = kit.Bench(tmp_path, _tiny_world(), "synthetic", 10, ["train.lr=0.01"], val_every=5)
    assert user.lr_override("proclip", []) == []  # the user's train.lr= is kept
    assert user.sets_lr("proclip", []) and not bench.sets_lr("proclip", [])
    assert f"{kit.STUDY_LR_SCALE:g}x the paper's" in bench.lr_text()
    assert f"paper {paper:g}" in bench.lr_text()
    assert (
        kit.Bench(tmp_path, _tiny_world(), "s", 10, [], val_every=5, lr_scale=1.0).lr_override(
            "proclip", []
        )
        == []
    )


# A small taxonomy: 4 families x 2**2 = 16 classes, 2 prompt templates (the default world has
# 108 classes x 4 templates). Every validation of a study arm evaluates zero-shot per class and
# per template, which was most of a tiny study's time; the studies' logic is the same.
SMALL_TREE = "depth=2,branching=2,templates=2"


def _tiny_world():
    from curvalign.data.synthetic import config_from_spec, make_world

    return make_world(config_from_spec(f"images=160,text_pairs=0,captions_max=3,{SMALL_TREE}"))


# --- each study tiny -----------------------------------------------------------------------------

TINY = f"synthetic:images=160,text_pairs=60,captions_max=3,{SMALL_TREE}"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16"]


def test_the_runner_runs_a_study_tiny_and_it_is_too_short(tmp_path, one_thread):
    """The runner's own checks at tiny size, on one study (the cheapest, with a learning-rate
    grid); every study's own file (tests/test_study_NAME.py) runs it through the runner at tiny
    size with a pilot and checks that its claims are too short there."""
    from curvalign_lab.runner import run_study

    name = "proclip-product"
    result = run_study(
        name,
        tmp_path / name,
        steps=4,
        seeds=2,
        seed_base=5,
        data=TINY,
        overrides=TINY_TRAIN,
        lr_grid=(1e-3, 3e-3),
    )
    assert result.claims
    for claim in result.claims:
        # 4 steps is below every study's need, unless the claim is not testable here at all
        assert claim.outcome == kit.TOO_SHORT or claim.verdict == kit.NOT_REPRODUCED
        assert claim.holm_verdict in kit.VERDICTS
        assert claim.effect.n in (0, 2)
        assert claim.mde_text and claim.paper_effect_text
    assert result.seeds == (5, 6) and result.wall_s > 0
    assert result.command is not None and "--seed-base 5" in result.command
    # every arm's learning rate came from the shared grid, chosen on validation
    assert result.lr_grid == (1e-3, 3e-3) and result.lr_choice
    for choice in result.lr_choice.values():
        assert choice.chosen in (1e-3, 3e-3) and len(choice.grid) == 2
    assert "Holm family" in result.markdown
    assert all(Path(f).exists() for f in result.figures)
    assert result.convergence and all(c.seeds == 2 for c in result.convergence.values())
    saved = json.loads((tmp_path / name / "study.json").read_text())
    assert saved["verdict"] == result.verdict and saved["command"].startswith("curvalign study")
    # the file is the record's JSON, and reads back as the same record
    assert saved == json.loads(json.dumps(result.to_json()))
    assert StudyResult.from_json(saved).to_json() == saved
    assert "Verdict rule" in (tmp_path / name / "study.md").read_text()


def test_results_page_is_generated_from_the_json(tmp_path, short_study):
    from curvalign_lab import results

    root, _ = short_study  # proclip-product, too short, with a learning-rate grid
    text = results.render(root)
    assert "## Verdicts" in text and "## proclip-product" in text
    assert kit.TOO_SHORT in text and "Wall time" in text
    # the verdicts table carries the paper's effect (its source in a footnote), the planned n
    # and the verdict in a few words, the whole reason in a footnote
    assert "| planned n |" in text and "| inconclusive: too short [^" in text
    assert "+2 to +7 R@1 points" in text
    # the studies that were not run are named, never silently missing
    assert "Studies not run for this page" in text and "`agr-curriculum`" in text
    assert results.main([str(tmp_path / "nothing-here")]) == 2
    copy = tmp_path / "docs"
    assert results.main([str(root), "--copy-to", str(copy)]) == 0
    assert (copy / "proclip-product" / "study.json").exists() and list(copy.glob("*.png"))
    assert results.render(copy) == text  # the committed JSON regenerates the same page
    page = tmp_path / "results.md"
    page.write_text("# old\nstale study\n## Demo\nbenchmark table\n")
    args = [str(copy), "--keep-from", str(page), "## Demo", "-o", str(page)]
    assert results.main(args) == 0
    new = page.read_text()
    assert new.startswith(text.rstrip("\n")) and new.endswith("## Demo\nbenchmark table\n")
    assert "stale study" not in new
    assert results.main([str(copy), "--keep-from", str(page), "## Nope"]) == 2
    # one page per study, linked from the table, instead of one long page
    index = tmp_path / "studies.md"
    assert results.main([str(copy), "--pages", str(copy), "-o", str(index)]) == 0
    assert "[proclip-product](proclip-product/study.md)" in index.read_text()
    assert "## proclip-product" not in index.read_text()
    own = (copy / "proclip-product" / "study.md").read_text()
    assert own.startswith("# proclip-product") and "Step-0 health" in own


def test_study_all_rejects_data_and_options():
    from typer.testing import CliRunner

    from curvalign.cli import app

    result = CliRunner().invoke(app, ["study", "all", "--data", TINY, "--out", "x"])
    assert result.exit_code != 0 and "own data" in result.output


# --- the world's study options -------------------------------------------------------------------


def test_paraphrase_pairs_come_from_their_own_distribution():
    from curvalign.data.synthetic import build_world, config_from_spec

    plain = build_world(config_from_spec("images=150,text_pairs=30"))
    para = build_world(config_from_spec("images=150,text_pairs=30,paraphrase_topics=8"))
    # everything but the pairs is unchanged
    assert torch.equal(plain.store.image_features, para.store.image_features)
    assert torch.equal(plain.store.text_features, para.store.text_features)
    assert not torch.equal(plain.store.pair_a_features, para.store.pair_a_features)
    assert plain.heldout_pairs is None
    held = para.heldout_pairs
    assert held is not None and len(held.scores) == 600
    scores = para.store.pair_scores
    assert scores.min() >= 0 and scores.max() <= 1
    assert torch.all(scores[0::3] == 1.0)  # kind 0: same topic
    same = held.topic_a == held.topic_b
    assert torch.all(held.scores[same] == 1.0) and torch.all(held.scores[~same] < 1.0)
    # the pair texts are not captions
    caption_rows = {tuple(r) for r in para.store.text_features[:50].tolist()}
    assert not any(tuple(r) in caption_rows for r in para.store.pair_a_features.tolist())


def test_leaf_pairs_give_several_images_per_pair():
    from curvalign.data.synthetic import build_world, config_from_spec

    world = build_world(config_from_spec("images=300,text_pairs=0,leaf_pairs=5"))
    counts = torch.bincount(world.object_image, minlength=300)
    assert counts.max() <= 2
    pairs = set()
    for img in torch.nonzero(counts == 2).flatten().tolist():
        leaves = world.object_leaf[world.object_image == img].tolist()
        pairs.add(tuple(leaves))
    assert 1 < len(pairs) <= 5
    assert len(torch.nonzero(counts == 2)) / len(pairs) >= 10
    with pytest.raises(ValueError, match="leaf_pairs"):
        config_from_spec("leaf_pairs=-1")


# --- the recipe options the studies use ------------------------------------------------------------


def _agr(**kw):
    from curvalign.recipes.agr import AGR, AGRConfig

    torch.manual_seed(0)
    return AGR(AGRConfig(embed_dim=16, lora_rank=4, **kw), 12, 10)


def test_agr_delta_form_and_hyperbolic_temperature():
    torch.manual_seed(1)
    img, txt = torch.randn(6, 12), torch.randn(6, 10)
    algo, eq = _agr(), _agr(delta_form="equation")
    for r in (algo, eq):
        r.alpha.fill_(1.0)
        r.beta.fill_(0.3)
        r.eval()
    sa = algo.scores(algo.embed_texts(txt), algo.embed_images(img))
    se = eq.scores(eq.embed_texts(txt), eq.embed_images(img))
    assert not torch.allclose(sa, se)  # beta < 1: the two readings differ
    for r in (algo, eq):
        r.beta.fill_(1.0)
    sa = algo.scores(algo.embed_texts(txt), algo.embed_images(img))
    se = eq.scores(eq.embed_texts(txt), eq.embed_images(img))
    torch.testing.assert_close(sa, se)  # ... and agree at beta = 1
    assert _agr().tau_h is None  # default: S_H = -d, checkpoints unchanged
    hot = _agr(learn_tau_h=True, tau_h_init=0.5)
    assert any("tau_h" in n for n, p in hot.named_parameters() if p.requires_grad)
    t, i = hot.embed_texts(txt), hot.embed_images(img)
    parts = hot.routed(t, i, "text", 0.0, 0.0)
    from curvalign.scores import lorentz_distance_scores

    expected = lorentz_distance_scores(t["lorentz"], i["lorentz"], hot.curvature()) / 0.5
    torch.testing.assert_close(parts.s_h, expected)
    with pytest.raises(ValueError, match="delta_form"):
        _agr(delta_form="other")


def test_agr_routing_summary():
    torch.manual_seed(2)
    r = _agr()
    r.alpha.fill_(1.0)
    r.beta.fill_(1.0)
    r.eval()
    s = r.routing_summary(r.embed_texts(torch.randn(5, 10)), r.embed_images(torch.randn(5, 12)))
    for key in ("w_mean", "w_pos", "w_neg", "gate", "euclidean_share", "e_above_h"):
        assert 0.0 <= s[key] <= 2.0, key
    assert s["w_mean"] == pytest.approx((s["w_pos"] + 4 * s["w_neg"]) / 5, rel=1e-5)


def test_dualpath_gate_speed_and_phase2_without_text_pairs():
    from curvalign.recipes.base import Batch, Progress
    from curvalign.recipes.dualpath import DualPath, DualPathConfig

    def make(**kw):
        torch.manual_seed(0)
        return DualPath(
            DualPathConfig(model_dim=8, hidden_dim=16, embed_dim=8, dropout=0.0, **kw), 6, 5
        )

    slow, fast = make(), make(gate_speed=10.0)
    for r in (slow, fast):
        r.head.gate_warmup.fill_(1.0)
        with torch.no_grad():
            r.head.gate_logit.add_(0.2)
    assert float(slow.head.gate().detach()) == pytest.approx(
        torch.sigmoid(torch.tensor(-4.8)).item(), rel=1e-5
    )
    assert float(fast.head.gate().detach()) == pytest.approx(
        torch.sigmoid(torch.tensor(-3.0)).item(), rel=1e-5
    )

    torch.manual_seed(3)
    batch = Batch(
        image=torch.randn(4, 6),
        text=torch.randn(4, 5),
        pair_a=torch.randn(4, 5),
        pair_b=torch.randn(4, 5),
        pair_score=torch.rand(4),
    )
    phase2 = Progress(step=90, total=100)
    with_pairs = make(schedule_unit="steps", switch_at=10).loss(batch, phase2)
    without = make(schedule_unit="steps", switch_at=10, phase2_text_pairs=False).loss(batch, phase2)
    assert "text_info_nce" in with_pairs.terms and "text_info_nce" not in without.terms
    assert "image_info_nce" in without.terms
    phase1 = Progress(step=1, total=100)
    assert (
        "text_info_nce"
        in make(schedule_unit="steps", switch_at=10, phase2_text_pairs=False)
        .loss(batch, phase1)
        .terms
    )


def test_phyclip_l2_product_metric():
    from curvalign.geometry import lorentz
    from curvalign.recipes.phyclip import Phyclip, PhyclipConfig

    torch.manual_seed(4)
    r = Phyclip(PhyclipConfig(num_factors=3, factor_dim=4, product_metric="l2"), 10, 8)
    t, i = r.embed_texts(torch.randn(5, 8)), r.embed_images(torch.randn(6, 10))
    c = r.curvature()
    brute = torch.stack(
        [lorentz.pairwise_dist(t["point"][:, f], i["point"][:, f], c[f]) for f in range(3)]
    )
    expected = -brute.square().mean(0).sqrt()
    s = r.scores(t, i)
    torch.testing.assert_close(s, expected)
    pairs = r.pair_scores({"point": t["point"][:5]}, {"point": i["point"][:5]})
    torch.testing.assert_close(pairs, s.diagonal()[:5] if s.shape[1] >= 5 else pairs)
    assert torch.isfinite(
        torch.autograd.grad(r.scores(t, t).sum(), r.text_head.proj.weight)[0]
    ).all()
    with pytest.raises(ValueError, match="product_metric"):
        PhyclipConfig(product_metric="l3")
    assert math.isfinite(float(s.sum().detach()))


def test_label_noise_control_moves_a_known_share_of_train_captions_only():
    world = _tiny_world()
    store = kit.with_val_split(world)
    noisy = kit.with_label_noise(store, 0.3, seed=1)
    train = store.texts_of_split("train")
    moved = noisy.text_to_image != store.text_to_image
    assert not moved[~torch.isin(torch.arange(store.num_texts), train)].any()  # val/test intact
    # at most the chosen 30% moved (a permutation may leave a few where they were), most did
    assert 0.2 * len(train) <= int(moved.sum()) <= round(0.3 * len(train))
    # the moved captions still point at train images
    train_images = set(store.split_image_ids("train").tolist())
    assert set(noisy.text_to_image[moved].tolist()) <= train_images
    assert torch.equal(kit.with_label_noise(store, 0.3, 1).text_to_image, noisy.text_to_image)
    assert torch.equal(kit.with_label_noise(store, 0.0).text_to_image, store.text_to_image)


def test_a_label_noise_control_trains_every_seed_on_one_nested_draw():
    from curvalign_lab.declare import label_noise

    store = kit.with_val_split(_tiny_world())
    shared = label_noise()((0.3, 0.6), 0.3).apply
    fresh = label_noise(draw=None)((0.3, 0.6), 0.3).apply
    assert shared is not None and fresh is not None
    # one draw for every run seed (common random numbers) ...
    a, b = shared(store, 0.3, 1000), shared(store, 0.3, 1001)
    assert torch.equal(a.text_to_image, b.text_to_image)
    assert not torch.equal(a.text_to_image, store.text_to_image)
    # ... where a fresh draw per seed differs from seed to seed
    assert not torch.equal(
        fresh(store, 0.3, 1000).text_to_image, fresh(store, 0.3, 1001).text_to_image
    )
    # nested doses: the larger share moves every caption the smaller one moves, to the same image
    large = shared(store, 0.6, 7).text_to_image
    moved_small = a.text_to_image != store.text_to_image
    assert moved_small.any() and torch.equal(large[moved_small], a.text_to_image[moved_small])
    assert int((large != store.text_to_image).sum()) > int(moved_small.sum())


# --- the claim-specific measures, on hand-made inputs --------------------------------------------


def _study_record(name: str, seeds, verdicts) -> StudyResult:
    """A study result with one claim per (claim, Holm-adjusted verdict text)."""
    claims = tuple(
        dataclasses.replace(
            kit.claim_record(c, mean_interval([0.1, 0.2, 0.3]), MOVED, "c"),
            holm_outcome=v,
            holm_verdict=v.split(" by")[0],
        )
        for c, v in verdicts
    )
    return StudyResult(
        name=name,
        paper="p",
        setup="s",
        claims=claims,
        verdict="",
        holds=False,
        seeds=seeds,
        rule=kit.RULE,  # hand-made verdicts: recorded under this rule, read as they are
    )


def test_stability_check_shows_every_flip_as_a_flip(tmp_path):
    from curvalign_lab import results

    def write(base, verdicts):
        for name, claims in verdicts.items():
            d = tmp_path / base / name
            d.mkdir(parents=True)
            seeds = (0, 1, 2) if base == "a" else (100, 101, 102)
            result = _study_record(name, seeds, claims)
            (d / "study.json").write_text(json.dumps(result.to_json()))

    under = "underpowered by plan (n > 10)"
    write("a", {"s": [("x", kit.HOLDS), ("y", under), ("z", kit.EQUIVALENT)]})
    write("b", {"s": [("x", kit.HOLDS), ("y", under), ("z", kit.EQUIVALENT)]})
    rows, ok = results.stability(tmp_path / "a", tmp_path / "b")
    assert ok and all(r["agree"] for r in rows)
    assert rows[1]["across_kind"] == kit.UNDERPOWERED and rows[2]["across_kind"] == kit.EQUIVALENT
    # holds on one base and underpowered on the other: unstable, not "underpowered"
    write("c", {"s": [("x", kit.DOES_NOT_HOLD), ("y", kit.HOLDS), ("z", kit.EQUIVALENT)]})
    rows, ok = results.stability(tmp_path / "a", tmp_path / "c")
    assert not ok
    assert [r["across_kind"] for r in rows] == [kit.UNSTABLE, kit.UNSTABLE, kit.EQUIVALENT]
    assert under in rows[1]["across"] and kit.HOLDS in rows[1]["across"]
    text = results.stability_markdown(rows, ok)
    assert "NOT stable" in text and "| s | x | 0-2 |" in text
    assert "2 flip between bases" in text
    # a long verdict is cut at a clause, its whole text in a footnote under the table
    long_rows = [dict(rows[1], a=under + "; " + "why " * 80)]
    long_text = results.stability_markdown(long_rows, False)
    cells = [
        c for line in long_text.splitlines() if line.startswith("| s |") for c in line.split("|")
    ]
    assert max(len(c.strip()) for c in cells) <= 200 and "[^s1]: " + under in long_text
    # the short table: a few words per base and across both, seeds in brackets
    table = results.across_table(rows)
    flip = "| s | y | underpowered by plan (0-2) | holds (100-102) | unstable across seed bases |"
    assert flip in table
    assert "| s | z | equivalent (0-2) | equivalent (100-102) | equivalent |" in table
    assert results.main([str(tmp_path / "a"), "--stability", str(tmp_path / "c"), "--across"]) == 1
    with pytest.raises(SystemExit):
        results.main([str(tmp_path / "a"), "--across"])


def test_lr_table_marks_a_rate_at_the_grid_edge():
    from curvalign_lab import results
    from curvalign_lab.records import LrChoice

    result = dataclasses.replace(
        _study_record("s", (0, 1), [("x", kit.HOLDS)]),
        lr_grid=(3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
        lr_choice={
            "a": LrChoice("clip", 1e-2, ((3e-3, 0.30), (1e-2, 0.35), (3e-2, 0.31))),
            "b": LrChoice("clip", 3e-2, ((1e-2, 0.30), (3e-2, 0.40))),
        },
    )
    table = results.lr_table(result)
    assert "| a | 0.01 | yes | 0.003: 30.0, 0.01: 35.0, 0.03: 31.0 |" in table
    assert "| b | 0.03 | **no (edge)** |" in table
    assert "1 of 2 arms chose a rate inside the grid" in table
    assert results.is_current(result)
    # a claim without the keys every recorded claim has is one clear error naming the key
    data = result.to_json()
    del data["claims"][0]["paper_source"]
    with pytest.raises(InputError, match="claim 'x' has no 'paper_source'"):
        StudyResult.from_json(data)


def test_cached_value_computes_once_and_waits_for_a_run_in_progress(tmp_path):
    import threading
    import time

    calls = []

    def compute():
        calls.append(1)
        return 0.25

    key = {"label": "a", "lr": 1e-3, "steps": 10}
    assert kit.cached_value(tmp_path, key, compute, notify=lambda m: None) == 0.25
    assert kit.cached_value(tmp_path, key, compute, notify=lambda m: None) == 0.25
    assert len(calls) == 1
    # another key is another run
    assert kit.cached_value(tmp_path, {**key, "lr": 3e-3}, compute, notify=lambda m: None) == 0.25
    assert len(calls) == 2
    # a diverged run (-inf) is stored and read back as -inf
    assert kit.cached_value(tmp_path, {"x": 1}, lambda: -math.inf, lambda m: None) == -math.inf
    assert kit.cached_value(tmp_path, {"x": 1}, compute, lambda m: None) == -math.inf
    # a run in progress elsewhere (its lock) is waited for, not repeated
    slow_key = {"label": "slow"}
    started = threading.Event()

    def slow():
        started.set()
        time.sleep(0.3)
        return 0.5

    first = threading.Thread(target=lambda: kit.cached_value(tmp_path, slow_key, slow, print))
    first.start()
    started.wait()
    waited = []
    assert kit.cached_value(tmp_path, slow_key, lambda: 9.0, waited.append) == 0.5
    first.join()
    assert any("waiting" in m for m in waited)


def test_the_moved_study_modules_keep_a_deprecated_alias():
    # the studies left the importable library for curvalign_lab; the old names still resolve,
    # with a DeprecationWarning naming the new place
    import importlib
    import sys

    from curvalign_lab import runner

    for old, new in (
        ("curvalign.report.studies", "curvalign_lab"),
        ("curvalign.report.studykit", "curvalign_lab.kit"),
        ("curvalign.report.results", "curvalign_lab.results"),
    ):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=new):
            module = importlib.import_module(old)
        assert module is not None
    from curvalign.report import studies as old_studies

    assert old_studies.run_study is runner.run_study
    assert old_studies.spearman is not None and old_studies.AGR_GATE_OPEN == 0.5
