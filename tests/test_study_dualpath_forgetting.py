"""dualpath-forgetting as a declaration: two phases measured at the Phase-1 end and at the end,
forced forgetting of a dose-sized share as its control (scanned on a pilot, so it can fail to
separate), intervals over seeds and held-out test pairs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from curvalign.errors import ConfigError
from curvalign.stats import Interval, mean_interval
from curvalign_lab import declare, kit
from curvalign_lab.common import load_study_data
from curvalign_lab.records import ClaimResult
from curvalign_lab.studies import dualpath_forgetting as dp

DATA = declare.QUICK_WORLD + ",paraphrase_topics=8,heldout_pairs=40"
TRAIN = (*declare.QUICK_OVERRIDES, *dp.STUDY.quick_overrides)


def _bench(tmp_path, steps: int = 4) -> tuple[kit.Bench, object]:
    store, world = load_study_data(DATA)
    bench = kit.Bench(tmp_path, store, DATA, steps, list(TRAIN), val_every=1, max_steps=steps)
    return bench, world


def test_shuffled_partners_corrupt_a_dose_sized_share():
    store, _ = load_study_data(DATA)
    n = len(store.pair_scores)
    same = dp.shuffled_partners(store, 0.0, seed=3)
    assert torch.equal(same.pair_b.features, store.pair_b.features)
    half = dp.shuffled_partners(store, 0.5, seed=3)
    moved = (half.pair_b.features != store.pair_b.features).any(dim=1)
    # only the chosen half may move (a partner permuted onto itself stays), the scores stay
    assert 0 < int(moved.sum()) <= round(0.5 * n)
    assert torch.equal(half.pair_scores, store.pair_scores)
    everything = dp.shuffled_partners(store, 1.0, seed=3)
    assert int((everything.pair_b.features != store.pair_b.features).any(dim=1).sum()) > moved.sum()
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        dp.shuffled_partners(store, 1.5, seed=3)


def test_forced_forgetting_starts_at_the_end_of_phase_1(tmp_path, one_thread):
    # the full arm and its control at the largest dose, two seeds, through the declared runner's
    # training (``Phases``: marks, probes, last weights; ``Handicap.start``)
    study = dataclasses.replace(dp.STUDY, arms=dp.STUDY.arms[:1])
    bench, world = _bench(tmp_path)
    trained, effects = declare.train_arms(study, bench, [0, 1], [1.0], world)
    label = declare.control_label(study, 1.0)
    for arm in (dp.FULL, label):
        for seed in (0, 1):
            probes = trained.probes[arm][seed]
            assert set(probes) == {dp.PHASE1, "end"}
            assert probes["end"]["pair_scores"].shape == (20,)  # the 20 held-out test pairs
    for seed in (0, 1):
        full, ctrl = trained.probes[dp.FULL][seed], trained.probes[label][seed]
        # up to the switch the control trains on the study's store: identical by construction
        assert torch.equal(full[dp.PHASE1]["pair_scores"], ctrl[dp.PHASE1]["pair_scores"])
        # from the switch on, on shuffled partners: the end differs
        assert not torch.equal(full["end"]["pair_scores"], ctrl["end"]["pair_scores"])
        # the control's effect is on the claim's metric: the change of the skill
        assert effects[1.0][seed] == pytest.approx(
            dp.change(trained, dp.FULL, seed) - dp.change(trained, label, seed)
        )
    # the interval counts the seeds and the test pairs: never narrower than the seeds' own
    two_level = dp._changes_interval(trained, dp.FULL, None)
    seeds_only = mean_interval([dp.change(trained, dp.FULL, s) for s in (0, 1)])
    assert two_level.n == 2 and two_level.mean == pytest.approx(seeds_only.mean)
    assert two_level.high - two_level.low >= seeds_only.high - seeds_only.low - 1e-12
    # the difference of an arm with itself is exactly 0, items and all
    same = dp._changes_interval(trained, dp.FULL, dp.FULL)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)


def _decide(control_effect: float, spread: float = 0.001) -> dict[str, ClaimResult]:
    """The study's claims decided on clear per-seed effects (every claim's interval well above
    its threshold) with a control whose effect is ``control_effect`` give or take ``spread``."""
    seeds = [0, 1, 2, 3]
    measured = {
        c.key: declare.Measured(
            {s: 0.05 for s in seeds}, interval=Interval(0.05, 0.04, 0.06, len(seeds))
        )
        for c in dp.STUDY.claims
    }
    control = {s: control_effect + spread * (s - 1.5) for s in seeds}
    claims = declare.decide_claims(
        dp.STUDY, measured, control, seeds, steps=400, plans=None, control_what="forced"
    )
    return {c.key: c for c in claims}


def test_the_forgetting_control_fails_when_a_margin_sized_effect_would_not_separate():
    # a control whose interval is wider than the margin (2 points) on each side cannot let a
    # claim hold, however clear the claim's own interval: at that noise a 2-point effect would
    # not separate (a large forced forgetting, 31 points give or take 5, is such a control)
    weak = _decide(0.31, spread=0.03)
    assert not weak["kept"].control_ok and weak["kept"].control_min == dp.MARGIN
    assert weak["kept"].outcome == kit.UNDETECTABLE
    # one that does not leave 0 fails too
    assert not _decide(0.01, spread=0.02)["kept"].control_ok
    strong = _decide(0.03)
    assert strong["kept"].control_ok and strong["kept"].verdict == kit.HOLDS
    # the other claims are controlled by its sign; none of them is calibrated on it
    assert all(strong[k].control_min == 0.0 for k in ("gate", "opened", "pairs"))
    # a scan that never reaches the margin: no dose, the control cannot calibrate
    choice = declare.choose_dose(dp.STUDY, {0.02: {0: 0.001}, 0.4: {0: 0.01}})
    assert choice.dose is None and not choice.calibrated
    choice = declare.choose_dose(dp.STUDY, {0.02: {0: 0.01}, 0.4: {0: 0.05}})
    assert choice.calibrated and 0.02 < choice.dose < 0.4


def test_the_pilot_scans_the_dose_and_plans_the_seeds(tmp_path, one_thread):
    # the pilot path at tiny size: one dose scanned (the scan starts from no effect at dose 0),
    # the seeds planned (capped at 2), on a smaller world
    handicap = dataclasses.replace(dp.STUDY.control.handicap, doses=(1.0,))
    study = dataclasses.replace(
        dp.STUDY, control=dataclasses.replace(dp.STUDY.control, handicap=handicap)
    )
    result = declare.run_declared(
        study,
        tmp_path / "dp",
        steps=2,
        data=DATA.replace("images=160", "images=100"),
        overrides=TRAIN,
        seeds=2,
        power=True,
        max_seeds=2,
        lr_grid=None,
    )
    choice = result.control.choice
    assert set(choice.scan) == {"1"} and choice.target == pytest.approx(dp.MARGIN)
    assert result.control.dose == (
        pytest.approx(choice.dose, rel=1e-2) if choice.calibrated else handicap.dose
    )
    plan = result.power_plan
    assert "kept" in plan.per_claim and plan.pilot_seed_base == declare.PILOT_OFFSET
    claims = {c.key: c for c in result.claims}
    assert set(claims) == {"kept", "gate", "opened", "pairs"}
    assert all("shuffled" in c.control_what for c in claims.values())
    assert all(
        c.outcome == kit.TOO_SHORT or c.verdict == kit.NOT_REPRODUCED for c in claims.values()
    )
    # every arm and the control went through the step-0 check
    assert set(result.starts) >= {a.label for a in dp.STUDY.arms}
    assert any(k.startswith("control:") for k in result.starts)
    assert all(math.isfinite(v) for v in result.arms[dp.FULL].values())
