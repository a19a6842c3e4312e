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


def test_index_add_then_search_names_the_new_items(world, tmp_path) -> None:
    import shutil

    from curvalign.data.extract import extract_features
    from test_extract import make_collection

    second = make_collection(tmp_path / "second")  # the same pixels under another root
    extract_features(
        world.encoder,
        second["images"],
        tmp_path / "store2",
        captions=second["captions"],
        batch_size=4,
        progress=False,
    )
    for recipe in ("meru", "atmg"):
        idx = tmp_path / f"idx-{recipe}"
        shutil.copytree(world.indexes[recipe], idx)
        emb2 = tmp_path / f"emb2-{recipe}"
        code, out = _run(
            "embed",
            world.runs[recipe],
            "--data",
            f"features:{tmp_path / 'store2'}",
            "--out",
            emb2,
            "-q",
        )
        assert code == 0, out
        code, out = _run("index", "add", idx, emb2)
        assert code == 0 and "added 6 images" in out and "(now 12)" in out, out
        result = Searcher.open(world.runs[recipe], idx, candidates=12).search_text("a dog", 12)
        ids = sorted(h.id for h in result.hits)
        assert ids == list(range(12))
        by_id = {h.id: h for h in result.hits}
        for i in range(6):  # an added copy scores like its original and names its own file
            assert by_id[i + 6].score == pytest.approx(by_id[i].score, rel=1e-5, abs=1e-6)
            assert by_id[i + 6].item.path == str(second["images"].resolve() / world.files[i])
            assert by_id[i].item.path == world.files[i]
    code, out = _run("index", "add", tmp_path / "idx-meru", tmp_path / "emb2-atmg")
    assert code == 2 and "holds 'atmg' embeddings but the index holds 'meru'" in out
