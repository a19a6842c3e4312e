"""Index upkeep: adding items without a rebuild; an ANN candidate index for rerank recipes
(issue 14, part 5)."""

from __future__ import annotations

import numpy as np
import pytest

from curvalign.index import search as search_module
from curvalign.index.search import build_index


def _spread_points(n: int, d: int, seed: int) -> np.ndarray:
    """Clustered directions, norms spread over three orders of magnitude (towards the boundary)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(20, d))
    x = centers[rng.integers(0, 20, n)] + 0.3 * rng.normal(size=(n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return (x * 10 ** rng.uniform(-1, 2, size=(n, 1))).astype(np.float32)


def _recall(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(i) & set(j)) / len(j) for i, j in zip(a, b, strict=True)]))


@pytest.mark.parametrize("method", ["hnsw", "ivf"])
def test_ann_add_without_rebuild_keeps_recall(method, monkeypatch, one_thread) -> None:
    x = _spread_points(3000, 12, 0)
    q = _spread_points(100, 12, 1) * 0.3
    base = build_index(x[:2400], 1.0, kind="ann", method=method, nlist=30, nprobe=8)
    before = base.search(q, 10)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("add rebuilt the graph")

    monkeypatch.setattr(search_module, "build_hnsw_graph", no_rebuild)
    base.add(x[2400:], ids=np.arange(2400, 3000))
    assert len(base) == 3000 and base.ids.tolist() == list(range(3000))
    exact = build_index(x, 1.0)
    _, want = exact.search(q, 10)
    dist, got = base.search(q, 10)
    assert _recall(got, want) >= 0.95
    assert (got >= 2400).any()  # the new points are found
    # distances stay exact for what is returned
    np.testing.assert_allclose(dist, search_module.lorentz_distance(x[got], q[:, None, :], 1.0))
    # queries whose top 10 holds no new point answer exactly as before the add
    same = ~(want >= 2400).any(axis=1)
    assert same.any() and _recall(got[same], before[1][same]) >= 0.95


def test_hnsw_add_round_trips_through_save(tmp_path, one_thread) -> None:
    x = _spread_points(1500, 8, 2)
    index = build_index(x[:1000], 0.5, kind="ann", method="hnsw", ef_search=64)
    index.add(x[1000:])
    index.save(tmp_path / "i")
    loaded = search_module.load_index(tmp_path / "i")
    assert loaded.info.options["ef_search"] == 64
    assert search_module.faiss.downcast_index(loaded._index).hnsw.efSearch == 64
    q = x[1000:1010]
    _, ids = loaded.search(q, 1)
    assert ids[:, 0].tolist() == list(range(1000, 1010))  # each new point is its own neighbour
