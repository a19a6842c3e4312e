"""Euclidean pairwise maps: squared distances and cosine similarities.

Computed in at least float32 with autocast disabled (``|x|^2 + |y|^2 - 2 x.y`` cancels badly
in bf16). CLIP's score and ProCLIP's Euclidean factor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvalign.geometry._numerics import check_points, eps, no_autocast, safe_norm, work_dtype

__all__ = ["sqdist", "pairwise_sqdist", "pairwise_cosine"]


def _check_pair(X: Tensor, Y: Tensor) -> None:
    check_points(X, "X", 2)
    check_points(Y, "Y", 2)
    if X.dim() != 2 or Y.dim() != 2 or X.shape[-1] != Y.shape[-1]:
        raise ValueError(
            f"X, Y: expected [N, d] and [M, d], got {tuple(X.shape)} and {tuple(Y.shape)}"
        )


@no_autocast
def sqdist(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise squared distance ``|x - y|^2``: ``[..., d]`` -> ``[...]``."""
    check_points(x, "x")
    check_points(y, "y")
    dtype = work_dtype(x, y)
    delta = x.to(dtype) - y.to(dtype)
    return (delta * delta).sum(-1)


@no_autocast
def pairwise_sqdist(X: Tensor, Y: Tensor) -> Tensor:
    """All ``|x_i - y_j|^2`` as ``|x|^2 + |y|^2 - 2 x.y`` clamped ``>= 0``: ``[N, M]``."""
    _check_pair(X, Y)
    dtype = work_dtype(X, Y)
    X, Y = X.to(dtype), Y.to(dtype)
    sq = (X * X).sum(-1).unsqueeze(-1) + (Y * Y).sum(-1).unsqueeze(-2)
    return torch.addmm(sq, X, Y.transpose(0, 1), alpha=-2.0).clamp_min(0.0)


@no_autocast
def pairwise_cosine(X: Tensor, Y: Tensor) -> Tensor:
    """All cosine similarities ``x_i.y_j / (|x_i||y_j|)`` (norms clamped ``>= eps``): ``[N, M]``."""
    _check_pair(X, Y)
    dtype = work_dtype(X, Y)
    X, Y = X.to(dtype), Y.to(dtype)
    e = eps(dtype)
    Xn = X / safe_norm(X, e).unsqueeze(-1)
    Yn = Y / safe_norm(Y, e).unsqueeze(-1)
    return Xn @ Yn.transpose(-1, -2)
