"""Sharded arrays read as one: embeddings split over many ``.npy`` files, memory-mapped in place.

clip-retrieval, img2dataset and most embedding dumps write ``[n_k, D]`` arrays shard by shard
(``img_emb_0.npy``, ``img_emb_1.npy``, ...). ``ShardedRows`` presents them as one ``[N, D]``
array without concatenating them: every shard stays a read-only memory map, a global row ``i``
lives in shard ``k = searchsorted(offsets, i, "right") - 1`` at local row ``i - offsets[k]``,
and only the rows asked for are read and copied. It has what the rest of curvalign asks of a
store's feature field: ``shape``, ``dtype``, ``dim()``, ``numel()``, ``is_floating_point()``,
``len()`` and ``rows[index]`` for an int, a slice, or a 1-D index tensor / array / list (a
boolean mask too), which returns a new ``torch.Tensor`` in the shards' dtype (float16 stays
float16). Operations on the whole array (``.float()``, arithmetic) are deliberately absent:
they would copy it all.

Kernel advice. A memory map's default read-ahead fits sequential reads: each page fault reads a
window of pages around it. A training sampler gathers scattered rows, and on a layout larger
than the page cache that window is read from disk for every row (for 1 KiB rows, hundreds of
times the bytes the batch needs). ``advise("random")`` (the sampler calls it) tells the kernel
(``madvise(MADV_RANDOM)``) to read only the page a row lies on; the rows drawn, and so the
batches, do not change. A gather of rows spread over more than ``SPARSE_GATHER`` times their
count (the runs sampled for a store's statistics, a validation subset) is advised as
random for that read whatever the shard's advice. A contiguous read of at least ``SEQUENTIAL_MIN_BYTES`` from one shard
(embedding, importing, scanning values: all go through ``rows[a:b]``) switches that shard to
``MADV_SEQUENTIAL`` for the copy and back to the advice it had afterwards, so those passes
keep a full read-ahead whatever the sampler asked.

``ParquetColumn`` does the same for one string column of sharded parquet files (captions,
URLs), read a shard at a time with pyarrow (an optional dependency: ``pip install
'curvalign[parquet]'``); only the row counts are read when it is opened.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvalign.errors import CurvalignError


class ShardError(CurvalignError, ValueError):
    """Shards that cannot be read as one array (missing, unreadable, mismatched widths)."""


#: contiguous reads of at least this many bytes from one shard are advised as sequential
SEQUENTIAL_MIN_BYTES = 1 << 20
#: a gather of rows spread over more than this many times their count is advised as random
SPARSE_GATHER = 16

_ADVICE = {
    "normal": getattr(mmap, "MADV_NORMAL", None),
    "random": getattr(mmap, "MADV_RANDOM", None),
    "sequential": getattr(mmap, "MADV_SEQUENTIAL", None),
}


def _file_map(array: np.ndarray) -> mmap.mmap | None:
    """The ``mmap`` under a memory-mapped numpy array (None for an array in memory)."""
    base: Any = array
    while base is not None:
        found = getattr(base, "_mmap", None)
        if isinstance(found, mmap.mmap):
            return found
        base = getattr(base, "base", None)
    return None


def _madvise(mapping: mmap.mmap, advice: int) -> None:
    """``mapping.madvise(advice)`` over the whole map (one place, so tests can watch it)."""
    mapping.madvise(advice)


def advise_array(array: np.ndarray, pattern: str) -> bool:
    """Advise the kernel of how a memory-mapped array will be read: ``"random"``,
    ``"sequential"`` or ``"normal"``. False (and nothing done) for an array in memory or a
    platform without ``madvise``."""
    if pattern not in _ADVICE:
        raise ValueError(f"access pattern {pattern!r}; expected one of {sorted(_ADVICE)}")
    mapping, flag = _file_map(array), _ADVICE[pattern]
    if mapping is None or flag is None or not hasattr(mapping, "madvise"):
        return False
    try:
        _madvise(mapping, flag)
    except (OSError, ValueError):  # a closed map or an unsupported flag: advice, not a must
        return False
    return True


def advise_rows(value: object, pattern: str) -> bool:
    """``advise`` a store field's rows when they are memory-mapped shards (``ShardedRows``) or a
    memory-mapped array; True when advice was given."""
    if isinstance(value, ShardedRows):
        return value.advise(pattern)
    if isinstance(value, np.ndarray):
        return advise_array(value, pattern)
    return False


_TORCH_DTYPES = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


class ShardedRows:
    """``[N, D]`` rows spread over memory-mapped ``[n_k, D]`` shards (see the module docstring)."""

    def __init__(self, shards: Sequence[np.ndarray], names: Sequence[str] | None = None) -> None:
        if not shards:
            raise ShardError("no shards given")
        names = list(names) if names is not None else [f"shard {k}" for k in range(len(shards))]
        if len(names) != len(shards):
            raise ShardError(f"{len(names)} names for {len(shards)} shards")
        first = shards[0]
        for name, shard in zip(names, shards, strict=True):
            if shard.ndim != 2:
                raise ShardError(
                    f"{name}: shape {list(shard.shape)}, a 2-D [rows, dim] array expected"
                )
            if shard.shape[1] != first.shape[1] or shard.dtype != first.dtype:
                raise ShardError(
                    f"{name}: {shard.dtype} [., {shard.shape[1]}] but {names[0]} is "
                    f"{first.dtype} [., {first.shape[1]}]; every shard must have one dtype and width"
                )
            if shard.dtype not in _TORCH_DTYPES:
                raise ShardError(
                    f"{name}: {shard.dtype} values; float16, float32 or float64 expected"
                )
        self.shards = list(shards)
        self.names = names
        #: check every row read for NaN/inf (O(rows read)), naming the shard file and row: set
        #: where the shards were opened without the full value scan
        self.check_values = False
        #: [S + 1] first global row of each shard, then N
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in shards])]).astype(np.int64)
        #: the access pattern last advised for every shard (``advise``)
        self.advice = "normal"

    def advise(self, pattern: str) -> bool:
        """Advise the kernel how the shards will be read (``"random"``: gathers of scattered
        rows, ``"sequential"``, ``"normal"``); see the module docstring. True if any shard is a
        memory map that took the advice."""
        took = [advise_array(shard, pattern) for shard in self.shards]
        self.advice = pattern
        return any(took)

    @classmethod
    def open(cls, paths: Sequence[str | os.PathLike[str]]) -> ShardedRows:
        """Memory-map each ``.npy`` file of ``paths`` read-only (nothing is read but headers)."""
        arrays = []
        for path in paths:
            try:
                arrays.append(np.load(path, mmap_mode="r", allow_pickle=False))
            except (OSError, ValueError, EOFError) as exc:
                raise ShardError(f"{path}: not a readable .npy array ({exc})") from None
        return cls(arrays, [str(p) for p in paths])

    # --- what a store's feature field offers --------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return torch.Size((int(self.offsets[-1]), int(self.shards[0].shape[1])))

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.shards[0].dtype]

    @property
    def nbytes(self) -> int:
        return sum(int(s.nbytes) for s in self.shards)

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return int(self.shape[0]) * int(self.shape[1])

    def is_floating_point(self) -> bool:
        return True

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __repr__(self) -> str:
        return f"ShardedRows({len(self)}x{self.shape[1]} {self.dtype}, {len(self.shards)} shards)"

    def __getitem__(self, index: Any) -> Tensor:
        """Rows ``index`` as a new tensor: ``[D]`` for an int, ``[n, D]`` otherwise. A tuple
        ``(rows, cols)`` selects rows first, then indexes the result with ``cols``."""
        if isinstance(index, tuple):
            rows, *rest = index
            return self[rows][(slice(None),) + tuple(rest)]
        n = len(self)
        if isinstance(index, (int, np.integer)) or (isinstance(index, Tensor) and index.dim() == 0):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"row {i} out of range for {n} rows")
            return self._gather(np.array([i % n]))[0]
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                return self._contiguous(start, max(start, stop))
            return self._gather(np.arange(start, stop, step))
        ids = index.cpu().numpy() if isinstance(index, Tensor) else np.asarray(index)
        if ids.dtype == np.bool_:
            if ids.shape != (n,):
                raise IndexError(f"boolean mask of shape {list(ids.shape)} for {n} rows")
            ids = np.flatnonzero(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise IndexError(
                f"rows must be an int, a slice or a 1-D integer index; got {ids.dtype} {list(ids.shape)}"
            )
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < -n or ids.max() >= n):
            raise IndexError(f"row index out of range for {n} rows (got {ids.min()}..{ids.max()})")
        return self._gather(np.where(ids < 0, ids + n, ids))

    def _contiguous(self, start: int, stop: int) -> Tensor:
        """Rows ``start:stop``: one copy of those rows, read shard by shard."""
        out = np.empty((stop - start, self.shape[1]), dtype=self.shards[0].dtype)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        k, row = max(first, 0), start
        row_bytes = int(self.shards[0].shape[1]) * self.shards[0].dtype.itemsize
        while row < stop:
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            end = min(stop, hi)
            # a long run of rows: full read-ahead for it, then the shard's own advice again
            ahead = (end - row) * row_bytes >= SEQUENTIAL_MIN_BYTES and self.advice != "sequential"
            if ahead:
                advise_array(self.shards[k], "sequential")
            try:
                out[row - start : end - start] = self.shards[k][row - lo : end - lo]
            finally:
                if ahead:
                    advise_array(self.shards[k], self.advice)
            row, k = end, k + 1
        if self.check_values:
            self._check(out, np.arange(start, stop, dtype=np.int64))
        return torch.from_numpy(out)

    def _gather(self, ids: np.ndarray) -> Tensor:
        """Rows ``ids`` (in range, non-negative) in that order; each shard is read once, in
        ascending row order (sequential pages on disk)."""
        out = np.empty((ids.size, self.shape[1]), dtype=self.shards[0].dtype)
        if ids.size == 0:
            return torch.from_numpy(out)
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        order = np.lexsort((ids, shard))
        bounds = np.flatnonzero(np.diff(shard[order])) + 1
        for part in np.split(order, bounds):
            k = int(shard[part[0]])
            local = ids[part] - self.offsets[k]
            # a sparse gather (a strided sample, a validation subset): read only the rows'
            # pages, whatever advice the shard has, then give it back its own advice
            sparse = (
                self.advice != "random" and SPARSE_GATHER * len(local) < local[-1] - local[0] + 1
            )
            if sparse:
                advise_array(self.shards[k], "random")
            try:
                out[part] = self.shards[k][local]
            finally:
                if sparse:
                    advise_array(self.shards[k], self.advice)
        if self.check_values:
            self._check(out, ids)
        return torch.from_numpy(out)

    def _check(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """ShardError naming the shard file and its row when ``rows`` (= rows ``ids``) holds a
        NaN or inf: one pass over what was read, nothing more."""
        finite = np.isfinite(rows).all(axis=1)
        if finite.all():
            return
        row = int(ids[int(np.flatnonzero(~finite)[0])])
        k = int(np.searchsorted(self.offsets, row, side="right")) - 1
        raise ShardError(
            f"{self.names[k]}: row {row - int(self.offsets[k])} (row {row} of the {len(self)} "
            "read as one) holds NaN or inf values; these shards are not scanned when opened "
            "(each row is checked when it is read): fix or drop that row, or open them with "
            "check=1 to count every such row"
        )


def is_row_source(value: object) -> bool:
    """True for what a store's feature field may hold: a tensor or ``ShardedRows``."""
    return isinstance(value, (Tensor, ShardedRows))


