"""Independent float64 references for the geometry tests, written straight from the papers.

Full hyperboloid points ``(t, x)`` with an explicit time coordinate, the full Minkowski
product, loops where that is clearest. Nothing here imports curvalign.
"""

from __future__ import annotations

import math

import torch

f64 = torch.float64


def full(x: torch.Tensor, c: float) -> torch.Tensor:
    """``(t, x)`` on ``-t^2 + |x|^2 = -1/c`` (AtMG Eq. 3)."""
    t = torch.sqrt(1.0 / c + (x * x).sum(-1, keepdim=True))
    return torch.cat([t, x], -1)


def minkowski(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``-a_0 b_0 + a_1:.b_1:`` on full coordinates."""
    return -a[..., 0] * b[..., 0] + (a[..., 1:] * b[..., 1:]).sum(-1)


def dist(x: torch.Tensor, y: torch.Tensor, c: float) -> torch.Tensor:
    """AtMG Eq. (4), ``acosh(-c <x, y>_L) / sqrt(c)``."""
    z = -c * minkowski(full(x, c), full(y, c))
    return torch.acosh(z.clamp_min(1.0)) / math.sqrt(c)


def expmap0_full(v: torch.Tensor, c: float) -> torch.Tensor:
    """``exp_o(v) = cosh(sqrt(c)|v|) o + sinh(sqrt(c)|v|) v / (sqrt(c)|v|)``, ``o = (1/sqrt(c), 0)``."""
    r = math.sqrt(c) * v.norm(dim=-1, keepdim=True)
    t = torch.cosh(r) / math.sqrt(c)
    return torch.cat([t, torch.sinh(r) / r * v], -1)


def log_at(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """Tangent vector at ``a`` pointing to ``b`` (full coordinates), unnormalised:
    ``b + c <a, b>_L a`` (the projection of ``b`` onto the tangent space at ``a``)."""
    return b + c * minkowski(a, b).unsqueeze(-1) * a


def exterior_angle(x: torch.Tensor, y: torch.Tensor, c: float) -> torch.Tensor:
    """Angle at ``x`` between the continuation of the geodesic origin -> x and the geodesic
    x -> y, measured with the Minkowski metric on the tangent space at ``x``. Independent of
    AtMG Eq. (9): it uses tangent vectors, not the closed form."""
    a, b = full(x, c), full(y, c)
    o = torch.zeros_like(a)
    o[..., 0] = 1.0 / math.sqrt(c)
    outward = -log_at(a, o, c)
    towards = log_at(a, b, c)
    cos = minkowski(outward, towards) / torch.sqrt(
        minkowski(outward, outward) * minkowski(towards, towards)
    )
    return torch.acos(cos.clamp(-1.0, 1.0))


def half_aperture(x: torch.Tensor, c: float, K: float = 0.1) -> torch.Tensor:
    """AtMG Eq. (10) with MERU's ``min(1, .)``."""
    return torch.asin(torch.clamp(2 * K / (math.sqrt(c) * x.norm(dim=-1)), max=1.0))


def einstein_midpoint(
    X: torch.Tensor, c: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """AtMG Eq. (5)-(6) with Lorentz factors ``1 / sqrt(1 - |k|^2)`` (docs/design.md), by loop."""
    n = X.shape[0]
    w = torch.ones(n, dtype=X.dtype) if weights is None else weights
    num = torch.zeros(X.shape[-1], dtype=X.dtype)
    den = torch.zeros((), dtype=X.dtype)
    for j in range(n):
        p = full(X[j], c)
        k = p[1:] / p[0]  # Pi_{H -> K}
        gamma = 1.0 / torch.sqrt(1.0 - (k * k).sum())
        num = num + w[j] * gamma * k
        den = den + w[j] * gamma
    m = num / den
    back = torch.cat([torch.ones(1, dtype=X.dtype), m]) / torch.sqrt(
        c * (1.0 - (m * m).sum())
    )  # Pi_{K -> H}
    return back[1:]


def sphere_dist(x: torch.Tensor, y: torch.Tensor, R: float) -> torch.Tensor:
    """``R acos(<x, y> / R^2)``."""
    return R * torch.acos(((x * y).sum(-1) / R**2).clamp(-1.0, 1.0))
