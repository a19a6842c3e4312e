"""proclip-product as a declaration: the product against the best single geometry of each seed,
with an interval over seeds and test items, and a label-noise control whose dose a pilot scans
(and which can fail)."""

from __future__ import annotations

import types

import pytest

from curvalign.stats import ItemTotals
from curvalign_lab import declare, kit
from curvalign_lab.studies import proclip_product as pp

TINY = "synthetic:images=160,text_pairs=60,captions_max=3,depth=2,branching=2,templates=2"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16", "hidden_dim=16"]


def _eval(hits: list[float]):
    """A fake evaluation whose mean R@1 is the mean of ``hits`` (one part, one item each)."""
    totals = ItemTotals([hits], [[1.0] * len(hits)])
    return types.SimpleNamespace(
        metrics=types.SimpleNamespace(mean_r1=sum(hits) / len(hits)),
        items=types.SimpleNamespace(totals=lambda metric: totals),
    )


def test_the_claim_is_the_product_minus_the_best_single_geometry_of_each_seed():
    bench = types.SimpleNamespace(steps=150, lr_choice={})
    trained = declare.Trained(bench, [0, 1])  # type: ignore[arg-type]
    r1 = {  # per arm, per seed: hits of 4 test items
        pp.PRODUCT: {0: [1, 1, 1, 0], 1: [1, 1, 0, 0]},
        "hyperbolic only": {0: [1, 0, 0, 0], 1: [1, 1, 1, 0]},
        "euclidean only": {0: [1, 1, 0, 0], 1: [0, 0, 0, 0]},
        "sphere only": {0: [0, 0, 0, 0], 1: [1, 0, 0, 0]},
    }
    for arm, seeds in r1.items():
        trained.evals[arm] = {s: _eval([float(h) for h in hits]) for s, hits in seeds.items()}
    m = pp.measure(trained)["product"]
    # seed 0: the best single is euclidean (0.5): 0.75 - 0.5; seed 1: hyperbolic (0.75)
    assert m.effect == pytest.approx({0: 0.25, 1: -0.25})
    assert m.items is not None
    product, rival = m.items
    assert [t.sums.sum() for t in rival] == [2.0, 3.0]  # the seed's own best single
    assert [t.sums.sum() for t in product] == [3.0, 2.0]
    assert "hyperbolic only" in m.note and "sphere only" in m.note
    # the interval counts seeds and test items: never narrower than the seeds' own
    iv = declare.claim_interval(m, [0, 1])
    assert iv.n == 2 and iv.mean == pytest.approx(0.0)
    assert iv.high - iv.low >= kit.difference({0: 0.25, 1: -0.25}, {0: 0.0, 1: 0.0}).high * 2 - 1e-9


def test_a_label_noise_control_that_costs_less_than_two_points_cannot_calibrate():
    study = pp.STUDY
    assert study.control is not None and len(study.control.handicap.doses) >= 3
    # the noise costs 0.5 to 1.9 points at every scanned share: no dose reaches the 2 points
    weak = {d: {0: e, 1: e} for d, e in ((0.1, 0.005), (0.3, 0.012), (0.6, 0.019))}
    choice = declare.choose_dose(study, weak)
    assert choice.target == pytest.approx(0.02) and not choice.calibrated
    clear = {"product": declare.Measured({0: 0.05, 1: 0.06, 2: 0.055})}
    claims = declare.decide_claims(
        study, clear, {0: 0.019, 1: -0.01, 2: 0.04}, [0, 1, 2], 150, None, "control"
    )
    assert claims[0].verdict != kit.HOLDS and claims[0].outcome == kit.UNDETECTABLE
    strong = {d: {0: e, 1: e} for d, e in ((0.1, 0.004), (0.3, 0.05), (0.6, 0.2))}
    good = declare.choose_dose(study, strong)
    assert good.calibrated and 0.1 < good.dose < 0.3


def test_the_pilot_scans_the_noise_and_plans_the_seeds_at_tiny_size(tmp_path, one_thread):
    from curvalign_lab.runner import run_study

    result = run_study(
        "proclip-product",
        tmp_path / "p",
        steps=2,
        seeds=2,
        data=TINY,
        overrides=TINY_TRAIN,
        lr_grid=(),
        power=True,
        max_seeds=2,
    )
    plan = result.power_plan
    assert plan.pilot_seeds == 2 and plan.max_seeds == 2 and plan.seeds == 2
    assert plan.pilot_seed_base == declare.PILOT_OFFSET and result.seeds == (0, 1)
    assert set(plan.per_claim) == {"product"}
    # the declared doses, and the dose first read off them where it is a new one (refinement)
    extra = set(result.control.choice.scan) - {"0.1", "0.3", "0.6"}
    assert set(result.control.choice.scan) >= {"0.1", "0.3", "0.6"}
    assert len(extra) <= declare.DOSE_REFINEMENTS and all(0.0 < float(d) < 0.6 for d in extra)
    claim = result.claims[0]
    assert claim.two_level and claim.outcome == kit.TOO_SHORT and claim.planned_n_text
    # every arm went through the step-0 check, with its warm start recorded
    starts = result.starts[pp.PRODUCT]
    assert all(s["checked"] and s["warm_start"] is not None for s in starts.values())
    runs = {p.name for p in (tmp_path / "p" / "runs").iterdir()}
    assert any(n.endswith("-s1000") for n in runs) and any(n.endswith("-s0") for n in runs)
    assert "--power --max-seeds 2" in result.command
    md = (tmp_path / "p" / "study.md").read_text()
    assert "Power, planned on a pilot" in md and "proclip_arms" in md
