"""Fused CPU kernels for the pairwise Lorentz distance and exterior angle, forward and backward.

The Gram matrices stay in torch (one GEMM forward, two backward, as in the reference); every
elementwise map over the ``[k, N, M]`` matrix between them is one OpenMP pass of
``_lorentz_kernel.cpp``, which also produces the row, column and total sums that the small
gradients (times, curvature) need. The eager reference (``lorentz._PairwiseAcosh``,
``lorentz._PairwiseExteriorAngle``) spends most of its excess over a cosine score on separate
passes, each of which writes a fresh ``[N, M]`` tensor (at B = 4096 a fresh 64 MiB buffer costs
five to ten times a pass over an existing one: the page faults), and on ``torch.acos``, which is
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
        fn.argtypes = [p, p, i64, i64, i64, p, p, p, p, i64, i64, i64, f64, p, p, p, p, i32, i32]
        fn = getattr(lib, f"curvalign_angle_forward_{suffix}")
        fn.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, f64, i32]
        fn = getattr(lib, f"curvalign_angle_backward_{suffix}")
        fn.argtypes = [p, p, i64, i64, i64, p, p, p, p, p, i64, i64, i64, f64, p, p, p, p, i32]
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


def _grad_view(grad: Tensor, dtype: torch.dtype) -> tuple[Tensor, int, int, int]:
    """The incoming gradient and its element strides as a ``[k, N, M]`` view, not copied: a
    symmetric InfoNCE hands in a transposed matrix, which the kernel reads tile by tile."""
    grad = grad.to(dtype)
    if grad.dim() == 2:
        return grad, 0, grad.stride(0), grad.stride(1)
    return grad, grad.stride(0), grad.stride(1), grad.stride(2)


def _bmm(A: Tensor, B: Tensor) -> Tensor:
    return torch.mm(A[0], B[0]).unsqueeze(0) if A.shape[0] == 1 else torch.bmm(A, B)


class _FusedDist(torch.autograd.Function):
    """``d = s acosh(1 + 2 max(w, 0))``, ``w = a (t_x t_y - X Y^T) - 1/2`` per factor, with
    ``a = c/2``, ``s = 1/sqrt(c)``, ``t = sqrt(1/c + |x|^2)``.

    ``X: [k, N, d]``, ``Y: [k, M, d]``, ``c: [k]`` (contiguous) -> ``[k, N, M]`` (``[N, M]``
    with ``squeeze``). The times, ``a`` and ``s`` are made here and differentiated by hand:
    with ``H = s grad dacosh/dw`` (computed over the saved Gram matrix) and the kernel's sums
    ``row_i = sum_j H t_yj``, ``col_j = sum_i H t_xi``,
    ``dX = a (row / t_x * X - H Y)``, ``dY = a (col / t_y * Y - H^T X)`` (the time's
    ``dt_x/dx = x / t_x`` folded in) and
    ``dc = sum H (t_x t_y - G) / 2 - s^3 / 2 sum grad acosh - a / (2 c^2) (sum row / t_x +
    sum col / t_y)``.
    """

    @staticmethod
    def forward(ctx, X, Y, c, squeeze):  # type: ignore[no-untyped-def, override]
        k, N, _ = X.shape
        M = Y.shape[1]
        cv = c.view(-1, 1)
        tx = torch.sqrt(cv.reciprocal() + torch.linalg.vecdot(X, X))
        ty = torch.sqrt(cv.reciprocal() + torch.linalg.vecdot(Y, Y))
        a, s = 0.5 * c, torch.rsqrt(c)
        G = _gram(X, Y)
        out = G.new_empty((N, M) if squeeze else (k, N, M))
        _fn("dist_forward", X.dtype)(
            G.data_ptr(), out.data_ptr(), tx.data_ptr(), ty.data_ptr(), a.data_ptr(),
            s.data_ptr(), k, N, M, torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(X, Y, c, tx, ty)
        ctx.gram = G  # consumed (overwritten) by the first backward
        return out  # [N, M] made here for k = 1: a select outside would cost a copy backward

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        X, Y, c, tx, ty = ctx.saved_tensors
        need_x, need_y, need_c = ctx.needs_input_grad[:3]
        k, N, _ = X.shape
        M = Y.shape[1]
        H = ctx.gram if ctx.gram is not None else _gram(X, Y)
        ctx.gram = None
        a, s = 0.5 * c, torch.rsqrt(c)
        w0 = eps(X.dtype)
        r_floor = math.sqrt(w0 * (1.0 + w0))  # the reference's floor of dacosh/dw
        grad, *strides = _grad_view(grad, X.dtype)  # [k, N, M] or [N, M], any strides
        row, col = tx.new_empty(k, N), ty.new_empty(k, M)
        ga, gs = c.new_empty(k), c.new_empty(k)
        _fn("dist_backward", X.dtype)(
            H.data_ptr(), grad.data_ptr(), *strides, tx.data_ptr(), ty.data_ptr(), a.data_ptr(),
            s.data_ptr(), k, N, M, r_floor, row.data_ptr(), col.data_ptr(), ga.data_ptr(),
            gs.data_ptr(), int(need_c), torch.get_num_threads(),
        )  # fmt: skip
        row_t, col_t = row.div_(tx), col.div_(ty)
        a3 = a.view(-1, 1, 1)
        gX = _addbmm_neg(X * row_t.unsqueeze(-1), H, Y).mul_(a3) if need_x else None
        gY = _addbmm_neg(Y * col_t.unsqueeze(-1), H.transpose(1, 2), X).mul_(a3) if need_y else None
        gc = None
        if need_c:
            times = row_t.sum(-1) + col_t.sum(-1)
            gc = 0.5 * ga - 0.5 * s**3 * gs - a / (2.0 * c * c) * times
        return gX, gY, gc, None


def _addbmm_neg(C: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """``C - A B`` for ``[k, n, d]``, ``[k, n, m]``, ``[k, m, d]`` (one GEMM call; ``C`` is
    a temporary and is overwritten)."""
    if A.shape[0] == 1:
        C[0].addmm_(A[0], B[0], alpha=-1.0)
    else:
        C.baddbmm_(A, B, alpha=-1.0)
    return C


def pairwise_dist_fused(X: Tensor, Y: Tensor, c: Tensor, squeeze: bool = False) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> ``[k, N, M]``
    (``[N, M]`` with ``squeeze`` and ``k = 1``).

    The per-factor Lorentz distances, as the reference ``lorentz.factor_pairwise_dist(X, Y, c)``.
    Call :func:`available` first.
    """
    k = X.shape[0]
    cv = c.reshape(-1).expand(k).contiguous()
    return _FusedDist.apply(_c(X), _c(Y), cv, squeeze and k == 1)


