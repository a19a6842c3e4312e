"""curvalign.index: exact Lorentz search through Faiss, ANN, rerank with recipe scores, persistence.

References are independent of the code under test: mpmath at 50 digits for the hyperbolic
distance, ``recipe.scores`` for the exhaustive rankings.
"""

from __future__ import annotations

import json
import math

import mpmath
import numpy as np
import pytest
import torch

from curvalign.index import (
    IndexMismatchError,
    RecipeIndex,
    build_index,
    database_vectors,
    exhaustive_topk,
    load_index,
    lorentz_distance,
    query_vectors,
    rerank_recall,
)
from curvalign.index.embed import embed_store, load_embeddings
from curvalign.recipes import get_recipe

mpmath.mp.dps = 50


def _mp_distance(x: np.ndarray, y: np.ndarray, c: float) -> mpmath.mpf:
    """Hyperbolic distance of two space-component vectors at 50 digits (x, y exactly as stored)."""
    c = mpmath.mpf(float(c))
    xs = [mpmath.mpf(float(v)) for v in x]
    ys = [mpmath.mpf(float(v)) for v in y]
    tx = mpmath.sqrt(1 / c + sum(v * v for v in xs))
    ty = mpmath.sqrt(1 / c + sum(v * v for v in ys))
    arg = c * (tx * ty - sum(a * b for a, b in zip(xs, ys, strict=False)))
    return mpmath.acosh(max(arg, mpmath.mpf(1))) / mpmath.sqrt(c)


def _reference(x: np.ndarray, q: np.ndarray, ids: np.ndarray, c: float, k: int):
    """Brute-force ranking: (distance, id) ascending, distances at 50 digits."""
    dists, out_ids = [], []
    for y in q:
        d = [_mp_distance(p, y, c) for p in x]
        order = sorted(range(len(x)), key=lambda i: (d[i], ids[i]))[:k]
        dists.append([float(d[i]) for i in order])
        out_ids.append([int(ids[i]) for i in order])
    return np.array(dists), np.array(out_ids)


def _points(rng: np.random.Generator, n: int, d: int, scale: float) -> np.ndarray:
    """Random directions with log-uniform norms around ``scale`` (a decade either side)."""
    v = rng.normal(size=(n, d))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return (v * scale * 10 ** rng.uniform(-1, 1, size=(n, 1))).astype(np.float32)


def _clustered(
    rng: np.random.Generator, n: int, d: int, c: float, clusters: int = 30
) -> np.ndarray:
    """Points with structure: expmap0 of tangent vectors around cluster centres."""
    centres = rng.normal(size=(clusters, d)) * 1.5 / math.sqrt(d)
    v = centres[rng.integers(0, clusters, n)] + rng.normal(size=(n, d)) * 0.4 / math.sqrt(d)
    r = np.linalg.norm(v, axis=1, keepdims=True)
    return (np.sinh(math.sqrt(c) * r) / (math.sqrt(c) * r) * v).astype(np.float32)


# --- the transform ------------------------------------------------------------------------------


def test_transform_dot_product_is_the_minkowski_inner_product():
    rng = np.random.default_rng(0)
    for c in (1e-3, 1.0, 7.0):
        x, y = _points(rng, 50, 5, 1.0), _points(rng, 50, 5, 1.0)
        u, v = database_vectors(x, c).astype(np.float64), query_vectors(y, c).astype(np.float64)
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        tx, ty = np.sqrt(1 / c + (x64**2).sum(1)), np.sqrt(1 / c + (y64**2).sum(1))
        minkowski = x64 @ y64.T - np.outer(tx, ty)
        np.testing.assert_allclose(
            u @ v.T, minkowski, rtol=1e-5, atol=1e-5 * np.abs(minkowski).max()
        )
        # The sign: the largest inner product is the smallest distance, for every query.
        dist = np.arccosh(np.maximum(-c * minkowski, 1.0)) / math.sqrt(c)
        assert (np.argmax(minkowski, axis=0) == np.argmin(dist, axis=0)).all()
        assert (minkowski <= -1 / c * (1 - 1e-9)).all()


