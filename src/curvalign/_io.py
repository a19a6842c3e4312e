"""Writing results safely: atomic writes of single files (temp file + fsync + rename) and whole
result directories (feature stores, embeddings, indexes), so a reader sees the old version or
the new one, never a partial write; output checks before any work; file modes that follow the
umask; stale temporary directories of killed writers; SHA-256 checksums of written files."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from curvalign.errors import CurvalignError, DamagedFileError


class OutputError(CurvalignError, ValueError):
    """An output location that cannot be written, or a write that failed midway."""


# --- modes that follow the umask --------------------------------------------------------------


def _umask() -> int:
    # os.umask can only be read by setting it; set it straight back (a few instructions apart)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def mode_for_new_file() -> int:
    """The mode ``open()`` gives a new file under the current umask (0644 under umask 022);
    ``tempfile.mkstemp`` would give 0600 whatever the umask."""
    return 0o666 & ~_umask()


def mode_for_new_dir() -> int:
    """The mode ``mkdir`` gives a new directory under the current umask (0755 under 022)."""
    return 0o777 & ~_umask()


def temp_file_beside(path: Path) -> Path:
    """An empty temporary file next to ``path`` (same file system, so ``os.replace`` onto
    ``path`` is atomic), with the mode an ordinary new file would get."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode_for_new_file())
    finally:
        os.close(fd)
    return Path(name)


# --- checks before any work -------------------------------------------------------------------


def check_output_location(path: str | os.PathLike[str], what: str = "output") -> None:
    """Raise ``OutputError`` (one line naming ``path`` and what is wrong) unless ``path`` could
    be created or written: it is a directory or does not exist yet, no parent is a file, and the
    nearest existing parent accepts a new file (probed by creating and removing one).

    Call it before expensive work so that a bad ``--out`` fails in a second, not after the data
    was built."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise OutputError(f"{what} {target} exists and is not a directory")
    probe_dir = target if target.is_dir() else None
    if probe_dir is None:
        parent = target.parent
        while not parent.exists():
            if parent == parent.parent:
                break
            parent = parent.parent
        if not parent.is_dir():
            raise OutputError(f"{what} {target} cannot be created: {parent} is not a directory")
        probe_dir = parent
    try:
        fd, name = tempfile.mkstemp(prefix=".curvalign-write-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise OutputError(
            f"{what} {target} is not writable: cannot create a file in {probe_dir} "
            f"({err.strerror or err})"
        ) from None


#: errno values that mean "this location cannot take the write" (not a bug, not bad input)
WRITE_FAILURES = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)


def describe_write_failure(err: OSError, path: Path | str) -> str:
    """``err`` (raised while writing under ``path``) as words for the user."""
    reason = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EFBIG: "file too large for the file system",
    }.get(err.errno or -1, err.strerror or str(err))
    if isinstance(err, NoSpaceError):
        reason += f" ({err.detail})"
    where = err.filename or path
    return f"writing {where} failed: {reason}"


class NoSpaceError(OSError):
    """ENOSPC found before writing: ``detail`` says how much was needed and how much is free."""

    def __init__(self, path: Path | str, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.detail = f"{_mib(needed)} needed, {_mib(free)} free"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_free_space(path: Path, needed: int) -> None:
    """Raise ``NoSpaceError`` when the file system holding ``path`` (a file to be written, or a
    directory) has fewer than ``needed`` bytes free: a full disk is said before the write, not
    found by a signal from a memory map midway."""
    where = path if path.is_dir() else path.parent
    free = shutil.disk_usage(where).free
    if free < needed:
        raise NoSpaceError(path, needed, free)


class NpyRowWriter:
    """A ``.npy`` file of ``shape`` (float32 by default) written in row blocks, in order, with
    plain ``write`` calls: a full disk is an ``OSError`` (ENOSPC), where a memory map
    (``np.lib.format.open_memmap``) takes SIGBUS and kills the process. The file's size is
    checked against the free space first (``check_free_space``).

    ``writer[start:stop] = rows`` appends ``rows`` (``start`` must be the number of rows written
    so far), as a memory map would be assigned; ``flush()`` closes the file. ``sha256()`` is
    the digest of the bytes written, kept as they are written: recording it does not read the
    file back (from disk, once a file larger than the free page cache was evicted)."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: str = "float32") -> None:
        import numpy as np

        self.path, self.shape, self.dtype = Path(path), tuple(shape), np.dtype(dtype)
        self.rows = 0
        header: dict[str, object] = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": self.shape,
        }
        row_items = int(np.prod(self.shape[1:], dtype=np.int64))
        check_free_space(self.path, self.shape[0] * row_items * self.dtype.itemsize + 4096)
        self._handle = open(self.path, "wb")  # noqa: SIM115 - closed by flush()
        self._digest = hashlib.sha256()
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, header)
        self._write(head.getvalue())

    def __setitem__(self, rows: slice, value: object) -> None:
        import numpy as np

        if rows.start != self.rows:
            raise ValueError(f"{self.path}: rows must be written in order (at {self.rows})")
        block = np.ascontiguousarray(value, dtype=self.dtype)
        if block.shape[1:] != self.shape[1:] or self.rows + len(block) > self.shape[0]:
            raise ValueError(
                f"{self.path}: a block of shape {block.shape} does not fit {self.shape}"
            )
        self._write(block.tobytes())
        self.rows += len(block)

    def _write(self, data: bytes) -> None:
        self._handle.write(data)
        self._digest.update(data)

    def sha256(self) -> str:
        """Hex SHA-256 of every byte written so far (the whole file once ``flush``ed)."""
        return self._digest.hexdigest()

    def flush(self) -> None:
        """Close the file (every row must have been written)."""
        if self._handle.closed:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        if self.rows != self.shape[0]:
            raise ValueError(f"{self.path}: {self.rows} of {self.shape[0]} rows written")

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and not handle.closed:
            handle.close()


