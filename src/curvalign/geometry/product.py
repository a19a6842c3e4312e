"""Product manifolds: the l1-product of Lorentz factors (PHyCLIP) and the weighted
mixed-curvature product H x E x S (ProCLIP).

Same conventions as :mod:`curvalign.geometry.lorentz`: space components, curvature ``c > 0``,
at least float32 with autocast disabled, pairwise results without ``[N, M, d]`` tensors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from curvalign._native import constant_under_compile
from curvalign.geometry import _fused_l1, euclidean, lorentz, sphere
from curvalign.geometry._numerics import (
    Curvature,
    as_positive,
    check_points,
    no_autocast,
    work_dtype,
)

__all__ = ["PARTS", "l1_pairwise_dist", "l1_dist", "mixed_pairwise_sqdist", "mixed_sqdist"]

#: The factor names of a mixed-curvature product, in ProCLIP's order.
PARTS = ("hyperbolic", "euclidean", "sphere")


def _check_factor_points(X: Tensor, Y: Tensor, row_wise: bool) -> None:
    check_points(X, "X", 3 if not row_wise else 2)
    check_points(Y, "Y", 3 if not row_wise else 2)
    if not row_wise and (X.dim() != 3 or Y.dim() != 3 or X.shape[1:] != Y.shape[1:]):
        raise ValueError(
            f"X, Y: expected [N, k, d] and [M, k, d] with equal k, d; got {tuple(X.shape)} and {tuple(Y.shape)}"
        )


#: Widest factor ``d + 1`` the Triton kernels take (``_triton_l1.MAX_WIDTH``; not imported from
#: there because importing that module imports triton).
_TRITON_MAX_WIDTH = 64


_TRITON_FOUND: list[bool] = []  # the probe's answer, once known (not functools.cache: Dynamo
# traces through a cache wrapper, ignoring the marking below)


@constant_under_compile  # Dynamo (torch 2.11) cannot trace find_spec
def _triton_installed() -> bool:
    """Whether ``triton`` can be found (without importing it: a CPU run never pays for it).
    A constant to ``torch.compile``: a model compiled with ``fullgraph=True`` on a GPU traces
    the choice of path, and this probe must not break its graph."""
    if not _TRITON_FOUND:
        _TRITON_FOUND.append(importlib.util.find_spec("triton") is not None)
    return _TRITON_FOUND[0]


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """:mod:`curvalign.geometry._triton_l1`, imported on first use; None (one warning) if it fails."""
    try:
        return importlib.import_module("curvalign.geometry._triton_l1")
    except Exception as exc:  # noqa: BLE001 - a broken triton install means: use the reference
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        warnings.warn(
            f"curvalign: triton is installed but does not import ({reason}); "
            "using the eager reference for the l1-product distance on GPU",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


@constant_under_compile
def _triton_ready(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether the Triton kernels import and run on ``device`` (compiled once, cached).

    Under ``torch.compile`` taken once, when the graph is traced (the import and the probe
    compile are not traceable); the kernels themselves are opaque custom ops there."""
    kernels = _triton_kernels()
    return kernels is not None and kernels.ready(device, dtype, width)


def _l1_path(
    device: torch.device, dtype: torch.dtype, width: int
) -> Literal["cpu", "triton", "reference"]:
    """Which implementation :func:`l1_pairwise_dist` takes for points on ``device``.

    ``dtype``: the working dtype; ``width``: ``d + 1``. ``"cpu"``: the fused C++ kernel
    (:mod:`._fused_l1`); ``"triton"``: the Triton kernels (:mod:`._triton_l1`) for CUDA tensors
    where ``triton`` is installed; ``"reference"``: the eager blocked implementation (other
    devices, wider factors, ``CURVALIGN_FUSED=0``). A kernel that fails to build or compile
    still falls back to the reference, with one warning.
    """
    if not _fused_l1.enabled() or dtype not in (torch.float32, torch.float64):
        return "reference"
    if device.type == "cpu" and width <= _fused_l1._MAX_WIDTH:
        return "cpu"
    if device.type == "cuda" and width <= _TRITON_MAX_WIDTH and _triton_installed():
        return "triton"
    return "reference"


