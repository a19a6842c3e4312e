"""Native CPU kernels: plain C++ sources compiled on first use, cached, loaded with ``ctypes``.

A kernel here is a C++ file behind an ``extern "C"`` interface (no torch headers: a
``torch.utils.cpp_extension`` module took 80 s to compile on the development machine, a plain
source takes about 2 s). :class:`NativeKernel` compiles it once with the system compiler
(``$CXX`` or ``g++``) into ``$TORCH_EXTENSIONS_DIR/curvalign`` (default
``~/.cache/torch_extensions/curvalign``) under a name made of the source's hash, the compiler
and the flags, so a cache shared between machines never hands an AVX2 build to a CPU without it
nor a stale build to an edited source; later processes load the cached library. OpenMP resolves
to the ``libgomp`` torch has loaded. ``CURVALIGN_FUSED=0`` turns every kernel off; a failed
build warns once and the caller falls back to its eager reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["NativeKernel", "cache_dir", "enabled"]

_log = logging.getLogger(__name__)


def enabled() -> bool:
    """False when ``CURVALIGN_FUSED`` is set to ``0`` / ``false`` / ``no`` / ``off``."""
    return os.environ.get("CURVALIGN_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def isa_flags() -> list[str]:
    """``-mavx2 -mfma`` where torch reports an AVX2 (or AVX-512) CPU, else nothing."""
    capability = torch.backends.cpu.get_cpu_capability()
    return ["-mavx2", "-mfma"] if capability in ("AVX2", "AVX512") else []


def cache_dir() -> Path:
    """Where built kernels are kept: ``$TORCH_EXTENSIONS_DIR/curvalign`` or the torch default."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    return Path(base) / "curvalign"


def compile_flags() -> list[str]:
    # -fno-math-errno and -fno-trapping-math let gcc vectorise sqrt and the selects (no
    # -ffast-math: inf and NaN must keep their meaning).
    return [
        "-std=c++17",
        "-O3",
        "-fno-math-errno",
        "-fno-trapping-math",
        "-fopenmp",
        "-fPIC",
        "-shared",
        *isa_flags(),
    ]


class NativeKernel:
    """One C++ source, built on first use and bound by ``bind`` (which sets ``argtypes``).

    ``name`` prefixes the cached file; ``what`` names the kernel in the one-time log message
    and in the warning of a failed build (e.g. ``"fused l1-product kernel"``); ``headers`` are
    the files the source includes (next to it): they enter the cache key with the source, so
    an edited header never serves a stale build.
    """

    def __init__(
        self,
        source: Path,
        name: str,
        what: str,
        bind: Callable[[ctypes.CDLL], None],
        headers: Sequence[Path] = (),
    ) -> None:
        self.source, self.name, self.what, self._bind = source, name, what, bind
        self.headers = tuple(headers)
        self._lock = threading.Lock()
        self.library: ctypes.CDLL | None = None
        self.failed: str | None = None

        def ready() -> bool:
            return enabled() and self.load() is not None

        # Under torch.compile the answer is taken once, when the graph is traced (Dynamo cannot
        # trace the build's lock, and the kernel's ops are opaque to it anyway): the switch and
        # a first build happen at compile time, not as a graph break.
        self._ready = torch.compiler.assume_constant_result(ready)

    def build(self) -> Path:
        """Compile the source into the cache (once per source, flags and compiler); its path."""
        compiler = os.environ.get("CXX") or "g++"
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
        flags = compile_flags()
        source = b"".join(path.read_bytes() for path in (self.source, *self.headers))
        key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        tag = "avx2" if "-mavx2" in flags else "generic"
        target = cache_dir() / f"{self.name}_{tag}_{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        _log.warning(
            "curvalign: compiling the %s once (a few seconds), cached in %s",
            self.what,
            target.parent,
        )
        # Built under a temporary name and renamed: concurrent processes never load a partial file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            run = subprocess.run(
                [compiler, *flags, "-o", tmp, str(self.source)], capture_output=True, text=True
            )
            if run.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[:500]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def load(self) -> ctypes.CDLL | None:
        """The compiled library, building it on first use; ``None`` (one warning) if that fails."""
        if self.library is not None or self.failed is not None:
            return self.library
        with self._lock:
            if self.library is None and self.failed is None:
                try:
                    lib = ctypes.CDLL(str(self.build()))
                    self._bind(lib)
                    self.library = lib
                except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                    self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    warnings.warn(
                        f"curvalign: the {self.what} could not be built ({self.failed}); "
                        "using the eager reference (slower, same values)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        return self.library

    def reset(self) -> None:
        """Forget the loaded library and any failure (tests use it to rebuild)."""
        self.library, self.failed = None, None

    def available(self, *tensors: Tensor) -> bool:
        """Whether the kernel applies: every tensor on CPU in float32/64, enabled, built.

        Under ``torch.compile``, ``CURVALIGN_FUSED`` is read when the graph is traced.
        """
        for t in tensors:
            if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
                return False
        return self._ready()
