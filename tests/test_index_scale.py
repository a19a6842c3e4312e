"""Search that scales: a flat index file is scanned in chunks (FlatFile), never loaded whole.

The RSS test runs ``curvalign index search`` in a subprocess over an index file of ~300 MB and
checks that the process's peak resident memory grows by well under the file's size (Faiss's
``read_index`` would hold all of it; so would a memory map, whose touched pages count as
resident).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

import curvalign.index.search as search_module
from curvalign.index import build_index, load_index
from curvalign.index.search import FlatFile, read_flat_or_faiss


def _lorentz_points(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    v = rng.normal(size=(n, d))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return (v * 10 ** rng.uniform(-1, 0.5, size=(n, 1))).astype(np.float32)


def test_flat_file_search_equals_faiss_for_any_chunking(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 17)).astype(np.float32)
    x[500] = x[20]  # an exact tie across chunks
    q = rng.normal(size=(7, 17)).astype(np.float32)
    q[0] = x[20]
    reference = faiss.IndexFlatIP(17)
    reference.add(x)
    faiss.write_index(reference, str(tmp_path / "flat.faiss"))
    flat = FlatFile.open(tmp_path / "flat.faiss")
    assert flat is not None and (flat.ntotal, flat.d) == (1000, 17)
    want_scores, want_rows = reference.search(q, 25)
    for chunk_rows in (1, 7, 333, 1000):  # one row per chunk up to one chunk for everything
        monkeypatch.setattr(search_module, "FLAT_CHUNK_BYTES", 4 * 17 * chunk_rows)
        scores, rows = flat.search(q, 25)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
        # the same rows up to the order of exact ties
        for got, want, s in zip(rows, want_rows, want_scores, strict=True):
            assert set(got[s > s[-1] + 1e-4].tolist()) == set(want[s > s[-1] + 1e-4].tolist())
    assert set(flat.search(q[:1], 2)[1][0].tolist()) == {20, 500}
    np.testing.assert_array_equal(flat.reconstruct_batch(np.array([999, 3, 3])), x[[999, 3, 3]])
    np.testing.assert_array_equal(flat.reconstruct_n(10, 5), x[10:15])
    # another kind of index is left to Faiss
    hnsw = faiss.IndexHNSWFlat(17, 8)
    hnsw.add(x[:50])
    faiss.write_index(hnsw, str(tmp_path / "hnsw.faiss"))
    assert FlatFile.open(tmp_path / "hnsw.faiss") is None
    assert isinstance(read_flat_or_faiss(tmp_path / "hnsw.faiss"), faiss.Index)


def test_a_loaded_exact_index_scans_its_file_and_stays_exact(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(1)
    x = _lorentz_points(rng, 600, 9)
    q = _lorentz_points(rng, 12, 9)
    index = build_index(x, 0.7, ids=np.arange(600) * 3 + 1)
    want = index.search(q, 10)
    index.save(tmp_path / "idx")
    monkeypatch.setattr(search_module, "FLAT_CHUNK_BYTES", 4 * 10 * 64)  # 64 rows a chunk
    loaded = load_index(tmp_path / "idx")
    assert isinstance(loaded._index, FlatFile)
    got = loaded.search(q, 10)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-12)
    # growing it reads it whole once, then saves a normal index file again
    loaded.add(x[:5] * 1.5, ids=np.arange(5) + 10_000)
    loaded.save(tmp_path / "idx")
    again = load_index(tmp_path / "idx")
    assert len(again) == 605 and isinstance(again._index, FlatFile)


def _build_unit_index(path: Path, n: int, d: int) -> None:
    """``n`` random unit vectors of width ``d`` as an exact index at ``path`` (what `index
    search` reads), and ``path``_queries.npy: scaled copies of the first ten."""
    rng = np.random.default_rng(0)
    v = rng.standard_normal((n, d), dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    meta = {"recipe": "meru", "side": "images", "key": "lorentz"}  # what `index search` reads
    build_index(v, 1.0, meta=meta).save(path)
    np.save(f"{path}_queries.npy", v[:10] * 1.01)


_PEAK = """
import resource, sys
import curvalign.cli as cli, curvalign.index.queries, curvalign.index.search  # imports first
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.argv = ["curvalign"] + sys.argv[1:]
code = 0
if len(sys.argv) > 1:
    try:
        cli.main()
    except SystemExit as exit:
        code = exit.code or 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("PEAK", base, peak, code, file=sys.stderr)