def require_pyarrow(what: str) -> ModuleType:
    """The ``pyarrow.parquet`` module, or a ShardError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ShardError(
            f"{what} needs pyarrow to read parquet metadata: pip install 'curvalign[parquet]'"
        ) from None
    return pq


class LazyStrings(Sequence[str]):
    """Per-row strings read on demand (not held as a Python list): ``len()``, ``[i]``,
    ``[a:b]`` and ``take(ids)``. A store's type checks skip these: their rows are only read
    when asked for."""

    def take(self, ids: Sequence[int] | np.ndarray) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError


class IndexedStrings(LazyStrings):
    """Strings stored as one UTF-8 file and the ``[n + 1]`` int64 byte offsets of their starts
    (``write``): opening reads neither (the offsets are memory-mapped); ``[i]`` reads one
    string. A native store keeps long item lists this way, so that it opens without parsing
    every caption."""

    def __init__(self, data: str | os.PathLike[str], offsets: str | os.PathLike[str]) -> None:
        self.data = Path(data)
        try:
            self.offsets = np.load(offsets, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise ShardError(f"{offsets}: not readable string offsets ({exc})") from None
        size = self.data.stat().st_size if self.data.is_file() else -1
        if (
            self.offsets.ndim != 1
            or len(self.offsets) < 1
            or self.offsets.dtype.kind != "i"
            or int(self.offsets[0]) != 0
            or int(self.offsets[-1]) != size
        ):
            raise ShardError(
                f"{offsets} does not index {self.data} ({size} bytes): damaged; write the "
                "store again"
            )

    @staticmethod
    def write(values: Sequence[str], data: Path, offsets: Path) -> None:
        """Write ``values`` (any sequence of strings, read once in order) as ``data`` +
        ``offsets``, a bounded buffer at a time."""
        ends = np.empty(len(values) + 1, dtype=np.int64)
        ends[0] = 0
        at = 0
        with open(data, "wb") as fh:
            for i in range(len(values)):
                raw = str(values[i]).encode("utf-8")
                fh.write(raw)
                at += len(raw)
                ends[i + 1] = at
        np.save(offsets, ends, allow_pickle=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _read(self, fh: Any, i: int) -> str:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        fh.seek(a)
        return fh.read(b - a).decode("utf-8")

    def __getitem__(self, index: Any) -> Any:  # int -> str, slice -> list[str]
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        i, n = int(index), len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        with open(self.data, "rb") as fh:
            return self._read(fh, i % n)

    def take(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """``[self[i] for i in ids]`` with the file opened once."""
        n = len(self)
        with open(self.data, "rb") as fh:
            return [self._read(fh, int(i) % n) for i in np.asarray(ids, dtype=np.int64).tolist()]


class ParquetColumn(LazyStrings):
    """One string column over sharded parquet files, ``len()`` from their footers, rows read a
    shard at a time on demand (the last shard read is kept). ``take(ids)`` reads each shard it
    needs once. A null value reads as ``""``."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]], column: str) -> None:
        pq = require_pyarrow("a parquet column")
        self.paths = [Path(p) for p in paths]
        self.column = column
        counts = []
        for path in self.paths:
            try:
                file = pq.ParquetFile(path)
            except Exception as exc:  # pyarrow raises its own error types for a bad file
                raise ShardError(f"{path}: not a readable parquet file ({exc})") from None
            if column not in file.schema_arrow.names:
                raise ShardError(f"{path}: no column {column!r} (it has {file.schema_arrow.names})")
            counts.append(file.metadata.num_rows)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._cached: tuple[int, list[str]] | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _shard(self, k: int) -> list[str]:
        if self._cached is None or self._cached[0] != k:
            pq = require_pyarrow("a parquet column")
            try:
                table = pq.read_table(self.paths[k], columns=[self.column])
            except Exception as exc:  # pyarrow raises its own error types for a bad file
                raise ShardError(f"{self.paths[k]}: not a readable parquet file ({exc})") from None
            values = table.column(0).to_pylist()
            self._cached = (k, ["" if v is None else str(v) for v in values])
        return self._cached[1]

    def __getitem__(self, index: Any) -> Any:  # int -> str, slice -> list[str]
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        i = int(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self._shard(k)[i - int(self.offsets[k])]

    def take(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """``[self[i] for i in ids]``, reading each shard once."""
        ids = np.asarray(ids, dtype=np.int64)
        out: list[str] = [""] * ids.size
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        for k in np.unique(shard):
            rows = self._shard(int(k))
            where = np.flatnonzero(shard == k)
            for j, i in zip(where.tolist(), (ids[where] - self.offsets[k]).tolist(), strict=True):
                out[j] = rows[i]
        return out
