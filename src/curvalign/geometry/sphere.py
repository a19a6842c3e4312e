"""The sphere of radius ``R`` (constant curvature ``1/R^2``) in ambient coordinates.

Points are ``[..., d]`` vectors of norm ``R`` (use :func:`project`). Angles go through a
cancellation-free ``acos`` (exact 0 at ``x = y``, bounded gradients at both ends), computed in
at least float32 with autocast disabled. ProCLIP (seed 003) spherical factor.
"""

from __future__ import annotations

from torch import Tensor

from curvalign.geometry._numerics import (
    acos_safe,
    as_positive,
    check_points,
    eps,
    no_autocast,
    safe_norm,
    work_dtype,
)

__all__ = ["project", "dist", "pairwise_dist"]

Radius = float | Tensor


@no_autocast
def project(x: Tensor, radius: Radius = 1.0) -> Tensor:
    """``R x / |x|`` (norm clamped ``>= eps``, so ``x = 0`` maps to 0 with finite gradient).

    ``x: [..., d]`` -> ``[..., d]``; ``radius`` a float or a tensor broadcasting against
    ``x.shape[:-1]``.
    """
    check_points(x, "x")
    dtype = work_dtype(x, radius)
    x = x.to(dtype)
    R = as_positive(radius, "radius", dtype, x.device)
    Rb = R.unsqueeze(-1) if R.dim() else R
    return Rb * x / safe_norm(x, eps(dtype)).unsqueeze(-1)


@no_autocast
def dist(x: Tensor, y: Tensor, radius: Radius = 1.0) -> Tensor:
    """Row-wise great-circle distance ``R acos(<x, y> / R^2)``. ``[..., d]`` -> ``[...]``."""
    check_points(x, "x")
    check_points(y, "y")
    dtype = work_dtype(x, y, radius)
    x, y = x.to(dtype), y.to(dtype)
    R = as_positive(radius, "radius", dtype, x.device)
    return R * acos_safe((x * y).sum(-1) / (R * R), eps(dtype))


@no_autocast
def pairwise_dist(X: Tensor, Y: Tensor, radius: Radius = 1.0) -> Tensor:
    """All great-circle distances ``R acos(<x_i, y_j> / R^2)``: ``[N, d], [M, d]`` -> ``[N, M]``."""
    check_points(X, "X", 2)
    check_points(Y, "Y", 2)
    if X.shape[-1] != Y.shape[-1]:
        raise ValueError(f"X, Y: last dimensions differ, got {tuple(X.shape)} and {tuple(Y.shape)}")
    dtype = work_dtype(X, Y, radius)
    X, Y = X.to(dtype), Y.to(dtype)
    R = as_positive(radius, "radius", dtype, X.device)
    if R.numel() != 1:
        raise ValueError(f"radius: expected a scalar, got shape {tuple(R.shape)}")
    R = R.reshape(())
    return R * acos_safe((X @ Y.transpose(-1, -2)) / (R * R), eps(dtype))
