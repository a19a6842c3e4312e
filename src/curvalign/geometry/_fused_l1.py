"""Fused CPU kernel for the l1-product distance (PHyCLIP), forward and backward.

:func:`l1_pairwise_dist_fused` computes exactly what the reference
(:func:`curvalign.geometry.lorentz.factor_pairwise_dist` with ``reduce_sum``) computes, from the
same time-augmented operands ``P = (c/2) [x, t_x]``, ``Q = [y, -t_y]`` and ``s = 1/sqrt(c)``
(built with autograd, so the gradients w.r.t. ``X``, ``Y`` and ``c`` flow through them), but in
one C++ loop per pass (``_l1_kernel.cpp``): ``k`` inner products of ``d + 1`` terms per pair as
vector FMAs on a cache-friendly layout (rows ``[N, k, d+1]``, columns interleaved by 8), the
``log1p`` written out so that it vectorises, and the backward recomputing each ``w`` instead of
storing ``[k, N, M]``. float32 on a build with AVX2 + FMA takes register-tiled loops with a
division-free ``log1p`` (:func:`avx2_float32`; about twice as fast, agreeing with the reference
to float rounding); float64 keeps the generic loops the gradcheck runs on.

Built and cached by :class:`curvalign._native.NativeKernel` (compiled on first use, about 2 s;
``CURVALIGN_FUSED=0`` turns it off; a failed build warns once and the caller falls back to the
eager reference). The kernel uses ``torch.get_num_threads()`` OpenMP threads. Forward and
backward are ``torch.library`` custom ops (``curvalign::l1_forward``, ``curvalign::l1_backward``):
opaque to ``torch.compile``, which traces the layout code around them.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from curvalign._native import NativeKernel, enabled
from curvalign.geometry._numerics import eps

__all__ = [
    "KERNEL",
    "available",
    "avx2_float32",
    "enabled",
    "l1_pairwise_dist_fused",
    "load_kernel",
]

_SOURCE = Path(__file__).with_name("_l1_kernel.cpp")
_LANES = 8  # columns per interleaved block (L in the C++ source)
_MAX_WIDTH = 64  # d + 1 the kernel accepts (its stack buffers)


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for suffix in ("f32", "f64"):
        fwd = getattr(lib, f"curvalign_l1_forward_{suffix}")
        fwd.argtypes = [p, p, p, p, i64, i64, i64, i64, i32]
        fwd.restype = None
        bwd = getattr(lib, f"curvalign_l1_backward_{suffix}")
        bwd.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, f64, i32]
        bwd.restype = None
    lib.curvalign_l1_avx2.argtypes = []
    lib.curvalign_l1_avx2.restype = i32


KERNEL = NativeKernel(
    _SOURCE, "l1", "fused l1-product kernel", _bind, headers=[_SOURCE.with_name("_vecmath.h")]
)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; ``None`` (one warning) if that fails."""
    return KERNEL.load()


def available(*tensors: Tensor) -> bool:
    """Whether the fused kernel applies to these tensors (enabled, CPU, float32/64, built)."""
    return KERNEL.available(*tensors)


def avx2_float32() -> bool:
    """Whether float32 runs the kernel's AVX2 + FMA loops (built with ``-mavx2 -mfma``; else the
    generic loops float64 uses). Call :func:`available` first."""
    lib = KERNEL.library
    return lib is not None and bool(lib.curvalign_l1_avx2())


def _suffix(dtype: torch.dtype) -> str:
    return "f32" if dtype == torch.float32 else "f64"


# The kernel as two ``torch.library`` custom ops with their autograd formula: eager calls run the
# C++ loop directly, and ``torch.compile`` sees opaque ops with known output shapes (the fake
# implementations) instead of tracing into a ctypes call it cannot see, which left the compiled
# graph returning the uninitialised output buffer.


