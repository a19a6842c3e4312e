"""Fused CPU kernel for AGR's router MLP over every (text, image) pair, forward and backward.

:func:`router_logits_fused` computes what ``PairwiseRouter._chunk_logits`` computes over all
rows (the folded LayerNorm + first layer, GELU, dropout, the second layer, GELU, dropout, the
output layer; logits times ``T_gate``), in one C++ loop per pass (``_router_kernel.cpp``) over
tiles of 8 pairs held in L1: no ``[pairs, 64]`` tensor exists in either pass. The backward
recomputes each tile's hidden layers (the kernel keeps nothing per pair, so the memory kept for
backward is the two jittered scalars a pair) and accumulates every gradient in the same loop:
the per-item rows, the LayerNorm statistics (float64, as the reference), the folded first
layer's map, ``fc2``, ``fc3``. Dropout masks are a hash of (seed, row, column, unit): the
backward replays the forward's masks exactly, the rate is ``BitDropout``'s (``p`` rounded to
2^-16) and the scale exact; the seed is drawn from torch's default generator, so
``torch.manual_seed`` reproduces a run (a different random stream from the eager path).

Built and cached by :class:`curvalign._native.NativeKernel` (compiled on first use, about 3 s;
``CURVALIGN_FUSED=0`` turns it off; a failed build warns once and the router falls back to its
eager reference). The kernel uses ``torch.get_num_threads()`` OpenMP threads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from curvalign._native import NativeKernel

__all__ = ["KERNEL", "available", "keep_masks", "routed_scores_both_fused", "router_logits_fused"]

_SOURCE = Path(__file__).with_name("_router_kernel.cpp")
_LANES = 8  # pairs per tile (L in the C++ source)


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64, u64 = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_double,
        ctypes.c_uint64,
    )
    consts = [i64, i64, i64, i64, f64, f64, i64, i64, f64, f64, u64, i32]
    for suffix in ("f32", "f64"):
        fwd = getattr(lib, f"curvalign_router_forward_{suffix}")
        fwd.argtypes = [p] * 12 + [f64, p] + consts
        fwd.restype = None
        bwd = getattr(lib, f"curvalign_router_backward_{suffix}")
        bwd.argtypes = [p] * 13 + [f64] + [p] * 14 + consts
        bwd.restype = None
    for suffix in ("f32", "f64"):
        fwd = getattr(lib, f"curvalign_routed_forward_{suffix}")
        fwd.argtypes = [p] * 9 + [i64, i64, f64, f64, f64, i32]
        fwd.restype = None
        bwd = getattr(lib, f"curvalign_routed_backward_{suffix}")
        bwd.argtypes = [p] * 16 + [i64, i64, f64, f64, f64, i32]
        bwd.restype = None
    masks = lib.curvalign_router_keep_masks
    masks.argtypes = [p, i64, i64, i64, i64, i64, i64, u64]
    masks.restype = None


KERNEL = NativeKernel(_SOURCE, "router", "fused router kernel", _bind)


def available(*tensors: Tensor) -> bool:
    """Whether the fused kernel applies to these tensors (enabled, CPU, float32/64, built)."""
    return KERNEL.available(*tensors)


def _suffix(dtype: torch.dtype) -> str:
    return "f32" if dtype == torch.float32 else "f64"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _FusedRouter(torch.autograd.Function):
    """See :func:`router_logits_fused`; every tensor argument already in the kernel's layout."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, se, sh, st, qt, si, qi, tp, ip, sm, w2, b2, w3, b3, consts
    ) -> Tensor:
        lib = KERNEL.library
        assert lib is not None
        w2t = w2.t().contiguous()
        nt, ni = se.shape
        out = se.new_empty(nt, ni)
        getattr(lib, f"curvalign_router_forward_{_suffix(se.dtype)}")(
            se.data_ptr(), sh.data_ptr(), st.data_ptr(), qt.data_ptr(), si.data_ptr(),
            qi.data_ptr(), tp.data_ptr(), ip.data_ptr(), sm.data_ptr(), w2t.data_ptr(),
            b2.data_ptr(), w3.data_ptr(), float(b3), out.data_ptr(), *consts,
        )  # fmt: skip
        ctx.save_for_backward(se, sh, st, qt, si, qi, tp, ip, sm, w2, b2, w3, b3)
        ctx.consts = consts
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        se, sh, st, qt, si, qi, tp, ip, sm, w2, b2, w3, b3 = ctx.saved_tensors
        lib = KERNEL.library
        assert lib is not None
        grad = grad.to(se.dtype).contiguous()
        need = ctx.needs_input_grad
        gse = torch.empty_like(se) if need[0] else None
        gsh = torch.empty_like(sh) if need[1] else None
        gst, gqt, gsi, gqi = (torch.empty_like(x) for x in (st, qt, si, qi))
        gtp, gip, gsm, gw2, gb2, gw3, gb3 = (
            torch.empty_like(x) for x in (tp, ip, sm, w2, b2, w3, b3)
        )
        w2t = w2.t().contiguous()
        getattr(lib, f"curvalign_router_backward_{_suffix(se.dtype)}")(
            se.data_ptr(), sh.data_ptr(), st.data_ptr(), qt.data_ptr(), si.data_ptr(),
            qi.data_ptr(), tp.data_ptr(), ip.data_ptr(), sm.data_ptr(), w2.data_ptr(),
            w2t.data_ptr(), b2.data_ptr(), w3.data_ptr(), float(b3), grad.data_ptr(),
            _ptr(gse), _ptr(gsh), gst.data_ptr(), gqt.data_ptr(), gsi.data_ptr(), gqi.data_ptr(),
            gtp.data_ptr(), gip.data_ptr(), gsm.data_ptr(), gw2.data_ptr(), gb2.data_ptr(),
            gw3.data_ptr(), gb3.data_ptr(), *ctx.consts,
        )  # fmt: skip
        return gse, gsh, gst, gqt, gsi, gqi, gtp, gip, gsm, gw2, gb2, gw3, gb3, None


