"""The studies' decision rules (curvalign_lab.rules) on hand-made numbers: pure functions."""

from __future__ import annotations

import math

import pytest

from curvalign_lab import kit, rules


def test_noncentral_t_cdf_against_known_values():
    # delta = 0: the central t (curvalign.stats.t_cdf); df = 1, delta = 0: the Cauchy
    from curvalign.stats import t_cdf

    for df in (1, 2, 5, 30):
        for x in (-2.5, -0.3, 0.0, 1.0, 4.0):
            assert rules.noncentral_t_cdf(x, df, 0.0) == pytest.approx(t_cdf(x, df), abs=1e-6)
    assert rules.noncentral_t_cdf(-1.0, 1, 0.0) == pytest.approx(0.25, abs=1e-6)
    # P(T <= 0) = Phi(-delta) for any df (T <= 0 exactly when Z + delta <= 0)
    for df in (1, 3, 12):
        for delta in (-1.0, 0.7, 2.5):
            phi = 0.5 * math.erfc(delta / math.sqrt(2))
            assert rules.noncentral_t_cdf(0.0, df, delta) == pytest.approx(phi, abs=1e-7)
    # monotone in t and in delta
    assert rules.noncentral_t_cdf(1.0, 4, 1.0) < rules.noncentral_t_cdf(2.0, 4, 1.0)
    assert rules.noncentral_t_cdf(1.0, 4, 2.0) < rules.noncentral_t_cdf(1.0, 4, 1.0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        rules.noncentral_t_cdf(0.0, 0, 1.0)


def test_noncentral_t_cdf_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    worst = 0.0
    for df in (1, 2, 4, 9, 29):
        for delta in (-1.5, 0.0, 1.0, 3.0, 6.0):
            for x in (-2.0, 0.5, 2.0, 4.5):
                got = rules.noncentral_t_cdf(x, df, delta)
                worst = max(worst, abs(got - float(stats.nct.cdf(x, df, delta))))
    assert worst < 1e-6


def test_power_and_mde_are_exact():
    # the MDE is where the power crosses 80%, two-sided and one-sided
    for n in (2, 3, 6):
        for side in (1, 2):
            mde = rules.minimal_detectable(0.03, n, sided=side)
            assert rules.power(mde, 0.03, n, sided=side) == pytest.approx(0.8, abs=1e-9)
            assert rules.power(0.9 * mde, 0.03, n, sided=side) < 0.8
    # one-sided tests need less: the MDE of a margin claim is smaller
    assert rules.minimal_detectable(1.0, 4, sided=1) < rules.minimal_detectable(1.0, 4)
    # the MDE scales with the SD and falls with n; power at 0 is the test's level
    assert rules.minimal_detectable(2.0, 5) == pytest.approx(2 * rules.minimal_detectable(1.0, 5))
    assert rules.minimal_detectable(1.0, 8) < rules.minimal_detectable(1.0, 4)
    assert rules.power(0.0, 1.0, 5) == pytest.approx(0.05, abs=1e-6)
    assert rules.minimal_detectable(0.0, 3) == 0.0
    assert math.isnan(rules.minimal_detectable(1.0, 1)) and math.isnan(rules.power(1.0, 1.0, 1))


def test_the_plan_targets_the_paper_effect_or_the_distance_to_the_margin():
    assert rules.planning_target("superiority", -0.02, None) == 0.02
    # AtMG "almost constant": a 0.55-point drop against a 2-point margin needs 1.45 points
    assert rules.planning_target("non-inferiority", -0.0055, 0.02) == pytest.approx(0.0145)
    assert rules.planning_target("equivalence", 0.0055, 0.02) == pytest.approx(0.0145)
    assert rules.planning_target("equivalence", -0.0055, 0.02) == pytest.approx(0.0145)
    # a non-inferiority claim whose paper effect is an advantage: its distance to the margin
    # (hyperbolic d = 5 65 MAP points above Euclidean d = 10, margin 5)
    assert rules.planning_target("non-inferiority", 0.65, 0.05) == pytest.approx(0.70)
    assert rules.planning_target("non-inferiority", 0.0, 0.02) == pytest.approx(0.02)
    # the paper's own effect at or beyond the margin: no n shows the claim
    assert math.isnan(rules.planning_target("non-inferiority", -0.03, 0.02))
    assert math.isnan(rules.planning_target("superiority", None, None))
    with pytest.raises(ValueError, match="margin"):
        rules.planning_target("equivalence", 0.01, None)
    with pytest.raises(ValueError, match="kind"):
        rules.planning_target("better", 0.01, None)


def test_plan_picks_the_fewest_seeds_and_says_underpowered_above_the_cap():
    pilot = [0.01, 0.03, 0.02]  # SD 0.01
    plan = rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, cap=10)
    assert not plan.underpowered and plan.pilot_n == 3
    assert plan.pilot_sd == pytest.approx(0.01)
    assert (
        rules.minimal_detectable(0.01, plan.n) <= 0.02 < rules.minimal_detectable(0.01, plan.n - 1)
    )
    assert plan.mde == pytest.approx(rules.minimal_detectable(0.01, plan.n))
    # a margin claim plans against the distance to the margin, with a one-sided test
    margin = rules.plan_claim(pilot, kind="non-inferiority", paper_effect=-0.0055, margin=0.02)
    assert margin.target == pytest.approx(0.0145)
    # ... at the level it is decided at (its 95% interval's bound: one-sided 0.025), which needs
    # at least the seeds a one-sided 0.05 plan would promise
    assert margin.mde == pytest.approx(
        rules.minimal_detectable(0.01, margin.n, sided=1, alpha=0.025)
    )
    assert rules.minimal_detectable(0.01, margin.n - 1, sided=1, alpha=0.025) > 0.0145 or (
        margin.n == rules.MIN_SEEDS
    )
    assert margin.mde > rules.minimal_detectable(0.01, margin.n, sided=1, alpha=0.05)
    # in a Holm family of 4 the plan is made at Holm's first level (0.05 / 4): more seeds, and
    # at its n the MDE at that level reaches the target
    four = rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, cap=10, family=4)
    assert four.n > plan.n and four.family == 4
    assert four.mde == pytest.approx(rules.minimal_detectable(0.01, four.n, alpha=0.0125))
    assert four.mde <= 0.02 < rules.minimal_detectable(0.01, four.n - 1, alpha=0.0125)
    with pytest.raises(ValueError, match="family"):
        rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, family=0)

    # a small effect at this SD needs more than the cap: underpowered by plan
    tiny = rules.plan_claim(pilot, kind="superiority", paper_effect=0.002, cap=6)
    assert tiny.underpowered and tiny.n == 6 and tiny.mde > 0.002
    assert "at the cap of 6 seeds" in tiny.reason
    # a pilot of one seed has no SD: nothing can be planned
    assert rules.plan_claim([0.01], kind="superiority", paper_effect=0.02).underpowered
    # the study's seeds are the most any plan asks: the cap where a plan is underpowered
    assert rules.study_seeds([plan, margin]) == max(plan.n, margin.n)
    assert rules.study_seeds([plan, tiny, margin]) == tiny.n == 6
    assert rules.study_seeds([]) == rules.MIN_SEEDS == 3
    # a clear claim still runs on 3 seeds: the plan does not size the control's interval
    easy = rules.plan_claim(pilot, kind="superiority", paper_effect=0.5, cap=10)
    assert easy.n == rules.MIN_SEEDS and rules.minimal_detectable(0.01, 2) <= 0.5
    # identical pilot effects (SD 0) plan nothing: the cap, not 2 seeds
    flat = rules.plan_claim([0.05, 0.05, 0.05], kind="superiority", paper_effect=0.02, cap=6)
    assert flat.n == 6 and not flat.underpowered and "SD 0" in flat.reason
    with pytest.raises(ValueError, match="cap"):
        rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, cap=1)