@torch.library.custom_op("curvalign::l1_forward", mutates_args=())
def _l1_forward(P: Tensor, Qi: Tensor, s: Tensor, M: int) -> Tensor:
    """``P [N, k, D1]``, ``Qi [Mb, k, D1, 8]``, ``s [k]`` (contiguous) -> ``[N, M]``."""
    lib = KERNEL.library
    assert lib is not None, "call available() first"
    N, k, width = P.shape
    out = P.new_empty(N, M)
    getattr(lib, f"curvalign_l1_forward_{_suffix(P.dtype)}")(
        P.data_ptr(), Qi.data_ptr(), s.data_ptr(), out.data_ptr(),
        N, M, k, width, torch.get_num_threads(),
    )  # fmt: skip
    return out


@_l1_forward.register_fake
def _(P: Tensor, Qi: Tensor, s: Tensor, M: int) -> Tensor:
    return P.new_empty(P.shape[0], M)


@torch.library.custom_op("curvalign::l1_backward", mutates_args=())
def _l1_backward(P: Tensor, Qi: Tensor, s: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``dL/dP``, ``dL/dQi``, ``dL/ds`` for an incoming ``grad [N, M]``."""
    w0 = eps(P.dtype)
    r_floor = math.sqrt(w0 * (1.0 + w0))  # as the reference's _PairwiseAcosh.backward
    lib = KERNEL.library
    assert lib is not None, "call available() first"
    N, k, width = P.shape
    grad = grad.to(P.dtype).contiguous()
    gP, gQ, gs = torch.empty_like(P), torch.empty_like(Qi), torch.empty_like(s)
    getattr(lib, f"curvalign_l1_backward_{_suffix(P.dtype)}")(
        P.data_ptr(), Qi.data_ptr(), s.data_ptr(), grad.data_ptr(),
        gP.data_ptr(), gQ.data_ptr(), gs.data_ptr(),
        N, grad.shape[1], k, width, r_floor, torch.get_num_threads(),
    )  # fmt: skip
    return gP, gQ, gs


@_l1_backward.register_fake
def _(P: Tensor, Qi: Tensor, s: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(P), torch.empty_like(Qi), torch.empty_like(s)


def _l1_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    P, Qi, s, _ = inputs
    ctx.save_for_backward(P, Qi, s)


def _l1_grad(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    P, Qi, s = ctx.saved_tensors
    return (*_l1_backward(P, Qi, s, grad), None)


_l1_forward.register_autograd(_l1_grad, setup_context=_l1_setup)


def l1_pairwise_dist_fused(X: Tensor, Y: Tensor, c: Tensor, scale: float = 1.0) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> ``[N, M]``.

    ``scale`` times the sum over factors of the Lorentz distances, as the reference
    ``factor_pairwise_dist(X, Y, c, reduce_sum=True)``; the constant is folded into the
    per-factor ``s = 1/sqrt(c)`` (a score's ``-1/k`` costs no pass over the matrix). Call
    :func:`available` first.
    """
    from curvalign.geometry.lorentz import minkowski_operands

    k, width = X.shape[0], X.shape[2] + 1
    M = Y.shape[1]
    if width > _MAX_WIDTH:
        raise ValueError(
            f"X: factor width d = {width - 1} is above the fused kernel's {_MAX_WIDTH - 1}"
        )
    c = c.reshape(-1).expand(k)
    P, Q = minkowski_operands(X, Y, c)  # [k, N, d+1], [k, M, d+1], with autograd
    P = P[..., :width].transpose(0, 1).contiguous()  # rows [N, k, d+1]
    Mb = -(-M // _LANES)
    Q = Q[..., :width]
    if Mb * _LANES != M:
        Q = torch.cat([Q, Q.new_zeros(k, Mb * _LANES - M, width)], 1)
    Qi = Q.reshape(k, Mb, _LANES, width).permute(1, 0, 3, 2).contiguous()  # [Mb, k, d+1, 8]
    s = torch.rsqrt(c).mul(scale).contiguous()
    return _l1_forward(P, Qi, s, M)