class _FusedExteriorAngle(torch.autograd.Function):
    """The reference ``lorentz._PairwiseExteriorAngle`` with its elementwise maps fused into one
    pass forward and one backward, and its operands made (and differentiated) here.

    ``X: [k, N, d]``, ``Y: [k, M, d]``, ``c: [k]`` (contiguous) -> ``[k, N, M]`` (``[N, M]``
    with ``squeeze``). Operands as the reference's, per factor with ``hc = c/2``:
    ``Gs = hc X Y^T`` (the kernel scales the plain Gram matrix), ``txs = hc t_x``,
    ``u = t_x / |x|``, ``a = hc |x|^2 / t_x`` (``|x|`` floored at eps) and ``t_y``.
    Backward: the kernel writes ``mG = -dL/dGs`` and the row and column sums of the
    reference's ``g_txs, g_u, g_a, g_ty``; the chain through ``t_x = sqrt(1/c + |x|^2)``,
    ``|x|``, ``t_y`` and ``hc`` is applied here on ``[k, N]`` vectors, and the Gram matrix's
    own share of ``dL/dhc``, ``sum dL/dGs * G = -sum_i x_i . (mG Y)_i``, from the backward GEMM.
    """

    @staticmethod
    def forward(ctx, X, Y, c, squeeze):  # type: ignore[no-untyped-def, override]
        k, N, _ = X.shape
        M = Y.shape[1]
        e = eps(X.dtype)
        cv, hc = c.view(-1, 1), 0.5 * c
        sqx = torch.linalg.vecdot(X, X)
        tx = torch.sqrt(cv.reciprocal() + sqx)
        ty = torch.sqrt(cv.reciprocal() + torch.linalg.vecdot(Y, Y))
        nx = torch.sqrt(sqx.clamp_min(e * e))  # safe_norm(X, eps)
        hcv = hc.view(-1, 1)
        txs, u, a = hcv * tx, tx / nx, hcv * nx * nx / tx
        G = _gram(X, Y)
        out = G.new_empty((N, M) if squeeze else (k, N, M))
        _fn("angle_forward", X.dtype)(
            G.data_ptr(), out.data_ptr(), hc.data_ptr(), txs.data_ptr(), u.data_ptr(),
            a.data_ptr(), ty.data_ptr(), k, N, M, e, torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(X, Y, c, sqx, tx, ty, nx, txs, u, a)
        ctx.gram = G  # consumed (overwritten) by the first backward
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        X, Y, c, sqx, tx, ty, nx, txs, u, a = ctx.saved_tensors
        need_x, need_y, need_c = ctx.needs_input_grad[:3]
        k, N, _ = X.shape
        M = Y.shape[1]
        e = eps(X.dtype)
        mG = ctx.gram if ctx.gram is not None else _gram(X, Y)
        ctx.gram = None
        hc = 0.5 * c
        grad, *strides = _grad_view(grad, X.dtype)
        row_rc, g_txs, row_a = (tx.new_empty(k, N) for _ in range(3))
        g_ty = ty.new_empty(k, M)
        _fn("angle_backward", X.dtype)(
            mG.data_ptr(), grad.data_ptr(), *strides, hc.data_ptr(), txs.data_ptr(), u.data_ptr(),
            a.data_ptr(), ty.data_ptr(), k, N, M, e, row_rc.data_ptr(), g_txs.data_ptr(),
            row_a.data_ptr(), g_ty.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        # The reference's operand gradients, then the chain to X, Y and c by hand.
        hcv = hc.view(-1, 1)
        g_u = row_rc.neg_().div_(u)
        g_a = row_a.mul_(u)
        d_tx = g_txs * hcv + g_u / nx - g_a * hcv * nx * nx / (tx * tx)
        d_nx = (g_a * 2.0 * hcv * nx / tx - g_u * tx / (nx * nx)) * (sqx >= e * e)
        coef_x = d_tx / tx + d_nx / nx  # 2 dL/d|x|^2
        hc3 = hc.view(-1, 1, 1)
        gX = gY = gc = None
        if need_x or need_c:
            P = _bmm(mG, Y)  # -dL/dGs Y
            if need_c:
                d_hc = (g_txs * tx + g_a * nx * nx / tx).sum(-1) - torch.linalg.vecdot(X, P).sum(-1)
            if need_x:
                gX = P.mul_(-hc3).addcmul_(X, coef_x.unsqueeze(-1))
        if need_y:
            gY = _bmm(mG.transpose(1, 2), X).mul_(-hc3).addcmul_(Y, (g_ty / ty).unsqueeze(-1))
        if need_c:
            times = (d_tx / tx).sum(-1) + (g_ty / ty).sum(-1)
            gc = 0.5 * d_hc - times / (2.0 * c * c)
        return gX, gY, gc, None


def pairwise_angle_fused(X: Tensor, Y: Tensor, c: Tensor, squeeze: bool = False) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> the
    exterior angles ``[k, N, M]`` (``[N, M]`` with ``squeeze`` and ``k = 1``), as the reference
    ``lorentz._PairwiseExteriorAngle``. Call :func:`available` first.
    """
    k = X.shape[0]
    cv = c.reshape(-1).expand(k).contiguous()
    return _FusedExteriorAngle.apply(_c(X), _c(Y), cv, squeeze and k == 1)