def test_a_plan_counts_the_test_items_that_more_seeds_do_not_shrink():
    pilot = [0.01, 0.03, 0.02]  # SD 0.01
    seeds_only = rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, cap=10)
    # an items' SE of 0.004 adds 0.004^2 to the mean's variance whatever n: more seeds
    items = rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, cap=10, item_se=0.004)
    assert items.n > seeds_only.n and not items.underpowered and items.item_se == 0.004
    spread = math.sqrt(0.01**2 + items.n * 0.004**2)
    assert items.mde == pytest.approx(rules.minimal_detectable(spread, items.n))
    assert "test items' SE 0.004" in items.reason
    # an items' floor above the target: no cap reaches it, and the reason says so
    floor = rules.plan_claim(pilot, kind="superiority", paper_effect=0.02, cap=50, item_se=0.009)
    assert floor.underpowered and floor.item_floor > 0.02 and floor.mde > floor.item_floor
    assert "no number of seeds reaches it" in floor.reason
    # 2.8 SEs at 80% power and a two-sided 0.05 (normal limit)
    assert floor.item_floor == pytest.approx((1.959964 + 0.841621) * 0.009, rel=1e-5)
    assert seeds_only.item_floor == 0.0 and "items" not in seeds_only.reason


def test_holds_on_one_base_and_underpowered_on_the_other_is_unstable():
    holds = (kit.HOLDS, kit.HOLDS)
    under = (kit.UNDERPOWERED, "underpowered by plan (n > 10)")
    kind, text = rules.across_bases(holds, under)
    assert kind == rules.UNSTABLE == kit.UNSTABLE
    assert kit.HOLDS in text and "underpowered by plan" in text
    assert rules.across_bases(under, holds)[0] == rules.UNSTABLE
    # the same class agrees, whatever the numbers in the texts
    assert rules.across_bases(under, (kit.UNDERPOWERED, "underpowered (n > 12)")) == under
    assert rules.across_bases(holds, holds) == holds


