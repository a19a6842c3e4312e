"""Triton kernels for the l1-product distance (PHyCLIP) on CUDA, forward and backward.

:func:`l1_pairwise_dist_triton` computes what the eager reference
(:func:`curvalign.geometry.lorentz.factor_pairwise_dist` with ``reduce_sum``) and the CPU kernel
(:mod:`curvalign.geometry._fused_l1`) compute, from the same time-augmented operands
``P = (c/2) [x, t_x]``, ``Q = [y, -t_y]`` and ``s = 1/sqrt(c)`` (built with autograd, so the
gradients w.r.t. ``X``, ``Y`` and the per-factor ``c`` flow through them), laid out factor- and
coordinate-major (``[k, d+1, N]``, ``[k, d+1, M]``: the loads of one coordinate over a tile of
rows are contiguous):

- forward, one program per ``[BLOCK_N, BLOCK_M]`` tile of the output, looping over the ``k``
  factors: ``w = -P_f . Q_f - 1/2`` as ``d + 1`` outer-product FMAs, ``u = max(w, 0)``,
  ``r = sqrt(u + u^2)``, ``acosh(1 + 2u) = log1p(2 (u + r))`` and ``out += s_f acosh``;
- backward, one kernel, one program per (row group, factor f) walking the group's row tiles:
  ``w`` once per element and factor (no ``[k, N, M]`` tensor is kept from the forward), with
  ``G = grad [u > 0] / max(r, r_floor)`` (the reference's floor, as a clamped ``rsqrt``); per
  row tile ``dP_f = -s_f G Q_f`` over all columns (in registers, written once), per column tile
  the group's partial ``G^T P_f`` (added into the group's own ``[k, d+1, M]`` buffer; the groups
  are summed afterwards) and a partial ``ds_f = sum grad acosh``. The two gradient sums are
  ``tl.dot`` products (TF32x3 tensor-core products in float32). Each output element is written
  by one program (no atomics): the gradients do not depend on scheduling.

``log1p`` is the CPU kernel's: ``log(a)``, ``a = 1 + v``, from the exponent split and an atanh
series, plus ``(v - (a - 1)) / a`` (the rounding of ``1 + v`` corrected to first order); +inf and
NaN pass through. Triton's CUDA ``log1p`` is a libdevice call, which the CPU interpreter cannot
run, and the same code must run in both. The tests run these kernels under ``TRITON_INTERPRET=1``
on CPU tensors, compile them for sm_90 with Triton's compiler and, where a GPU is present, run
them on it (``tests/test_geometry_triton.py``); the launch settings were chosen by timing on an
H100 (``benchmarks/gpu_l1.py --sweep``).

Importing this module imports ``triton``; :mod:`curvalign.geometry.product` imports it only for
CUDA tensors (and only when ``triton`` is installed). :func:`ready` compiles the kernels once per
(device, dtype, width) on a tiny problem; a failure warns once and the caller uses the eager
reference.
"""

from __future__ import annotations

import logging
import math
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from curvalign.geometry._numerics import eps

__all__ = ["BLOCKS", "LAUNCH", "MAX_WIDTH", "compile_for", "l1_pairwise_dist_triton", "ready"]

_log = logging.getLogger(__name__)

#: Factor widths ``d + 1`` the kernels accept (each coordinate is an unrolled FMA).
MAX_WIDTH = 64
#: ``(BLOCK_N, BLOCK_M)``: the output tile of the forward, the row x column tile of the backward.
BLOCKS = (32, 32)
#: ``(num_warps, num_stages)`` per dtype and kernel. Chosen by timing on an H100
#: (``benchmarks/gpu_l1.py --sweep``, docs/results/gpu/): the backward's 32 x 32 tile at 4 warps
#: is the largest that ptxas compiles without spills (``--ptxas 90``).
LAUNCH = {
    torch.float32: {"forward": (4, 3), "backward": (4, 1)},
    torch.float64: {"forward": (8, 3), "backward": (8, 1)},
}
#: Row groups of the backward (at most): each group owns one ``[k, d+1, M]`` partial of ``dQ``
#: (extra memory ``groups x k (d+1) M`` entries, 151 MB at k = 64, d = 8, M = 4096 in float32)
#: and walks its share of the row tiles.
ROW_GROUPS = 16
#: ``input_precision`` of the backward's ``tl.dot`` (the gradient sums ``G Q`` and ``G^T P``)
#: per dtype: float32 uses ``"tf32x3"`` (three TF32 tensor-core products: on an H100 the step
#: at B = 4096 took 15 ms against 31 ms with FMAs, ``"ieee"``, and the errors against the float64
#: truth were no larger, docs/results/gpu/h100-run5-sweep.txt); float64 has no tensor-core form.
DOT_PRECISION = {torch.float32: "tf32x3", torch.float64: "ieee"}

