"""atmg-curvature as a declaration: its regime claims are measured bounds, its label-noise
control is a scanned dose that can fail, its small-curvature arms start curved, and the pilot
path runs at tiny size through the one runner."""

from __future__ import annotations

import json
import math

import pytest

from curvalign.errors import ConfigError
from curvalign.stats import Interval
from curvalign_lab import declare, kit, page, rules
from curvalign_lab.records import ClaimResult, StudyResult
from curvalign_lab.studies import atmg_curvature as atmg

#: a tiny world with classes (zero-shot needs them): 4 families x 2 leaves, 1 prompt template
TINY = (
    "synthetic:images=96,text_pairs=0,captions_min=1,captions_max=2,depth=2,branching=2,templates=1"
)
TINY_TRAIN = ("batch_size=16", "pair_batch_size=16")
SEEDS = [0, 1, 2]


def _measured(effects: list[float]) -> declare.Measured:
    return declare.Measured(dict(zip(SEEDS, effects, strict=True)))


def _decide(
    study: declare.Study, measured, control: float, spread: float = 0.001
) -> dict[str, ClaimResult]:
    claims = declare.decide_claims(
        study,
        measured,
        {s: control + spread * (s - SEEDS[1]) for s in SEEDS},
        SEEDS,
        study.steps,
        None,
        "control",
    )
    return {c.key: c for c in claims}


def test_atmg_regime_claims_are_measured_bounds() -> None:
    """A claim about encoder training is not reproduced by heads on frozen features; the reason
    says, from the data, whether the paper's effect is excluded here, and the claim stays
    outside the Holm family."""
    small = Interval(0.009, -0.006, 0.024, 3)
    text = atmg.measured_regime(small, atmg.ATMG_MERU_DROP)
    assert "28.4 points is excluded, upper bound 2.40" in text
    assert atmg.bound_note(small, atmg.ATMG_MERU_DROP) == (
        "a drop of 28.4 points is excluded: upper bound 2.40"
    )
    wide = Interval(0.10, -0.20, 0.40, 3)
    assert atmg.measured_regime(wide, atmg.ATMG_MERU_DROP).startswith(atmg.ATMG_REGIME)
    assert "does not exclude 28.4" in atmg.measured_regime(wide, atmg.ATMG_MERU_DROP)
    assert "is not excluded (upper bound 40.00)" in atmg.bound_note(wide, atmg.ATMG_MERU_DROP)
    # through the measure's helper and the runner's decision: the bound is on the claim's own
    # interval (here the seeds' t interval: no item totals)
    near = atmg.with_bound(_measured([0.01, 0.02, 0.015]), SEEDS, atmg.ATMG_MERU_DROP)
    far = atmg.with_bound(_measured([0.1, 0.5, 0.3]), SEEDS, atmg.ATMG_MERU_DROP)
    iv = declare.claim_interval(near, SEEDS)
    assert near.note == f"a drop of 28.4 points is excluded: upper bound {100 * iv.high:.2f}"
    assert "is not excluded" in far.note
    stable = _measured([0.001, -0.002, 0.0])
    claims = _decide(
        atmg.STUDY, {"atmg_vs_meru": near, "meru_drops": far, "stable": stable}, control=0.05
    )
    for key in ("atmg_vs_meru", "meru_drops"):
        assert claims[key].holm_verdict == kit.NOT_REPRODUCED
        assert claims[key].holm_family is None
    assert f"upper bound {100 * iv.high:.2f}" in claims["atmg_vs_meru"].holm_outcome
    assert "does not exclude 28.4" in claims["meru_drops"].holm_outcome
    # the one tested claim: non-inferiority at the margin, its family of one
    assert claims["stable"].holm_family == 1
    assert claims["stable"].kind == rules.NON_INFERIORITY
    assert claims["stable"].threshold == pytest.approx(-atmg.STABLE_MARGIN)