def test_precondition_and_regime_claims_leave_the_holm_family():
    assert rules.in_holm_family("primary", None, None)
    assert rules.in_holm_family("secondary", None, None)
    assert not rules.in_holm_family("precondition", None, None)
    assert not rules.in_holm_family("regime", None, None)
    assert not rules.in_holm_family("primary", "gate shut", None)
    assert not rules.in_holm_family("primary", None, "no encoder training")


def test_dose_response_picks_the_dose_of_the_claims_size():
    # effects 0.4, 5, 20 points at 10%, 30%, 60% noise: 2 points lies between 10% and 30%,
    # interpolated in log effect (both bracketing effects are positive)
    dose = rules.dose_for_effect([0.1, 0.3, 0.6], [0.004, 0.05, 0.2], 0.02)
    assert dose == pytest.approx(0.1 + math.log(0.02 / 0.004) / math.log(0.05 / 0.004) * 0.2)
    # on a convex response the log dose reaches the target where the linear one falls short:
    # effect = d**3 scanned at 0.3 and 0.6 (0.027, 0.216), target 0.1 (true dose 0.464)
    convex = rules.dose_for_effect([0.3, 0.6], [0.3**3, 0.6**3], 0.1)
    linear = 0.3 + (0.1 - 0.3**3) / (0.6**3 - 0.3**3) * 0.3
    assert linear**3 < 0.08 and 0.1 <= convex**3 < 0.13
    # a bracket that starts at an effect of 0 is interpolated linearly
    dose = rules.dose_for_effect([0.3, 0.6], [0.0, 0.05], 0.02)
    assert dose == pytest.approx(0.3 + 0.02 / 0.05 * 0.3)
    # from 0 at dose 0 when the first dose already exceeds the target
    assert rules.dose_for_effect([0.5], [0.1], 0.02) == pytest.approx(0.1)
    # a noisy scan is fitted monotone first: the dip at 0.3 cannot put the dose there
    assert rules.isotonic([0.0, 0.05, 0.03, 0.2]) == pytest.approx([0.0, 0.04, 0.04, 0.2])
    dose = rules.dose_for_effect([0.1, 0.2, 0.3, 0.6], [0.0, 0.05, 0.03, 0.2], 0.1)
    assert 0.3 < dose < 0.6
    # no dose reaches the claim's size: the control must be replaced
    assert rules.dose_for_effect([0.1, 0.3], [0.0, 0.01], 0.02) is None
    with pytest.raises(ValueError, match="one effect per dose"):
        rules.dose_for_effect([0.1], [0.1, 0.2], 0.02)


