"""The evaluation result as a typed record (``eval/result.py``): its JSON is the former dict.

``evaluate`` returned a nested dict until the record replaced it; ``curvalign eval --json``,
results.json and ``--tune-metric`` paths read that dict, so ``to_json()`` must give it back key
for key and in the same order. ``data/evaluation_before_record.json`` holds what the dict-returning
pipeline (commit 11608d3) gave on the tiny hand-made stores below; regenerate it (with any
version) by ``PYTHONPATH=src python tests/test_eval_result.py > tests/data/evaluation_before_record.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from curvalign.eval import evaluate
from curvalign.eval.result import EvaluationResult, ZeroShotMetrics
from curvalign.recipes import get_recipe
from test_eval_conventions import _ClassPointLorentz, _multilabel_store
from test_eval_metrics import _IdentityLorentz, _IdentityNoOrigin, _toy_store

BEFORE = Path(__file__).parent / "data" / "evaluation_before_record.json"


def _clip():
    torch.manual_seed(0)
    cls = get_recipe("clip")
    return cls(cls.Config(embed_dim=2, head_init="input"), 2, 2).eval()  # as recorded


#: (name, recipe, store): together every part of the result (retrieval, zero-shot, hierarchy,
#: prompt sensitivity, multi-label, entailment with and without a measure, compositional,
#: ordering with and without an origin, diagnostics)
CASES = {
    "lorentz": lambda: (_IdentityLorentz(), _toy_store()),
    "class point": lambda: (_ClassPointLorentz(), _toy_store()),
    "no origin": lambda: (_IdentityNoOrigin(), _toy_store()),
    "templates": lambda: (_clip(), _multilabel_store()),
}


def _json_of(result) -> dict:
    """What ``curvalign eval --json`` prints of a result (dict or record), parsed back."""
    from curvalign.report.tables import to_jsonable

    raw = result.to_json() if hasattr(result, "to_json") else result
    return json.loads(json.dumps(to_jsonable(raw)))


def _same(got, want, path="") -> None:
    """Equal keys in the same order, equal strings, numbers equal to 1e-9 relative."""
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            _same(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12, nan_ok=True), path
    else:
        assert got == want and type(got) is type(want), path


@pytest.mark.parametrize("case", list(CASES))
def test_to_json_is_the_dict_evaluate_returned_before_the_record(case):
    recipe, store = CASES[case]()
    result = evaluate(recipe, store, split="test")
    assert isinstance(result, EvaluationResult)
    _same(_json_of(result), json.loads(BEFORE.read_text())[case])


def test_the_cases_reach_every_part_of_the_result():
    before = json.loads(BEFORE.read_text())
    parts = {key for result in before.values() for key in result}
    assert parts == {
        "meta",
        "retrieval",
        "zeroshot",
        "hierarchy",
        "prompt_sensitivity",
        "multilabel",
        "entailment",
        "compositional",
        "ordering",
        "diagnostics",
    }
    assert {before[c]["entailment"]["measure"] is None for c in ("lorentz", "class point")} == {
        False
    }


def test_fields_are_typed_and_metric_paths_read_the_json_leaves():
    result = evaluate(_IdentityLorentz(), _toy_store(), split="test")
    assert isinstance(result.zeroshot, ZeroShotMetrics)
    assert result.meta.num_images == 4
    # caption 3 is nearest image 1, not its own image: 3 of 4 captions find their image first
    assert result.metric("retrieval/t2i@1") == pytest.approx(3 / 4)
    assert result.metric("zeroshot/top1") == result.zeroshot.top1 == 1.0
    assert result.metric("ordering/text/pairs") == pytest.approx(3 / 4)
    assert result.mean_r1 == pytest.approx(
        0.5 * (result.retrieval["t2i@1"] + result.retrieval["i2t@1"])
    )
    # a part the store lacks, a name that is no metric, a string leaf: no number
    assert result.metric("multilabel/mAP") is None
    assert result.metric("zeroshot/top3") is None
    assert result.metric("ordering/note") is None
    assert result.metric("meta/recipe") is None


def test_with_run_appends_the_run_fields_after_the_split_sizes():
    result = evaluate(_IdentityLorentz(), _toy_store(), split="test", diagnostics=False)
    tagged = result.with_run(health={"warnings": []}, step=7, run_dir="runs/x")
    meta = tagged.to_json()["meta"]
    assert list(meta)[-2:] == ["step", "run_dir"] and meta["step"] == 7
    assert list(tagged.to_json())[-1] == "health"
    assert "step" not in result.to_json()["meta"]  # the record is frozen; a new one came back
    with pytest.raises(AttributeError):
        result.meta = tagged.meta  # type: ignore[misc]


if __name__ == "__main__":  # the reference file (module docstring)
    out = {}
    for name, make in CASES.items():
        recipe, store = make()
        out[name] = _json_of(evaluate(recipe, store, split="test"))
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
