"""Fused CPU kernels for the pairwise Lorentz distance and exterior angle, forward and backward.

The Gram matrices stay in torch (one GEMM forward, two backward, as in the reference); every
elementwise map over the ``[k, N, M]`` matrix between them is one OpenMP pass of
``_lorentz_kernel.cpp``, which also produces the row, column and total sums that the small
gradients (times, curvature) need. The eager reference (``lorentz._PairwiseAcosh``,
``lorentz._PairwiseExteriorAngle``) spends most of its excess over a cosine score on separate
passes, each of which writes a fresh ``[N, M]`` tensor (at B = 4096 a fresh 64 MiB buffer costs
about five times a pass over an existing one: the page faults), and on ``torch.acos``, which is
not vectorised on CPU.

Memory: the forward keeps the Gram matrix (the reference keeps two to four ``[k, N, M]``
tensors); the backward recomputes the elementwise values from it and writes the matrix the two
backward GEMMs need over it. A second backward through the same graph (``retain_graph=True``)
finds it consumed and recomputes the Gram matrix (same values, one GEMM more).

Built and cached by :class:`curvalign._native.NativeKernel` (compiled on first use, a few
seconds; ``CURVALIGN_FUSED=0`` turns it off; a failed build warns once and the callers in
:mod:`curvalign.geometry.lorentz` fall back to the eager reference). Uses
``torch.get_num_threads()`` OpenMP threads.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from curvalign._native import NativeKernel
from curvalign.geometry._numerics import eps

__all__ = ["KERNEL", "available", "load_kernel", "pairwise_dist_fused", "pairwise_angle_fused"]

_SOURCE = Path(__file__).with_name("_lorentz_kernel.cpp")


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for suffix in ("f32", "f64"):
        fn = getattr(lib, f"curvalign_dist_forward_{suffix}")
        fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i32]
        fn = getattr(lib, f"curvalign_dist_backward_{suffix}")
        fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, f64, p, p, p, p, i32, i32]
        fn = getattr(lib, f"curvalign_angle_forward_{suffix}")
        fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, f64, i32]
        fn = getattr(lib, f"curvalign_angle_backward_{suffix}")
        fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, f64, p, p, p, p, i32]
        for name in ("dist_forward", "dist_backward", "angle_forward", "angle_backward"):
            getattr(lib, f"curvalign_{name}_{suffix}").restype = None


KERNEL = NativeKernel(_SOURCE, "lorentz", "fused Lorentz/exterior-angle kernel", _bind)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; ``None`` (one warning) if that fails."""
    return KERNEL.load()


def available(*tensors: Tensor) -> bool:
    """Whether the fused kernel applies to these tensors (enabled, CPU, float32/64, built)."""
    return KERNEL.available(*tensors)


def _fn(name: str, dtype: torch.dtype):  # noqa: ANN202 - a ctypes function
    lib = KERNEL.library
    assert lib is not None, "call available() first"
    return getattr(lib, f"curvalign_{name}_{'f32' if dtype == torch.float32 else 'f64'}")


def _c(t: Tensor) -> Tensor:
    return t.contiguous()


def _gram(A: Tensor, B: Tensor) -> Tensor:
    """``A B^T`` for ``[k, n, d]``, ``[k, m, d]``: a fresh contiguous ``[k, n, m]``."""
    if A.shape[0] == 1:
        return torch.mm(A[0], B[0].t()).unsqueeze(0)
    return torch.bmm(A, B.transpose(1, 2))


def _bmm(A: Tensor, B: Tensor) -> Tensor:
    return torch.mm(A[0], B[0]).unsqueeze(0) if A.shape[0] == 1 else torch.bmm(A, B)


