"""A study is a declaration in one file: a toy study declared here runs through the one runner
(training through ``fit``, the decision rules, the page), with a pilot that plans its seeds and
sizes its control by a dose-response scan; and a registered study runs with ``--quick``."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from curvalign.report.tables import to_jsonable
from curvalign_lab import declare, kit, page, rules
from curvalign_lab.records import PlanRecord, StudyResult

TOY_DATA = "synthetic:images=120,text_pairs=0,captions_max=3,val_fraction=0.25"
TOY_TRAIN = ("batch_size=16", "pair_batch_size=16")


def _measure(trained: declare.Trained) -> dict[str, declare.Measured]:
    # the claim: CLIP at 16 dimensions beats CLIP at 2 (on mean R@1), paired per seed; a
    # precondition claim: the wide arm learns at all (trained - the step-0 validation value)
    wide = trained.difference("clip d16", "clip d2")
    learned = {
        s: (run.best_val or 0.0) - (run.val_history[0][1] if run.val_history else 0.0)
        for s, run in trained.runs["clip d16"].items()
    }
    return {"wider": wide, "learns": declare.Measured(learned)}


TOY = declare.Study(
    name="toy-width",
    paper='"Wider heads retrieve better" (a toy claim, no paper).',
    claims=(
        declare.Claim(
            "wider",
            "clip d16 beats clip d2 (mean R@1)",
            words="wider heads retrieve better",
            source="toy, Sec. 1",
            effect=0.05,
            min_steps=2,
        ),
        declare.Claim(
            "learns",
            "clip d16 improves on its start (validation)",
            words="training helps",
            source="toy, Sec. 0",
            effect=None,
            role="precondition",
        ),
    ),
    arms=(
        declare.Arm("clip d16", "clip", ("embed_dim=16",)),
        declare.Arm("clip d2", "clip", ("embed_dim=2",)),
    ),
    measure=_measure,
    control=declare.Control("clip d16", declare.label_noise()((0.3, 0.9), 0.5), "wider"),
    data=TOY_DATA,
    steps=4,
    validations=2,
    baselines=("the step-0 head",),
    preconditions=("the wide arm learns",),
)


def test_a_toy_study_declared_in_one_file_runs_plans_and_writes_its_page(tmp_path, one_thread):
    result = declare.run_declared(
        TOY,
        tmp_path / "toy",
        seeds=2,
        seed_base=7,
        power=True,
        max_seeds=3,
        overrides=TOY_TRAIN,
        lr_grid=None,
    )
    plan = result.power_plan
    assert plan is not None
    # the pilot ran on a disjoint base and planned the tested claim only
    assert plan.pilot_seed_base == 7 + declare.PILOT_OFFSET
    assert set(plan.per_claim) == {"wider"}
    wider = plan.per_claim["wider"]
    assert isinstance(wider, PlanRecord)
    assert wider.cap == 3 and wider.pilot_n == 2 and wider.kind == rules.SUPERIORITY
    # the claim counts its test items, so its plan counts their SE (more seeds do not shrink it)
    assert wider.item_se > 0
    assert result.seeds == tuple(range(7, 7 + plan.seeds))
    # the control's seeds are planned on its own pilot noise, at that SD's 80% upper limit; the
    # run takes the most any plan asks (the cap for an underpowered one), at least MIN_SEEDS
    control_plan = plan.controls["wider"]
    assert control_plan.kind == "control" and control_plan.target == pytest.approx(0.05)
    assert control_plan.cap == 3 and control_plan.pilot_n in (2, 4)
    if control_plan.pilot_sd > 0:
        assert control_plan.planned_sd > control_plan.pilot_sd
    assert plan.seeds == min(3, max(rules.MIN_SEEDS, wider.n, control_plan.n))
    # the control's dose came from the pilot's scan of both doses, and of the dose first read
    # off them where that is a new one (one refinement, declare.DOSE_REFINEMENTS)
    control = result.control
    assert control is not None and control.choice is not None
    scanned = set(control.choice.scan)
    assert scanned >= {"0.3", "0.9"} and len(scanned) <= 2 + declare.DOSE_REFINEMENTS
    assert control.doses_scanned == tuple(float(d) for d in control.choice.scan)
    if len(scanned) == 2:  # nothing new to measure: no dose read, or a scanned one
        first = control.choice.dose
        assert first is None or any(math.isclose(float(f"{first:.3g}"), d) for d in (0.3, 0.9))
    else:
        (extra,) = scanned - {"0.3", "0.9"}
        assert 0.0 < float(extra) < 0.9
    # the scan keeps its per-seed effects: the control's plan pools them near the chosen dose
    assert set(control.choice.per_seed) == scanned
    for dose, by_seed in control.choice.per_seed.items():
        assert set(by_seed) == {"1007", "1008"}
        assert control.choice.scan[dose] == pytest.approx(sum(by_seed.values()) / 2)
    assert control.choice.target == pytest.approx(0.05)
    if control.choice.calibrated:
        assert control.dose is not None and 0.0 < control.dose <= 0.9
    else:
        assert control.dose == 0.5
    claims = {c.key: c for c in result.claims}
    # the claim about a test metric counts seeds and test items
    assert claims["wider"].two_level and claims["wider"].effect.n == len(result.seeds)
    assert claims["wider"].holm_family == 1 and claims["learns"].holm_family is None
    # the claim carries its plan, and was decided with it
    assert claims["wider"].plan == wider and claims["wider"].inputs.plan == wider
    # underpowered only by plan
    if wider.underpowered:
        assert claims["wider"].holm_verdict in (kit.UNDERPOWERED, kit.HOLDS, kit.DOES_NOT_HOLD)
    else:
        assert claims["wider"].holm_verdict != kit.UNDERPOWERED
    # every arm's start is recorded (step-0 health and resolved start)
    assert result.starts is not None
    for arm in ("clip d16", "clip d2"):
        starts = result.starts[arm]
        assert set(starts) >= {str(s) for s in result.seeds}
        assert all(s["checked"] for s in starts.values())
        assert all(isinstance(s["resolved_init"], dict) for s in starts.values())
    # JSON-ready, and read back as the same record (also through the JSON text)
    data = result.to_json()
    assert StudyResult.from_json(data) == result
    text_json = json.dumps(to_jsonable(data))
    again = StudyResult.from_json(json.loads(text_json))
    assert json.dumps(to_jsonable(again.to_json())) == text_json
    assert data["power_plan"]["per_claim"]["wider"] == wider.to_json()
    assert data["power_plan"]["controls"]["wider"] == control_plan.to_json()
    assert "holm_family" not in data["claims"][1] and "plan" in data["claims"][0]["inputs"]
    text = page.study_page(result)
    assert "Power, planned on a pilot" in text and "toy-width" in text
    assert "| control of wider | control |" in text
    if control_plan.pilot_sd > 0:
        assert f"(planned at {100 * control_plan.planned_sd:.3g})" in text
        assert "80% upper confidence limit of their pilot SD" in text
    assert "Step-0 health" in text


def test_the_verdict_table_keeps_every_cell_short(tmp_path):
    long_reason = "because " + "the interval is wide and the control small; " * 20
    claim = kit.claim_record(
        "a claim whose statement is long " + "and longer " * 30,
        kit.Interval(0.05, 0.01, 0.09, 3),
        kit.Interval(0.04, 0.01, 0.07, 3),
        "control",
        paper_effect=0.02,
        paper_source="seed 003, Sec. 4 / Table 1: " + "words " * 60,
        control_min=0.02,
    )
    claim = dataclasses.replace(
        claim,
        holm_verdict=kit.INCONCLUSIVE_KIND,
        holm_outcome=long_reason,
        planned_n_text="4 (pilot SD 2.1, cap 10)",
    )
    study = StudyResult(
        name="s", paper="p", setup="s", claims=(claim,), verdict="", holds=False, seeds=(0, 1, 2)
    )
    table = page.verdict_table(
        [study],
        across={("s", claim.claim): (kit.UNSTABLE, "unstable across seed bases " + long_reason)},
    )
    rows = [line for line in table.splitlines() if line.startswith("| s |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == 8
    assert max(len(c) for c in cells) <= page.CELL_LIMIT
    # the long texts are in footnotes, whole
    assert long_reason.strip() in table and "[^" in cells[-2]
    assert re.search(r"^\[\^n\d+\]: seed 003", table, re.M)
    assert cells[-1].startswith("unstable across seed bases")


def test_a_study_runs_with_quick(tmp_path, one_thread):
    from typer.testing import CliRunner

    from curvalign.cli import app
    from curvalign_lab.runner import STUDIES

    # every registered study declares a smoke run
    assert set(STUDIES) >= {"proclip-product", "proclip-regime", "agr-curriculum"}
    out = tmp_path / "q"
    done = CliRunner().invoke(app, ["study", "proclip-product", "--quick", "--out", str(out), "-q"])
    assert done.exit_code == 0, done.output
    result = json.loads((out / "study.json").read_text())
    assert result["seeds"] == [0, 1] and result["steps"] == 4
    assert "--quick" in result["command"] and not result.get("power_plan")
    # no plan: no claim is called underpowered
    assert all(c["holm_verdict"] != kit.UNDERPOWERED for c in result["claims"])
    text = (out / "study.md").read_text()
    assert "No pilot ran" in text and "Step-0 health" in text


def test_declarations_are_checked():
    with pytest.raises(Exception, match="margin"):
        declare.Claim("x", "x", "x", "x", 0.01, kind=rules.NON_INFERIORITY)
    with pytest.raises(Exception, match="control arm"):
        declare.Study(
            "bad",
            "p",
            TOY.claims,
            TOY.arms,
            _measure,
            control=declare.Control("nope", TOY.control.handicap, "wider"),
        )
