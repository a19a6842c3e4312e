"""Checking the files of an index or an embeddings directory without re-reading them each time.

A file is hashed (SHA-256) once, when it is written; its description (``index.json``,
``embedding.json``) records the digest and the file's size and modification time
(``file_stats``: ``{name: [bytes, mtime_ns]}``). Opening it compares size and modification
time with the recorded ones, which costs one ``stat``; only a file whose size or time differs,
or one opened with ``full=True``, is hashed again (and then named if its bytes changed). So
one ``index search`` costs what the search costs, not a read of every stored vector.

Why a changed file cannot keep its recorded time: the writer sets each file's modification
time two seconds into the past (whole seconds, which every file system stores) before it
records it, so any later write, which stamps the current time, differs from the record even on
a file system whose clock ticks coarsely. A copy that keeps times (``cp -p``, ``copytree``)
keeps the bytes too. A file whose recorded time was deliberately restored after its bytes were
changed is only caught by ``full=True``.

A digest checked in this process is remembered by (path, inode, size, mtime), so an index
copied without its times is hashed once per process, not once per call. Inside ``verifying()``
(``curvalign index search --verify``, ``index build --verify``) every file checked is hashed
whatever its size and time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from curvalign._io import verify_file
from curvalign.errors import DamagedFileError

#: key of ``index.json`` / ``embedding.json`` holding ``{name: [size, mtime_ns]}``
STATS_KEY = "file_stats"
#: how far into the past a written file's modification time is set (see the module docstring)
_BACKDATE_S = 2

_checked: dict[tuple[str, int, int, int], str] = {}
#: nesting depth of ``verifying()``: above 0, every ``check_file`` hashes the whole file
_verifying = 0


@contextmanager
def verifying() -> Iterator[None]:
    """Within it, ``check_file`` hashes every file it checks (as ``full=True``), however it
    was opened: the full check a user asks for with ``--verify``."""
    global _verifying
    _verifying += 1
    try:
        yield
    finally:
        _verifying -= 1


def seal_files(directory: Path, names: list[str]) -> dict[str, list[int]]:
    """Back-date ``names`` in ``directory`` (whole seconds, two in the past) and return their
    ``{name: [size, mtime_ns]}`` to record beside their SHA-256."""
    directory = Path(directory)
    stamp = (int(time.time()) - _BACKDATE_S) * 1_000_000_000
    out: dict[str, list[int]] = {}
    for name in names:
        path = directory / name
        os.utime(path, ns=(stamp, stamp))
        st = path.stat()
        out[name] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def check_file(
    path: Path,
    sha256: dict[str, str] | None,
    stats: dict[str, list[int]] | None,
    where: str,
    redo: str,
    *,
    full: bool = False,
) -> None:
    """Raise ``DamagedFileError`` naming ``path`` if it is not the file recorded in ``where``.

    A recorded size and modification time that match (and ``full`` false) pass without reading
    the file; otherwise its SHA-256 is compared with ``sha256[name]`` (``verify_file``). A file
    with no recorded digest (an older curvalign wrote it) is not checked.
    """
    path = Path(path)
    if not sha256 or path.name not in sha256:
        return
    full = full or _verifying > 0
    try:
        st = path.stat()
    except OSError as err:
        raise DamagedFileError(f"{path} cannot be read ({err.strerror or err}); {redo}") from None
    recorded = (stats or {}).get(path.name)
    now = [int(st.st_size), int(st.st_mtime_ns)]
    key = (str(path.resolve()), int(st.st_ino), now[0], now[1])
    if not full and (
        (recorded is not None and list(recorded) == now) or _checked.get(key) == sha256[path.name]
    ):
        return
    verify_file(path, sha256, where, redo)
    _checked[key] = sha256[path.name]


__all__ = ["STATS_KEY", "check_file", "seal_files", "verifying"]
