"""`curvalign extract KIND`: one subcommand per input kind, and the one-command form from before
the subcommands (`curvalign extract --encoder E --images DIR ...`) routed to the same kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from curvalign._extract_kinds import EXTRACT_KINDS, kind_of_flags
from curvalign.cli import app
from curvalign.data import extract
from curvalign.data.extract import ExtractSummary
from curvalign.data.features import FeatureStore
from test_extract import PixelEncoder, make_collection

#: the library function each kind calls
FUNCTIONS = {
    "images": "extract_features",
    "texts": "extract_texts",
    "wds": "extract_webdataset",
    "sugarcrepe": "extract_sugarcrepe",
}


@pytest.fixture
def calls(monkeypatch, tmp_path: Path) -> list[tuple[str, tuple, dict]]:
    """Every library extraction the command asks for, as (function, args, kwargs); none runs."""
    seen: list[tuple[str, tuple, dict]] = []
    for name in FUNCTIONS.values():

        def fake(*args, _name=name, **kwargs):
            seen.append((_name, args, kwargs))
            return ExtractSummary(tmp_path / "store", images=3, texts=5, boxes=0, classes=2)

        monkeypatch.setattr(extract, name, fake)
    return seen


def _invoke(*args: str):
    return CliRunner().invoke(app, ["extract", *args])


#: (kind, its options beyond --encoder and --out, what the library function is given)
CASES = [
    ("images", ["--images", "imgs", "--captions", "c.json", "--tokens"], {"tokens": True}),
    ("texts", ["--pairs", "p.tsv", "--score-max", "5"], {"score_max": 5.0}),
    ("wds", ["--wds", "w", "--splits", "test, train"], {"splits": ["test", "train"]}),
    ("sugarcrepe", ["--sugarcrepe", "sc", "--images", "val2017"], {"shard_size": 1024}),
]


@pytest.mark.parametrize("kind, options, expected", CASES)
def test_each_kind_and_its_old_form_call_the_same_library_function(
    calls, tmp_path: Path, kind: str, options: list[str], expected: dict
) -> None:
    common = ["--encoder", "pixels", "--out", str(tmp_path / "s"), "-q"]
    new = _invoke(kind, *common, *options)
    old = _invoke(*common, *options)
    assert new.exit_code == 0 and old.exit_code == 0, new.output + old.output
    assert [c[0] for c in calls] == [FUNCTIONS[kind]] * 2
    assert calls[0][1:] == calls[1][1:]  # the same arguments by either form
    assert expected.items() <= calls[0][2].items()
    assert new.output == old.output and "wrote " in new.output


def test_a_flag_the_kind_does_not_read_is_named_before_anything_runs(calls, tmp_path) -> None:
    common = ["--encoder", "pixels", "--out", str(tmp_path / "s")]
    result = _invoke(*common, "--wds", "w", "--tokens", "--captions", "c.json")
    assert result.exit_code == 2 and not calls
    assert "`curvalign extract wds` does not read --tokens, --captions" in result.output
    result = _invoke(*common, "--boxes", "b.jsonl")  # no --images: text only
    assert result.exit_code == 2 and "`curvalign extract texts` does not read --boxes" in (
        result.output
    )
    assert "curvalign extract images" in result.output  # the form that reads it
    new = _invoke("wds", *common, "--wds", "w", "--tokens")
    assert new.exit_code == 2 and "--tokens" in new.output and not calls


def test_the_old_form_selects_its_kind_by_flags() -> None:
    assert kind_of_flags(["--encoder", "--wds", "--images"]) == "wds"
    assert kind_of_flags(["--sugarcrepe", "--images"]) == "sugarcrepe"
    assert kind_of_flags(["--images", "--captions"]) == "images"
    assert kind_of_flags(["--captions", "--pairs"]) == "texts"
    assert set(FUNCTIONS) == set(EXTRACT_KINDS)


def test_images_by_either_form_write_the_same_store(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(extract, "load_encoder", lambda spec, device="cpu": PixelEncoder())
    c = make_collection(tmp_path)
    options = ["--encoder", "pixels", "--images", str(c["images"]), "--captions"]
    options += [str(c["captions"]), "--boxes", str(c["boxes"]), "-q"]
    new = _invoke("images", *options, "--out", str(tmp_path / "new"))
    old = _invoke(*options, "--out", str(tmp_path / "old"))
    assert new.exit_code == 0 and old.exit_code == 0, new.output + old.output
    assert "6 images, 12 captions" in new.output and "skipped 2 unreadable images" in old.output
    a, b = FeatureStore.load(tmp_path / "new"), FeatureStore.load(tmp_path / "old")
    for name, value in a.fields().items():
        other = b.field(name)
        assert (value is None) == (other is None), name
        if value is not None and hasattr(value, "shape"):
            assert value.shape == other.shape and (value == other).all(), name


def test_the_cli_imports_without_the_click_package() -> None:
    """typer >= 0.29 vendors click (``typer._click``) and no longer installs the click package:
    the command line (its extract group's ``parse_args``) must not import it."""
    pytest.importorskip("typer._click", reason="typer < 0.29 imports the click package itself")
    code = "import sys; sys.modules['click'] = None; import curvalign.cli"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
