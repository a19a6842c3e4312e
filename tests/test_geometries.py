"""Geometries as values (curvalign.geometries): the built-in objects answer what the built-in
recipes answer, their lifts rank like their scores, and the Lorentz pieces an index uses
(excess, distance from the excess, Poincare-ball coordinates) agree with independent forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from curvalign.errors import InputError
from curvalign.geometries import (
    Euclidean,
    Geometry,
    Lorentz,
    Sphere,
    named_geometry,
)
from curvalign.geometry import lorentz
from curvalign.index.rerank import Proxy
from curvalign.recipes import get_recipe
from curvalign.recipes.base import IndexProxy

BUILT_IN = ["clip", "meru", "hycoclip", "atmg", "phyclip", "proclip", "agr", "dualpath"]
#: recipes whose ranking score is the score of the geometry of one key
ONE_KEY_SCORE = {
    "clip": "point",
    "dualpath": "point",
    "meru": "point",
    "hycoclip": "point",
    "phyclip": "point",
}


def _embedded(name: str):
    torch.manual_seed(0)
    cls = get_recipe(name)
    recipe = cls(cls.Config(), 12, 12).eval()
    with torch.no_grad():
        features = torch.randn(30, 12) * 3
        return recipe, recipe.embed_images(features), recipe.embed_texts(features.flip(0) + 1)


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_recipe_names_a_geometry_per_key_with_its_curvature_and_bounds(name):
    recipe, images, _ = _embedded(name)
    geometries = recipe.geometries()
    assert {k: g.kind for k, g in geometries.items()} == dict(recipe.embedding_geometry)
    assert set(geometries) <= set(images)
    c = recipe.curvature_value()
    for geometry in geometries.values():
        if isinstance(geometry, Lorentz):
            torch.testing.assert_close(geometry.curvature, c)
            assert geometry.bounds == recipe.curvature_bounds()


@pytest.mark.parametrize("name", sorted(ONE_KEY_SCORE))
def test_the_geometry_scores_like_the_recipe(name):
    recipe, images, texts = _embedded(name)
    key = ONE_KEY_SCORE[name]
    geometry = recipe.geometries()[key]
    with torch.no_grad():
        want = recipe.scores(texts, images).double()
        pairs = recipe.pair_scores(texts, images).double()
    got = geometry.scores(texts[key].double(), images[key].double())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        geometry.pair_scores(texts[key].double(), images[key].double()), pairs, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("name", ["meru", "hycoclip", "atmg", "phyclip"])
def test_the_geometry_answers_distance_to_origin_and_tangent_like_the_recipe(name):
    recipe, images, _ = _embedded(name)
    geometry = recipe.geometries()["point"]
    torch.testing.assert_close(
        geometry.distance_to_origin(images["point"]), recipe.distance_to_origin(images)
    )
    torch.testing.assert_close(
        geometry.tangent(images["point"]).reshape(30, -1), recipe.tangent_features(images)
    )


def test_a_sphere_has_no_origin_and_a_flat_space_has_its_norm():
    x = torch.randn(5, 3, dtype=torch.float64)
    assert Sphere().distance_to_origin(x) is None
    torch.testing.assert_close(Euclidean().distance_to_origin(x), x.norm(dim=1))


@pytest.mark.parametrize("geometry", [Sphere(), Euclidean(), Lorentz(torch.tensor(0.7).double())])
def test_each_lift_ranks_like_its_geometrys_score(geometry):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    y = torch.randn(8, 6, generator=g, dtype=torch.float64)
    if isinstance(geometry, Sphere):
        x, y = x / x.norm(dim=1, keepdim=True), y / y.norm(dim=1, keepdim=True)
    lift = geometry.lift("k")
    u = lift.database({"k": x}).astype(np.float64)
    v = lift.query({"k": y}).astype(np.float64)
    score = geometry.scores(y, x).numpy()
    order_lift = np.argsort(-(v @ u.T), axis=1, kind="stable")[:, :5]
    order_score = np.argsort(-score, axis=1, kind="stable")[:, :5]
    assert (order_lift == order_score).all()


def test_a_geometry_known_by_name_only_has_that_kind_and_no_score():
    geometry = named_geometry("klein")
    assert isinstance(geometry, Geometry) and geometry.kind == "klein"
    assert geometry.lift("point") is None and geometry.distance_to_origin(torch.ones(2, 2)) is None
    with pytest.raises(InputError, match="'klein'"):
        geometry.scores(torch.ones(2, 2), torch.ones(2, 2))


def test_a_proxy_of_an_unknown_kind_without_vectors_is_refused_by_name():
    recipe, images, _ = _embedded("clip")
    proxy = Proxy(recipe, "klein", IndexProxy("klein", "point"))
    with pytest.raises(InputError, match="unknown proxy kind 'klein'.*lift="):
        proxy.database(images)


# --- the Lorentz pieces an index uses, against independent forms ---------------------------------


@pytest.mark.parametrize("c", [1e-3, 1.0, 9.0])
def test_excess_and_distance_from_excess_match_the_naive_float64_form(c):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 4, generator=g, dtype=torch.float64)
    y = torch.randn(50, 4, generator=g, dtype=torch.float64)
    tx = torch.sqrt(1 / c + (x * x).sum(1))
    ty = torch.sqrt(1 / c + (y * y).sum(1))
    naive = -c * ((x * y).sum(1) - tx * ty) - 1  # well conditioned for these points
    z = lorentz.excess(x, y, c)
    torch.testing.assert_close(z, naive, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(
        lorentz.dist_from_excess(z, c), torch.acosh(1 + naive) / math.sqrt(c), rtol=1e-9, atol=0
    )
    assert (lorentz.excess(x, x, c) == 0).all() and (lorentz.dist_from_excess(z * 0, c) == 0).all()


@pytest.mark.parametrize("c", [0.2, 1.0, 5.0])
def test_poincare_coordinates_keep_the_distance(c):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 3, generator=g, dtype=torch.float64) * 2
    y = torch.randn(20, 3, generator=g, dtype=torch.float64) * 2
    p, q = lorentz.poincare(x, c), lorentz.poincare(y, c)
    assert (c * (p * p).sum(1) < 1).all()
    # the ball's own distance formula (Nickel & Kiela 2017) on the ball coordinates
    sq = lambda a: (a * a).sum(1)  # noqa: E731
    ball = torch.acosh(1 + 2 * c * sq(p - q) / ((1 - c * sq(p)) * (1 - c * sq(q)))) / math.sqrt(c)
    torch.testing.assert_close(ball, lorentz.dist(x, y, c), rtol=1e-9, atol=1e-12)


def test_the_numpy_adapters_do_not_depend_on_their_block_size(monkeypatch):
    """The index's float64 numpy adapters call geometry.lorentz in row blocks (and over broadcast
    leading dimensions, as the exact search's ``[queries, candidates]`` excess does): the result
    is the one of a single call over the whole arrays, bit for bit."""
    import curvalign.geometries as geometries

    rng = np.random.default_rng(4)
    x = (rng.normal(size=(37, 5)) * 3).astype(np.float32)
    y = (rng.normal(size=(6, 1, 5)) * 3).astype(np.float32)
    whole = {
        "time": lorentz.time(torch.from_numpy(x).double(), 0.5).numpy(),
        "excess": lorentz.excess(torch.from_numpy(x).double(), torch.from_numpy(y).double(), 0.5),
        "ball": lorentz.poincare(torch.from_numpy(x).double(), 0.5).numpy().astype(np.float32),
    }
    monkeypatch.setattr(geometries, "BLOCK_ELEMENTS", 7)  # one row per call, many calls
    got_excess = geometries.lorentz_excess(x, y, 0.5)
    assert got_excess.shape == (6, 37)
    np.testing.assert_array_equal(got_excess, whole["excess"].numpy())
    np.testing.assert_array_equal(geometries.lorentz_time(x, 0.5), whole["time"])
    np.testing.assert_array_equal(geometries.poincare_ball(x, 0.5), whole["ball"])
    z = whole["excess"].numpy()
    np.testing.assert_array_equal(
        geometries.distance_from_excess(z, 0.5),
        lorentz.dist_from_excess(torch.from_numpy(z), 0.5).numpy(),
    )