def router_logits_fused(
    se: Tensor,
    sh: Tensor,
    text_part: Tensor,
    image_part: Tensor,
    scalar_map: Tensor,
    sum_t: Tensor,
    sq_t: Tensor,
    sum_i: Tensor,
    sq_i: Tensor,
    w2: Tensor,
    b2: Tensor,
    w3: Tensor,
    b3: Tensor,
    in_dim: int,
    eps: float,
    thresholds: tuple[int, int],
    seed: int,
) -> Tensor:
    """The router's logits times ``T_gate`` for every pair: ``[Nt, Ni]``.

    se, sh            [Nt, Ni]  the (jittered) scalar inputs, working dtype
    text_part         [Nt, H1]  ``W'_T u_t``;  image_part [Ni, H1]  ``W'_I u_i``
    scalar_map        [4, H1]   ``(w_E, w_H, W' 1, c)`` of the folded first layer
    sum_t, sq_t       [Nt]      per-item sums and sums of squares of the contexts (float64)
    sum_i, sq_i       [Ni]
    w2, b2            [H2, H1], [H2];  w3 [1, H2] or [H2];  b3 [1]
    thresholds        the two dropout layers' 16-bit thresholds (0: no dropout)
    Every tensor but the statistics is in the working dtype (float32 or float64); gradients flow
    to all of them (through the padding below) as autograd would through the reference.
    """
    work = se.dtype
    nt, ni = se.shape
    h1, h2 = w2.shape[1], w2.shape[0]
    h1p, h2p, nip = _round_up(h1, 8), _round_up(h2, 8), _round_up(ni, _LANES)
    # zero-padded hidden units are 0 after GELU and meet zero weights: they change nothing
    tp = F.pad(text_part, (0, h1p - h1)).contiguous()
    sm = F.pad(scalar_map, (0, h1p - h1)).contiguous()
    ip = F.pad(image_part, (0, h1p - h1, 0, nip - ni))
    ip = ip.reshape(nip // _LANES, _LANES, h1p).transpose(1, 2).contiguous()  # [Nib, H1p, 8]
    si = F.pad(sum_i, (0, nip - ni)).contiguous()
    qi = F.pad(sq_i, (0, nip - ni)).contiguous()
    w2p = F.pad(w2, (0, h1p - h1, 0, h2p - h2)).contiguous()
    b2p = F.pad(b2, (0, h2p - h2)).contiguous()
    w3p = F.pad(w3.reshape(-1), (0, h2p - h2)).contiguous()
    thr1, thr2 = thresholds
    consts = (
        nt, ni, h1p, h2p, float(in_dim), float(eps), thr1, thr2,
        65536.0 / (65536 - thr1), 65536.0 / (65536 - thr2), seed & (2**64 - 1),
        torch.get_num_threads(),
    )  # fmt: skip
    return _FusedRouter.apply(
        se.contiguous(), sh.contiguous(), sum_t.contiguous(), sq_t.contiguous(), si, qi,
        tp, ip, sm, w2p, b2p, w3p, b3.reshape(1).to(work), consts,
    )  # fmt: skip


class _RoutedBoth(torch.autograd.Function):
    """See :func:`routed_scores_both_fused`."""

    @staticmethod
    def forward(ctx, s_h, s_e, w, gt, ct, gi, ci, consts):  # type: ignore[override]
        lib = KERNEL.library
        assert lib is not None
        s1, s2 = torch.empty_like(s_h), torch.empty_like(s_h)
        getattr(lib, f"curvalign_routed_forward_{_suffix(s_h.dtype)}")(
            s_h.data_ptr(), s_e.data_ptr(), w.data_ptr(), gt.data_ptr(), ct.data_ptr(),
            gi.data_ptr(), ci.data_ptr(), s1.data_ptr(), s2.data_ptr(), *consts,
        )  # fmt: skip
        ctx.save_for_backward(s_h, s_e, w, gt, ct, gi, ci)
        ctx.consts = consts
        return s1, s2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g1, g2):  # type: ignore[override]
        s_h, s_e, w, gt, ct, gi, ci = ctx.saved_tensors
        lib = KERNEL.library
        assert lib is not None
        zero = torch.zeros((), dtype=s_h.dtype)
        g1 = (zero if g1 is None else g1.to(s_h.dtype)).expand_as(s_h).contiguous()
        g2 = (zero if g2 is None else g2.to(s_h.dtype)).expand_as(s_h).contiguous()
        grads = [torch.empty_like(x) for x in (s_h, s_e, w, gt, ct, gi, ci)]
        getattr(lib, f"curvalign_routed_backward_{_suffix(s_h.dtype)}")(
            s_h.data_ptr(), s_e.data_ptr(), w.data_ptr(), gt.data_ptr(), ct.data_ptr(),
            gi.data_ptr(), ci.data_ptr(), g1.data_ptr(), g2.data_ptr(),
            *(g.data_ptr() for g in grads), *ctx.consts,
        )  # fmt: skip
        return (*grads, None)


