"""The open geometry menu: a recipe in the Poincare ball (tests/plugin_poincare.py), a geometry
``src/curvalign`` does not have, found through the ``curvalign.recipes`` entry-point group,
trains, evaluates with every metric its geometry supports, embeds, builds an exact index and
searches, with its own ``Geometry`` and ``Lift`` and no edit in src/."""

from __future__ import annotations

import json
import math
from importlib.metadata import EntryPoint

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import curvalign.plugins
import curvalign.recipes
from curvalign.cli import app
from curvalign.geometry import lorentz
from curvalign.index.embed import load_embeddings
from curvalign.index.rerank import RecipeIndex
from curvalign.runs import load_run
from plugin_poincare import NAME, PoincareInfoNCE, dist, pairwise_dist, to_hyperboloid

DATA = "synthetic:images=120,text_pairs=20,seed=5"
runner = CliRunner()


def _run(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def _reference_dist(x: np.ndarray, y: np.ndarray, c: float) -> np.ndarray:
    """Poincare distances ``[N, M]`` by another route: map both sides to the hyperboloid and take
    ``curvalign.geometry.lorentz.pairwise_dist`` in float64 (the ball and the hyperboloid are
    isometric)."""
    hx, _ = to_hyperboloid(x, c)
    hy, _ = to_hyperboloid(y, c)
    return lorentz.pairwise_dist(torch.from_numpy(hx), torch.from_numpy(hy), c).numpy()


# --- the ball's math against independent references ---------------------------------------------


@pytest.mark.parametrize("c", [0.3, 1.0, 4.0])
def test_ball_distance_matches_the_hyperboloid_and_the_closed_form_radius(c):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 5, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * torch.rand(20, 1, generator=g, dtype=torch.float64)
    x = x * 0.95 / math.sqrt(c)  # inside the ball of radius 1/sqrt(c)
    y = x.flip(0)
    ct = torch.tensor(c, dtype=torch.float64)
    want = _reference_dist(x.numpy(), y.numpy(), c)
    # one matrix product: |x - y|^2 cancels at x = y (there the square root of rounding shows)
    np.testing.assert_allclose(pairwise_dist(x, y, ct).numpy(), want, rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(dist(x, y, ct).numpy(), np.diag(want), rtol=1e-9)
    # from the origin: 2 atanh(sqrt(c) r) / sqrt(c)
    r = x.norm(dim=1).numpy()
    origin = np.zeros((1, 5))
    np.testing.assert_allclose(
        _reference_dist(origin, x.numpy(), c)[0], 2 * np.arctanh(math.sqrt(c) * r) / math.sqrt(c)
    )


def test_the_lift_dot_product_is_minus_cosh_of_the_ball_distance():
    recipe = PoincareInfoNCE(PoincareInfoNCE.Config(embed_dim=6, curvature_init=2.0), 9, 9)
    with torch.no_grad():
        images = recipe.embed_images(torch.randn(30, 9) * 2)
        texts = recipe.embed_texts(torch.randn(10, 9) * 2)
    lift = recipe.index_proxies()["poincare"].lift
    u = lift.database(images).astype(np.float64)
    v = lift.query(texts).astype(np.float64)
    c = float(recipe.curvature_value())
    d = _reference_dist(texts["point"].double().numpy(), images["point"].double().numpy(), c)
    np.testing.assert_allclose(v @ u.T, -np.cosh(math.sqrt(c) * d) / c, rtol=1e-4)
    # so the largest dot product is the nearest image, for every text
    assert (np.argmax(v @ u.T, axis=1) == np.argmin(d, axis=1)).all()


# --- end to end, through the entry point and the CLI --------------------------------------------


@pytest.fixture(scope="module")
def plugged():
    """The recipe installed as an entry point of the group would be (nothing registered by hand)."""
    point = EntryPoint(
        name=NAME,
        value="plugin_poincare:PoincareInfoNCE",
        group=curvalign.plugins.RECIPE_ENTRY_POINT_GROUP,
    )
    real = curvalign.plugins.entry_points
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            curvalign.plugins,
            "entry_points",
            lambda group: [point] if group == point.group else real(group=group),
        )
        mp.setattr(curvalign.recipes, "_loaded", False)  # discover again, entry points included
        yield
        curvalign.recipes._REGISTRY.pop(NAME, None)


@pytest.fixture(scope="module")
def run_dir(plugged, tmp_path_factory):
    out = tmp_path_factory.mktemp("poincare") / "run"
    _run(
        "train",
        "--recipe",
        NAME,
        "--data",
        DATA,
        "--steps",
        "20",
        "--out",
        out,
        "-q",
        "batch_size=32",
        "tensorboard=false",
        "checkpoint_every=0",
    )
    return out


def test_poincare_recipe_evaluates_with_every_metric_its_geometry_supports(run_dir):
    assert curvalign.recipes.get_recipe(NAME) is PoincareInfoNCE
    result = json.loads(_run("eval", run_dir, "--json"))
    assert result["meta"]["recipe"] == NAME
    for part in ("retrieval", "zeroshot", "hierarchy", "compositional", "ordering"):
        assert result[part] is not None, part
    # the ball has an origin: ordering applies to both chain kinds, distances are reported
    assert result["ordering"]["text"] is not None and result["ordering"]["image"] is not None
    assert result["diagnostics"]["distance_to_origin"] is not None
    assert result["diagnostics"]["spectrum"]["image"]["effective_rank"] > 1

    # retrieval ranks with the ball's own distance: recompute t2i@1 through the hyperboloid
    from curvalign.data import load_data
    from curvalign.eval.pipeline import split_rows

    store, recipe = load_data(DATA), load_run(run_dir).recipe
    image_ids, text_ids, t2i = split_rows(store, "test")
    with torch.no_grad():
        images = recipe.embed_images(store.image_features[image_ids].float())["point"]
        texts = recipe.embed_texts(store.text_features[text_ids].float())["point"]
    c = float(recipe.curvature_value())
    d = torch.from_numpy(_reference_dist(texts.double().numpy(), images.double().numpy(), c))
    own = d[torch.arange(len(t2i)), t2i]
    # ranks from float32 scores: count as ties what float32 cannot separate
    tol = 1e-5 * own.abs().clamp_min(1.0)[:, None]
    ahead = (d < own[:, None] - tol).sum(1)
    tied = (torch.abs(d - own[:, None]) <= tol).sum(1) - 1
    lower = float((ahead + tied == 0).double().mean())
    upper = float((ahead == 0).double().mean())
    assert lower - 1e-6 <= result["retrieval"]["t2i@1"] <= upper + 1e-6  # a float32 mean


def test_poincare_recipe_embeds_indexes_and_searches_exactly(run_dir, tmp_path):
    _run("embed", run_dir, "--out", tmp_path / "emb", "-q")
    emb = load_embeddings(tmp_path / "emb")
    assert emb.recipe_name == NAME and emb.geometry("point") == "poincare"
    recipe = load_run(run_dir).recipe
    c = float(recipe.curvature_value())
    assert emb.curvature == pytest.approx([c])

    _run("index", "build", tmp_path / "emb", "--out", tmp_path / "idx")
    found = json.loads(
        _run(
            "index", "search", tmp_path / "idx", "--query-text-ids", "0,7,42", "--k", "5", "--json"
        )
    )
    images = emb.side("images")["point"].astype(np.float64)
    texts = emb.side("texts")["point"].astype(np.float64)
    d = _reference_dist(texts, images, c)
    for row in found["results"]:
        want = np.lexsort((np.arange(d.shape[1]), d[row["query"]]))[:5]  # ascending, ties by id
        assert row["ids"] == want.tolist()
        assert row["scores"] == pytest.approx((-d[row["query"], want]).tolist(), rel=1e-4)


def test_poincare_candidates_from_an_approximate_graph_on_its_own_coordinates(run_dir, tmp_path):
    """An HNSW candidate graph built on the plug-in's graph coordinates finds the exact top 5
    from 20 candidates (the rerank is exact; only the candidates are approximate)."""
    recipe = load_run(run_dir).recipe
    from curvalign.data import load_data

    store = load_data(DATA)
    with torch.no_grad():
        images = recipe.embed_images(store.image_features.float())
        texts = recipe.embed_texts(store.text_features[:40].float())
    engine = RecipeIndex(recipe, images, "images", candidate_index="hnsw", M=8)
    _, got = engine.search(texts, k=5, candidates=20)
    c = float(recipe.curvature_value())
    d = _reference_dist(texts["point"].double().numpy(), images["point"].double().numpy(), c)
    want = np.argsort(d, axis=1, kind="stable")[:, :5]
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(got, want, strict=True)])
    assert recall >= 0.95