def test_stable_distance_matches_mpmath_near_duplicates_far_out():
    rng = np.random.default_rng(1)
    x = _points(rng, 20, 8, 1e3)
    y = (x + rng.normal(size=x.shape).astype(np.float32) * 1e-2).astype(np.float32)
    for c in (0.1, 1.0, 10.0):
        got = lorentz_distance(x, y, c)
        want = np.array([float(_mp_distance(a, b, c)) for a, b in zip(x, y, strict=False)])
        np.testing.assert_allclose(got, want, rtol=1e-8)
        assert (lorentz_distance(x, x, c) == 0).all()


# --- exact search -------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [1e-4, 0.1, 1.0, 10.0])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e3])
def test_exact_search_equals_brute_force_ranking(c, scale):
    rng = np.random.default_rng(int(c * 1e4) + int(scale * 7))
    x = _points(rng, 70, 6, scale)
    x[10] = x[3]  # exact duplicates: a tie, broken by id
    x[40] = x[3]
    ids = rng.permutation(1000)[:70]  # external ids, not in insertion order
    q = np.vstack([_points(rng, 6, 6, scale), x[3:4]])
    index = build_index(x, c, ids=ids)
    dist, got = index.search(q, 8)
    want_d, want_ids = _reference(x, q, ids, c, 8)
    np.testing.assert_array_equal(got, want_ids)
    np.testing.assert_allclose(dist, want_d, rtol=1e-9, atol=1e-12)
    tied = sorted(ids[[3, 10, 40]])
    assert got[-1, :3].tolist() == tied and (dist[-1, :3] == 0).all()


@pytest.mark.parametrize("max_candidates", [4096, 30])
def test_exact_search_certificate_recovers_when_float32_cannot_separate(
    monkeypatch, max_candidates
):
    # Far from the origin with nearly equal norms the float32 scores are all noise (plain Faiss
    # gets the top 5 wrong here); the index must still return the float64 ranking, by widening
    # the candidate list (default cap) or by the float64 scan (a cap of 30 forces it).
    import curvalign.index.search as search_module

    monkeypatch.setattr(search_module, "_MAX_CANDIDATES", max_candidates)
    scans = []
    real_scan = search_module.LorentzIndex._scan
    monkeypatch.setattr(
        search_module.LorentzIndex,
        "_scan",
        lambda self, *a, **kw: scans.append(1) or real_scan(self, *a, **kw),
    )
    rng = np.random.default_rng(2)
    base = _points(rng, 1, 4, 1e4)[0]
    x = (base + rng.normal(size=(400, 4)) * 1e-1).astype(np.float32)
    q = (base + rng.normal(size=(3, 4)) * 1e-1).astype(np.float32)
    index = build_index(x, 1.0)
    dist, got = index.search(q, 5)
    ref = lorentz_distance(x[None].astype(np.float64), q[:, None].astype(np.float64), 1.0)
    order = np.lexsort((np.broadcast_to(np.arange(400), ref.shape), ref), axis=-1)[:, :5]
    np.testing.assert_array_equal(got, order)
    np.testing.assert_allclose(dist, np.take_along_axis(ref, order, 1), rtol=1e-12)
    _, plain = index._index.search(query_vectors(q, 1.0), 5)
    assert (plain != order).any()  # the case is a real one: float32 alone ranks wrongly
    assert (len(scans) > 0) == (max_candidates < 400)


def test_k_larger_than_collection_and_single_query():
    x = _points(np.random.default_rng(3), 5, 3, 1.0)
    dist, ids = build_index(x, 1.0).search(x[0], 10)
    assert ids.shape == (1, 5) and ids[0, 0] == 0 and dist[0, 0] == 0
    assert sorted(ids[0].tolist()) == list(range(5))


# --- approximate search -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,options", [("hnsw", {"ef_search": 128}), ("ivf", {"nlist": 32, "nprobe": 8})]
)
def test_ann_recall_is_high_and_distances_exact(method, options):
    rng = np.random.default_rng(4)
    c = 0.5
    x = _clustered(rng, 4000, 16, c)
    q = _clustered(rng, 100, 16, c)
    _, want = build_index(x, c).search(q, 10)
    ann = build_index(x, c, kind="ann", method=method, **options)
    dist, got = ann.search(q, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, want, strict=False)])
    assert recall >= 0.95, recall
    np.testing.assert_allclose(dist, lorentz_distance(x[got], q[:, None], c), rtol=1e-12)
    assert (np.diff(dist, axis=1) >= 0).all()