_INF = tl.constexpr(float("inf"))


@triton.jit
def _minus_gram(a_ptr, b_ptr, ia, ib, a_ok, b_ok, stride_a, stride_b, D1: tl.constexpr):
    """``w = -1/2 - sum_t a[t, ia] b[t, ib]``: ``[len(ia), len(ib)]``; ``a``, ``b``: ``[D1, n]``."""
    a = tl.load(a_ptr + ia, mask=a_ok, other=0.0)
    b = tl.load(b_ptr + ib, mask=b_ok, other=0.0)
    w = -0.5 - a[:, None] * b[None, :]
    for t in tl.static_range(1, D1):
        a = tl.load(a_ptr + t * stride_a + ia, mask=a_ok, other=0.0)
        b = tl.load(b_ptr + t * stride_b + ib, mask=b_ok, other=0.0)
        w -= a[:, None] * b[None, :]
    return w


@triton.jit
def _clamp_root(w):
    """``u = max(w, 0)`` and ``r = sqrt(u + u^2)`` (correctly rounded in float32 too)."""
    u = tl.maximum(w, 0.0)
    if w.dtype == tl.float32:
        r = tl.sqrt_rn(u + u * u)
    else:
        r = tl.sqrt(u + u * u)
    return u, r


@triton.jit
def _log_series(z, TERMS: tl.constexpr):
    """``sum_{n < TERMS} z^n / (2n + 1)`` (Horner, ``TERMS >= 2``).

    Every coefficient meets a tensor of ``z``'s dtype: a Python float standing alone would become
    a float32 constant in compiled code, also in a float64 kernel.
    """
    p = z * (1.0 / (2 * TERMS - 1)) + 1.0 / (2 * TERMS - 3)
    for n in tl.static_range(TERMS - 3, -1, -1):
        p = p * z + 1.0 / (2 * n + 1)
    return p


@triton.jit
def _acosh_1p2u(u, r):
    """``acosh(1 + 2u) = log1p(v)``, ``v = 2 (u + r)``; +inf and NaN pass through.

    ``log(a)``, ``a = 1 + v = 2^e m`` with ``m`` in ``[sqrt(1/2), sqrt(2))``, as
    ``e ln 2 + 2 atanh((m - 1) / (m + 1))`` (the CPU kernel's series: relative error below 1e-9
    in float32, 1e-18 in float64), plus ``(v - (a - 1)) / a`` (the rounding of ``1 + v``
    corrected to first order): the same function as the CPU kernel's ``log1p``, and one that the
    CPU interpreter can run (libdevice's ``log1p`` is an external call it cannot).
    """
    v = 2.0 * (u + r)
    a = 1.0 + v
    if a.dtype == tl.float32:
        bits = a.to(tl.int32, bitcast=True)
        e = (bits - 0x3F3504F3) >> 23
        m = (bits - (e << 23)).to(tl.float32, bitcast=True)
        TERMS: tl.constexpr = 5
    else:
        bits = a.to(tl.int64, bitcast=True)
        e = (bits - 0x3FE6A09E667F3BCD) >> 52
        m = (bits - (e << 52)).to(tl.float64, bitcast=True)
        TERMS: tl.constexpr = 11
    f = m - 1.0
    z = f / (2.0 + f)
    log_a = e.to(a.dtype) * 0.6931471805599453 + 2.0 * z * _log_series(z * z, TERMS)
    return tl.where(a < _INF, log_a + (v - (a - 1.0)) / a, a)


