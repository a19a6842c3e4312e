"""An index and its embeddings are hashed when written, not on every search: opening them checks
size and modification time, and hashes only a file that differs (or on request)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import curvalign._io as io_module
from curvalign.cli import app
from curvalign.errors import DamagedFileError
from curvalign.index.embed import load_embeddings, open_index
from curvalign.index.queries import search_queries
from curvalign.train.trainer import train

runner = CliRunner()


def _cli(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hashing")
    run = train(
        "meru",
        "synthetic:images=80,text_pairs=10,seed=3",
        root / "run",
        steps=1,
        overrides=["embed_dim=8", "batch_size=32"],
        show_progress=False,
    )
    _cli("embed", run, "--out", root / "emb", "-q")
    _cli("index", "build", root / "emb", "--out", root / "idx", "--exact")
    return root


@pytest.fixture
def hashed(monkeypatch) -> list[tuple[str, int]]:
    """Every file ``curvalign._io.sha256_file`` hashes, with its size in bytes."""
    seen: list[tuple[str, int]] = []
    real = io_module.sha256_file

    def counting(path, *args, **kwargs):
        seen.append((Path(path).name, Path(path).stat().st_size))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(io_module, "sha256_file", counting)
    return seen


def test_index_search_hashes_no_file(built, hashed):
    for _ in range(2):  # every call, not only the second
        out = json.loads(
            _cli(
                "index", "search", built / "idx", "--query-text-ids", "0,1,2", "--k", "3", "--json"
            )
        )
        assert len(out["results"]) == 3
    assert hashed == []
    # a full check is still there on request, and reads the index and its ids
    open_index(built / "idx", verify=True)
    assert {name for name, _ in hashed} == {"index.faiss", "ids.npy"}
    assert sum(size for _, size in hashed) == sum(
        (built / "idx" / n).stat().st_size for n in ("index.faiss", "ids.npy")
    )


def test_a_file_changed_in_place_with_its_size_kept_is_hashed_and_named(built, tmp_path, hashed):
    idx = shutil.copytree(built / "idx", tmp_path / "idx")  # copytree keeps modification times
    search_queries(idx, text_ids=[0], k=2)
    assert hashed == []
    faiss_file = idx / "index.faiss"
    data = bytearray(faiss_file.read_bytes())
    data[-1] ^= 0x01  # same size, other bytes, a new modification time
    faiss_file.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match="index.faiss is damaged"):
        search_queries(idx, text_ids=[0], k=2)
    assert [name for name, _ in hashed] == ["index.faiss"]


def test_a_copy_without_its_times_is_hashed_once_per_process(built, tmp_path, hashed):
    emb = shutil.copytree(built / "emb", tmp_path / "emb", copy_function=shutil.copyfile)
    for name in os.listdir(emb):  # copyfile stamps the current time: differs from the record
        assert (emb / name).stat().st_mtime_ns != (built / "emb" / name).stat().st_mtime_ns
    first = load_embeddings(emb).side("images")["point"]
    n_hashed = len(hashed)
    assert n_hashed == 1
    again = load_embeddings(emb).side("images")["point"]
    assert len(hashed) == n_hashed
    np.testing.assert_array_equal(first, again)


def test_verify_on_the_command_line_hashes_what_the_search_reads(built, hashed):
    args = ("index", "search", built / "idx", "--query-text-ids", "0,1", "--k", "3", "--json")
    plain = json.loads(_cli(*args))
    assert hashed == []
    assert json.loads(_cli(*args, "--verify")) == plain
    names = {name for name, _ in hashed}
    # the index's files and the embedded queries' files, each hashed in full
    assert {"index.faiss", "ids.npy"} <= names and any(n.startswith("texts.") for n in names)


def test_a_build_in_small_blocks_finds_what_the_default_build_finds(built, tmp_path, hashed):
    _cli("index", "build", built / "emb", "--out", tmp_path / "small", "--block-rows", "7")
    # the embeddings' recorded size and time: not hashed again to build (only what it wrote)
    assert {name for name, _ in hashed} == {"index.faiss", "ids.npy"}
    query = ("--query-text-ids", "0,4,9", "--k", "5", "--json")
    small = json.loads(_cli("index", "search", tmp_path / "small", *query))["results"]
    default = json.loads(_cli("index", "search", built / "idx", *query))["results"]
    assert [r["ids"] for r in small] == [r["ids"] for r in default]


def test_embed_digests_its_files_as_it_writes_them(built, tmp_path, hashed):
    _cli("embed", built / "run", "--out", tmp_path / "emb", "-q")
    # only the small id map is hashed after writing; the embeddings are not read back
    assert {name for name, _ in hashed} == {"text_to_image.npy"}
    hashed.clear()
    emb = load_embeddings(tmp_path / "emb", verify=True)  # the full hash agrees with the record
    for side in ("images", "texts"):
        assert all(np.isfinite(v).all() for v in emb.side(side).values())
    assert any(name.startswith("images.") for name, _ in hashed)
