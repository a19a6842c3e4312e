"""Learnable positive scalars: temperatures, curvatures, scales, metric weights.

A positive quantity ``v`` is stored as its log (``v = exp(log_value)``), so plain gradient steps
keep it positive and move it by ratios, and it is clamped to ``[min, max]`` after the exp
(docs/design.md, Numerics: MERU/PHyCLIP curvature ``[0.1, 10]``, AGR ``[1e-4, 2]``, temperature
``>= 0.01``).

How the clamp treats gradients
    A plain ``clamp`` has zero gradient outside the range: a parameter that an optimiser step
    (Adam's momentum, say) carries past a bound is stuck there for good, even when the loss
    later wants it back. A plain straight-through clamp has the opposite fault: the raw
    parameter keeps drifting past the bound while the value stays pinned, and takes as long to
    come back. We use a *one-sided* straight-through clamp in log space: the forward clamps;
    the backward passes the gradient inside the range, and at (or beyond) a bound passes only
    the part that points back inside (a descent step moves the value inwards) and zeroes the
    part that pushes further out. This is projected gradient descent without mutating the
    parameter in place: the raw log can overshoot a bound only by what momentum carries, and
    any inward gradient brings it back at once. A learned curvature that collapses to its lower
    bound (MERU) therefore sits exactly on the bound, visibly, and can leave it.

    The inward/outward decision is taken on the *total* gradient of the parameter in one
    backward pass, not on each use: a scalar used twice in a loss (MERU's curvature in the
    contrastive and the entailment term; AGR's gate temperature when both directions are
    routed separately) must move as the sum of its gradients says. Deciding per use blocked the
    outward part of one use and kept the inward part of the other, so at a bound the parameter
    moved inwards even when the loss as a whole pushed it out (and two implementations of one
    loss that used the scalar once or twice gave different gradients). ``LearnableScalar``
    therefore clamps straight-through in the forward and projects in a gradient hook on its
    parameter, which autograd calls once with the summed gradient. Under DDP the hook sees this
    rank's gradient before the all-reduce. :func:`inward_clamp` keeps the per-use rule for a
    tensor that is used once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn


class _InwardClamp(torch.autograd.Function):
    """clamp(x, lo, hi) whose gradient at a bound keeps only the inward-pointing part."""

    @staticmethod
    def forward(ctx, x: Tensor, lo: float, hi: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.lo, ctx.hi = lo, hi
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        # Gradient descent moves x by -grad: at the lower bound that is inwards when grad < 0,
        # at the upper bound when grad > 0.
        return grad.masked_fill(_outward_blocked(x, grad, ctx.lo, ctx.hi), 0.0), None, None


class _StraightThroughClamp(torch.autograd.Function):
    """clamp(x, lo, hi) whose gradient is the identity: the bound is enforced on the summed
    gradient by :func:`_outward_blocked` in the parameter's hook, not here."""

    @staticmethod
    def forward(ctx, x: Tensor, lo: float, hi: float) -> Tensor:
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None


def _outward_blocked(x: Tensor, grad: Tensor, lo: float, hi: float) -> Tensor:
    """Where a descent step along ``-grad`` would push ``x`` (at or beyond a bound) further out."""
    return ((x <= lo) & (grad > 0)) | ((x >= hi) & (grad < 0))


def inward_clamp(x: Tensor, lo: float = -math.inf, hi: float = math.inf) -> Tensor:
    """``x.clamp(lo, hi)`` with the one-sided straight-through gradient described above."""
    if lo == -math.inf and hi == math.inf:
        return x
    return _InwardClamp.apply(x, lo, hi)