# --- add, save, load ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind,method", [("exact", "hnsw"), ("ann", "hnsw"), ("ann", "ivf")])
def test_save_load_round_trip_and_add(tmp_path, kind, method):
    rng = np.random.default_rng(5)
    c = 2.0
    x = _clustered(rng, 1500, 8, c)
    q = _clustered(rng, 20, 8, c)
    options = {"nlist": 16} if method == "ivf" else {}
    index = build_index(
        x[:1000],
        c,
        kind=kind,
        method=method,
        ids=np.arange(1000) * 2,
        meta={"recipe": "meru"},
        **options,
    )
    index.add(x[1000:], ids=np.arange(1000, 1500) * 2 + 1)
    d1, i1 = index.search(q, 7)
    path = index.save(tmp_path / "idx")
    meta = json.loads((path / "index.json").read_text())
    assert (
        meta["count"] == 1500
        and meta["dim"] == 8
        and meta["curvature"] == c
        and meta["meta"]["recipe"] == "meru"
    )
    loaded = load_index(path)
    d2, i2 = loaded.search(q, 7)
    np.testing.assert_array_equal(i1, i2)
    # the loaded index scans its file's rows from another buffer than the built one's, so the
    # float64 GEMM may sum in another order: distances agree to float64 rounding, not bit for bit
    np.testing.assert_allclose(d1, d2, rtol=1e-12)
    if kind == "exact":  # adding equals building on everything at once
        ids_all = np.concatenate([np.arange(1000) * 2, np.arange(1000, 1500) * 2 + 1])
        d3, i3 = build_index(x, c, ids=ids_all).search(q, 7)
        np.testing.assert_array_equal(i1, i3)
        np.testing.assert_allclose(d1, d3, rtol=1e-12)
    # saving over an existing index replaces it whole
    build_index(x[:10], c).save(path)
    assert len(load_index(path)) == 10


# --- bad input ----------------------------------------------------------------------------------


def test_bad_queries_and_inputs_are_refused_with_a_clear_message(tmp_path):
    x = _points(np.random.default_rng(6), 50, 32, 1.0)
    index = build_index(x, 1.0)
    with pytest.raises(
        IndexMismatchError,
        match="query has dimension 64 but the index holds Lorentz points of dimension 32",
    ):
        index.search(np.zeros((2, 64), np.float32), 3)
    with pytest.raises(
        IndexMismatchError, match="sphere points but the index holds Lorentz points"
    ):
        index.search(x[:2], 3, geometry="sphere")
    with pytest.raises(
        IndexMismatchError, match="curvature -0.5 but the index holds points of curvature -1"
    ):
        index.search(x[:2], 3, curvature=0.5)
    with pytest.raises(IndexMismatchError, match="embedding dict"):
        index.search({"point": x[:2]}, 3)
    with pytest.raises(IndexMismatchError, match=r"\[n, k, d\]"):
        index.search(np.zeros((2, 4, 8), np.float32), 3)
    bad = x[:2].copy()
    bad[1, 0] = np.nan
    with pytest.raises(IndexMismatchError, match="non-finite"):
        index.search(bad, 3)
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(x[:2], 0)
    with pytest.raises(IndexMismatchError, match="duplicates"):
        build_index(x[:3], 1.0, ids=[1, 1, 2])
    with pytest.raises(IndexMismatchError, match="already in the index"):
        index.add(x[:1], ids=[0])
    with pytest.raises(IndexMismatchError, match="positive finite"):
        build_index(x, -1.0)
    with pytest.raises(FileNotFoundError, match="not a curvalign index"):
        load_index(tmp_path)


# --- rerank with the recipe's own score ----------------------------------------------------------


def _random_recipe(name: str, seed: int = 0):
    torch.manual_seed(seed)
    cls = get_recipe(name)
    overrides = {"phyclip": {"num_factors": 8, "factor_dim": 4}}.get(name, {})
    config = cls.Config(**overrides) if overrides else cls.Config()
    if hasattr(config, "embed_dim") and name != "phyclip":
        config.embed_dim = 16
    recipe = cls(config, 12, 10).eval()
    # Spread the points so that the rankings are not degenerate at initialisation.
    with torch.no_grad():
        images = recipe.embed_images(torch.randn(150, 12) * 3)
        texts = recipe.embed_texts(torch.randn(30, 10) * 3)
    return recipe, images, texts