class _FusedDist(torch.autograd.Function):
    """``d = s acosh(1 + 2 max(w, 0))``, ``w = a (t_x t_y - X Y^T) - 1/2`` per factor.

    ``X: [k, N, d]``, ``Y: [k, M, d]``, ``tx: [k, N]``, ``ty: [k, M]``, ``a = c/2``, ``s = 1/sqrt(c)``
    (``[k]``; all contiguous, built with autograd outside, so the dependence of the times, ``a``
    and ``s`` on ``X``, ``Y`` and ``c`` is differentiated by torch) -> ``[k, N, M]``.
    Backward with ``H = s grad dacosh/dw`` (computed over the saved Gram matrix):
    ``dX = -a H Y``, ``dY = -a H^T X``, ``dt_x = a H t_y``, ``dt_y = a H^T t_x``,
    ``da = sum H (t_x t_y - G)``, ``ds = sum grad acosh``.
    """

    @staticmethod
    def forward(ctx, X, Y, tx, ty, a, s, squeeze):  # type: ignore[no-untyped-def, override]
        k, N, _ = X.shape
        M = Y.shape[1]
        G = _gram(X, Y)
        out = G.new_empty((N, M) if squeeze else (k, N, M))
        _fn("dist_forward", X.dtype)(
            G.data_ptr(), out.data_ptr(), tx.data_ptr(), ty.data_ptr(), a.data_ptr(),
            s.data_ptr(), k, N, M, torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(X, Y, tx, ty, a, s)
        ctx.gram = G  # consumed (overwritten) by the first backward
        return out  # [N, M] made here for k = 1: a select outside would cost a copy backward

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        X, Y, tx, ty, a, s = ctx.saved_tensors
        k, N, _ = X.shape
        M = Y.shape[1]
        H = ctx.gram if ctx.gram is not None else _gram(X, Y)
        ctx.gram = None
        w0 = eps(X.dtype)
        r_floor = math.sqrt(w0 * (1.0 + w0))  # the reference's floor of dacosh/dw
        need_c = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
        grad = grad.to(X.dtype).contiguous()  # [k, N, M] or [N, M], read as flat memory
        row, col = tx.new_empty(k, N), ty.new_empty(k, M)
        ga, gs = a.new_empty(k), s.new_empty(k)
        _fn("dist_backward", X.dtype)(
            H.data_ptr(), grad.data_ptr(), tx.data_ptr(), ty.data_ptr(), a.data_ptr(),
            s.data_ptr(), k, N, M, r_floor, row.data_ptr(), col.data_ptr(), ga.data_ptr(),
            gs.data_ptr(), int(need_c), torch.get_num_threads(),
        )  # fmt: skip
        minus_a = -a.view(-1, 1, 1)  # applied to the small [k, n, d] products
        gX = _bmm(H, Y).mul_(minus_a) if ctx.needs_input_grad[0] else None
        gY = _bmm(H.transpose(1, 2), X).mul_(minus_a) if ctx.needs_input_grad[1] else None
        a2 = a.view(-1, 1)
        ga, gs = (ga, gs) if need_c else (None, None)
        return gX, gY, row.mul_(a2), col.mul_(a2), ga, gs, None


def pairwise_dist_fused(X: Tensor, Y: Tensor, c: Tensor, squeeze: bool = False) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> ``[k, N, M]``
    (``[N, M]`` with ``squeeze`` and ``k = 1``).

    The per-factor Lorentz distances, as the reference ``lorentz.factor_pairwise_dist(X, Y, c)``.
    Call :func:`available` first.
    """
    k = X.shape[0]
    cv = c.reshape(-1).expand(k).contiguous()
    tx = torch.sqrt(cv.view(-1, 1).reciprocal() + torch.linalg.vecdot(X, X))
    ty = torch.sqrt(cv.view(-1, 1).reciprocal() + torch.linalg.vecdot(Y, Y))
    squeeze = squeeze and k == 1
    return _FusedDist.apply(_c(X), _c(Y), _c(tx), _c(ty), 0.5 * cv, torch.rsqrt(cv), squeeze)


class _FusedExteriorAngle(torch.autograd.Function):
    """The reference ``lorentz._PairwiseExteriorAngle`` (same inputs, same formulas; see there)
    with its elementwise maps fused into one pass forward and one backward."""

    @staticmethod
    def forward(ctx, Xs, Y, txs, u, a, ty, squeeze):  # type: ignore[no-untyped-def, override]
        k, N, _ = Xs.shape
        M = Y.shape[1]
        Gs = _gram(Xs, Y)
        out = Gs.new_empty((N, M) if squeeze else (k, N, M))
        _fn("angle_forward", Xs.dtype)(
            Gs.data_ptr(), out.data_ptr(), txs.data_ptr(), u.data_ptr(), a.data_ptr(),
            ty.data_ptr(), k, N, M, eps(Xs.dtype), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(Xs, Y, txs, u, a, ty)
        ctx.gram = Gs  # consumed (overwritten) by the first backward
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        Xs, Y, txs, u, a, ty = ctx.saved_tensors
        k, N, _ = Xs.shape
        M = Y.shape[1]
        mG = ctx.gram if ctx.gram is not None else _gram(Xs, Y)
        ctx.gram = None
        grad = grad.to(Xs.dtype).contiguous()
        row_rc, row_txs, row_a = (txs.new_empty(k, N) for _ in range(3))
        col_ty = ty.new_empty(k, M)
        _fn("angle_backward", Xs.dtype)(
            mG.data_ptr(), grad.data_ptr(), txs.data_ptr(), u.data_ptr(), a.data_ptr(),
            ty.data_ptr(), k, N, M, eps(Xs.dtype), row_rc.data_ptr(), row_txs.data_ptr(),
            row_a.data_ptr(), col_ty.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        # mG = -dL/dGs
        gXs = _bmm(mG, Y).neg_() if ctx.needs_input_grad[0] else None
        gY = _bmm(mG.transpose(1, 2), Xs).neg_() if ctx.needs_input_grad[1] else None
        return gXs, gY, row_txs, row_rc.neg_().div_(u), row_a.mul_(u), col_ty, None


def pairwise_angle_fused(
    Xs: Tensor, Y: Tensor, txs: Tensor, u: Tensor, a: Tensor, ty: Tensor, squeeze: bool = False
) -> Tensor:
    """The exterior angles ``[k, N, M]`` (``[N, M]`` with ``squeeze`` and ``k = 1``) from the
    reference's operands (see ``lorentz._PairwiseExteriorAngle``). Call :func:`available` first.
    """
    squeeze = squeeze and Xs.shape[0] == 1
    return _FusedExteriorAngle.apply(_c(Xs), _c(Y), _c(txs), _c(u), _c(a), _c(ty), squeeze)