def routed_scores_both_fused(
    s_h: Tensor,
    s_e: Tensor,
    route_weight: Tensor,
    row_gate: Tensor,
    row_calibration: Tensor,
    column_gate: Tensor,
    column_calibration: Tensor,
    alpha: float,
    beta: float,
    max_delta: float,
) -> tuple[Tensor, Tensor]:
    """AGR's routed score of one ``[Nt, Ni]`` matrix with the row side as the queries and with
    the column side as the queries, in one pass each way (``routed_scores`` twice, same values
    to float rounding). ``s_h``, ``s_e``, ``route_weight`` [Nt, Ni]; ``row_gate`` [Nt],
    ``row_calibration`` [Nt, 3]; ``column_gate`` [Ni], ``column_calibration`` [Ni, 3]; one
    float dtype. Returns (row-query scores, column-query scores), both [Nt, Ni]."""
    nt, ni = s_h.shape
    consts = (nt, ni, float(alpha), float(beta), float(max_delta), torch.get_num_threads())
    return _RoutedBoth.apply(
        s_h.contiguous(), s_e.contiguous(), route_weight.contiguous(), row_gate.contiguous(),
        row_calibration.contiguous(), column_gate.contiguous(),
        column_calibration.t().contiguous(), consts,
    )  # fmt: skip


def keep_masks(
    nt: int, ni: int, h1: int, h2: int, thresholds: tuple[int, int], seed: int
) -> Tensor:
    """The kernel's dropout keep masks ``[Nt, Ni, H1p + H2p]`` (bool; hidden widths padded to 8)
    for a seed: tests check their rate and replay the forward's masks with them."""
    lib = KERNEL.load()
    assert lib is not None
    h1p, h2p = _round_up(h1, 8), _round_up(h2, 8)
    keep = torch.empty(nt, ni, h1p + h2p, dtype=torch.uint8)
    lib.curvalign_router_keep_masks(
        keep.data_ptr(), nt, ni, h1p, h2p, thresholds[0], thresholds[1], seed & (2**64 - 1)
    )
    return keep.bool()