@no_autocast
def l1_pairwise_dist(
    X: Tensor,
    Y: Tensor,
    c: Curvature,
    block: int = 1 << 18,
    fused: bool | None = None,
    scale: float = 1.0,
) -> Tensor:
    """PHyCLIP's l1-product distance: ``sum_k d_k(x_i^(k), y_j^(k))`` for all pairs.

    ``X: [N, k, d]``, ``Y: [M, k, d]``, ``c``: scalar or ``[k]`` (per-factor curvature) ->
    ``[N, M]``.

    On CPU (float32/float64 working dtype, ``d < 64``) the default path is the fused C++ kernel
    of :mod:`curvalign.geometry._fused_l1` (forward and backward in one loop each, compiled once
    on first use and cached); on CUDA, where ``triton`` is installed (the ``triton`` extra), the
    Triton kernels of :mod:`curvalign.geometry._triton_l1` (compiled on first use per dtype,
    cached by Triton). ``CURVALIGN_FUSED=0`` or ``fused=False`` turns both off; a failed build
    warns once and falls back (:func:`_l1_path` makes the choice). Otherwise, and as the
    reference they are tested against, the
    sum is built in blocks of ``[k_b, n_b, M]`` pair-factor elements (about
    ``block`` of them, default 2^18 = 1 MiB in float32, small enough to stay in cache) by a
    custom autograd function that saves only its (small) inputs and recomputes each block in
    the backward: no ``[k, N, M]`` tensor is held in either pass; the peak beyond the
    ``[N, M]`` output and its gradient is about ``4 * block`` elements plus ``O((N + M) k d)``.
    PHyCLIP's ``d_avg`` is this divided by ``k``.

    ``scale`` (a constant) multiplies the result; the fused CPU kernel folds it into its
    per-factor ``1/sqrt(c)`` (PHyCLIP's score ``-d_avg`` is ``scale=-1/k``, no extra pass).
    """
    _check_factor_points(X, Y, row_wise=False)
    dtype = work_dtype(X, Y, c)
    k = X.shape[1]
    cc = as_positive(c, "c", dtype, X.device)
    if cc.numel() not in (1, k):
        raise ValueError(f"c: expected a scalar or shape [{k}], got {tuple(cc.shape)}")
    if block < 1:
        raise ValueError(f"block: expected a positive number of elements, got {block}")
    Xk = X.to(dtype).transpose(0, 1)
    Yk = Y.to(dtype).transpose(0, 1)
    width = X.shape[-1] + 1
    path = "reference" if fused is False else _l1_path(X.device, dtype, width)
    if path == "cpu" and _fused_l1.available(Xk, Yk, cc):
        return _fused_l1.l1_pairwise_dist_fused(Xk, Yk, cc.reshape(-1), scale)
    if path == "triton" and _triton_ready(X.device, dtype, width):
        from curvalign.geometry import _triton_l1  # imported by _triton_ready

        out = _triton_l1.l1_pairwise_dist_triton(Xk, Yk, cc.reshape(-1))
    else:
        out = lorentz.factor_pairwise_dist(Xk, Yk, cc.reshape(-1), reduce_sum=True, block=block)
    return out if scale == 1.0 else out * scale