def _sd(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_control_noise_is_pooled_over_the_doses_that_bracket_the_chosen_one():
    scan = {
        0.1: {0: 0.00, 1: 0.01, 2: 0.02},  # quiet at a small dose
        0.3: {0: 0.03, 1: 0.05, 2: 0.07},
        0.6: {0: 0.10, 1: 0.20, 2: 0.30},  # loud at a large one
    }
    sd, n = rules.control_sd(scan, 0.2)
    pooled = math.sqrt((_sd([0.0, 0.01, 0.02]) ** 2 + _sd([0.03, 0.05, 0.07]) ** 2) / 2)
    assert sd == pytest.approx(pooled) and n == 6
    # a dose on the scan reads that dose alone; outside the scan, the nearest dose
    assert rules.control_sd(scan, 0.6) == (pytest.approx(_sd([0.1, 0.2, 0.3])), 3)
    assert rules.control_sd(scan, 0.05) == (pytest.approx(_sd([0.0, 0.01, 0.02])), 3)
    # no dose reached the target: the control runs at its largest dose, so that dose's noise
    assert rules.control_sd(scan, None)[0] == pytest.approx(_sd([0.1, 0.2, 0.3]))
    # one seed per dose: no SD
    assert math.isnan(rules.control_sd({0.1: {0: 0.01}}, 0.1)[0])


def test_a_noisy_control_plans_more_seeds_and_one_beyond_reach_is_underpowered():
    quiet = {0.3: {0: 0.019, 1: 0.020, 2: 0.021}}
    loud = {0.3: {0: 0.0, 1: 0.02, 2: 0.04}}
    # at the point estimate (confidence 0); the default limit is checked below
    q = rules.plan_control(quiet, 0.3, 0.02, cap=10, confidence=0)
    lo = rules.plan_control(loud, 0.3, 0.02, cap=10, confidence=0)
    assert q.n == rules.MIN_SEEDS and not q.underpowered
    assert lo.n > q.n and not lo.underpowered
    # the plan's seeds detect the claim's size with 80% power at the control's noise
    assert rules.power(0.02, lo.pilot_sd, lo.n) >= rules.POWER
    assert rules.power(0.02, lo.pilot_sd, lo.n - 1) < rules.POWER
    # and at that n the 95% half-width is below the size: the control can separate
    from curvalign.stats import t_quantile

    half = t_quantile(0.975, lo.n - 1) * lo.pilot_sd / math.sqrt(lo.n)
    assert half < 0.02
    beyond = rules.plan_control({0.3: {0: -0.2, 1: 0.02, 2: 0.24}}, 0.3, 0.02, cap=6, confidence=0)
    assert beyond.underpowered and beyond.n == 6
    # the study's seeds: the most any powered plan needs, claims' and the control's alike
    assert rules.study_seeds([q, lo]) == lo.n
    assert rules.study_seeds([q, beyond]) == beyond.n == 6


def test_a_control_underpowered_by_plan_makes_its_claim_underpowered_not_inconclusive():
    from curvalign_lab.records import DecisionInputs, PlanRecord

    effect = kit.Interval(-0.05, -0.09, -0.02, 3)
    failed = kit.Interval(0.03, -0.08, 0.14, 3)  # the control did not separate
    beyond = PlanRecord.from_plan(
        rules.plan_control({0.1: {0: -0.02, 1: 0.02, 2: 0.06}}, 0.1, 0.02, cap=6), kind="control"
    )
    within = PlanRecord.from_plan(
        rules.plan_control({0.1: {0: 0.019, 1: 0.02, 2: 0.021}}, 0.1, 0.02, cap=6),
        kind="control",
    )
    assert beyond.underpowered and not within.underpowered
    v = kit.decide(effect, failed, control_min=0.02, control_plan=beyond)
    assert v.kind == kit.UNDERPOWERED and "its control needs n > 6" in v.text
    # a control whose plan was within the cap and still failed: inconclusive, as before
    assert kit.decide(effect, failed, control_min=0.02, control_plan=within).text == (
        kit.UNDETECTABLE
    )
    assert kit.decide(effect, failed, control_min=0.02).text == kit.UNDETECTABLE
    # a control that separated decides the claim whatever its plan said
    separated = kit.Interval(0.02, 0.01, 0.03, 6)
    assert kit.decide(effect, separated, control_min=0.02, control_plan=beyond).kind == (
        kit.DOES_NOT_HOLD
    )
    # the inputs carry the control's plan through JSON, and a claim without one writes no key
    inputs = DecisionInputs(control_min=0.02, control_plan=beyond)
    assert DecisionInputs.from_json(inputs.to_json()) == inputs
    assert "control_plan" not in DecisionInputs(control_min=0.02).to_json()
    v2 = kit.decide_inputs(effect, failed, DecisionInputs.from_json(inputs.to_json()))
    assert v2 == v


def test_a_control_is_planned_at_the_upper_confidence_limit_of_its_pilot_sd():
    import scipy.stats

    for df in (1, 2, 4, 9):
        for p in (0.2, 0.5, 0.975):
            assert rules.chi2_quantile(p, df) == pytest.approx(
                scipy.stats.chi2.ppf(p, df), rel=1e-9
            )
    # 6 pilot seeds over two doses: 4 degrees of freedom; the 80% limit is sd sqrt(4 / chi2_0.2)
    scan = {0.2: {0: 0.010, 1: 0.020, 2: 0.030}, 0.3: {0: 0.015, 1: 0.025, 2: 0.035}}
    sd, n = rules.control_sd(scan, 0.25)
    upper = sd * math.sqrt(4 / scipy.stats.chi2.ppf(0.2, 4))
    assert rules.sd_upper_limit(sd, 4, 0.8) == pytest.approx(upper)
    plan = rules.plan_control(scan, 0.25, 0.02, cap=10)
    point = rules.plan_control(scan, 0.25, 0.02, cap=10, confidence=0)
    assert plan.pilot_sd == pytest.approx(sd) and plan.planned_sd == pytest.approx(upper)
    assert math.isnan(point.planned_sd) and point.n < plan.n
    # the seeds are the fewest whose power reaches 80% at the limit, not at the point estimate
    assert rules.power(0.02, upper, plan.n) >= rules.POWER > rules.power(0.02, upper, plan.n - 1)
    assert f"upper confidence limit {upper:.3g}" in plan.reason
    # the record keeps the limit (and an older record without it reads as nan)
    from curvalign_lab.records import PlanRecord

    record = PlanRecord.from_plan(plan, kind="control")
    assert PlanRecord.from_json(record.to_json()) == record
    assert record.to_json()["planned_sd"] == pytest.approx(upper)
    older = {k: v for k, v in record.to_json().items() if k != "planned_sd"}
    assert math.isnan(PlanRecord.from_json(older).planned_sd)


def test_an_interval_that_excludes_the_papers_effect_decides_even_under_an_underpowered_plan():
    underpowered = {"underpowered": True, "cap": 10, "reason": "MDE 0.03 at the cap"}
    control = kit.Interval(0.03, 0.02, 0.04, 10)
    # the 95% interval lies below the paper's 2 points: excluded, whatever the plan said
    below = kit.Interval(0.005, -0.008, 0.018, 10)
    verdict = kit.decide(below, control, paper_effect=0.02, control_min=0.02, plan=underpowered)
    assert verdict.kind == kit.DOES_NOT_HOLD and "excluded (upper bound 1.8)" in verdict.text
    # in a Holm family of 4 the bound is read at 1 - 0.05/4: wider, so no longer excluded
    family = kit.decide(
        below,
        control,
        paper_effect=0.02,
        control_min=0.02,
        plan=underpowered,
        family=4,
        significant=False,
    )
    assert family.kind == kit.UNDERPOWERED
    # an interval that reaches the paper's effect stays underpowered by plan
    wide = kit.Interval(0.001, -0.03, 0.032, 10)
    assert (
        kit.decide(wide, control, paper_effect=0.02, control_min=0.02, plan=underpowered).kind
        == kit.UNDERPOWERED
    )
    # without a separated control nothing is excluded
    dead = kit.Interval(0.0, -0.01, 0.01, 10)
    assert (
        kit.decide(below, dead, paper_effect=0.02, control_min=0.02, plan=underpowered).kind
        == kit.UNDERPOWERED
    )
