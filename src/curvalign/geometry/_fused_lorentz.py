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

Each kernel is a pair of ``torch.library`` custom ops (``curvalign::lorentz_dist``,
``curvalign::lorentz_exterior_angle`` and their ``_backward``): opaque to ``torch.compile``,
which traces the torch code around them (``tests/test_kernels_compile.py``).

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

__all__ = [
    "KERNEL",
    "available",
    "load_kernel",
    "pairwise_angle_fused",
    "pairwise_angles_both_fused",
    "pairwise_dist_fused",
]

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


KERNEL = NativeKernel(
    _SOURCE,
    "lorentz",
    "fused Lorentz/exterior-angle kernel",
    _bind,
    headers=[_SOURCE.with_name("_vecmath.h")],
)


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


# Each kernel is a pair of ``torch.library`` custom ops (forward, backward) with their autograd
# formula: eager calls run the C++ passes directly, and ``torch.compile`` sees opaque ops with
# known output shapes (the fake implementations) instead of tracing into a ctypes call it cannot
# see, which left the compiled graph returning the uninitialised output buffer.
#
# The forward also returns the Gram matrix (kept for backward) and a one-byte state, 0 while the
# Gram matrix is intact. The backward op writes over the Gram matrix (declared: ``mutates_args``)
# and sets the state to 1; a backward that finds the state set recomputes the Gram matrix into
# the buffer first (same values, one GEMM more). Eager, the first backward releases the buffer
# (it would otherwise live as long as the output) and a second one through the same graph
# (``retain_graph=True``) hands the op a fresh buffer marked consumed; a compiled graph keeps
# its saved buffer, and the state tells its second backward to recompute.