def test_the_label_noise_control_is_scanned_and_can_fail() -> None:
    """The control's dose comes from the pilot's scan, at the claim's size (the 2-point
    margin); a scan that never costs 2 points cannot calibrate, and a control below the size
    leaves the claim undecided where one above it lets the same effect hold."""
    study = atmg.build(doses=(0.1, 0.3, 0.6))
    handicap = study.control.handicap
    assert study.control.claim == "stable" and handicap.doses == (0.1, 0.3, 0.6)
    assert study.claim("stable").size == pytest.approx(atmg.STABLE_MARGIN)
    scan = {0.1: {0: 0.0, 1: 0.01}, 0.3: {0: 0.02, 1: 0.03}, 0.6: {0: 0.08, 1: 0.1}}
    choice = declare.choose_dose(study, scan)
    # 0.1 costs 0.5 points, 0.3 costs 2.5: the 2-point crossing lies between them
    assert choice.calibrated and 0.1 < choice.dose < 0.3
    weak = {d: {s: v / 10 for s, v in e.items()} for d, e in scan.items()}
    assert declare.choose_dose(study, weak).to_json() == {
        "target": pytest.approx(0.02),
        "scan": {
            "0.1": pytest.approx(0.0005),
            "0.3": pytest.approx(0.0025),
            "0.6": pytest.approx(0.009),
        },
        "dose": None,
        "calibrated": False,
        "per_seed": {
            d: {s: pytest.approx(v) for s, v in by_seed.items()}
            for d, by_seed in {
                "0.1": {"0": 0.0, "1": 0.001},
                "0.3": {"0": 0.002, "1": 0.003},
                "0.6": {"0": 0.008, "1": 0.01},
            }.items()
        },
    }
    regime = {k: _measured([0.0, 0.01, 0.0]) for k in ("atmg_vs_meru", "meru_drops")}
    measured = {**regime, "stable": _measured([0.004, 0.006, 0.005])}
    # a control whose interval does not leave 0 at this noise
    failed = _decide(study, measured, control=0.005, spread=0.03)["stable"]
    assert not failed.control_ok and failed.holm_outcome == kit.UNDETECTABLE
    separated = _decide(study, measured, control=0.05)["stable"]
    assert separated.control_ok and separated.holm_verdict == kit.HOLDS


def test_small_curvature_arms_start_curved() -> None:
    """AtMG's texts start at a quarter of the images' radius: at c = 0.1 with the data-aware
    scales (images at tangent norm 1) c r^2 of the texts is about 0.006, below the step-0
    check's 0.01; that arm starts further out, every other arm as the library resolves it."""
    (option,) = atmg.start_options("atmg", 0.1)
    norm = float(option.split("=")[1])
    assert option.startswith("tangent_norm_init=")
    assert 0.1 * (0.25 * norm) ** 2 == pytest.approx(atmg.FLAT_FLOOR, rel=1e-3)
    assert atmg.start_options("atmg", 0.5) == () and atmg.start_options("meru", 0.1) == ()
    assert all(atmg.start_options(r, c) == () for r in ("meru", "atmg") for c in (1.0, 3.0))


def test_the_flat_start_fires_and_the_study_start_does_not(tmp_path, one_thread) -> None:
    """The step-0 check itself: AtMG at c = 0.1 fires ``flat_geometry`` at the library's start
    and not at the study's (one training step each, the runner's start record)."""
    from curvalign_lab.common import load_study_data

    store, _ = load_study_data(TINY)
    bench = kit.Bench(tmp_path, store, TINY, 1, TINY_TRAIN, val_every=1, max_steps=1, lr_grid=None)
    flat, curved = atmg.arm("atmg", 0.1), atmg.arm("atmg", 0.1)
    library = tuple(o for o in flat.options if not o.startswith("tangent_norm_init"))
    bench.train("library start", "atmg", library, 0)
    bench.train("study start", "atmg", curved.options, 0)
    fired = {label: [w["code"] for w in s[0]["warnings"]] for label, s in bench.starts.items()}
    assert "flat_geometry" in fired["library start"]
    assert "flat_geometry" not in fired["study start"]
    texts = bench.starts["study start"][0]["curvature_radius2"]["text"]
    assert texts >= 0.01
    # a start that fires is listed on the study's page
    record = StudyResult(
        name="s",
        paper="p",
        setup="s",
        claims=(),
        verdict="",
        holds=True,
        starts=bench.starts,
        starts_fired=tuple(kit.starts_fired(bench.starts)),
    )
    text = page.starts_text(record)
    assert "warnings that fired" in text and "- library start: flat_geometry on seeds 0" in text
    assert "study start" not in text


def test_a_flat_arm_leaves_the_stability_claim_untested() -> None:
    """Comparing curvatures with an arm that starts flat compares a Euclidean head with curved
    ones: the measure names such runs and the claim's precondition is not met."""
    flat = {"warnings": [{"code": "flat_geometry", "message": "flat"}]}
    healthy = {"warnings": [{"code": "flat_logits", "message": "other"}]}
    starts = {"atmg c=0.1": {0: flat, 1: healthy}, "atmg c=1": {0: healthy, 1: healthy}}
    labels = ["atmg c=0.1", "atmg c=1"]
    assert atmg.flat_starts(starts, labels, [0, 1]) == ["atmg c=0.1 seed 0"]
    assert atmg.flat_starts(starts, labels, [1]) == []
    measured = {k: _measured([0.0, 0.01, 0.0]) for k in ("atmg_vs_meru", "meru_drops")}
    stable = _measured([0.004, 0.006, 0.005])
    stable.precondition = "AtMG arms started flat (step-0 flat_geometry): ['atmg c=0.1 seed 0']"
    claim = _decide(atmg.STUDY, {**measured, "stable": stable}, control=0.05)["stable"]
    assert claim.holm_verdict == kit.NOT_REPRODUCED and "started flat" in claim.holm_outcome
    assert claim.holm_family is None