@pytest.mark.parametrize(
    "name", ["atmg", "phyclip", "proclip", "agr", "meru", "hycoclip", "clip", "dualpath"]
)
def test_rerank_with_all_candidates_equals_exhaustive_ranking(name):
    # In float64: the recipes compute pair_scores row-wise and scores through a Gram matrix, and
    # in float32 those two can swap near-ties (the rerank is exact for pair_scores by contract).
    recipe, images, texts = _random_recipe(name)
    recipe = recipe.double()
    images = {k: v.double() for k, v in images.items()}
    texts = {k: v.double() for k, v in texts.items()}
    for side, queries, database in (("images", texts, images), ("texts", images, texts)):
        n = next(iter(database.values())).shape[0]
        engine = RecipeIndex(recipe, database, side)
        scores, ids = engine.search(queries, k=10, candidates=n)
        want_scores, want_ids = exhaustive_topk(recipe, queries, database, side, 10)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-9, atol=1e-9)
        assert (
            rerank_recall(recipe, queries, database, side, k=10, candidates=n, engine=engine) == 1.0
        )


@pytest.mark.parametrize("name", ["atmg", "phyclip", "proclip", "agr"])
def test_rerank_recall_with_a_third_of_the_collection(name):
    recipe, images, texts = _random_recipe(name, seed=1)
    recall = rerank_recall(recipe, texts, images, "images", k=10, candidates=50)
    assert 0.0 <= recall <= 1.0
    assert recall >= 0.8, f"{name}: recall@10 {recall} with K=50 of 150"


@pytest.mark.parametrize("name", ["atmg", "phyclip", "proclip", "agr"])
def test_rerank_does_not_depend_on_how_pairs_are_batched(name):
    """The rerank scores ``score_batch`` pairs per ``pair_scores`` call: any batching, down to one
    pair, gives the same ids and scores as one call over every pair."""
    recipe, images, texts = _random_recipe(name, seed=2)
    engine = RecipeIndex(recipe, images, "images")
    rows = engine.candidates(texts, 40)
    engine.score_batch = rows.size
    want_scores, want_ids = engine.rerank(texts, rows, 10)
    for batch in (1, 7, 1024):
        engine.score_batch = batch
        scores, ids = engine.rerank(texts, rows, 10)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-7)


def test_recipe_index_refuses_queries_from_another_geometry():
    recipe, images, _ = _random_recipe("meru")
    _, _, clip_texts = _random_recipe("proclip")
    engine = RecipeIndex(recipe, images, "images")
    with pytest.raises(IndexMismatchError, match="lacks embedding keys"):
        engine.search(clip_texts, 5)


# --- embed ---------------------------------------------------------------------------------------


def test_embed_writes_memory_maps_equal_to_in_memory_embedding(tmp_path):
    from curvalign.data.synthetic import SyntheticConfig, make_world

    store = make_world(SyntheticConfig(images=60, text_pairs=10, seed=3))
    recipe, _, _ = _random_recipe("agr")
    recipe = type(recipe)(recipe.config, store.image_dim, store.text_dim).eval()
    path = embed_store(
        recipe, store, tmp_path / "emb", batch_size=17, info={"run_dir": "x", "step": 0}
    )
    emb = load_embeddings(path)
    assert emb.meta["counts"] == {"images": store.num_images, "texts": store.num_texts}
    assert emb.geometry("lorentz") == "lorentz" and emb.curvature is not None
    with torch.no_grad():
        want_images = recipe.embed_images(store.image_features.float())
        want_texts = recipe.embed_texts(store.text_features.float())
    images, texts = emb.side("images"), emb.side("texts")
    assert set(images) == set(want_images)
    for key in want_images:
        assert isinstance(images[key], np.memmap)
        np.testing.assert_allclose(images[key], want_images[key].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(texts[key], want_texts[key].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(emb.text_to_image(), store.text_to_image.numpy())