def _pair_outputs(X: Tensor, Y: Tensor, squeeze: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh ``out`` (``[N, M]`` with squeeze, else ``[k, N, M]``), Gram ``[k, N, M]``, state."""
    k, N, M = X.shape[0], X.shape[1], Y.shape[1]
    out = X.new_empty((N, M) if squeeze else (k, N, M))
    return out, X.new_empty(k, N, M), torch.zeros((), dtype=torch.uint8)


def _restore_gram(X: Tensor, Y: Tensor, G: Tensor, state: Tensor) -> None:
    """Recompute the Gram matrix into ``G`` if an earlier backward consumed it; mark it used."""
    if int(state.item()) != 0:
        if X.shape[0] == 1:
            torch.mm(X[0], Y[0].t(), out=G[0])
        else:
            torch.bmm(X, Y.transpose(1, 2), out=G)
    state.fill_(1)


def _unused(t: Tensor) -> Tensor:
    """The placeholder an op returns for a gradient nobody asked for (mapped to ``None``)."""
    return t.new_empty(0)


def _grads_or_none(grads: tuple[Tensor, ...], needs: tuple[bool, ...]) -> list[Tensor | None]:
    return [g if need else None for g, need in zip(grads, needs, strict=True)]


def _dist_operands(
    X: Tensor, Y: Tensor, c: Tensor, scale: float = 1.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``t_x [k, N]``, ``t_y [k, M]``, ``a = c/2``, ``s = scale/sqrt(c)`` (``[k]``)."""
    cv = c.view(-1, 1)
    tx = torch.sqrt(cv.reciprocal() + torch.linalg.vecdot(X, X))
    ty = torch.sqrt(cv.reciprocal() + torch.linalg.vecdot(Y, Y))
    return tx, ty, 0.5 * c, torch.rsqrt(c).mul_(scale)


@torch.library.custom_op("curvalign::lorentz_dist", mutates_args=())
def _dist_forward(
    X: Tensor, Y: Tensor, c: Tensor, squeeze: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``d = s acosh(1 + 2 max(w, 0))``, ``w = a (t_x t_y - X Y^T) - 1/2`` per factor, with
    ``a = c/2``, ``s = scale/sqrt(c)``, ``t = sqrt(1/c + |x|^2)``: ``scale`` times the distance
    (a score's sign folded into the kernel's factor instead of a pass over the matrix).

    ``X: [k, N, d]``, ``Y: [k, M, d]``, ``c: [k]`` (contiguous) -> (``[k, N, M]``, or
    ``[N, M]`` with ``squeeze``; the Gram matrix ``[k, N, M]``; its state).
    """
    k, N, _ = X.shape
    M = Y.shape[1]
    tx, ty, a, s = _dist_operands(X, Y, c, scale)
    G = _gram(X, Y)
    out = G.new_empty((N, M) if squeeze else (k, N, M))
    _fn("dist_forward", X.dtype)(
        G.data_ptr(), out.data_ptr(), tx.data_ptr(), ty.data_ptr(), a.data_ptr(),
        s.data_ptr(), k, N, M, torch.get_num_threads(),
    )  # fmt: skip
    # [N, M] made here for k = 1: a select outside would cost a copy backward
    return out, G, torch.zeros((), dtype=torch.uint8)


@_dist_forward.register_fake
def _(
    X: Tensor, Y: Tensor, c: Tensor, squeeze: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return _pair_outputs(X, Y, squeeze)


@torch.library.custom_op("curvalign::lorentz_dist_backward", mutates_args=("G", "state"))
def _dist_backward(
    grad: Tensor,
    X: Tensor,
    Y: Tensor,
    c: Tensor,
    G: Tensor,
    state: Tensor,
    need_x: bool,
    need_y: bool,
    need_c: bool,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """With ``H = s grad dacosh/dw`` (computed over the Gram matrix ``G``, in place) and the
    kernel's sums ``row_i = sum_j H t_yj``, ``col_j = sum_i H t_xi``,
    ``dX = a (row / t_x * X - H Y)``, ``dY = a (col / t_y * Y - H^T X)`` (the time's
    ``dt_x/dx = x / t_x`` folded in) and
    ``dc = sum H (t_x t_y - G) / 2 - s^3 / 2 sum grad acosh - a / (2 c^2) (sum row / t_x +
    sum col / t_y)``. A gradient not needed comes back empty.
    """
    k, N, _ = X.shape
    M = Y.shape[1]
    _restore_gram(X, Y, G, state)
    H = G
    tx, ty, a, s = _dist_operands(X, Y, c, scale)
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
    gX = _addbmm_neg(X * row_t.unsqueeze(-1), H, Y).mul_(a3) if need_x else _unused(X)
    gY = (
        _addbmm_neg(Y * col_t.unsqueeze(-1), H.transpose(1, 2), X).mul_(a3)
        if need_y
        else _unused(Y)
    )
    gc = _unused(c)
    if need_c:
        times = row_t.sum(-1) + col_t.sum(-1)
        # ds/dc = -s^3 / (2 scale^2) for s = scale / sqrt(c)
        gc = 0.5 * ga - 0.5 * s**3 / scale**2 * gs - a / (2.0 * c * c) * times
    return gX, gY, gc


def _backward_fake(grad, X, Y, c, G, state, need_x, need_y, need_c, scale=1.0):
    """Shapes of either backward op's gradients (empty where not needed)."""
    return tuple(
        torch.empty_like(t) if need else _unused(t)
        for t, need in ((X, need_x), (Y, need_y), (c, need_c))
    )


_dist_backward.register_fake(_backward_fake)


def _save_with_gram(ctx, inputs, output) -> None:
    X, Y, c = inputs[:3]
    ctx.scale = inputs[4] if len(inputs) > 4 else 1.0
    _, G, state = output
    ctx.mark_non_differentiable(G, state)
    ctx.set_materialize_grads(False)  # no zero [k, N, M] "gradient" for the Gram matrix
    ctx.save_for_backward(X, Y, c)
    # not saved tensors: the backward writes over them, which the saved-tensor version check
    # would reject on a second backward (that case recomputes the Gram matrix, see above)
    ctx.gram, ctx.gram_state = G, state


def _take_gram(ctx, X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor]:
    """The kept Gram matrix and its state for the backward op, released from ``ctx`` so that it
    does not outlive the backward while the output lives on; a second backward
    (``retain_graph=True``) gets a fresh buffer marked consumed, which the op fills first."""
    G, state = ctx.gram, ctx.gram_state
    ctx.gram = ctx.gram_state = None
    if G is None:
        G = X.new_empty(X.shape[0], X.shape[1], Y.shape[1])
        state = torch.ones((), dtype=torch.uint8)
    return G, state


def _dist_grad(ctx, grad, _grad_gram, _grad_state):
    X, Y, c = ctx.saved_tensors
    G, state = _take_gram(ctx, X, Y)
    if grad is None:  # the output unused (grads are not materialised): no gradient
        return None, None, None, None, None
    needs = tuple(ctx.needs_input_grad[:3])
    grads = _dist_backward(grad, X, Y, c, G, state, *needs, ctx.scale)
    return (*_grads_or_none(grads, needs), None, None)


_dist_forward.register_autograd(_dist_grad, setup_context=_save_with_gram)


def _addbmm_neg(C: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """``C - A B`` for ``[k, n, d]``, ``[k, n, m]``, ``[k, m, d]`` (one GEMM call; ``C`` is
    a temporary and is overwritten)."""
    if A.shape[0] == 1:
        C[0].addmm_(A[0], B[0], alpha=-1.0)
    else:
        C.baddbmm_(A, B, alpha=-1.0)
    return C


def pairwise_dist_fused(
    X: Tensor, Y: Tensor, c: Tensor, squeeze: bool = False, scale: float = 1.0
) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> ``[k, N, M]``
    (``[N, M]`` with ``squeeze`` and ``k = 1``).

    The per-factor Lorentz distances, as the reference ``lorentz.factor_pairwise_dist(X, Y, c)``.
    Call :func:`available` first.
    """
    k = X.shape[0]
    cv = c.reshape(-1).expand(k).contiguous()
    return _dist_forward(_c(X), _c(Y), cv, squeeze and k == 1, float(scale))[0]


def _angle_operands(X: Tensor, Y: Tensor, c: Tensor) -> tuple[Tensor, ...]:
    """``hc = c/2`` and, per factor, ``|x|^2``, ``t_x``, ``t_y``, ``|x|`` (floored at eps),
    ``txs = hc t_x``, ``u = t_x / |x|``, ``a = hc |x|^2 / t_x``."""
    e = eps(X.dtype)
    cv, hc = c.view(-1, 1), 0.5 * c
    sqx = torch.linalg.vecdot(X, X)
    tx = torch.sqrt(cv.reciprocal() + sqx)
    ty = torch.sqrt(cv.reciprocal() + torch.linalg.vecdot(Y, Y))
    nx = torch.sqrt(sqx.clamp_min(e * e))  # safe_norm(X, eps)
    hcv = hc.view(-1, 1)
    return hc, sqx, tx, ty, nx, hcv * tx, tx / nx, hcv * nx * nx / tx


@torch.library.custom_op("curvalign::lorentz_exterior_angle", mutates_args=())
def _angle_forward(X: Tensor, Y: Tensor, c: Tensor, squeeze: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The reference ``lorentz._PairwiseExteriorAngle`` with its elementwise maps fused into one
    pass forward and one backward, and its operands made (and differentiated) here.

    ``X: [k, N, d]``, ``Y: [k, M, d]``, ``c: [k]`` (contiguous) -> (``[k, N, M]``, or
    ``[N, M]`` with ``squeeze``; the Gram matrix; its state). Operands as the reference's, per
    factor with ``hc = c/2``: ``Gs = hc X Y^T`` (the kernel scales the plain Gram matrix),
    ``txs = hc t_x``, ``u = t_x / |x|``, ``a = hc |x|^2 / t_x`` (``|x|`` floored at eps), ``t_y``.
    """
    k, N, _ = X.shape
    M = Y.shape[1]
    G = _gram(X, Y)
    out = G.new_empty((N, M) if squeeze else (k, N, M))
    _angle_kernel_forward(G, X, Y, c, out)
    return out, G, torch.zeros((), dtype=torch.uint8)


def _angle_kernel_forward(G: Tensor, X: Tensor, Y: Tensor, c: Tensor, out: Tensor) -> None:
    """The forward pass: the angles at the rows of ``X`` towards the rows of ``Y`` from their
    Gram matrix ``G: [k, N, M]`` (kept), into ``out`` (``[k, N, M]`` or ``[N, M]``)."""
    k, N, _ = X.shape
    M = Y.shape[1]
    hc, _, _, ty, _, txs, u, a = _angle_operands(X, Y, c)
    _fn("angle_forward", X.dtype)(
        G.data_ptr(), out.data_ptr(), hc.data_ptr(), txs.data_ptr(), u.data_ptr(),
        a.data_ptr(), ty.data_ptr(), k, N, M, eps(X.dtype), torch.get_num_threads(),
    )  # fmt: skip


@_angle_forward.register_fake
def _(X: Tensor, Y: Tensor, c: Tensor, squeeze: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _pair_outputs(X, Y, squeeze)


@torch.library.custom_op("curvalign::lorentz_exterior_angle_backward", mutates_args=("G", "state"))
def _angle_backward(
    grad: Tensor,
    X: Tensor,
    Y: Tensor,
    c: Tensor,
    G: Tensor,
    state: Tensor,
    need_x: bool,
    need_y: bool,
    need_c: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel writes ``mG = -dL/dGs`` over the Gram matrix and the row and column sums of
    the reference's ``g_txs, g_u, g_a, g_ty``; the chain through ``t_x = sqrt(1/c + |x|^2)``,
    ``|x|``, ``t_y`` and ``hc`` is applied here on ``[k, N]`` vectors, and the Gram matrix's
    own share of ``dL/dhc``, ``sum dL/dGs * G = -sum_i x_i . (mG Y)_i``, from the backward GEMM.
    A gradient not needed comes back empty.
    """
    _restore_gram(X, Y, G, state)
    coef_x, coef_y, d_hc, times = _angle_kernel_backward(grad, X, Y, c, G)
    mG = G
    hc3 = (0.5 * c).view(-1, 1, 1)
    gX, gY, gc = _unused(X), _unused(Y), _unused(c)
    if need_x or need_c:
        P = _bmm(mG, Y)  # -dL/dGs Y
        if need_c:
            d_hc = d_hc - torch.linalg.vecdot(X, P).sum(-1)
        if need_x:
            gX = P.mul_(-hc3).addcmul_(X, coef_x.unsqueeze(-1))
    if need_y:
        gY = _bmm(mG.transpose(1, 2), X).mul_(-hc3).addcmul_(Y, coef_y.unsqueeze(-1))
    if need_c:
        gc = 0.5 * d_hc - times / (2.0 * c * c)
    return gX, gY, gc


def _angle_kernel_backward(
    grad: Tensor, X: Tensor, Y: Tensor, c: Tensor, G: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward pass over an intact Gram matrix ``G`` (``[k, N, M]``, overwritten with
    ``mG = -dL/dGs``) and the chain through the row and column operands.

    Returns ``coef_x [k, N]`` and ``coef_y [k, M]`` (``dL/dX = -hc mG Y + coef_x X``, ``dL/dY =
    -hc mG^T X + coef_y Y``), and the curvature's parts ``d_hc [k]`` (without the Gram
    matrix's own share ``-sum mG * G``) and ``times [k]`` (``dL/dc = d_hc / 2 - times / (2
    c^2)``, once that share is added to ``d_hc``)."""
    k, N, _ = X.shape
    M = Y.shape[1]
    e = eps(X.dtype)
    hc, sqx, tx, ty, nx, txs, u, a = _angle_operands(X, Y, c)
    grad, *strides = _grad_view(grad, X.dtype)
    row_rc, g_txs, row_a = (tx.new_empty(k, N) for _ in range(3))
    g_ty = ty.new_empty(k, M)
    _fn("angle_backward", X.dtype)(
        G.data_ptr(), grad.data_ptr(), *strides, hc.data_ptr(), txs.data_ptr(), u.data_ptr(),
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
    coef_y = g_ty / ty
    d_hc = (g_txs * tx + g_a * nx * nx / tx).sum(-1)
    times = (d_tx / tx).sum(-1) + coef_y.sum(-1)
    return coef_x, coef_y, d_hc, times


_angle_backward.register_fake(_backward_fake)


def _angle_grad(ctx, grad, _grad_gram, _grad_state):
    X, Y, c = ctx.saved_tensors
    G, state = _take_gram(ctx, X, Y)
    if grad is None:  # the output unused (grads are not materialised): no gradient
        return None, None, None, None
    needs = tuple(ctx.needs_input_grad[:3])
    return (*_grads_or_none(_angle_backward(grad, X, Y, c, G, state, *needs), needs), None)


_angle_forward.register_autograd(_angle_grad, setup_context=_save_with_gram)


def pairwise_angle_fused(X: Tensor, Y: Tensor, c: Tensor, squeeze: bool = False) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> the
    exterior angles ``[k, N, M]`` (``[N, M]`` with ``squeeze`` and ``k = 1``), as the reference
    ``lorentz._PairwiseExteriorAngle``. Call :func:`available` first.
    """
    k = X.shape[0]
    cv = c.reshape(-1).expand(k).contiguous()
    return _angle_forward(_c(X), _c(Y), cv, squeeze and k == 1)[0]


# --- both directions from one Gram matrix ---------------------------------------------------
# AtMG's loss scores texts against images with the angle at the text and images against texts
# with the angle at the image: two [N, M] angle matrices whose Gram matrices are one matrix and
# its transpose. One GEMM forward (the transpose is a copy) and, since the two angles' gradients
# with respect to that Gram matrix add (``mG_a + mG_b^T``), two GEMMs backward, where two
# separate calls take three each.


@torch.library.custom_op("curvalign::lorentz_exterior_angle_pair", mutates_args=())
def _pair_forward(X: Tensor, Y: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``X: [N, d]``, ``Y: [M, d]``, ``c: [1]`` (contiguous) -> (``ext(x_i, y_j)`` ``[N, M]``,
    ``ext(y_j, x_i)`` ``[M, N]``, the Gram matrix ``[N, M]`` and its transpose (kept for
    backward), their state)."""
    G = torch.mm(X, Y.t())
    Gt = G.t().clone(memory_format=torch.contiguous_format)  # never a view of G (1 x 1)
    X3, Y3 = X.unsqueeze(0), Y.unsqueeze(0)
    out_xy, out_yx = G.new_empty(G.shape), G.new_empty(Gt.shape)
    _angle_kernel_forward(G.unsqueeze(0), X3, Y3, c, out_xy)
    _angle_kernel_forward(Gt.unsqueeze(0), Y3, X3, c, out_yx)
    return out_xy, out_yx, G, Gt, torch.zeros((), dtype=torch.uint8)


@_pair_forward.register_fake
def _(X: Tensor, Y: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    N, M = X.shape[0], Y.shape[0]
    return (
        X.new_empty(N, M),
        X.new_empty(M, N),
        X.new_empty(N, M),
        X.new_empty(M, N),
        torch.zeros((), dtype=torch.uint8),
    )


@torch.library.custom_op(
    "curvalign::lorentz_exterior_angle_pair_backward", mutates_args=("G", "Gt", "state")
)
def _pair_backward(
    grad_xy: Tensor,
    grad_yx: Tensor,
    X: Tensor,
    Y: Tensor,
    c: Tensor,
    G: Tensor,
    Gt: Tensor,
    state: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Both kernel backward passes (each writes its ``-dL/dGs`` over its Gram matrix), their
    sum ``M = mG_xy + mG_yx^T`` (into ``G``), then ``dL/dX = -hc M Y + ...`` and ``dL/dY =
    -hc M^T X + ...``: two GEMMs for both directions."""
    if int(state.item()) != 0:  # consumed by an earlier backward: recompute both
        torch.mm(X, Y.t(), out=G)
        Gt.copy_(G.t())
    state.fill_(1)
    X3, Y3 = X.unsqueeze(0), Y.unsqueeze(0)
    cx_a, cy_a, dhc_a, times_a = _angle_kernel_backward(grad_xy, X3, Y3, c, G.unsqueeze(0))
    cy_b, cx_b, dhc_b, times_b = _angle_kernel_backward(grad_yx, Y3, X3, c, Gt.unsqueeze(0))
    Msum = G.add_(Gt.t())
    hc = 0.5 * c
    P = torch.mm(Msum, Y)
    d_hc = dhc_a + dhc_b - torch.linalg.vecdot(X, P).sum()
    gX = P.mul_(-hc).addcmul_(X, (cx_a + cx_b)[0].unsqueeze(-1))
    gY = torch.mm(Msum.t(), X).mul_(-hc).addcmul_(Y, (cy_a + cy_b)[0].unsqueeze(-1))
    gc = 0.5 * d_hc - (times_a + times_b) / (2.0 * c * c)
    return gX, gY, gc


@_pair_backward.register_fake
def _(grad_xy, grad_yx, X, Y, c, G, Gt, state):
    return torch.empty_like(X), torch.empty_like(Y), torch.empty_like(c)


def _pair_setup(ctx, inputs, output) -> None:
    X, Y, c = inputs
    _, _, G, Gt, state = output
    ctx.mark_non_differentiable(G, Gt, state)
    ctx.set_materialize_grads(False)  # no zero [N, M] "gradients" for the Gram matrices
    ctx.save_for_backward(X, Y, c)
    ctx.gram = (G, Gt, state)  # written over by the backward: not saved tensors (see above)


def _pair_grad(ctx, grad_xy, grad_yx, _g, _gt, _state):
    X, Y, c = ctx.saved_tensors
    G, Gt, state = ctx.gram if ctx.gram is not None else (None, None, None)
    ctx.gram = None
    if G is None:  # a second backward: fresh buffers, marked consumed
        G, Gt = X.new_empty(X.shape[0], Y.shape[0]), X.new_empty(Y.shape[0], X.shape[0])
        state = torch.ones((), dtype=torch.uint8)
    if grad_xy is None and grad_yx is None:
        return None, None, None
    N, M = X.shape[0], Y.shape[0]
    grad_xy = X.new_zeros(N, M) if grad_xy is None else grad_xy
    grad_yx = X.new_zeros(M, N) if grad_yx is None else grad_yx
    gX, gY, gc = _pair_backward(grad_xy, grad_yx, X, Y, c, G, Gt, state)
    needs = ctx.needs_input_grad
    return (gX if needs[0] else None, gY if needs[1] else None, gc if needs[2] else None)


_pair_forward.register_autograd(_pair_grad, setup_context=_pair_setup)


def pairwise_angles_both_fused(X: Tensor, Y: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``X: [N, d]``, ``Y: [M, d]`` (working dtype), ``c: [1]`` -> (``ext(x_i, y_j)`` ``[N, M]``,
    ``ext(y_j, x_i)`` ``[M, N]``): the two exterior-angle matrices of
    ``lorentz.pairwise_exterior_angle(X, Y)`` and ``(Y, X)`` from one Gram matrix. Call
    :func:`available` first."""
    out_xy, out_yx, *_ = _pair_forward(_c(X), _c(Y), c.reshape(1).contiguous())
    return out_xy, out_yx