def test_options_rebuild_the_study() -> None:
    from curvalign_lab.runner import parse_study_options

    options = parse_study_options("atmg-curvature", ["curvatures=0.1,1", "doses=0.3,0.9"])
    study = declare.configured(atmg.STUDY, options)
    assert [a.label for a in study.arms] == ["meru c=0.1", "atmg c=0.1", "meru c=1", "atmg c=1"]
    assert study.control.handicap.doses == (0.3, 0.9)
    assert declare.configured(atmg.STUDY, {}, quick=True).arms == study.arms
    with pytest.raises(ConfigError, match="one value below 0.5"):
        atmg.build(curvatures=(0.5, 1.0))
    with pytest.raises(ConfigError, match="no option bogus"):
        declare.configured(atmg.STUDY, {"bogus": 1})


def test_the_pilot_plans_scans_and_the_page_shows_the_starts(tmp_path, one_thread) -> None:
    """The pilot path at tiny size: a pilot on the disjoint base plans the tested claim and
    scans the control's doses; every claim about the test metric counts seeds and test images;
    every arm's start is recorded and the small-curvature AtMG arm starts curved."""
    study = atmg.build(curvatures=(0.1, 1.0), doses=(0.3, 0.9))
    result = declare.run_declared(
        study,
        tmp_path / "atmg",
        steps=2,
        data=TINY,
        overrides=TINY_TRAIN,
        seeds=2,
        seed_base=3,
        power=True,
        max_seeds=2,
        lr_grid=None,
    )
    plan = result.power_plan
    assert plan.pilot_seed_base == 3 + declare.PILOT_OFFSET
    assert set(plan.per_claim) == {"stable"}  # regime claims are not planned
    assert result.seeds == (3, 4)
    choice = result.control.choice
    # the declared doses, and the dose first read off them where it is a new one (refinement)
    extra = set(choice.scan) - {"0.3", "0.9"}
    assert set(choice.scan) >= {"0.3", "0.9"} and len(extra) <= declare.DOSE_REFINEMENTS
    assert all(0.0 < float(d) < 0.9 for d in extra)
    assert choice.target == pytest.approx(atmg.STABLE_MARGIN)
    assert result.control.dose == (
        pytest.approx(choice.dose, abs=1e-3) if choice.calibrated else 0.3
    )
    claims = {c.key: c for c in result.claims}
    assert all(c.two_level for c in claims.values())
    for key in ("atmg_vs_meru", "meru_drops"):
        assert claims[key].holm_verdict == kit.NOT_REPRODUCED
        # the bound is the upper end of the interval the page shows (seeds and test items)
        high = 100 * claims[key].effect.high
        assert "a drop of 28.4 points is " in claims[key].note
        assert f"upper bound {high:.2f}" in claims[key].note
    assert claims["stable"].holm_outcome == kit.TOO_SHORT  # 2 steps < 50
    # the arms' metric is the claim's: zero-shot top-1, between 0 and 1
    assert result.arms_metric == "test zeroshot/top1"
    assert all(0 <= v <= 1 for arm in result.arms.values() for v in arm.values())
    for arm in study.arms:
        starts = result.starts[arm.label]
        assert {"3", "4"} <= set(starts) and all(s["checked"] for s in starts.values())
        assert all(s["resolved_init"] for s in starts.values())
    low = result.starts["atmg c=0.1"]
    assert all("flat_geometry" not in [w["code"] for w in s["warnings"]] for s in low.values())
    assert all(s["resolved_init"]["tangent_norm_init"] > 1 for s in low.values())
    json.dumps(result.to_json())  # JSON-ready, and read back as the same record
    assert StudyResult.from_json(result.to_json()) == result
    text = page.study_page(result)
    assert "Step-0 health" in text and "Power, planned on a pilot" in text
    assert "hierarchy ordering" in text and "test zeroshot/top1" in text
    assert text.count("| study | claim |") == 1  # the verdict table once
    assert math.isfinite(claims["stable"].effect.mean)
