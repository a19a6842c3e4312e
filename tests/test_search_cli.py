"""`curvalign search`: free text, a file of queries, image files; table or JSON (issue 14, part 3)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from _search_world import build_world, needs_open_clip
from curvalign.cli import app
from curvalign.index.searcher import Searcher

pytestmark = needs_open_clip
runner = CliRunner()


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout + (
        result.stderr if result.stderr_bytes is not None else ""
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    return build_world(tmp_path_factory.mktemp("search_cli_world"))


def test_search_prints_readable_results(world) -> None:
    code, out = _run(
        "search", world.runs["meru"], "--index", world.indexes["meru"], "a dog on grass", "--k", "3"
    )
    assert code == 0, out
    assert "a dog on grass" in out and "distance" in out
    want = Searcher.open(world.runs["meru"], world.indexes["meru"]).search_text("a dog on grass", 3)
    for hit in want.hits:
        assert hit.item.path in out and f"{hit.distance:.4f}" in out
    assert f"image paths are relative to {world.images.resolve()}" in out.replace("\n", "")


def test_search_json_several_queries_and_a_file(world, tmp_path) -> None:
    qfile = tmp_path / "queries.txt"
    qfile.write_text("two cats\n\ncaption 1 about picture cat/img1.png\n")
    code, out = _run(
        "search",
        world.runs["atmg"],
        "--index",
        world.indexes["atmg"],
        "a dog",
        "--queries-file",
        qfile,
        "--k",
        "2",
        "--json",
        "--candidates",
        "4",
    )
    assert code == 0, out
    payload = json.loads(out)
    assert payload["recipe"] == "atmg" and payload["ranked_by"] == "score"
    assert [r["query"] for r in payload["results"]] == [
        "a dog",
        "two cats",
        "caption 1 about picture cat/img1.png",
    ]
    hit = payload["results"][0]["hits"][0]
    assert hit["rank"] == 1 and hit["item"]["path"] in world.files and hit["distance"] is None


def test_search_errors_are_one_line(world, tmp_path) -> None:
    code, out = _run("search", world.runs["meru"], "--index", world.indexes["meru"])
    assert code == 2 and "give at least one query" in out
    code, out = _run(
        "search",
        world.runs["meru"],
        "--index",
        world.indexes["meru"],
        "--image",
        world.images / world.files[0],
    )
    assert code == 2 and "holds images, ranked for text queries" in out
    code, out = _run(
        "search",
        world.runs["meru"],
        "--index",
        world.indexes["meru"],
        "x",
        "--encoder",
        f"hf-clip:{tmp_path / 'nothing'}",
    )
    assert code == 2 and "expected a local directory" in out and "Traceback" not in out
