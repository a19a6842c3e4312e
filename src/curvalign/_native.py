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
from typing import TypeVar

import torch
from torch import Tensor

#: the attribute ``torch.compiler.assume_constant_result`` sets (torch 2.x); checked against it by
#: tests/test_native_build.py, so a torch that marks functions differently fails a test
_DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"


_F = TypeVar("_F", bound=Callable[..., object])


def constant_under_compile(fn: _F) -> _F:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it (its answer is taken
    once, when a graph is traced), without importing ``torch._dynamo`` at import time: the public
    decorator imports it, which costs about two seconds of every curvalign process's start,
    although only a ``torch.compile`` ever reads the mark (and has imported Dynamo by then)."""
    setattr(fn, _DYNAMO_CONSTANT_MARK, True)
    return fn


__all__ = ["NativeKernel", "UnsafeCacheError", "cache_dir", "check_cache_dir", "enabled"]

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


class UnsafeCacheError(RuntimeError):
    """A kernel cache directory that others could write into (a library there is not loaded)."""


def check_cache_dir(directory: Path) -> None:
    """Raise ``UnsafeCacheError`` unless ``directory`` belongs to this user and no one else may
    write into it: a library another user can plant there would run as this user when loaded."""
    info = directory.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeCacheError(
            f"the kernel cache {directory} belongs to another user (uid {info.st_uid}); set "
            "TORCH_EXTENSIONS_DIR to a directory of your own"
        )
    if info.st_mode & 0o022:
        raise UnsafeCacheError(
            f"the kernel cache {directory} is writable by others (mode "
            f"{info.st_mode & 0o777:o}); run `chmod go-w {directory}` or set TORCH_EXTENSIONS_DIR "
            "to a private directory"
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _write_digest(library: Path, digest: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".sha256", dir=library.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(digest + "\n")
    os.replace(tmp, _digest_file(library))


def foreign_library(library: Path) -> str | None:
    """Why the cached ``library`` must not be loaded (None when it may): it is writable by
    others, belongs to someone else, or its SHA-256 is not the one this user's build recorded."""
    info = library.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"it belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o022:
        return f"it is writable by others (mode {info.st_mode & 0o777:o})"
    try:
        recorded = _digest_file(library).read_text().strip()
    except OSError:
        return "no build record: curvalign did not build it"
    if recorded != _sha256(library):
        return "its SHA-256 differs from the one recorded when it was built"
    return None


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
        self._ready = constant_under_compile(ready)

    def target(self) -> Path:
        """The cached library's path: named by the hash of source, headers, compiler and flags."""
        compiler = os.environ.get("CXX") or "g++"
        flags = compile_flags()
        source = b"".join(path.read_bytes() for path in (self.source, *self.headers))
        key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        tag = "avx2" if "-mavx2" in flags else "generic"
        return cache_dir() / f"{self.name}_{tag}_{key}.so"

    def build(self) -> Path:
        """Compile the source into the cache (once per source, flags and compiler); its path.

        A cached library is used only when the cache directory and the file are safe (see
        ``check_cache_dir``) and the file's SHA-256 is the one recorded beside it when this
        user's build wrote it (``NAME.so.sha256``); anything else is rebuilt, never loaded."""
        compiler = os.environ.get("CXX") or "g++"
        target = self.target()
        if target.exists():
            check_cache_dir(target.parent)
            refused = foreign_library(target)
            if refused is None:
                return target
            if _digest_file(target).exists() or "no build record" not in refused:
                warnings.warn(
                    f"curvalign: not loading {target} ({refused}); rebuilding the {self.what}",
                    RuntimeWarning,
                    stacklevel=4,
                )
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
        flags = compile_flags()
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_cache_dir(target.parent)
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
            digest = _sha256(Path(tmp))
            _write_digest(target, digest)
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
