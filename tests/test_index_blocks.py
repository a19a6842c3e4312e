"""Index builds read their points in blocks (memory outside the maps: one block, plus the index
itself for in-memory builds) and give the index the unblocked build gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import curvalign.index.search as search_module
from curvalign.index.search import build_index, load_index, save_exact_index


class RowSpy:
    """An ``[N, d]`` array that records every row range read from it (as a memory map would be
    read), and refuses to be read whole."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape
        self.reads: list[int] = []

    def __getitem__(self, index):
        rows = self.array[index]
        self.reads.append(len(rows))
        return rows

    def __array__(self, *args, **kwargs):
        raise AssertionError("the points were read whole")


def _points(n: int = 500, d: int = 6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) * 0.8).astype(np.float32)


def test_exact_index_written_in_blocks_equals_the_unblocked_build(tmp_path: Path):
    x, c = _points(), 0.7
    spy = RowSpy(x)
    save_exact_index(tmp_path / "blocked", spy, c, block_rows=64)
    assert max(spy.reads) == 64 and sum(spy.reads) == len(x) and len(spy.reads) == 8
    blocked = load_index(tmp_path / "blocked")
    whole = build_index(x, c)
    queries = _points(20, 6, seed=1)
    d_b, i_b = blocked.search(queries, 10)
    d_w, i_w = whole.search(queries, 10)
    np.testing.assert_array_equal(i_b, i_w)
    np.testing.assert_array_equal(d_b, d_w)  # the same float32 rows, the same float64 rerank
    assert blocked.info.max_norm == whole.info.max_norm
    # the file holds exactly the vectors an in-memory build stores
    np.testing.assert_array_equal(
        blocked._index.reconstruct_n(0, len(x)), whole._index.reconstruct_n(0, len(x))
    )


@pytest.mark.parametrize(("kind", "method"), [("exact", "hnsw"), ("ann", "ivf")])
def test_in_memory_builds_read_blocks_and_match(kind, method, monkeypatch):
    x, c = _points(800), 1.3
    spy = RowSpy(x)
    blocked = build_index(spy, c, kind=kind, method=method, block_rows=100)
    # IVF first gathers its k-means sample (only those rows), then reads the blocks
    assert spy.reads[-8:] == [100] * 8 and len(spy.reads) == (9 if method == "ivf" else 8)
    whole = build_index(x, c, kind=kind, method=method)
    queries = _points(25, 6, seed=2)
    d_b, i_b = blocked.search(queries, 10)
    d_w, i_w = whole.search(queries, 10)
    np.testing.assert_array_equal(i_b, i_w)
    np.testing.assert_array_equal(d_b, d_w)


def test_default_block_follows_the_budget():
    assert search_module.build_block_rows(511) == search_module.BUILD_BLOCK_BYTES // (4 * 512)
    assert search_module.build_block_rows(511, 4 * 512 * 10) == 10
    with pytest.raises(Exception, match="budget must be positive"):
        search_module.build_block_rows(8, 0)


def test_a_rerank_index_writes_its_flat_proxy_in_blocks(tmp_path: Path, monkeypatch):
    import curvalign.index.embed as embed_module
    from curvalign.index.embed import build_from_embeddings, embed_store, load_embeddings
    from curvalign.index.queries import search_queries
    from curvalign.index.search import FlatFile
    from curvalign.runs import load_run
    from curvalign.train.trainer import train

    data = "synthetic:images=90,text_pairs=10,seed=4"
    run = train(
        "clip",
        data,
        tmp_path / "run",
        steps=1,
        overrides=["embed_dim=8", "batch_size=32"],
        show_progress=False,
    )
    from curvalign.data import load_data

    embed_store(load_run(run).recipe, load_data(data), tmp_path / "emb", info={"run_dir": str(run)})
    emb = load_embeddings(tmp_path / "emb")
    sizes: list[int] = []
    real = embed_module.write_flat_index

    def recording(path, d, chunks):
        def seen():
            for chunk in chunks:
                sizes.append(len(chunk))
                yield chunk

        return real(path, d, seen())

    monkeypatch.setattr(embed_module, "write_flat_index", recording)
    build_from_embeddings(emb, tmp_path / "blocked", block_rows=16)
    assert sizes == [16] * 5 + [10]
    sizes.clear()
    build_from_embeddings(emb, tmp_path / "whole")
    assert sizes == [90]
    a = FlatFile.open(tmp_path / "blocked" / "proxy.faiss").reconstruct_n(0, 90)
    b = FlatFile.open(tmp_path / "whole" / "proxy.faiss").reconstruct_n(0, 90)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    import mmap

    import curvalign.data.sharded as sharded

    advised: list[int] = []
    real_madvise = sharded._madvise
    monkeypatch.setattr(
        sharded, "_madvise", lambda m, flag: advised.append(flag) or real_madvise(m, flag)
    )
    got = search_queries(tmp_path / "blocked", text_ids=[0, 3, 7], k=5).result
    # the rerank's scattered row reads: only their pages (MADV_RANDOM on the embeddings' maps)
    assert mmap.MADV_RANDOM in advised
    want = search_queries(tmp_path / "whole", text_ids=[0, 3, 7], k=5).result
    np.testing.assert_array_equal(got.ids, want.ids)