"""


@pytest.mark.slow
def test_index_search_keeps_rss_below_the_index_size(tmp_path: Path):
    index = tmp_path / "idx"
    # 150,000 x 512 points: index.faiss holds [N, 513] float32 = 308 MB. Built here: only the
    # search needs a fresh process (its peak RSS is the measure), and a start costs seconds
    _build_unit_index(index, 150_000, 512)
    size_kb = (index / "index.faiss").stat().st_size // 1024
    assert size_kb > 250_000
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _PEAK,
            "index",
            "search",
            str(index),
            "--query-npy",
            f"{index}_queries.npy",
            "--k",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    base, peak, code = (int(v) for v in run.stderr.strip().splitlines()[-1].split()[1:])
    assert code == 0, run.stderr
    found = json.loads(run.stdout)
    # each query is a scaled copy of point i: its nearest stored point is itself
    assert [r["ids"][0] for r in found["results"]] == list(range(10))
    grown = peak - base
    assert grown < size_kb / 3, f"search grew peak RSS by {grown} kB for a {size_kb} kB index"


@pytest.mark.parametrize("name", ["clip", "proclip", "phyclip"])
def test_a_saved_flat_proxy_is_scanned_from_its_file(tmp_path: Path, monkeypatch, name):
    # what `index search` does for a rerank index: the saved proxy is opened as a FlatFile and
    # the search (candidates from a chunked scan, exact rerank) returns what the in-memory
    # index returns
    import torch

    from curvalign.index import RecipeIndex
    from curvalign.recipes import get_recipe

    torch.manual_seed(0)
    cls = get_recipe(name)
    config = cls.Config(**({"num_factors": 8, "factor_dim": 4} if name == "phyclip" else {}))
    if hasattr(config, "embed_dim") and name != "phyclip":
        config.embed_dim = 16
    recipe = cls(config, 12, 10).eval()
    with torch.no_grad():
        images = recipe.embed_images(torch.randn(300, 12) * 3)
        texts = recipe.embed_texts(torch.randn(20, 10) * 3)
    memory = RecipeIndex(recipe, images, "images")
    want = memory.search(texts, 10, 40)
    memory.save_proxy(str(tmp_path / "proxy.faiss"))
    proxy = read_flat_or_faiss(tmp_path / "proxy.faiss")
    assert isinstance(proxy, FlatFile)
    monkeypatch.setattr(search_module, "FLAT_CHUNK_BYTES", 4 * proxy.d * 37)  # 37 rows a chunk
    from_file = RecipeIndex(recipe, images, "images", proxy_index=proxy)
    assert from_file.candidate_index == "flat"
    got = from_file.search(texts, 10, 40)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_write_flat_index_in_chunks_reads_back_with_faiss(tmp_path: Path):
    from curvalign.index.search import write_flat_index

    rng = np.random.default_rng(3)
    x = rng.normal(size=(1000, 9)).astype(np.float32)
    flat = write_flat_index(tmp_path / "f.faiss", 9, (x[a : a + 300] for a in range(0, 1000, 300)))
    assert (flat.ntotal, flat.d) == (1000, 9)
    whole = faiss.read_index(str(tmp_path / "f.faiss"))  # Faiss itself reads the file
    assert whole.ntotal == 1000
    np.testing.assert_array_equal(whole.reconstruct_n(0, 1000), x)
    q = rng.normal(size=(4, 9)).astype(np.float32)
    np.testing.assert_array_equal(flat.search(q, 5)[1], whole.search(q, 5)[1])


@pytest.mark.parametrize("name", ["clip", "meru"])
def test_ivfpq_candidates_rerank_to_the_exact_answer(tmp_path: Path, name):
    import torch

    from curvalign.index import RecipeIndex, exhaustive_topk
    from curvalign.recipes import get_recipe

    torch.manual_seed(1)
    cls = get_recipe(name)
    config = cls.Config()
    if hasattr(config, "embed_dim"):
        config.embed_dim = 16
    recipe = cls(config, 12, 10).eval()
    with torch.no_grad():
        images = recipe.embed_images(torch.randn(4000, 12) * 3)
        texts = recipe.embed_texts(torch.randn(25, 10) * 3)
    # every cell probed: only the PQ codes approximate, and 300 candidates reranked exactly
    engine = RecipeIndex(recipe, images, "images", candidate_index="ivfpq", nlist=20, nprobe=20)
    assert engine.candidate_index == "ivfpq"
    _, want = exhaustive_topk(recipe, texts, images, "images", 10)
    _, got = engine.search(texts, 10, 300)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, want, strict=True)])
    assert recall >= 0.95, recall
    # one cell probed of 20: fewer true neighbours reach the rerank
    few = RecipeIndex(recipe, images, "images", candidate_index="ivfpq", nlist=20, nprobe=1)
    _, got_few = few.search(texts, 10, 300)
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got_few, want, strict=True)]) < recall
    # saved and opened again, as `index build --ann ivfpq` / `index search` do
    engine.save_proxy(str(tmp_path / "proxy.faiss"))
    again = RecipeIndex(
        recipe, images, "images", proxy_index=read_flat_or_faiss(tmp_path / "proxy.faiss")
    )
    assert again.candidate_index == "ivfpq"
    np.testing.assert_array_equal(again.search(texts, 10, 300)[1], got)


def test_ivfpq_refuses_an_angle_proxy():
    import torch

    from curvalign.errors import InputError
    from curvalign.index import RecipeIndex
    from curvalign.recipes import get_recipe

    cls = get_recipe("atmg")
    config = cls.Config()
    config.embed_dim = 8
    recipe = cls(config, 12, 10).eval()
    with torch.no_grad():
        images = recipe.embed_images(torch.randn(500, 12))
    with pytest.raises(InputError, match="ranks by an angle"):
        RecipeIndex(recipe, images, "images", candidate_index="ivfpq")