# --- stale temporary directories --------------------------------------------------------------

_OWNER_FILE = ".owner-pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove temporary siblings of ``target`` (``.NAME.tmp-*``, ``.NAME.old-*``) left by a
    process that was killed while writing ``target``; a directory whose writer is still
    running (its pid file names a live process) is kept. Returns what was removed."""
    target = Path(target)
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            if not stale.is_dir() or stale.is_symlink():
                continue
            owner = stale / _OWNER_FILE
            try:
                pid = int(owner.read_text().strip())
            except (OSError, ValueError):
                pid = None
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                continue
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt (see ``terminate_as_interrupt``)."""


def remove_stale_temp_files(directory: Path, names: tuple[str, ...]) -> list[Path]:
    """Remove ``.NAME.*.tmp`` files in ``directory`` (what ``atomic_write`` leaves when its
    process is killed mid-write) for each of ``names``. Call it only where no other process
    writes those names (a run directory belongs to one trainer). Returns what was removed."""
    removed = []
    for name in names:
        for stale in Path(directory).glob(f".{name}.*.tmp"):
            if stale.is_file() and not stale.is_symlink():
                stale.unlink(missing_ok=True)
                removed.append(stale)
    return removed


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` (a KeyboardInterrupt, as Ctrl-C does),
    so ``finally`` and ``except`` blocks clean up before the process exits (a temporary
    directory is removed); outside the main thread a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- atomic directories -----------------------------------------------------------------------


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
    is left as it was.

    Temporaries of ``target`` left by a killed earlier writer are removed first; the new one
    gets the mode of an ordinary new directory (the umask's), and a write that fails for lack of
    space or permission raises ``OutputError`` saying that ``target`` was left unchanged."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, mode_for_new_dir())
        (tmp / _OWNER_FILE).write_text(str(os.getpid()))
        yield tmp
        (tmp / _OWNER_FILE).unlink()
        replace_directory(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno not in WRITE_FAILURES:
            raise
        kept = f"{target} is unchanged" if target.exists() else f"nothing was written at {target}"
        raise OutputError(f"{describe_write_failure(err, target)}; {kept}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- atomic files ---------------------------------------------------------------------------


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, fsync it, then move it onto
    ``path`` (with the mode the umask gives a new file). On any error the temporary file is
    removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_file_beside(path)
    try:
        write(tmp)
        os.chmod(tmp, mode_for_new_file())  # a writer may have recreated it with its own mode
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


# --- checksums --------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of the bytes of ``path`` (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_checksums(directory: Path, names: list[str] | None = None) -> dict[str, str]:
    """``{name: SHA-256}`` of ``names`` in ``directory`` (default: every plain, non-hidden
    file), to be recorded in the directory's description (``embedding.json``, ``index.json``)."""
    directory = Path(directory)
    if names is None:
        names = sorted(
            p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")
        )
    return {name: sha256_file(directory / name) for name in names}


def verify_file(path: Path, recorded: dict[str, str] | None, where: str, redo: str) -> None:
    """Raise ``DamagedFileError`` naming ``path`` when its SHA-256 differs from ``recorded[name]``
    (``where`` names the file that recorded it, ``redo`` says what writes it again). A file with
    no recorded digest (written by an older curvalign) is not checked. Call it before the file
    is deserialised."""
    path = Path(path)
    if not recorded or path.name not in recorded:
        return
    try:
        digest = sha256_file(path)
    except OSError as err:
        raise DamagedFileError(f"{path} cannot be read ({err.strerror or err}); {redo}") from None
    if digest != recorded[path.name]:
        raise DamagedFileError(
            f"{path} is damaged or was changed after it was written: its SHA-256 "
            f"{digest[:12]}... differs from the {recorded[path.name][:12]}... recorded in "
            f"{where}; {redo}"
        )


def read_json_file(path: Path, redo: str) -> object:
    """``json.loads`` of ``path``; a file that is not valid JSON (damaged, truncated) is one
    ``DamagedFileError`` naming it and ``redo`` (what writes it again)."""
    import json

    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedFileError(f"{path} is not valid JSON ({err}): damaged; {redo}") from None
