"""agr-curriculum as a declaration: its routing statistics measured during training through the
trainer's hooks, the learning rate chosen where the query gate opens, Theorem 5.3's premise read
from the runs' logs, and a control whose dose a pilot scans (and which can fail)."""

from __future__ import annotations

import json
import math
import types

import pytest

from curvalign_lab import declare, kit, rules
from curvalign_lab.studies import agr_curriculum as agr

TINY = "synthetic:images=160,text_pairs=60,captions_max=3,depth=2,branching=2,templates=2"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16"]
#: the pilot test's world: smaller still (no text pairs, one prompt template)
PILOT_WORLD = "synthetic:images=96,text_pairs=0,captions_max=3,depth=2,branching=2,templates=1"


def _tiny_world():
    from curvalign.data.synthetic import config_from_spec, make_world

    return make_world(config_from_spec(TINY.removeprefix("synthetic:")))


def test_decay_rate_and_routing_class():
    # L(t) = 2 exp(-0.01 t), logged every 10 steps; the rate is read up to step 100 only
    log = [{"step": t, "loss_euclidean": 2 * math.exp(-0.01 * t)} for t in range(10, 201, 10)]
    log[-1]["loss_euclidean"] = 100.0  # after `until`: ignored
    assert agr.decay_rate(log, "loss_euclidean", 100) == pytest.approx(0.01, rel=1e-9)
    assert math.isnan(agr.decay_rate(log, "loss_hyperbolic", 100))
    assert agr.routing_class(0.93) == "Euclidean dominance"
    assert agr.routing_class(0.047) == "hyperbolic dominance"  # the four-phase arm's 0.047
    assert agr.routing_class(0.15) == "balanced"


def test_agr_routing_claims_need_an_open_gate() -> None:
    """With the query gate shut the router is barely trained, so w̄ cannot test Theorem 5.3."""
    gate = agr.agr_gate_precondition
    assert gate({"single": 0.997, "four-phase": agr.AGR_GATE_OPEN}) is None
    shut = gate({"single": 0.02, "four-phase": 0.9})
    assert shut is not None and "single g = 0.02" in shut and "four-phase" not in shut
    assert gate({"single": float("nan")}) is not None


def test_the_learning_rate_is_chosen_where_the_precondition_holds(tmp_path, monkeypatch):
    """AGR's routing claims need an open query gate: a rate whose model keeps it shut scores
    -inf on the grid, so the choice falls on a rate where the claim can be tested, and each
    excluded rate is kept with its reason."""
    store = _tiny_world()
    bench = kit.Bench(tmp_path, store, "synthetic", 4, [], val_every=2, lr_grid=(1e-3, 1e-2, 1e-1))

    def fake_fit(label, recipe, extra, seed, **kwargs):
        lr = float(next(e for e in extra if e.startswith("lr=")).split("=")[1])
        # validation rises with the rate; the gate opens only below 0.05
        return types.SimpleNamespace(best_val=lr, recipe=types.SimpleNamespace(gate=lr < 0.05))

    monkeypatch.setattr(bench, "_fit", fake_fit)
    chosen = bench.choose_lr(
        "single", "agr", [], admissible=lambda m: None if m.gate else "gate shut"
    )
    assert chosen == 1e-2
    assert bench.lr_choice["single"].excluded == {"0.1": "gate shut"}
    assert "rates excluded where the claim's precondition failed: 0.1" in bench.lr_text()
    # without the precondition the top of the grid wins
    assert bench.choose_lr("other", "agr", []) == 1e-1


