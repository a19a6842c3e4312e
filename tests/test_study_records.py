"""Study results as typed records: the committed study.json files read back and write the same
JSON, and the committed results pages regenerate byte for byte from them."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from curvalign.errors import InputError
from curvalign.report.tables import to_jsonable
from curvalign.stats import Interval, TwoLevelInterval
from curvalign_lab import kit, page, results
from curvalign_lab.records import (
    ClaimResult,
    ControlRecord,
    DoseChoice,
    PlanRecord,
    PowerPlan,
    StudyResult,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
COMMITTED = sorted([*RESULTS.glob("*/study.json"), *RESULTS.glob("seed-base-100/*/study.json")])


def _as_written(data: dict) -> dict:
    """``data`` as ``write_json`` writes it and ``json`` reads it back (NaN as null)."""
    return json.loads(json.dumps(to_jsonable(data)))


def test_the_committed_results_are_there():
    assert len(COMMITTED) >= 12  # six studies on two seed bases


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_committed_study_json_reads_back_and_writes_the_same_json(path):
    data = json.loads(path.read_text())
    result = StudyResult.from_json(data)
    assert result.name == data["name"] and len(result.claims) == len(data["claims"])
    assert all(isinstance(c, ClaimResult) for c in result.claims)
    assert _as_written(result.to_json()) == data
    assert StudyResult.from_json(result.to_json()) == result


def test_the_committed_pages_regenerate_byte_for_byte(tmp_path, monkeypatch):

    # the command of the page's header (HEADER, results.py), run from the repository's root
    monkeypatch.chdir(ROOT)
    index = tmp_path / "studies.md"
    args = ["docs/results", "--stability", "docs/results/seed-base-100", "--pages", str(tmp_path)]
    code = results.main([*args, "--figures", "../", "-o", str(index)])
    assert code in (0, 1)  # 1: a claim flips between the seed bases (the page says which)
    assert index.read_text() == (RESULTS / "studies.md").read_text()
    pages = sorted(tmp_path.glob("*/study.md"))
    assert len(pages) >= 6
    for written in pages:
        assert written.read_text() == (RESULTS / written.parent.name / "study.md").read_text()


def _claim(**changes) -> ClaimResult:
    claim = kit.claim_record(
        "a beats b",
        TwoLevelInterval(0.05, 0.01, 0.09, 3, seed_se=0.01, item_se=0.02, df=2.0, items=40),
        Interval(0.04, 0.01, 0.07, 3),
        "a clean - a handicapped",
        paper_effect=0.02,
        paper_source="seed 003, Sec. 4",
        control_min=0.02,
        effect_values=[0.04, 0.05, 0.06],
        plan=PlanRecord(0.01, 3, 0.02, 4, 10, 0.018, False, "4 seeds give MDE 0.018 <= 0.02"),
    )
    return dataclasses.replace(claim, **changes)


def test_a_record_round_trips_with_every_optional_part():
    claim = kit.apply_holm([_claim(key="k", words="w", kind="superiority", two_level=True)])[0]
    plan = claim.inputs.plan
    assert plan is not None
    result = StudyResult(
        name="s",
        paper="p",
        setup="setup.",
        claims=(claim, _claim(effect=Interval(math.nan, math.nan, math.nan, 1))),
        verdict="v",
        holds=False,
        declared=True,
        control=ControlRecord(
            "{dose} moved", 0.3, (0.1, 0.5), DoseChoice(0.02, {"0.1": 0.01, "0.5": 0.04}, 0.3, True)
        ),
        power_plan=PowerPlan(
            {"k": plan, "h": dataclasses.replace(plan, family=3, item_se=0.004)},
            4,
            10,
            3,
            ("x",),
            12.5,
            pilot_seed_base=1000,
        ),
        arms={"a": {"0": 0.5, "1": None}},
        starts={"a": {"0": {"checked": True, "warnings": []}}},
        starts_fired=(),
        tables="",
        command="curvalign study s",
    )
    data = result.to_json()
    assert StudyResult.from_json(data) == result
    # through JSON text: NaN is written as null and read back as nan
    again = StudyResult.from_json(_as_written(data))
    assert math.isnan(again.claims[1].effect.mean) and again.claims[1].effect.n == 1
    assert _as_written(again.to_json()) == _as_written(data)
    assert isinstance(again.claims[0].effect, TwoLevelInterval)
    # the keys a record does not have stay absent, and the page reads the record
    assert "own_trainer" not in data and "holm_family" not in data["claims"][1]
    assert data["claims"][0]["holm_family"] == 1 and data["claims"][0]["inputs"]["plan"]
    text = page.study_page(again)
    assert "Power, planned on a pilot** of 3 seeds (seed base 1000)" in text
    assert "**Control.** 0.3 moved; dose chosen on the pilot's scan" in text


def test_an_older_record_keeps_what_this_one_does_not_know():
    claim = _claim().to_json()
    del claim["inputs"]["plan"]  # written before claims carried a plan
    claim["seed_only"] = {"mean": 0.1, "low": 0.0, "high": 0.2, "n": 3}
    study = StudyResult(
        name="old", paper="p", setup="s", claims=(), verdict="", holds=True, seeds=(0, 1)
    ).to_json()
    study |= {"claims": [claim], "premise": {"lambda": 2.5}}
    record = StudyResult.from_json(study)
    assert record.extra == {"premise": {"lambda": 2.5}}
    assert record.claims[0].inputs.plan_recorded is False
    assert record.claims[0].seed_only == Interval(0.1, 0.0, 0.2, 3)
    assert record.to_json() == study


def test_a_file_that_is_not_a_study_result_is_one_clear_error(tmp_path):

    good = StudyResult(name="s", paper="p", setup="s", claims=(), verdict="", holds=True)
    data = good.to_json()
    del data["wall_s"]
    path = tmp_path / "s" / "study.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"study.json of 's' has no 'wall_s'"):
        results.load_results(tmp_path)
    assert results.main([str(tmp_path)]) == 2
    data = good.to_json() | {"claims": [{"claim": "c", "effect": {"mean": 1}}]}
    with pytest.raises(InputError, match="claim 'c' has no 'role'"):
        StudyResult.from_json(data)


def test_a_second_run_of_one_study_is_listed_under_its_folder(tmp_path):
    """Two runs of one study in one results folder (its own world, and a real store under
    NAME-SUFFIX) are two rows and two pages, in the order of the studies, none dropped."""
    source = Path("docs/results/proclip-product/study.json")
    other = Path("docs/results/atmg-curvature/study.json")
    for folder, src in (
        ("proclip-product-coco", source),
        ("proclip-product", source),
        ("atmg-curvature", other),
    ):
        (tmp_path / folder).mkdir()
        shutil.copyfile(src, tmp_path / folder / "study.json")
    loaded = results.load_results(tmp_path)
    assert [r.name for r in loaded] == ["atmg-curvature", "proclip-product", "proclip-product-coco"]
    written = results.write_pages(tmp_path, tmp_path / "pages")
    assert sorted(p.parent.name for p in written) == sorted(r.name for r in loaded)
    assert (
        "# proclip-product-coco" in (tmp_path / "pages/proclip-product-coco/study.md").read_text()
    )
