"""Fused CPU kernel for the l1-product distance (PHyCLIP), forward and backward.

:func:`l1_pairwise_dist_fused` computes exactly what the reference
(:func:`curvalign.geometry.lorentz.factor_pairwise_dist` with ``reduce_sum``) computes, from the
same time-augmented operands ``P = (c/2) [x, t_x]``, ``Q = [y, -t_y]`` and ``s = 1/sqrt(c)``
(built with autograd, so the gradients w.r.t. ``X``, ``Y`` and ``c`` flow through them), but in
one C++ loop per pass (``_l1_kernel.cpp``): ``k`` inner products of ``d + 1`` terms per pair as
vector FMAs on a cache-friendly layout (rows ``[N, k, d+1]``, columns interleaved by 8), the
``log1p`` written out so that it vectorises, and the backward recomputing each ``w`` instead of
storing ``[k, N, M]``.

The kernel is plain C++ behind an ``extern "C"`` interface (no torch headers), compiled on
first use by the system C++ compiler (``$CXX`` or ``g++``, about 2 s) into a shared library
loaded with ``ctypes`` and cached under ``$TORCH_EXTENSIONS_DIR/curvalign`` (default
``~/.cache/torch_extensions/curvalign``); later processes load the cached library. OpenMP
resolves to the ``libgomp`` torch has loaded, and the kernel uses ``torch.get_num_threads()``
threads. ``-mavx2 -mfma`` are added only when torch reports an AVX2-capable CPU, and the flags
and the source's hash are part of the library's name, so a cache shared between machines never
hands an AVX2 build to a CPU without it nor a stale build to an edited source.
``CURVALIGN_FUSED=0`` turns the kernel off; a failed build warns once and the caller falls back
to the eager reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from curvalign.geometry._numerics import eps

__all__ = ["available", "enabled", "l1_pairwise_dist_fused", "load_kernel"]

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("_l1_kernel.cpp")
_LANES = 8  # columns per interleaved block (L in the C++ source)
_MAX_WIDTH = 64  # d + 1 the kernel accepts (its stack buffers)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed: str | None = None


def enabled() -> bool:
    """False when ``CURVALIGN_FUSED`` is set to ``0`` / ``false`` / ``no`` / ``off``."""
    return os.environ.get("CURVALIGN_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def _isa_flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return ["-mavx2", "-mfma"] if capability in ("AVX2", "AVX512") else []


def cache_dir() -> Path:
    """Where built kernels are kept: ``$TORCH_EXTENSIONS_DIR/curvalign`` or the torch default."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    return Path(base) / "curvalign"


def _build() -> Path:
    """Compile the kernel into the cache (once per source, flags and compiler); its path."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
    # -fno-math-errno and -fno-trapping-math let gcc vectorise sqrt and the selects (no
    # -ffast-math: inf and NaN must keep their meaning).
    flags = [
        "-std=c++17",
        "-O3",
        "-fno-math-errno",
        "-fno-trapping-math",
        "-fopenmp",
        "-fPIC",
        "-shared",
    ]
    flags += _isa_flags()
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    tag = "avx2" if "-mavx2" in flags else "generic"
    target = cache_dir() / f"l1_{tag}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _log.warning(
        "curvalign: compiling the fused l1-product kernel once (a few seconds), cached in %s",
        target.parent,
    )
    # Built under a temporary name and renamed: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [compiler, *flags, "-o", tmp, str(_SOURCE)], capture_output=True, text=True
        )
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for suffix in ("f32", "f64"):
        fwd = getattr(lib, f"curvalign_l1_forward_{suffix}")
        fwd.argtypes = [p, p, p, p, i64, i64, i64, i64, i32]
        fwd.restype = None
        bwd = getattr(lib, f"curvalign_l1_backward_{suffix}")
        bwd.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, f64, i32]
        bwd.restype = None
    return lib


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; ``None`` (one warning) if that fails."""
    global _library, _failed
    if _library is not None or _failed is not None:
        return _library
    with _lock:
        if _library is None and _failed is None:
            try:
                _library = _bind(_build())
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                _failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                warnings.warn(
                    "curvalign: the fused l1-product kernel could not be built "
                    f"({_failed}); using the eager reference (slower, same values)",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _library


def available(*tensors: Tensor) -> bool:
    """Whether the fused kernel applies to these tensors (enabled, CPU, float32/64, built)."""
    if not enabled():
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
            return False
    return load_kernel() is not None


def _suffix(dtype: torch.dtype) -> str:
    return "f32" if dtype == torch.float32 else "f64"


class _FusedL1(torch.autograd.Function):
    """``[N, k, D1]``, ``[Mb, k, D1, 8]``, ``[k]`` -> ``[N, M]``; see the module docstring."""

    @staticmethod
    def forward(ctx, P: Tensor, Qi: Tensor, s: Tensor, M: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(P, Qi, s)
        assert _library is not None
        N, k, width = P.shape
        out = P.new_empty(N, M)
        getattr(_library, f"curvalign_l1_forward_{_suffix(P.dtype)}")(
            P.data_ptr(), Qi.data_ptr(), s.data_ptr(), out.data_ptr(),
            N, M, k, width, torch.get_num_threads(),
        )  # fmt: skip
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        P, Qi, s = ctx.saved_tensors
        w0 = eps(P.dtype)
        r_floor = math.sqrt(w0 * (1.0 + w0))  # as the reference's _PairwiseAcosh.backward
        assert _library is not None
        N, k, width = P.shape
        grad = grad.to(P.dtype).contiguous()
        gP, gQ, gs = torch.empty_like(P), torch.empty_like(Qi), torch.empty_like(s)
        getattr(_library, f"curvalign_l1_backward_{_suffix(P.dtype)}")(
            P.data_ptr(), Qi.data_ptr(), s.data_ptr(), grad.data_ptr(),
            gP.data_ptr(), gQ.data_ptr(), gs.data_ptr(),
            N, grad.shape[1], k, width, r_floor, torch.get_num_threads(),
        )  # fmt: skip
        return gP, gQ, gs, None


def l1_pairwise_dist_fused(X: Tensor, Y: Tensor, c: Tensor) -> Tensor:
    """``X: [k, N, d]``, ``Y: [k, M, d]`` (working dtype, any strides), ``c: [k]`` -> ``[N, M]``.

    The sum over factors of the Lorentz distances, as the reference
    ``factor_pairwise_dist(X, Y, c, reduce_sum=True)``. Call :func:`available` first.
    """
    from curvalign.geometry.lorentz import _minkowski_operands

    k, width = X.shape[0], X.shape[2] + 1
    M = Y.shape[1]
    if width > _MAX_WIDTH:
        raise ValueError(
            f"X: factor width d = {width - 1} is above the fused kernel's {_MAX_WIDTH - 1}"
        )
    c = c.reshape(-1).expand(k)
    P, Q = _minkowski_operands(X, Y, c)  # [k, N, d+1], [k, M, d+1], with autograd
    P = P[..., :width].transpose(0, 1).contiguous()  # rows [N, k, d+1]
    Mb = -(-M // _LANES)
    Q = Q[..., :width]
    if Mb * _LANES != M:
        Q = torch.cat([Q, Q.new_zeros(k, Mb * _LANES - M, width)], 1)
    Qi = Q.reshape(k, Mb, _LANES, width).permute(1, 0, 3, 2).contiguous()  # [Mb, k, d+1, 8]
    s = torch.rsqrt(c).contiguous()
    return _FusedL1.apply(P, Qi, s, M)
