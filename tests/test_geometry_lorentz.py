"""curvalign.geometry.lorentz against independent float64 references, gradcheck, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _geometry_reference as ref
from curvalign.geometry import lorentz as L

f64 = torch.float64
CURVATURES = [1e-2, 0.3, 1.0, 10.0]
PROPS = settings(max_examples=40, deadline=None)


def points(seed: int, n: int, d: int, scale: float = 1.0, c: float = 1.0) -> torch.Tensor:
    """Points at hyperbolic radii up to a few units (space norms up to ~sinh(3)/sqrt(c))."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g, dtype=f64) * scale / math.sqrt(c)
    return ref.expmap0_full(v, c)[..., 1:]


# ----------------------------------------------------------------------------------------
# Against the references
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", CURVATURES)
def test_time_inner_and_distances_match_reference(c: float) -> None:
    x, y = points(0, 7, 5, c=c), points(1, 6, 5, c=c)
    assert torch.allclose(L.time(x, c), ref.full(x, c)[:, 0], rtol=1e-12)
    xe, ye = x[:, None].expand(7, 6, 5), y[None].expand(7, 6, 5)
    expect_inner = ref.minkowski(ref.full(xe, c), ref.full(ye, c))
    assert torch.allclose(L.inner(xe, ye, c), expect_inner, rtol=1e-10)
    assert torch.allclose(L.pairwise_inner(x, y, c), expect_inner, rtol=1e-10)
    expect = ref.dist(xe, ye, c)
    assert torch.allclose(L.dist(xe, ye, c), expect, rtol=1e-9, atol=1e-12)
    assert torch.allclose(L.pairwise_dist(x, y, c), expect, rtol=1e-9, atol=1e-12)
    o = torch.zeros_like(x)
    assert torch.allclose(L.dist0(x, c), ref.dist(x, o, c), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("c", CURVATURES)
def test_expmap0_matches_full_hyperboloid_formula(c: float) -> None:
    g = torch.Generator().manual_seed(2)
    v = torch.randn(9, 4, generator=g, dtype=f64) * 2.0 / math.sqrt(c)
    expect = ref.expmap0_full(v, c)
    got = L.expmap0(v, c)
    assert torch.allclose(got, expect[:, 1:], rtol=1e-12)
    assert torch.allclose(L.time(got, c), expect[:, 0], rtol=1e-12)
    # The geodesic from the origin along v has length |v|.
    assert torch.allclose(L.dist0(got, c), v.norm(dim=-1), rtol=1e-10)
    assert torch.allclose(L.logmap0(got, c), v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("c", CURVATURES)
def test_exterior_angle_matches_tangent_space_reference(c: float) -> None:
    x, y = points(3, 8, 4, c=c), points(4, 5, 4, c=c)
    xe, ye = x[:, None].expand(8, 5, 4), y[None].expand(8, 5, 4)
    expect = ref.exterior_angle(xe, ye, c)
    assert torch.allclose(L.exterior_angle(xe, ye, c), expect, atol=1e-9)
    assert torch.allclose(L.pairwise_exterior_angle(x, y, c), expect, atol=1e-6)


def test_exterior_angle_curvature_scaling() -> None:
    """Eq. (9) is invariant under x -> x / sqrt(s), c -> s c (a rescaled copy of the same
    triangle), which pins down where c enters the formula."""
    x, y = points(5, 6, 3), points(6, 6, 3)
    for s in (0.1, 4.0):
        assert torch.allclose(
            L.exterior_angle(x / math.sqrt(s), y / math.sqrt(s), s),
            L.exterior_angle(x, y, 1.0),
            atol=1e-10,
        )
        assert torch.allclose(
            L.dist(x / math.sqrt(s), y / math.sqrt(s), s) * math.sqrt(s),
            L.dist(x, y, 1.0),
            rtol=1e-10,
        )


@pytest.mark.parametrize("c", CURVATURES)
def test_half_aperture_and_midpoint_match_reference(c: float) -> None:
    x = points(7, 10, 3, c=c)
    assert torch.allclose(L.half_aperture(x, c), ref.half_aperture(x, c), atol=1e-12)
    assert torch.allclose(L.half_aperture(x, c, K=0.3), ref.half_aperture(x, c, K=0.3), atol=1e-12)
    w = torch.rand(10, generator=torch.Generator().manual_seed(8), dtype=f64) + 0.1
    assert torch.allclose(
        L.einstein_midpoint(x, c), ref.einstein_midpoint(x, c), rtol=1e-9, atol=1e-12
    )
    assert torch.allclose(
        L.einstein_midpoint(x, c, weights=w), ref.einstein_midpoint(x, c, w), rtol=1e-9, atol=1e-12
    )


def test_factor_layout_matches_per_factor_calls() -> None:
    g = torch.Generator().manual_seed(9)
    X, Y = (
        torch.randn(5, 3, 4, generator=g, dtype=f64),
        torch.randn(6, 3, 4, generator=g, dtype=f64),
    )
    c = torch.tensor([0.5, 1.0, 3.0], dtype=f64)
    D, A, I = (
        L.pairwise_dist(X, Y, c),
        L.pairwise_exterior_angle(X, Y, c),
        L.pairwise_inner(X, Y, c),
    )
    assert D.shape == A.shape == I.shape == (3, 5, 6)
    for j in range(3):
        assert torch.allclose(D[j], L.pairwise_dist(X[:, j], Y[:, j], c[j]), rtol=1e-12, atol=1e-14)
        assert torch.allclose(A[j], L.pairwise_exterior_angle(X[:, j], Y[:, j], c[j]), atol=1e-12)
        assert torch.allclose(I[j], L.pairwise_inner(X[:, j], Y[:, j], c[j]), rtol=1e-12)
    # Row-wise functions broadcast c: [k] against x: [B, k, d].
    assert torch.allclose(L.dist(X, X.flip(0), c)[:, 1], L.dist(X[:, 1], X.flip(0)[:, 1], c[1]))
    mid = L.einstein_midpoint(X, c, dim=0)
    assert mid.shape == (3, 4)
    assert torch.allclose(mid[2], L.einstein_midpoint(X[:, 2], c[2]), rtol=1e-12)


# ----------------------------------------------------------------------------------------
# Gradients (float64 gradcheck, including c)
# ----------------------------------------------------------------------------------------


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def test_gradcheck_rowwise_functions() -> None:
    x, y = _leaf(points(10, 4, 3)), _leaf(points(11, 4, 3))
    c = _leaf(torch.tensor(0.7, dtype=f64))
    for fn in (L.time, L.expmap0, L.logmap0, L.dist0, L.half_aperture):
        assert torch.autograd.gradcheck(fn, (x, c))
    for fn in (L.inner, L.dist, L.exterior_angle):
        assert torch.autograd.gradcheck(fn, (x, y, c))
    w = _leaf(torch.rand(4, dtype=f64) + 0.5)
    assert torch.autograd.gradcheck(lambda a, cc, ww: L.einstein_midpoint(a, cc, ww), (x, c, w))


def test_gradcheck_pairwise_functions() -> None:
    X, Y = _leaf(points(12, 4, 3)), _leaf(points(13, 5, 3))
    c = _leaf(torch.tensor(1.7, dtype=f64))
    for fn in (L.pairwise_inner, L.pairwise_dist, L.pairwise_exterior_angle):
        assert torch.autograd.gradcheck(fn, (X, Y, c))
    g = torch.Generator().manual_seed(14)
    Xk = _leaf(torch.randn(4, 2, 3, generator=g, dtype=f64))
    Yk = _leaf(torch.randn(3, 2, 3, generator=g, dtype=f64))
    ck = _leaf(torch.tensor([0.4, 2.5], dtype=f64))
    for fn in (L.pairwise_dist, L.pairwise_exterior_angle):
        assert torch.autograd.gradcheck(fn, (Xk, Yk, ck))


# ----------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------

seeds = st.integers(0, 2**31 - 1)
curv = st.sampled_from([1e-2, 0.1, 0.5, 1.0, 3.0, 10.0])
scales = st.sampled_from([0.05, 0.5, 1.0, 2.0])


@PROPS
@given(seeds, curv, scales)
def test_distance_is_a_metric(seed: int, c: float, scale: float) -> None:
    x, y, z = (
        points(seed, 6, 4, scale, c),
        points(seed + 1, 6, 4, scale, c),
        points(seed + 2, 6, 4, scale, c),
    )
    dxy, dyx = L.dist(x, y, c), L.dist(y, x, c)
    assert torch.allclose(dxy, dyx, rtol=1e-12, atol=1e-14)
    assert torch.equal(L.dist(x, x, c), torch.zeros(6, dtype=f64))
    assert (dxy >= 0).all()
    assert (L.dist(x, z, c) <= dxy + L.dist(y, z, c) + 1e-9).all()
    D = L.pairwise_dist(x, x, c)
    assert torch.allclose(D, D.T, rtol=1e-10, atol=1e-10)
    # The Gram matrix's rounding floor: z carries an error of about eps c t^2.
    assert D.diagonal().abs().max() < 4 * math.sqrt(2.3e-16) * L.time(x, c).max()


@PROPS
@given(seeds, curv, scales)
def test_pairwise_equals_rowwise(seed: int, c: float, scale: float) -> None:
    x, y = points(seed, 5, 3, scale, c), points(seed + 7, 4, 3, scale, c)
    xe, ye = x[:, None].expand(5, 4, 3), y[None].expand(5, 4, 3)
    assert torch.allclose(L.pairwise_dist(x, y, c), L.dist(xe, ye, c), rtol=1e-8, atol=1e-7)
    assert torch.allclose(L.pairwise_inner(x, y, c), L.inner(xe, ye, c), rtol=1e-10)
    assert torch.allclose(
        L.pairwise_exterior_angle(x, y, c), L.exterior_angle(xe, ye, c), atol=1e-6
    )


@PROPS
@given(seeds, curv, st.sampled_from([1e-3, 0.3, 1.0, 3.0, 8.0]))
def test_expmap_logmap_inverse_and_on_manifold(seed: int, c: float, radius: float) -> None:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(6, 5, generator=g, dtype=f64)
    v = v / v.norm(dim=-1, keepdim=True) * radius / math.sqrt(c)
    x = L.expmap0(v, c)
    t = L.time(x, c)
    # -t^2 + |x|^2 = -1/c, relative to the size of the terms.
    assert torch.allclose(
        (-t * t + (x * x).sum(-1)) * c,
        torch.full((6,), -1.0, dtype=f64),
        atol=1e-12 * (1 + (c * t * t).max().item()),
    )
    assert torch.allclose(L.logmap0(x, c), v, rtol=1e-9, atol=1e-13)
    assert torch.allclose(L.expmap0(L.logmap0(x, c), c), x, rtol=1e-9, atol=1e-13)


@PROPS
@given(seeds, curv, st.floats(1.01, 5.0), st.floats(0.05, 0.95))
def test_exterior_angle_range_ray_and_towards_origin(
    seed: int, c: float, beyond: float, before: float
) -> None:
    x, y = points(seed, 6, 3, 1.0, c), points(seed + 3, 6, 3, 1.0, c)
    a = L.exterior_angle(x, y, c)
    assert ((a >= 0) & (a <= math.pi)).all()
    A = L.pairwise_exterior_angle(x, y, c)
    assert ((A >= 0) & (A <= math.pi)).all()
    # Along the ray from the origin beyond x: 0; between the origin and x: pi.
    assert L.exterior_angle(x, beyond * x, c).abs().max() < 1e-7
    assert (L.exterior_angle(x, before * x, c) - math.pi).abs().max() < 1e-7


@PROPS
@given(seeds, curv)
def test_einstein_midpoint_properties(seed: int, c: float) -> None:
    x, y = points(seed, 1, 4, 1.0, c), points(seed + 1, 1, 4, 1.0, c)
    assert torch.allclose(L.einstein_midpoint(x, c), x[0], rtol=1e-10, atol=1e-13)
    # The Einstein midpoint of two points is their geodesic midpoint.
    m = L.einstein_midpoint(torch.cat([x, y]), c)
    d = L.dist(x[0], y[0], c)
    assert torch.allclose(L.dist(m, x[0], c), d / 2, rtol=1e-8, atol=1e-10)
    assert torch.allclose(L.dist(m, y[0], c), d / 2, rtol=1e-8, atol=1e-10)
    # Repeating a point is the same as weighting it.
    X = torch.cat([x, x, y])
    w = torch.tensor([2.0, 1.0], dtype=f64)
    assert torch.allclose(
        L.einstein_midpoint(X, c), L.einstein_midpoint(torch.cat([x, y]), c, weights=w), rtol=1e-10
    )


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------


def test_bad_input_gets_one_clear_error() -> None:
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match="c: expected a finite number > 0"):
        L.dist(x, x, -1.0)
    with pytest.raises(TypeError, match="x: expected a floating-point tensor"):
        L.time(torch.ones(3, 2, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="X, Y: trailing shapes must match"):
        L.pairwise_dist(x, torch.randn(3, 4), 1.0)
    with pytest.raises(ValueError, match="c: expected a scalar"):
        L.pairwise_dist(x, x, torch.ones(3))
    with pytest.raises(ValueError, match="weights"):
        L.einstein_midpoint(x, 1.0, weights=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="dim"):
        L.einstein_midpoint(x, 1.0, dim=-1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), c=st.sampled_from([1e-2, 1.0, 10.0]))
def test_tangent_mean_along_a_ray_averages_distances_to_the_origin(seed: int, c: float) -> None:
    """Points on one geodesic ray from the origin: the centroid lies on that ray, at the mean of
    their distances to the origin (the expected value comes from dist0, not from logmap0)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(5, generator=g, dtype=torch.float64)
    direction = direction / direction.norm()
    radii = torch.rand(4, generator=g, dtype=torch.float64) * 3.0
    # a point at geodesic distance r along the ray has space part sinh(sqrt(c) r)/sqrt(c) * direction
    points = (torch.sinh(math.sqrt(c) * radii) / math.sqrt(c))[:, None] * direction
    centroid = L.tangent_mean(points, c)
    assert centroid.shape == (1, 5)
    assert torch.allclose(L.dist0(centroid, c), L.dist0(points, c).mean(), atol=1e-9)
    along = (centroid[0] @ direction) / centroid[0].norm().clamp_min(1e-300)
    assert radii.mean() < 1e-6 or torch.isclose(
        along, torch.tensor(1.0, dtype=torch.float64), atol=1e-9
    )


def test_tangent_mean_of_one_point_and_per_factor_curvatures() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 4, generator=g, dtype=torch.float64)
    c = torch.tensor([0.1, 1.0, 10.0], dtype=torch.float64)
    assert torch.allclose(L.tangent_mean(x, c), x, atol=1e-12)
    prompts = torch.randn(6, 3, 4, generator=g, dtype=torch.float64)
    per_factor = torch.stack([L.tangent_mean(prompts[:, f], float(c[f]))[0] for f in range(3)])
    assert torch.allclose(L.tangent_mean(prompts, c)[0], per_factor, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pairwise_dist_padded_operands_equal_unpadded(monkeypatch, dtype) -> None:
    """Wide time-augmented operands (d + 1 = 101 -> 104 columns) are zero-padded; the values
    and gradients equal those of the unpadded product to float rounding."""
    g = torch.Generator().manual_seed(11)
    X0 = 0.1 * torch.randn(13, 100, generator=g, dtype=dtype)
    Y0 = 0.1 * torch.randn(9, 100, generator=g, dtype=dtype)

    def run():
        X, Y = X0.clone().requires_grad_(), Y0.clone().requires_grad_()
        c = torch.tensor(0.7, dtype=dtype, requires_grad=True)
        out = L.pairwise_dist(X, Y, c, fused=False)  # the padding is the reference's
        out.square().sum().backward()
        return out.detach(), X.grad, Y.grad, c.grad

    shapes: list[tuple[int, ...]] = []
    real_bmm = torch.baddbmm

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        shapes.append(tuple(args[1].shape))
        return real_bmm(*args, **kw)

    monkeypatch.setattr(torch, "baddbmm", spy)
    padded = run()
    assert shapes[0][-1] == 104  # the check can fail: the padding is in effect
    monkeypatch.setattr(L, "_PAD_FROM", 10**9)
    plain = run()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(padded, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