@no_autocast
def l1_dist(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """Row-wise l1-product distance ``sum_k d_k(x^(k), y^(k))``: ``[..., k, d]`` -> ``[...]``.

    ``c`` broadcasts against ``x.shape[:-1]`` (``[k]`` per factor). For reranking candidates.
    """
    _check_factor_points(x, y, row_wise=True)
    return lorentz.dist(x, y, c).sum(-1)


def _check_parts(
    parts_x: Mapping[str, Tensor],
    parts_y: Mapping[str, Tensor],
    weights: Mapping[str, float | Tensor],
) -> list[str]:
    for name, parts in (("parts_x", parts_x), ("parts_y", parts_y), ("weights", weights)):
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(
                f"{name}: unknown factor(s) {sorted(unknown)}; expected keys among {PARTS}"
            )
    keys = [p for p in PARTS if p in parts_x]
    if not keys:
        raise ValueError(f"parts_x: expected at least one of {PARTS}")
    if set(parts_x) != set(parts_y):
        raise ValueError(
            f"parts_x, parts_y: factors differ, {sorted(parts_x)} vs {sorted(parts_y)}"
        )
    missing = set(keys) - set(weights)
    if missing:
        raise ValueError(f"weights: missing weight(s) for {sorted(missing)}")
    return keys


def _weight(value: float | Tensor, key: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"weights[{key!r}]: expected a scalar, got shape {tuple(value.shape)}")
        return value.to(dtype=dtype, device=device).reshape(())
    value = float(value)
    if not value >= 0.0:
        raise ValueError(f"weights[{key!r}]: expected a number >= 0, got {value}")
    return torch.tensor(value, dtype=dtype, device=device)


@no_autocast
def mixed_pairwise_sqdist(
    parts_x: Mapping[str, Tensor],
    parts_y: Mapping[str, Tensor],
    weights: Mapping[str, float | Tensor],
    c: Curvature = 1.0,
    radius: float | Tensor = 1.0,
) -> Tensor:
    """ProCLIP's weighted squared product distance for all pairs.

    ``a_H d_H(h_i, h_j)^2 + a_E |e_i - e_j|^2 + a_S d_S(s_i, s_j)^2`` (ProCLIP's score is its
    negative). ``parts_x`` / ``parts_y``: dicts with any of the keys ``"hyperbolic"`` (Lorentz
    space components ``[N, d_H]``, curvature ``c``), ``"euclidean"`` (``[N, d_E]``),
    ``"sphere"`` (points of norm ``radius``, ``[N, d_S]``); both with the same keys.
    ``weights``: the same keys -> non-negative scalar (float or 0-dim tensor, e.g. a learnable
    ``exp(log_a)``). Returns ``[N, M]``.
    """
    keys = _check_parts(parts_x, parts_y, weights)
    dtype = work_dtype(*parts_x.values(), *parts_y.values(), c, radius)
    first = parts_x[keys[0]]
    total: Tensor | None = None
    for key in keys:
        X, Y = parts_x[key], parts_y[key]
        if key == "hyperbolic":
            d = lorentz.pairwise_dist(X, Y, c)
            term = d * d
        elif key == "euclidean":
            term = euclidean.pairwise_sqdist(X, Y)
        else:
            d = sphere.pairwise_dist(X, Y, radius)
            term = d * d
        term = _weight(weights[key], key, dtype, first.device) * term.to(dtype)
        total = term if total is None else total + term
    assert total is not None
    return total


@no_autocast
def mixed_sqdist(
    parts_x: Mapping[str, Tensor],
    parts_y: Mapping[str, Tensor],
    weights: Mapping[str, float | Tensor],
    c: Curvature = 1.0,
    radius: float | Tensor = 1.0,
) -> Tensor:
    """Row-wise :func:`mixed_pairwise_sqdist`: parts ``[..., d_part]`` -> ``[...]`` (reranking)."""
    keys = _check_parts(parts_x, parts_y, weights)
    dtype = work_dtype(*parts_x.values(), *parts_y.values(), c, radius)
    first = parts_x[keys[0]]
    total: Tensor | None = None
    for key in keys:
        x, y = parts_x[key], parts_y[key]
        if key == "hyperbolic":
            term = lorentz.dist(x, y, c) ** 2
        elif key == "euclidean":
            term = euclidean.sqdist(x, y)
        else:
            term = sphere.dist(x, y, radius) ** 2
        term = _weight(weights[key], key, dtype, first.device) * term.to(dtype)
        total = term if total is None else total + term
    assert total is not None
    return total
