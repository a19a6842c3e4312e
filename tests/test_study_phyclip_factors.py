"""phyclip-factors as a declaration: retrieval claims with item-level intervals and a label-noise
control scanned on a pilot; composition claims on precision@5 per test leaf pair, with a control
applied when measuring (a share of the second concept's factors from a wrong partner) whose
dose the pilot scans, so it can fail to separate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from curvalign.recipes.phyclip import Phyclip
from curvalign.stats import Interval
from curvalign_lab import declare, kit
from curvalign_lab.common import load_study_data
from curvalign_lab.records import ClaimResult
from curvalign_lab.studies import phyclip_factors as ph

DATA = declare.QUICK_WORLD + ",leaf_pairs=4"
TRAIN = declare.QUICK_OVERRIDES


def test_tangent_sum_composition_in_one_hyperbolic_space():
    from curvalign.geometry import lorentz
    from curvalign.recipes.phyclip import PhyclipConfig

    torch.manual_seed(5)
    r = Phyclip(PhyclipConfig(num_factors=1, factor_dim=4), 10, 8)
    a = r.embed_texts(torch.randn(3, 8))
    b = r.embed_texts(torch.randn(3, 8))
    c = float(r.curvature().detach()[0])
    composed = ph.tangent_sum_compose(r)(a, b)["point"]
    assert composed.shape == a["point"].shape == (3, 1, 4)
    va, vb = lorentz.logmap0(a["point"][:, 0], c), lorentz.logmap0(b["point"][:, 0], c)
    torch.testing.assert_close(composed[:, 0], lorentz.expmap0(va + vb, c), rtol=1e-4, atol=1e-5)
    # unlike the factor-wise max, the sum is neither input when both are nonzero
    assert not torch.allclose(composed, a["point"]) and not torch.allclose(composed, b["point"])


def test_a_share_of_wrong_factors_is_the_composition_handicap(tmp_path, one_thread):
    store, world = load_study_data(DATA)
    bench = kit.Bench(tmp_path, store, DATA, 4, list(TRAIN), val_every=2)
    recipe = bench.untrained(Phyclip.name, ph.STUDY.arms[2].options, 0)  # k=16
    intact = ph.composition_precision(recipe, store, world, swap=0.0, seed=0)
    assert intact is not None
    pairs = intact["composed"].shape[0]
    assert pairs >= 2 and all(v.shape == (pairs,) for v in intact.values())
    # dose 0: no factor moves, the handicapped composition is the composition itself
    assert torch.equal(intact["handicapped"], intact["composed"])
    # dose 1: every factor of the second concept is the wrong partner's, whatever the draw
    wrong = [ph.composition_precision(recipe, store, world, swap=1.0, seed=s) for s in (0, 1)]
    assert torch.equal(wrong[0]["handicapped"], wrong[1]["handicapped"])
    assert torch.equal(wrong[0]["composed"], intact["composed"])
    # a store without the world's ground truth: no composition
    assert ph.composition_precision(recipe, store, None) is None


def _decide(control_effect: float, spread: float = 0.001) -> dict[str, ClaimResult]:
    """The study's claims decided on clear effects, the composition claims' measured control
    at ``control_effect`` (every seed but one a little above it), the retrieval control strong."""
    seeds = [0, 1, 2, 3]
    measured = {
        c.key: declare.Measured(
            {s: 0.08 for s in seeds}, interval=Interval(0.08, 0.06, 0.10, len(seeds))
        )
        for c in ph.STUDY.claims
    }
    mc = ph.STUDY.measured_controls[0]
    weak = {s: control_effect + spread * (s - 1.5) for s in seeds}
    per_claim = {k: (weak, mc.text(0.1), k == mc.claim) for k in mc.claims}
    claims = declare.decide_claims(
        ph.STUDY,
        measured,
        {s: 0.03 + 0.001 * s for s in seeds},
        seeds,
        steps=150,
        plans=None,
        control_what="noise",
        measured_controls=per_claim,
    )
    return {c.key: c for c in claims}


def test_the_composition_control_fails_when_a_claim_sized_effect_would_not_separate():
    # the composition control's interval does not leave 0 (P@5 noise wider than the claim's 5
    # points): however clear the composition effect, the claim cannot hold; the retrieval claims
    # keep their own control
    weak = _decide(0.02, spread=0.04)
    assert not weak["composition"].control_ok
    assert weak["composition"].control_min == pytest.approx(ph.COMPOSITION_EFFECT)
    assert weak["composition"].outcome == kit.UNDETECTABLE
    assert "factors" in weak["composition"].control_what
    assert weak["k"].control_ok and weak["k"].verdict == kit.HOLDS
    strong = _decide(0.06)
    assert strong["composition"].control_ok and strong["composition"].verdict == kit.HOLDS
    # the second composition claim uses the same control, calibrated on the first
    assert strong["composition-vs-sum"].control == strong["composition"].control
    assert strong["composition-vs-sum"].control_min == 0.0


def test_measured_controls_are_checked():
    mc = ph.STUDY.measured_controls[0]
    with pytest.raises(Exception, match="measured control"):
        dataclasses.replace(ph.STUDY, measured_controls=(dataclasses.replace(mc, claims=("k",)),))
    with pytest.raises(Exception, match="measured control"):
        dataclasses.replace(
            ph.STUDY, measured_controls=(dataclasses.replace(mc, claims=(mc.claim, "nope")),)
        )


def test_the_pilot_scans_both_controls(tmp_path, one_thread):
    # the pilot path at tiny size, the arms the claims compare (k=1, k=16, its ℓ2 variant), one
    # label-noise dose and every composition dose (measured: no training)
    study = dataclasses.replace(
        ph.STUDY,
        arms=tuple(a for a in ph.STUDY.arms if a.label != "k=4"),
        control=dataclasses.replace(
            ph.STUDY.control,
            handicap=dataclasses.replace(ph.STUDY.control.handicap, doses=(0.9,)),
        ),
    )
    result = declare.run_declared(
        study,
        tmp_path / "ph",
        steps=2,
        data=DATA,
        overrides=TRAIN,
        seeds=2,
        power=True,
        max_seeds=2,
        lr_grid=None,
    )
    (mc,) = result.measured_controls
    assert mc.claims == ("composition", "composition-vs-sum")
    scan = mc.choice.scan
    assert set(scan) == {f"{d:g}" for d in ph.STUDY.measured_controls[0].doses}
    assert mc.choice.target == pytest.approx(ph.COMPOSITION_EFFECT)
    if mc.choice.calibrated:
        assert mc.dose == pytest.approx(mc.choice.dose, rel=1e-2)
    else:
        assert mc.dose == ph.STUDY.measured_controls[0].dose
    # the declared dose, and the dose first read off it where it is a new one (refinement)
    extra = set(result.control.choice.scan) - {"0.9"}
    assert "0.9" in result.control.choice.scan and len(extra) <= declare.DOSE_REFINEMENTS
    assert all(0.0 < float(d) < 0.9 for d in extra)
    claims = {c.key: c for c in result.claims}
    # intervals over seeds and test items (test images, test leaf pairs) for every claim
    assert all(c.two_level for c in claims.values())
    assert "factors" in claims["composition"].control_what
    assert "captions" in claims["k"].control_what
    assert all(c.outcome == kit.TOO_SHORT for c in claims.values())
    assert "applied when measuring" in result.markdown