def test_the_declared_precondition_reads_the_gate_on_validation_pairs(tmp_path, monkeypatch):
    """``STUDY.admissible`` (what ``Bench.choose_lr`` gets for every arm) measures the gate on
    the validation split's matched pairs, never on the test split, and says why a rate fails."""
    from curvalign_lab.common import matched_test_pairs

    bench = kit.Bench(tmp_path, _tiny_world(), "synthetic", 4, [], val_every=2)
    seen = []

    def routing(recipe, store, image_ids, text_ids):
        seen.append(image_ids)
        return {"gate": recipe}

    monkeypatch.setattr(agr, "_routing_on", routing)
    assert agr.STUDY.admissible is not None
    admissible = agr.STUDY.admissible(bench)
    assert admissible(0.1) == f"query gate g = 0.1 < {agr.AGR_GATE_OPEN:g}"
    assert admissible(0.9) is None
    val_ids, _ = matched_test_pairs(bench.store, "val")
    assert all(ids.equal(val_ids) for ids in seen)
    assert not set(val_ids.tolist()) & set(bench.store.split_image_ids("test").tolist())


def test_the_control_flattens_the_hyperbolic_score_at_a_fixed_temperature():
    """The handicap is of the training (the store is left as it is): a fixed tau_H at the dose,
    never learnt back to the paper's 1, read by the recipe's own config parser."""
    from curvalign.config import resolve_config

    assert agr.STUDY.control is not None
    handicap = agr.STUDY.control.handicap
    assert handicap.options is agr.hyperbolic_flattened and len(handicap.doses) >= 3
    assert min(handicap.doses) > 1.0 and handicap.dose == max(handicap.doses)
    options = agr.hyperbolic_flattened(10.0, 450)
    assert options == ("tau_h_init=10", "learn_tau_h=false")
    config = resolve_config("agr", "synthetic", overrides=[*agr.curriculum(450), *options])
    assert config.recipe_config["tau_h_init"] == 10.0
    assert config.recipe_config["learn_tau_h"] is False
    store = object()
    assert handicap.apply(store, 10.0, 0) is store


