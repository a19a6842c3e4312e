"""Atomic writes: single files (temp file + fsync + rename) and whole result directories
(feature stores, embeddings, indexes). A reader sees the old version or the new one, never a
partial write."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def replace_directory(tmp: Path, target: Path) -> None:
    """Put the fully written directory ``tmp`` at ``target``, replacing what was there.

    A reader sees either the old directory or the new one, never a half-written mix: the old one
    is moved aside, the new one renamed into place (both atomic on one file system), and only
    then is the old one removed. Callers decide beforehand whether ``target`` may be replaced.
    """
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield an empty sibling directory of ``target`` to write into; when the block ends normally
    it replaces ``target`` (``replace_directory``), when it raises it is removed and ``target``
    is left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, fsync it, then move it onto
    ``path``. On any error the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """``path.write_text(text)``, atomically (``atomic_write``)."""
    atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``path.write_bytes(data)``, atomically (``atomic_write``)."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
