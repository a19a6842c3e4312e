"""curvalign.geometry.sphere and .euclidean against float64 references and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _geometry_reference as ref
from curvalign.geometry import euclidean as E
from curvalign.geometry import sphere as S

f64 = torch.float64
PROPS = settings(max_examples=40, deadline=None)


def rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


@pytest.mark.parametrize("R", [0.5, 1.0, 3.0])
def test_sphere_matches_reference(R: float) -> None:
    x, y = S.project(rand(0, 6, 4), R), S.project(rand(1, 5, 4), R)
    assert torch.allclose(x.norm(dim=-1), torch.full((6,), R, dtype=f64), rtol=1e-14)
    xe, ye = x[:, None].expand(6, 5, 4), y[None].expand(6, 5, 4)
    expect = ref.sphere_dist(xe, ye, R)
    assert torch.allclose(S.dist(xe, ye, R), expect, atol=1e-12)
    assert torch.allclose(S.pairwise_dist(x, y, R), expect, atol=1e-12)


def test_sphere_ends_are_exact_with_finite_gradients() -> None:
    x = S.project(rand(2, 4, 3)).requires_grad_()
    d_same, d_opposite = S.dist(x, x), S.dist(x, -x)
    # <x, x> / R^2 rounds to 1 - O(eps): the acos of the spec leaves O(sqrt(eps)).
    assert d_same.abs().max() < 1e-7
    assert torch.allclose(d_opposite, torch.full((4,), math.pi, dtype=f64))
    (g,) = torch.autograd.grad((d_same + d_opposite).sum(), x)
    assert torch.isfinite(g).all()


def test_euclidean_matches_reference() -> None:
    x, y = rand(3, 6, 4), rand(4, 5, 4)
    diff = x[:, None] - y[None]
    assert torch.allclose(E.pairwise_sqdist(x, y), (diff * diff).sum(-1), rtol=1e-12, atol=1e-12)
    assert torch.allclose(E.sqdist(x[:, None], y[None]), (diff * diff).sum(-1), rtol=1e-12)
    cos = torch.nn.functional.cosine_similarity(x[:, None], y[None], dim=-1)
    assert torch.allclose(E.pairwise_cosine(x, y), cos, atol=1e-12)
    assert torch.equal(E.pairwise_sqdist(x, x).diagonal() >= 0, torch.ones(6, dtype=torch.bool))


def test_gradcheck_sphere_and_euclidean() -> None:
    x = S.project(rand(5, 4, 3), 2.0).requires_grad_()
    y = S.project(rand(6, 3, 3), 2.0).requires_grad_()
    R = torch.tensor(2.0, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(S.pairwise_dist, (x, y, R))
    assert torch.autograd.gradcheck(S.dist, (x[:3], y, R))
    assert torch.autograd.gradcheck(S.project, (rand(7, 3, 3).requires_grad_(), R))
    a, b = rand(8, 4, 3).requires_grad_(), rand(9, 5, 3).requires_grad_()
    assert torch.autograd.gradcheck(E.pairwise_sqdist, (a, b))
    assert torch.autograd.gradcheck(E.pairwise_cosine, (a, b))


seeds = st.integers(0, 2**31 - 1)


@PROPS
@given(seeds, st.sampled_from([0.5, 1.0, 2.0]))
def test_sphere_distance_is_a_metric(seed: int, R: float) -> None:
    x, y, z = (S.project(rand(seed + i, 5, 3), R) for i in range(3))
    dxy = S.dist(x, y, R)
    assert torch.allclose(dxy, S.dist(y, x, R), atol=1e-14)
    assert ((dxy >= 0) & (dxy <= math.pi * R + 1e-12)).all()
    assert (S.dist(x, z, R) <= dxy + S.dist(y, z, R) + 1e-9).all()
    D = S.pairwise_dist(x, y, R)
    assert torch.allclose(
        D, S.dist(x[:, None].expand(5, 5, 3), y[None].expand(5, 5, 3), R), atol=1e-12
    )


@PROPS
@given(seeds)
def test_euclidean_pairwise_equals_rowwise_and_is_symmetric(seed: int) -> None:
    x, y = rand(seed, 5, 3), rand(seed + 1, 4, 3)
    assert torch.allclose(
        E.pairwise_sqdist(x, y), E.sqdist(x[:, None], y[None]), rtol=1e-10, atol=1e-12
    )
    assert torch.allclose(E.pairwise_sqdist(x, y), E.pairwise_sqdist(y, x).T, rtol=1e-12)
    C = E.pairwise_cosine(x, x)
    assert torch.allclose(C.diagonal(), torch.ones(5, dtype=f64))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="radius"):
        S.project(torch.randn(3, 2), 0.0)
    with pytest.raises(ValueError, match="X, Y"):
        E.pairwise_sqdist(torch.randn(3, 2), torch.randn(3, 4))