def _fake_trained(tmp_path, w, gates, losses):
    """A ``Trained`` without training: ``w[arm][seed]`` w̄ at T_w, ``gates[arm]`` the gate, and
    per (arm, seed) a log whose branch losses decay at ``losses`` = (lambda_E, lambda_H)."""
    steps = 450
    t_w = agr.warmup_end(steps)
    bench = types.SimpleNamespace(steps=steps, lr_choice={})
    trained = declare.Trained(bench, [0, 1])  # type: ignore[arg-type]
    for arm, per_seed in w.items():
        for seed, value in per_seed.items():
            run_dir = tmp_path / f"{arm}-{seed}"
            run_dir.mkdir(parents=True)
            lam_e, lam_h = losses
            log = [
                {
                    "step": t,
                    "loss_euclidean": math.exp(-lam_e * t),
                    "loss_hyperbolic": math.exp(-lam_h * t),
                }
                for t in range(5, t_w + 1, 5)
            ]
            (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
            trained.runs.setdefault(arm, {})[seed] = types.SimpleNamespace(run_dir=run_dir)
            stats = {"w_mean": value, "gate": gates[arm], "euclidean_share": value / 2}
            trained.during.setdefault(arm, {})[seed] = {t_w: stats, steps: stats}
    return trained


def test_measure_reads_the_marks_and_the_premise_from_the_logs(tmp_path):
    w = {"single": {0: 0.95, 1: 0.93}, "four-phase": {0: 0.2, 1: 0.1}}
    trained = _fake_trained(tmp_path / "a", w, {"single": 0.9, "four-phase": 0.8}, (0.01, 0.002))
    m = agr.measure(trained)
    assert m["dominance"].effect == pytest.approx({0: 0.05, 1: 0.03})
    assert m["single>four"].effect == pytest.approx({0: 0.75, 1: 0.83})
    assert m["share"].effect == pytest.approx({0: 0.375, 1: 0.415})
    assert all(x.precondition is None for x in m.values())
    assert "Euclidean dominance" in m["dominance"].note
    # the premise fails (lambda_E < 2 lambda_H) and a gate is shut: not testable, with both why
    shut = _fake_trained(tmp_path / "b", w, {"single": 0.02, "four-phase": 0.8}, (0.003, 0.002))
    why = agr.measure(shut)["single>four"].precondition
    assert why is not None and "lambda_E > 2 lambda_H" in why and "single g = 0.02" in why
    # the control's effect: w̄ of the handicapped four-phase arm over the clean one
    label = "control"
    shut.during[label] = {
        s: {k: {"w_mean": 0.9} for k in v} for s, v in shut.during["four-phase"].items()
    }
    assert agr.control_effect(shut, label, 0) == pytest.approx(0.7)
    text = agr.tables(shut, agr.measure(shut))
    assert "| control | T_w |" in text and "no grid" in text


def test_a_control_that_cannot_reach_the_claim_size_makes_the_claims_unable_to_hold():
    """The pilot's scan: a flattening that never moves w̄ by the claim's 0.78 is not
    calibrated, and with it the claim it sizes cannot hold however clear its effect."""
    study = agr.STUDY
    weak = {3.0: {0: 0.05, 1: 0.07}, 10.0: {0: 0.1, 1: 0.12}, 30.0: {0: 0.3, 1: 0.2}}
    choice = declare.choose_dose(study, weak)
    assert choice.target == pytest.approx(0.78) and not choice.calibrated
    strong = {3.0: {0: 0.3, 1: 0.3}, 10.0: {0: 0.7, 1: 0.9}, 30.0: {0: 0.9, 1: 0.95}}
    good = declare.choose_dose(study, strong)
    assert good.calibrated and 3.0 < good.dose < 30.0
    assert good.dose == pytest.approx(
        rules.dose_for_effect([3.0, 10.0, 30.0], [0.3, 0.8, 0.925], 0.78)
    )
    clear = {
        s: declare.Measured({0: 0.8, 1: 0.82, 2: 0.79})
        for s in ("dominance", "single>four", "share")
    }
    # a control that does not leave 0 at this noise: no claim can hold on it
    weak_control = {0: 0.9, 1: -0.3, 2: 0.3}
    claims = declare.decide_claims(study, clear, weak_control, [0, 1, 2], 450, None, "control")
    sized = next(c for c in claims if c.key == "single>four")
    assert sized.holm_verdict != kit.HOLDS and not sized.control_ok
    strong_control = {0: 0.8, 1: 0.85, 2: 0.9}
    claims = declare.decide_claims(study, clear, strong_control, [0, 1, 2], 450, None, "control")
    assert next(c for c in claims if c.key == "single>four").holm_verdict == kit.HOLDS


def test_the_pilot_scans_the_control_and_plans_the_seeds_at_tiny_size(
    tmp_path, one_thread, monkeypatch
):
    """The whole declared path at tiny size: a pilot on a disjoint base scans the control's
    doses, every arm and the control are measured at T_w and at the end during training, and
    the page carries the learning-rate, routing and Definition 5.2 tables."""
    from curvalign_lab.runner import run_study

    monkeypatch.setattr(agr, "EMBED_DIM", 16)  # the curriculum's options read it per call
    result = run_study(
        "agr-curriculum",
        tmp_path / "agr",
        steps=3,
        seeds=2,
        data=PILOT_WORLD,
        overrides=TINY_TRAIN,
        lr_grid=(),
        power=True,
        max_seeds=2,
    )
    plan = result.power_plan
    assert plan.pilot_seed_base == declare.PILOT_OFFSET and result.seeds == (0, 1)
    scan = result.control.choice.scan
    assert set(scan) == {"3", "10", "30"}
    # 3 steps is below the claims' budget; the routing statistics were measured at T_w = 2
    for claim in result.claims:
        assert claim.outcome == kit.TOO_SHORT or claim.verdict == kit.NOT_REPRODUCED
    assert result.starts["four-phase"] and result.starts["single"]
    md = (tmp_path / "agr" / "study.md").read_text()
    assert "Learning rate and its precondition" in md and "| four-phase | T_w |" in md
    assert "Definition 5.2" in md and "Power, planned on a pilot" in md
    assert md.count("Routing statistics (x100") == 1  # the body is not repeated
    runs = tmp_path / "agr" / "runs"
    assert any(p.name.endswith("-s1000") for p in runs.iterdir())
