"""Shared numerics for the geometry modules: working dtype, curvature tensors, safe maps.

Every public geometry function computes in a *working dtype* of at least float32, with
autocast disabled, so that the arguments of acosh/asin/acos never live in bf16/fp16. The
clamping margins below are derived from that dtype (``torch.finfo(dtype).eps``), never a fixed
``1e-8`` that float32 would round away.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

Curvature = float | Tensor

F = TypeVar("F", bound=Callable[..., object])


def no_autocast(fn: F) -> F:
    """Run ``fn`` with autocast disabled on every device type (inputs are upcast by hand)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_autocast_enabled("cpu") or (
            torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
        ):
            with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def work_dtype(*tensors: Tensor | float) -> torch.dtype:
    """The dtype to compute in: the promoted floating dtype of the inputs, at least float32."""
    dtype = torch.float32
    for t in tensors:
        if isinstance(t, Tensor) and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_points(x: Tensor, name: str, min_dim: int = 1) -> None:
    """One clear error for inputs that are not floating tensors of enough dimensions."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(
            f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(x.shape)}"
        )


def as_positive(value: Curvature, name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a tensor of ``dtype`` on ``device``; python numbers are checked to be > 0.

    Tensors are not checked element-wise (that would synchronise an accelerator); learnable
    positives are stored as logs and clamped after ``exp`` (docs/design.md), so they are positive.
    """
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            value = value.to(dtype)
        return value.to(dtype=dtype, device=device)
    value = float(value)
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{name}: expected a finite number > 0, got {value}")
    return torch.tensor(value, dtype=dtype, device=device)


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype``: the smallest margin that ``1 + margin`` still represents."""
    return float(torch.finfo(dtype).eps)


def sqrt_lin(w: Tensor, w0: float) -> Tensor:
    """``sqrt(w)`` for ``w >= w0``, the chord ``w / sqrt(w0)`` on ``[0, w0)``, 0 for ``w < 0``.

    Continuous, exactly 0 at 0 and with derivative bounded by ``1 / sqrt(w0)``: the plain
    ``sqrt`` has an infinite derivative at 0, which turns a clamped zero into NaN gradients.
    Below ``w0`` (the dtype's rounding floor) the value is below ``sqrt(w0)`` either way.
    """
    return w.clamp_min(0.0) * torch.rsqrt(w.clamp_min(w0))


def safe_norm(x: Tensor, floor: float) -> Tensor:
    """Euclidean norm over the last axis, kept ``>= floor`` (finite gradient at ``x = 0``)."""
    return torch.sqrt(torch.linalg.vecdot(x, x).clamp_min(floor * floor))


def acos_safe(u: Tensor, w0: float) -> Tensor:
    """``acos(u)`` for ``u`` clamped into ``[-1, 1]``, with bounded gradients at both ends.

    Uses ``acos(u) = 2 asin(sqrt((1 - u) / 2))`` for ``u >= 0`` and
    ``pi - 2 asin(sqrt((1 + u) / 2))`` for ``u < 0``: exact 0 at ``u = 1`` and ``pi`` at
    ``u = -1`` (a clamp into ``[-1 + eps, 1 - eps]`` would leave ``sqrt(2 eps)`` there), and the
    square roots go through :func:`sqrt_lin`. Each branch only ever sees arguments in
    ``[0, 1/2]`` so neither produces an infinite derivative that ``where`` would turn into NaN.
    """
    u = u.clamp(-1.0, 1.0)
    half_one_minus = ((1.0 - u) * 0.5).clamp(0.0, 0.5)
    half_one_plus = ((1.0 + u) * 0.5).clamp(0.0, 0.5)
    near_one = 2.0 * torch.asin(sqrt_lin(half_one_minus, w0))
    near_minus_one = math.pi - 2.0 * torch.asin(sqrt_lin(half_one_plus, w0))
    return torch.where(u >= 0.0, near_one, near_minus_one)


def tiny_floor(dtype: torch.dtype) -> float:
    """``sqrt(finfo.tiny)``: a floor for squared quantities that are computed without
    cancellation (their relative error is eps), far below any value that carries information
    yet still a normal number whose reciprocal square root is finite."""
    return float(torch.finfo(dtype).tiny) ** 0.5


class _BoundedAtan2(torch.autograd.Function):
    """``atan2(a, b)`` whose backward divides by ``max(a^2 + b^2, floor^2)``.

    Exact derivative wherever ``a^2 + b^2 >= floor^2``; inside that disc (where the angle
    itself is undetermined, e.g. at ``x = y``) the gradient is scaled down instead of growing
    like ``1 / r`` without bound, and at ``a = b = 0`` it is 0 rather than NaN.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, floor: float) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.floor = floor
        return torch.atan2(a, b)

    @staticmethod
    @no_autocast
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        scale = grad / (a * a + b * b).clamp_min(ctx.floor * ctx.floor)
        return scale * b, -scale * a, None


def bounded_atan2(a: Tensor, b: Tensor, floor: float) -> Tensor:
    """:class:`_BoundedAtan2`: ``atan2(a, b)`` with gradients bounded by ``1 / floor``."""
    return _BoundedAtan2.apply(a, b, floor)
