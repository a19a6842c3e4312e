"""curvalign.geometry.product: l1-product (PHyCLIP) and mixed-curvature product (ProCLIP)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import _geometry_reference as ref
from curvalign.geometry import lorentz as L
from curvalign.geometry import product as P
from curvalign.geometry import sphere as S

f64 = torch.float64


def rand(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64) * scale


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_l1_matches_per_factor_reference() -> None:
    X, Y = rand(0, 5, 3, 4), rand(1, 6, 3, 4)
    c = [0.5, 1.0, 4.0]
    expect = sum(ref.dist(X[:, None, j], Y[None, :, j], c[j]) for j in range(3))
    got = P.l1_pairwise_dist(X, Y, torch.tensor(c, dtype=f64))
    assert torch.allclose(got, expect, rtol=1e-9, atol=1e-12)
    assert torch.allclose(
        P.l1_dist(X[:, None], Y[None], torch.tensor(c, dtype=f64)), expect, rtol=1e-9
    )
    # A scalar curvature is shared by all factors.
    assert torch.allclose(
        P.l1_pairwise_dist(X, Y, 1.0), P.l1_pairwise_dist(X, Y, torch.ones(3, dtype=f64))
    )


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "default"])
@pytest.mark.parametrize("block", [1, 7, 40, 10**9])
def test_l1_blocked_equals_naive_sum_values_and_gradients(block: int, fused: bool | None) -> None:
    Xn, Yn = rand(2, 6, 4, 3), rand(3, 5, 4, 3)
    cn = torch.tensor([0.3, 1.0, 2.0, 7.0], dtype=f64)
    X, Y, c = (t.clone().requires_grad_() for t in (Xn, Yn, cn))
    X2, Y2, c2 = (t.clone().requires_grad_() for t in (Xn, Yn, cn))
    got = P.l1_pairwise_dist(X, Y, c, block=block, fused=fused)
    naive = sum(L.pairwise_dist(X2[:, j], Y2[:, j], c2[j]) for j in range(4))
    assert torch.allclose(got, naive, rtol=1e-12, atol=1e-12)
    weights = rand(4, 6, 5)
    (got * weights).sum().backward()
    (naive * weights).sum().backward()
    for a, b in ((X, X2), (Y, Y2), (c, c2)):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)


def test_l1_gradcheck_including_curvature() -> None:
    X, Y = rand(5, 4, 3, 2).requires_grad_(), rand(6, 3, 3, 2).requires_grad_()
    c = torch.tensor([0.4, 1.0, 3.0], dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, cc: P.l1_pairwise_dist(a, b, cc, block=5, fused=False), (X, Y, c)
    )
    assert torch.autograd.gradcheck(lambda a, b, cc: P.l1_pairwise_dist(a, b, cc), (X, Y, c))


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "default"])
def test_l1_never_materialises_k_n_m(fused: bool | None) -> None:
    """No op in the forward or backward produces a tensor as large as ``k * N * M``; with a
    small block nothing beyond the ``[N, M]`` output and its gradient is even close. (The fused
    kernel's own buffers, one ``[M, k, d+1]`` column gradient per thread, are checked by size
    in the kernel; the operands it gets are padded to a multiple of 8 columns.)"""
    k, N, M, d = 16, 48, 40, 4
    X = rand(7, N, k, d, scale=0.5).float().requires_grad_()
    Y = rand(8, M, k, d, scale=0.5).float().requires_grad_()
    c = torch.ones(k, requires_grad=True)
    with LargestOutput() as mode:
        out = P.l1_pairwise_dist(X, Y, c, block=256, fused=fused)
        out.sum().backward()
    assert mode.largest < k * N * M
    padded_m = -(-M // 8) * 8
    assert mode.largest <= max(N * M, N * k * (d + 1), padded_m * k * (d + 1), 2 * 256 + M)
    assert X.grad is not None and torch.isfinite(X.grad).all() and torch.isfinite(c.grad).all()


def test_pairwise_dist_never_materialises_n_m_d() -> None:
    N, M, d = 30, 20, 16
    X, Y = rand(9, N, d).requires_grad_(), rand(10, M, d).requires_grad_()
    with LargestOutput() as mode:
        (L.pairwise_dist(X, Y, 1.0).sum() + L.pairwise_exterior_angle(X, Y, 1.0).sum()).backward()
    assert mode.largest < N * M * d


def _mixed_parts(seed: int, n: int, R: float) -> dict[str, torch.Tensor]:
    return {
        "hyperbolic": rand(seed, n, 3),
        "euclidean": rand(seed + 1, n, 2),
        "sphere": S.project(rand(seed + 2, n, 4), R),
    }


def test_mixed_matches_proclip_formula() -> None:
    R, c = 2.0, 0.7
    px, py = _mixed_parts(0, 5, R), _mixed_parts(10, 4, R)
    w = {"hyperbolic": 0.5, "euclidean": 1.5, "sphere": 2.0}
    got = P.mixed_pairwise_sqdist(px, py, w, c=c, radius=R)
    dh = ref.dist(px["hyperbolic"][:, None], py["hyperbolic"][None], c)
    de = ((px["euclidean"][:, None] - py["euclidean"][None]) ** 2).sum(-1)
    ds = ref.sphere_dist(px["sphere"][:, None], py["sphere"][None], R)
    expect = 0.5 * dh**2 + 1.5 * de + 2.0 * ds**2
    assert torch.allclose(got, expect, rtol=1e-9, atol=1e-12)
    rows = P.mixed_sqdist(
        {k: v[:, None] for k, v in px.items()},
        {k: v[None] for k, v in py.items()},
        w,
        c=c,
        radius=R,
    )
    assert torch.allclose(rows, expect, rtol=1e-9, atol=1e-12)
    # A subset of factors works; tensor weights carry gradients.
    a = torch.tensor(0.3, dtype=f64, requires_grad=True)
    only_e = P.mixed_pairwise_sqdist(
        {"euclidean": px["euclidean"]}, {"euclidean": py["euclidean"]}, {"euclidean": a}
    )
    only_e.sum().backward()
    assert torch.allclose(a.grad, de.sum())


def test_mixed_gradcheck() -> None:
    px = {k: v.requires_grad_() for k, v in _mixed_parts(20, 3, 1.0).items()}
    py = {k: v.requires_grad_() for k, v in _mixed_parts(30, 4, 1.0).items()}
    c = torch.tensor(1.3, dtype=f64, requires_grad=True)
    w = torch.tensor([0.7, 1.1, 0.4], dtype=f64, requires_grad=True)

    def f(hx, ex, sx, hy, ey, sy, cc, ww):  # type: ignore[no-untyped-def]
        weights = {"hyperbolic": ww[0], "euclidean": ww[1], "sphere": ww[2]}
        return P.mixed_pairwise_sqdist(
            {"hyperbolic": hx, "euclidean": ex, "sphere": sx},
            {"hyperbolic": hy, "euclidean": ey, "sphere": sy},
            weights,
            c=cc,
        )

    assert torch.autograd.gradcheck(f, (*px.values(), *py.values(), c, w))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.1, 1.0, 5.0]))
def test_products_are_symmetric_and_zero_on_the_diagonal(seed: int, c: float) -> None:
    X = rand(seed, 5, 4, 3)
    D = P.l1_pairwise_dist(X, X, c)
    assert torch.allclose(D, D.T, rtol=1e-10, atol=1e-9)
    assert D.diagonal().abs().max() < 1e-6 * L.time(X, c).max() * 4
    Y = rand(seed + 1, 5, 4, 3)
    assert (
        P.l1_dist(X, Y, c) <= P.l1_dist(X, X.roll(1, 0), c) + P.l1_dist(X.roll(1, 0), Y, c) + 1e-9
    ).all()
    parts = _mixed_parts(seed, 4, 1.0)
    w = {"hyperbolic": 1.0, "euclidean": 1.0, "sphere": 1.0}
    Mx = P.mixed_pairwise_sqdist(parts, parts, w, c=c)
    assert torch.allclose(Mx, Mx.T, rtol=1e-9, atol=1e-9)
    assert Mx.diagonal().abs().max() < 1e-6 * math.sqrt(1 + Mx.max().item())


def test_bad_input() -> None:
    X = torch.randn(4, 3, 2)
    with pytest.raises(ValueError, match=r"c: expected a scalar or shape \[3\]"):
        P.l1_pairwise_dist(X, X, torch.ones(2))
    with pytest.raises(ValueError, match="X, Y"):
        P.l1_pairwise_dist(X, torch.randn(4, 2, 2), 1.0)
    with pytest.raises(ValueError, match="unknown factor"):
        P.mixed_pairwise_sqdist({"hyper": X[:, 0]}, {"hyper": X[:, 0]}, {"hyper": 1.0})
    with pytest.raises(ValueError, match="missing weight"):
        P.mixed_pairwise_sqdist({"euclidean": X[:, 0]}, {"euclidean": X[:, 0]}, {})
    with pytest.raises(ValueError, match="factors differ"):
        P.mixed_pairwise_sqdist(
            {"euclidean": X[:, 0]}, {"sphere": X[:, 0]}, {"euclidean": 1.0, "sphere": 1.0}
        )