@triton.jit
def _l1_forward_kernel(
    Pt, Qt, s, out, N, M, K,
    D1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(M, BLOCK_M)
    rows = (pid // col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (pid % col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    col_ok = cols < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=Pt.dtype.element_ty)
    p_ptr = Pt
    q_ptr = Qt
    for f in range(K):
        w = _minus_gram(p_ptr, q_ptr, rows, cols, row_ok, col_ok, N, M, D1)
        u, r = _clamp_root(w)
        acc += tl.load(s + f) * _acosh_1p2u(u, r)
        p_ptr += D1 * N
        q_ptr += D1 * M
    offsets = rows.to(tl.int64)[:, None] * M + cols[None, :]
    tl.store(out + offsets, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _l1_backward_kernel(
    Pt, Qt, s, r_floor_ptr, grad, gPt, gQ_part, gs_part, N, M, ROW_TILES,
    D1: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    NEED_P: tl.constexpr, NEED_Q: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (row group, factor f): for each of the group's row tiles, ``w`` once per column
    tile; ``dP_f`` of the tile's rows (``-s_f G Q_f``, over all columns, written once), the
    group's partial ``G^T P_f`` of every column (``gQ_part[group, f]``, zeros on entry, unscaled;
    the caller adds the groups and scales by ``-s_f``) and its share of ``ds_f``. Each output element is written
    by one program (no atomics): the gradients do not depend on scheduling."""
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    f = tl.program_id(1).to(tl.int64)
    k = tl.num_programs(1)
    dd = tl.arange(0, BD)
    d_ok = dd < D1
    p_ptr = Pt + f * (D1 * N)
    q_ptr = Qt + f * (D1 * M)
    part = gQ_part + (group * k + f) * (D1 * M)
    r_floor = tl.load(r_floor_ptr)
    inv_floor = 1.0 / r_floor
    minus_s = -tl.load(s + f)
    gs = tl.zeros((BLOCK_N,), dtype=Pt.dtype.element_ty)
    for tile in range(group, ROW_TILES, groups):
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        g_rows = grad + rows.to(tl.int64)[:, None] * M
        acc = tl.zeros((BLOCK_N, BD), dtype=Pt.dtype.element_ty)
        if NEED_Q:
            p = tl.load(
                p_ptr + dd[None, :] * N + rows[:, None],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BD]
        for m0 in range(0, M, BLOCK_M):
            cols = m0 + tl.arange(0, BLOCK_M)
            col_ok = cols < M
            w = _minus_gram(p_ptr, q_ptr, rows, cols, row_ok, col_ok, N, M, D1)
            u = tl.maximum(w, 0.0)
            uu = u + u * u
            r = tl.sqrt(uu)
            g = tl.load(g_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            gs += tl.sum(g * _acosh_1p2u(u, r), axis=1)
            # g / max(r, r_floor) without a division (1 / sqrt(0) = inf meets the floor)
            G = tl.where(u > 0.0, g * tl.minimum(tl.rsqrt(uu), inv_floor), 0.0)
            if NEED_P:
                q = tl.load(
                    q_ptr + dd[None, :] * M + cols[:, None],
                    mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )  # [BLOCK_M, BD]
                acc = tl.dot(G, q, acc, input_precision=PRECISION, out_dtype=acc.dtype)
            if NEED_Q:
                dq = tl.dot(tl.trans(G), p, input_precision=PRECISION, out_dtype=acc.dtype)
                ptrs = part + dd[None, :] * M + cols[:, None]
                ok = col_ok[:, None] & d_ok[None, :]
                # the partial starts at zero and each of the group's tiles adds to it (this
                # program alone owns these entries; the barrier orders one tile's store before
                # the next one's load whichever thread holds an entry)
                dq += tl.load(ptrs, mask=ok, other=0.0)
                tl.store(ptrs, dq, mask=ok)
                tl.debug_barrier()
        if NEED_P:
            g_ptr = gPt + f * (D1 * N) + dd[None, :] * N + rows[:, None]
            tl.store(g_ptr, minus_s * acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(gs_part + f * groups + group, tl.sum(gs, axis=0))


def _on(device: torch.device):  # noqa: ANN202
    """Launch on the tensors' GPU (Triton launches on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _launch(dtype: torch.dtype, kernel: str) -> dict:
    """Launch options of one kernel (FMA contraction explicit: Triton 3.9 warns if left unset)."""
    num_warps, num_stages = LAUNCH[dtype][kernel]
    return {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}


def _dot_width(width: int) -> int:
    """The coordinate axis padded for ``tl.dot`` (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(width))


# The launches as two ``torch.library`` custom ops with their autograd formula, as the CPU
# kernels: under ``torch.compile`` they are opaque ops with known output shapes (Dynamo neither
# traces the launch nor has to infer which pointers the kernels write through).


@torch.library.custom_op("curvalign::l1_triton_forward", mutates_args=())
def _triton_forward(Pt: Tensor, Qt: Tensor, s: Tensor, block_n: int, block_m: int) -> Tensor:
    """``Pt: [k, D1, N]``, ``Qt: [k, D1, M]``, ``s: [k]`` -> ``[N, M]``; see the module
    docstring."""
    k, width, N = Pt.shape
    M = Qt.shape[2]
    out = Pt.new_zeros(N, M)
    if N and M:
        grid = (triton.cdiv(N, block_n) * triton.cdiv(M, block_m),)
        with _on(Pt.device):
            _l1_forward_kernel[grid](
                Pt, Qt, s, out, N, M, k, D1=width, BLOCK_N=block_n, BLOCK_M=block_m,
                **_launch(Pt.dtype, "forward"),
            )  # fmt: skip
    return out


@_triton_forward.register_fake
def _(Pt: Tensor, Qt: Tensor, s: Tensor, block_n: int, block_m: int) -> Tensor:
    return Pt.new_empty(Pt.shape[2], Qt.shape[2])


@torch.library.custom_op("curvalign::l1_triton_backward", mutates_args=())
def _triton_backward(
    grad: Tensor,
    Pt: Tensor,
    Qt: Tensor,
    s: Tensor,
    block_n: int,
    block_m: int,
    need_p: bool,
    need_q: bool,
    need_s: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dL/dPt``, ``dL/dQt``, ``dL/ds`` (each empty where not needed)."""
    k, width, N = Pt.shape
    M = Qt.shape[2]
    w0 = eps(Pt.dtype)
    # the reference's floor of dacosh/dw (lorentz._PairwiseAcosh.backward), in the dtype
    r_floor = Pt.new_full((1,), math.sqrt(w0 * (1.0 + w0)))
    grad = grad.to(Pt.dtype).contiguous()
    gPt = torch.zeros_like(Pt) if need_p else Pt.new_empty(0)
    gQt = torch.zeros_like(Qt) if need_q else Qt.new_empty(0)
    gs = torch.zeros_like(s) if need_s else s.new_empty(0)
    if not (N and M):
        return gPt, gQt, gs
    bd = _dot_width(width)
    with _on(Pt.device):
        row_tiles = triton.cdiv(N, block_n)
        groups = min(row_tiles, ROW_GROUPS)
        part = Pt.new_zeros(groups, k, width, M) if need_q else Pt.new_empty(0)
        gs_part = Pt.new_empty(k, groups)
        _l1_backward_kernel[(groups, k)](
            Pt, Qt, s, r_floor, grad, gPt if need_p else Pt.new_empty(0), part, gs_part,
            N, M, row_tiles, D1=width, BD=bd, BLOCK_N=block_n, BLOCK_M=block_m,
            NEED_P=need_p, NEED_Q=need_q, PRECISION=DOT_PRECISION[Pt.dtype],
            **_launch(Pt.dtype, "backward"),
        )  # fmt: skip
        if need_q:
            gQt = part.sum(0) * (-s)[:, None, None]
        if need_s:
            gs = gs_part.to(torch.float64).sum(1).to(Pt.dtype)
    return gPt, gQt, gs


@_triton_backward.register_fake
def _(grad, Pt, Qt, s, block_n, block_m, need_p, need_q, need_s):  # noqa: ANN001, ANN202
    return tuple(
        torch.empty_like(t) if need else t.new_empty(0)
        for t, need in ((Pt, need_p), (Qt, need_q), (s, need_s))
    )


def _triton_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    Pt, Qt, s, block_n, block_m = inputs
    ctx.save_for_backward(Pt, Qt, s)
    ctx.blocks = (block_n, block_m)


def _triton_grad(ctx, grad):  # noqa: ANN001, ANN202
    Pt, Qt, s = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:3])
    grads = _triton_backward(grad, Pt, Qt, s, *ctx.blocks, *needs)
    return (*(g if need else None for g, need in zip(grads, needs, strict=True)), None, None)


_triton_forward.register_autograd(_triton_grad, setup_context=_triton_setup)


def l1_pairwise_dist_triton(
    X: Tensor, Y: Tensor, c: Tensor, blocks: tuple[int, int] | None = None
) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> ``[N, M]``.

    The sum over factors of the Lorentz distances, as the reference
    ``factor_pairwise_dist(X, Y, c, reduce_sum=True)``. ``blocks``: ``(BLOCK_N, BLOCK_M)``,
    powers of two >= 16 (default :data:`BLOCKS`; the tests use 16 x 16 so that small inputs
    span several tiles). Call :func:`ready` first on a GPU.
    """
    from curvalign.geometry.lorentz import minkowski_operands

    k, width = X.shape[0], X.shape[2] + 1
    if width > MAX_WIDTH:
        raise ValueError(f"X: factor width d = {width - 1} is above the kernel's {MAX_WIDTH - 1}")
    if X.dtype not in LAUNCH:
        raise TypeError(f"X: expected float32 or float64, got {X.dtype}")
    blocks = blocks or BLOCKS
    for b in blocks:
        if b < 16 or b & (b - 1):
            raise ValueError(f"blocks: expected powers of two >= 16, got {blocks}")
    c = c.reshape(-1).expand(k)
    P, Q = minkowski_operands(X, Y, c)  # [k, N, d+1], [k, M, d+1], with autograd
    Pt = P[..., :width].transpose(1, 2).contiguous()  # [k, d+1, N]
    Qt = Q[..., :width].transpose(1, 2).contiguous()  # [k, d+1, M]
    s = torch.rsqrt(c).contiguous()
    return _triton_forward(Pt, Qt, s, *blocks)


_READY: dict[tuple[str, torch.dtype, int], bool] = {}


def ready(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether the kernels run here: compiled once per (device, dtype, width) on a tiny problem.

    The first call logs that Triton is compiling (a few seconds; Triton caches the result on
    disk, ``~/.triton/cache``). Any failure warns once and returns False (the caller then uses
    the eager reference).
    """
    key = (str(device), dtype, width)
    if key not in _READY:
        _log.warning(
            "curvalign: compiling the Triton l1-product kernels for %s, %s, d + 1 = %d "
            "(first use in this process; Triton caches them on disk)",
            device,
            dtype,
            width,
        )
        try:
            g = torch.Generator().manual_seed(0)
            X = (0.3 * torch.randn(2, 3, width - 1, generator=g, dtype=dtype)).to(device)
            Y = (0.3 * torch.randn(2, 5, width - 1, generator=g, dtype=dtype)).to(device)
            c = torch.tensor([0.5, 2.0], dtype=dtype, device=device).requires_grad_()
            X.requires_grad_()
            Y.requires_grad_()
            out = l1_pairwise_dist_triton(X, Y, c)
            grads = torch.autograd.grad(out.sum(), (X, Y, c))
            ok = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
            if not ok:
                raise RuntimeError("non-finite result on a finite probe")
            _READY[key] = True
        except Exception as exc:  # noqa: BLE001 - any failure here means: use the reference
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            warnings.warn(
                f"curvalign: the Triton l1-product kernels do not run on {device} ({reason}); "
                "using the eager reference (slower, same values)",
                RuntimeWarning,
                stacklevel=3,
            )
            _READY[key] = False
    return _READY[key]


def compile_for(
    arch: int, dtype: torch.dtype = torch.float32, width: int = 9, blocks: tuple[int, int] = BLOCKS
) -> dict[str, object]:
    """Compile the three kernels ahead of time for CUDA compute capability ``arch`` (e.g. 90).

    Needs no GPU (Triton's wheel carries ``ptxas``): the tests use it to check that the real
    compiler, not only the CPU interpreter, accepts the kernels, and
    ``benchmarks/gpu_l1.py --ptxas`` to report their registers and spills. Returns Triton's
    compiled kernels by name (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = "*fp32" if dtype == torch.float32 else "*fp64"
    bn, bm = blocks
    sizes = {"N": "i32", "M": "i32"}
    consts = {"D1": width, "BLOCK_N": bn, "BLOCK_M": bm}
    bwd_consts = {**consts, "BD": _dot_width(width)}
    jobs: dict[str, tuple[Any, list[str], dict[str, str], dict[str, Any]]] = {
        "forward": (_l1_forward_kernel, ["Pt", "Qt", "s", "out"], {**sizes, "K": "i32"}, consts),
        "backward": (_l1_backward_kernel,
                     ["Pt", "Qt", "s", "r_floor_ptr", "grad", "gPt", "gQ_part", "gs_part"],
                     {**sizes, "ROW_TILES": "i32"},
                     {**bwd_consts, "NEED_P": True, "NEED_Q": True,
                      "PRECISION": DOT_PRECISION[dtype]}),
    }  # fmt: skip
    target = GPUTarget("cuda", arch, 32)
    compiled = {}
    for name, (fn, pointers, ints, constexprs) in jobs.items():
        signature = {p: ptr for p in pointers} | ints | {c: "constexpr" for c in constexprs}
        options = _launch(dtype, name)
        compiled[name] = triton.compile(
            ASTSource(fn, signature, constexprs=constexprs),
            target=target,
            options=options,
        )
    return compiled
