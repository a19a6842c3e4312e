"""The edge-matrix criteria shared by the l1-product kernels' tests (the C++ kernel in
tests/test_geometry_fused.py, the Triton kernels in tests/test_geometry_triton.py): a kernel's
value and gradients at ``x = y`` and ``x = 0`` against the eager reference's."""

from __future__ import annotations

import torch


def assert_edge_agrees(name: str, scale: float, c: float, what: str, u, v) -> None:  # noqa: ANN001
    """``u`` (kernel) against ``v`` (reference) for one of ``value``, ``dX``, ``dY``, ``dc`` of
    the edge case ``name`` (``"x=y"`` or ``"x=0"``) with points of norm ``scale`` and
    curvature ``c``."""
    assert torch.isfinite(u).all(), f"{name}, |x|={scale}, c={c}: non-finite {what}"
    atol = 0.0
    if name == "x=y" and what == "value":
        # Near the diagonal w is the Gram matrix's rounding noise (about eps c t^2 per factor):
        # bounded alike on both paths, equal on neither; the noise is the absolute tolerance
        # (at scale 0 every pair is such a pair).
        t2 = 1.0 / c + scale**2
        noise = 4 * float(torch.acosh(torch.tensor(1.0 + 16 * 1.2e-7 * max(c, 1) * t2)))
        atol = 2 * noise * max(1.0, c**-0.5)
        assert u.diagonal().abs().max() <= atol and v.diagonal().abs().max() <= atol
    elif name == "x=y":
        # On the diagonal w is rounding noise around 0 and dacosh/dw = 1/r is cut at its floor
        # 1/sqrt(eps) where w > 0 and is 0 where w <= 0: which of the two a pair gets depends
        # on the summation order, so the paths agree in bound only.
        bound = 2e4 * (1.0 + scale) ** 2 * max(c, 1.0 / c)
        assert u.abs().max() <= bound, f"{name}, |x|={scale}, c={c}: {what} unbounded"
        return
    # dc sums N M k terms that largely cancel (t depends on c on both sides).
    tol = 2e-5 if what == "value" else 1e-4
    err = ((u - v).abs() - atol).clamp_min(0.0).max() / v.abs().max().clamp_min(1.0)
    assert err < tol, f"{name}, |x|={scale}, c={c}: {what} differs by {err:.3g}"