class LearnableScalar(nn.Module):
    """A positive learnable scalar (or vector of them), stored as a log and clamped after exp.

    Args:
        init: initial value(s) in ``(min, max)``: a float, or a sequence / tensor for a vector
            (e.g. one curvature per PHyCLIP factor).
        min, max: bounds on the value (``None``: unbounded on that side).
        shape: shape of the vector when ``init`` is a float (``()`` for a scalar, ``(k,)`` for
            ``k`` values all starting at ``init``).
        learnable: ``False`` stores the log as a buffer instead of a parameter: the value is
            saved with the model but never trained (fixed curvature for ablations).

    ``forward()`` (or calling the module) returns the clamped value, a tensor of ``shape``.
    The stored parameter is ``log_value``.
    """

    def __init__(
        self,
        init: float | Sequence[float] | Tensor,
        min: float | None = None,
        max: float | None = None,
        shape: Sequence[int] = (),
        learnable: bool = True,
    ) -> None:
        super().__init__()
        value = torch.as_tensor(init, dtype=torch.float32).clone()
        if value.ndim == 0 and tuple(shape):
            value = value.expand(tuple(shape)).clone()
        if not torch.all(torch.isfinite(value)) or not torch.all(value > 0):
            raise ValueError(f"LearnableScalar init must be finite and positive, got {init!r}")
        if min is not None and max is not None and not 0 < min <= max:
            raise ValueError(
                f"LearnableScalar bounds must satisfy 0 < min <= max, got [{min}, {max}]"
            )
        if min is not None and min <= 0:
            raise ValueError(f"LearnableScalar min must be positive, got {min}")
        lo = min if min is not None else 0.0
        hi = max if max is not None else math.inf
        if torch.any(value < lo) or torch.any(value > hi):
            raise ValueError(f"LearnableScalar init {init!r} is outside its range [{lo}, {hi}]")
        self.min, self.max = min, max
        self._log_lo = math.log(min) if min is not None else -math.inf
        self._log_hi = math.log(max) if max is not None else math.inf
        self.learnable = learnable
        if learnable:
            self.log_value = nn.Parameter(value.log())
            self._guard_bounds()
        else:
            self.register_buffer("log_value", value.log())

    @property
    def _bounded(self) -> bool:
        return self._log_lo > -math.inf or self._log_hi < math.inf

    def _guard_bounds(self) -> None:
        """Install the one-sided projection as a hook on the parameter (once per parameter
        object: ``copy.deepcopy`` makes a new parameter without hooks, which ``forward``
        notices by the missing mark and guards again)."""
        param = self.log_value
        if not self._bounded or getattr(param, "_curvalign_bound_guard", False):
            return
        lo, hi = self._log_lo, self._log_hi

        def project(grad: Tensor) -> Tensor:  # the summed gradient of this backward pass
            return grad.masked_fill(_outward_blocked(param.detach(), grad, lo, hi), 0.0)

        param.register_hook(project)
        param._curvalign_bound_guard = True  # type: ignore[attr-defined]

    def forward(self) -> Tensor:
        if not self._bounded:
            return self.log_value.exp()
        if self.learnable and not torch.compiler.is_compiling():
            self._guard_bounds()
        return _StraightThroughClamp.apply(self.log_value, self._log_lo, self._log_hi).exp()

    @property
    def value(self) -> Tensor:
        """The current clamped value, detached (for logging)."""
        with torch.no_grad():
            return self.forward().detach()

    def summary(self, name: str) -> dict[str, float]:
        """Logging scalars: ``{name: v}`` for a scalar, ``{name/min, name/mean, name/max}`` for a vector."""
        v = self.value.float()
        if v.numel() == 1:
            return {name: float(v.reshape(()))}
        return {
            f"{name}/min": float(v.min()),
            f"{name}/mean": float(v.mean()),
            f"{name}/max": float(v.max()),
        }

    def extra_repr(self) -> str:
        shape = tuple(self.log_value.shape)
        return f"shape={shape}, min={self.min}, max={self.max}, learnable={self.learnable}"


def scalar_parameter_names(module: nn.Module) -> set[str]:
    """Names (as in ``module.named_parameters()``) of every parameter owned by a
    ``LearnableScalar`` inside ``module``: temperatures, curvatures, scales, weights. These get
    no weight decay (decay would pull a log towards 0, i.e. the value towards 1)."""
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, LearnableScalar) and sub.learnable:
            names.add(f"{prefix}.log_value" if prefix else "log_value")
    return names


__all__ = ["LearnableScalar", "inward_clamp", "scalar_parameter_names"]
