"""The edge matrix of docs/design.md "Numerics": finite values and finite gradients for x = y,
x = 0, huge norms (1e4 .. 1e6), c in {1e-4, 1e-2, 1, 10}, float32 and bf16 autocast."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from curvalign.geometry import euclidean as E
from curvalign.geometry import lorentz as L
from curvalign.geometry import product as P
from curvalign.geometry import sphere as S

CURVATURES = [1e-4, 1e-2, 1.0, 10.0]
SCALES = [0.0, 1e-6, 1.0, 1e4, 1e6]

# name -> function of (x, y, c) returning a tensor; x and y are [4, 6] points.
OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "time": lambda x, y, c: L.time(x, c),
    "expmap0": lambda x, y, c: L.expmap0(x, c),
    "logmap0": lambda x, y, c: L.logmap0(x, c),
    "inner": lambda x, y, c: L.inner(x, y, c),
    "dist": lambda x, y, c: L.dist(x, y, c),
    "dist0": lambda x, y, c: L.dist0(x, c),
    "half_aperture": lambda x, y, c: L.half_aperture(x, c),
    "exterior_angle": lambda x, y, c: L.exterior_angle(x, y, c),
    "pairwise_inner": lambda x, y, c: L.pairwise_inner(x, y, c),
    "pairwise_dist": lambda x, y, c: L.pairwise_dist(x, y, c),
    "pairwise_exterior_angle": lambda x, y, c: L.pairwise_exterior_angle(x, y, c),
    "einstein_midpoint": lambda x, y, c: L.einstein_midpoint(x, c),
    "l1_pairwise_dist": lambda x, y, c: P.l1_pairwise_dist(
        x.view(4, 2, 3), y.view(4, 2, 3), c.expand(2)
    ),
    "l1_dist": lambda x, y, c: P.l1_dist(x.view(4, 2, 3), y.view(4, 2, 3), c),
    "mixed_pairwise_sqdist": lambda x, y, c: P.mixed_pairwise_sqdist(
        {"hyperbolic": x, "euclidean": x, "sphere": S.project(x)},
        {"hyperbolic": y, "euclidean": y, "sphere": S.project(y)},
        {"hyperbolic": 1.0, "euclidean": 1.0, "sphere": 1.0},
        c=c,
    ),
    "sphere_dist": lambda x, y, c: S.dist(S.project(x), S.project(y)),
    "sphere_pairwise_dist": lambda x, y, c: S.pairwise_dist(S.project(x), S.project(y)),
    "pairwise_sqdist": lambda x, y, c: E.pairwise_sqdist(x, y),
    "pairwise_cosine": lambda x, y, c: E.pairwise_cosine(x, y),
}


def _cases(scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    x = x / x.norm(dim=-1, keepdim=True) * scale
    other = torch.randn(4, 6, generator=g) * max(scale, 1.0)
    return {
        "x=y": (x, x.clone()),
        "x=0": (torch.zeros_like(x), other),
        "y=0": (x, torch.zeros_like(x)),
        "ray": (x, 2.0 * x),
        "other": (x, other),
    }


def _check(name: str, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, autocast: bool) -> None:
    x = x.clone().requires_grad_()
    y = y.clone().requires_grad_()
    c = c.clone().requires_grad_()
    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if autocast
        else torch.autocast("cpu", enabled=False)
    )
    with ctx:
        out = OPS[name](x, y, c)
        loss = (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum()
    assert torch.isfinite(out).all(), f"{name}: non-finite value"
    if autocast:
        assert out.dtype == torch.float32, f"{name}: {out.dtype} under bf16 autocast"
    grads = torch.autograd.grad(loss, (x, y, c), allow_unused=True)
    for which, g in zip("xyc", grads, strict=False):
        assert g is None or torch.isfinite(g).all(), f"{name}: non-finite gradient in {which}"


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("c", CURVATURES)
@pytest.mark.parametrize("scale", SCALES)
def test_values_and_gradients_are_finite(scale: float, c: float, autocast: bool) -> None:
    curvature = torch.tensor(c)
    for case, (x, y) in _cases(scale).items():
        inputs = (x.bfloat16(), y.bfloat16()) if autocast else (x, y)
        for name in OPS:
            try:
                _check(name, *inputs, curvature, autocast)
            except AssertionError as err:
                raise AssertionError(f"{case}, |x|={scale}, c={c}: {err}") from None


def test_pairwise_diagonal_is_zero_with_bounded_gradient() -> None:
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
    D = L.pairwise_dist(x, x, 1.0)
    A = L.pairwise_exterior_angle(x, x, 1.0)
    # The Gram matrix's rounding floor in float32: z - 1 ~ eps t^2, so d ~ sqrt(eps) t.
    assert (
        D.diagonal().abs().max()
        < 8 * math.sqrt(torch.finfo(torch.float32).eps) * L.time(x, 1.0).max()
    )
    (gd,) = torch.autograd.grad(D.sum(), x)
    (ga,) = torch.autograd.grad(A.sum(), x)
    # Bounded by the dtype floor (1/sqrt(eps) ~ 3e3), not merely finite.
    assert gd.abs().max() < 1e4 and ga.abs().max() < 1e5


def test_expmap0_saturates_instead_of_overflowing() -> None:
    v = torch.tensor([[1e3, 0.0], [1e30, 0.0]])
    x = L.expmap0(v, 1.0)
    assert torch.isfinite(x).all()
    assert torch.allclose(x[:, 0], torch.full((2,), 2.0**15), rtol=1e-5)
    # The series branch is exact to the dtype at tiny norms.
    tiny = torch.tensor([[1e-20, 2e-20]])
    assert torch.equal(L.expmap0(tiny, 1.0), tiny)


def test_acosh_arguments_stay_float32_under_bf16_autocast() -> None:
    """Under autocast a bf16 Gram matrix would put an error of ~1e-2 * t^2 into acosh's
    argument; computing in float32 keeps pairwise distances close to the float64 value."""
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(16, 8, generator=g, dtype=torch.float64) * 0.3
    y64 = torch.randn(16, 8, generator=g, dtype=torch.float64) * 0.3
    expect = L.pairwise_dist(x64, y64, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.pairwise_dist(x64.float(), y64.float(), 1.0)
    assert got.dtype == torch.float32
    assert (got.double() - expect).abs().max() < 1e-4
    assert math.isfinite(float(got.sum()))
