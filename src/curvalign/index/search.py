"""Nearest-neighbour search over Lorentz points with Faiss, exact by construction.

The transform (why an inner-product engine finds hyperbolic nearest neighbours)
    A point of the hyperboloid ``{p : <p,p>_L = -1/c, p_0 > 0}`` is stored by its space part
    ``x`` ``[d]``; its time is ``t(x) = sqrt(1/c + |x|^2)``. The Minkowski inner product is
    ``<x,y>_L = x.y - t(x) t(y)`` and the distance ``d(x,y) = acosh(-c <x,y>_L) / sqrt(c)``,
    a strictly increasing function of ``-<x,y>_L``. So the nearest points to ``y`` are the ones
    with the *largest* ``<x,y>_L``. With database vectors ``u(x) = [x, t(x)]`` and query vectors
    ``v(y) = [y, -t(y)]`` (both ``[d + 1]``) the ordinary dot product is
    ``u(x).v(y) = x.y - t(x) t(y) = <x,y>_L``: maximum inner-product search on ``u, v`` is
    nearest-neighbour search in hyperbolic distance.

Exactness
    Faiss computes ``u.v`` in float32, and ``<x,y>_L`` suffers cancellation for points far from
    the origin, so its order is only approximate. The index therefore asks Faiss for more
    candidates than requested, recomputes their distances in float64 with a cancellation-free
    formula (``lorentz_excess``), sorts by (distance, id), and *certifies* the result: every
    point Faiss did not return has a float32 score at most the last returned one, and the
    float32 error of a score is at most ``gamma * |u| |v|`` (the standard dot-product bound,
    ``gamma = (d + 4) u32 / (1 - (d + 4) u32)``, which also covers rounding the time coordinate).
    If the k-th exact distance is strictly below the smallest distance any unreturned point
    could have, the top k (ties by id included) equal a float64 brute-force ranking; otherwise
    the query is retried with four times the candidates and, past a cap, answered by a chunked
    float64 scan of the whole collection. The answer is exact for the stored points, which
    are float32 (float64 input is rounded once, when added).

Approximate search (``kind="ann"``)
    ``method="hnsw"``: an HNSW graph. Faiss would build the graph by the dot product between
    database vectors ``u(x).u(x') = x.x' + t t'``, which is not a hyperbolic proximity (it
    favours far-out points), and recall collapses. The graph is therefore built with L2 on
    Poincare-ball coordinates ``x / (1 + sqrt(c) t(x))``; the ball model is conformal, so a
    point's Euclidean neighbours there are its hyperbolic neighbours to first order. The
    search then walks that graph with the exact transform above. ``method="ivf"``: an
    inverted file whose cells are hyperbolic Voronoi cells: centroids from k-means on the
    space components, each point assigned to the centroid of largest ``<x, c>_L``, and the
    query probes the ``nprobe`` cells of largest ``<y, c>_L``. Either way the returned
    candidates are re-ranked exactly as above, so distances are exact and only recall is
    approximate (``benchmarks/search.py`` measures it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
from numpy.typing import ArrayLike

from curvalign._io import file_checksums, read_json_file, staged_directory
from curvalign.errors import (
    CurvalignError,
    DamagedFileError,
    InputError,
    NotFoundError,
    OverwriteError,
)
from curvalign.geometries import (
    database_vectors,
    distance_from_excess,
    lorentz_distance,
    lorentz_excess,
    lorentz_time,
    poincare_ball,
    query_vectors,
)
from curvalign.index.checked import check_file, seal_files

GEOMETRY = "lorentz"
FORMAT_VERSION = 1
_U32 = float(np.finfo(np.float32).eps) / 2  # unit roundoff of float32
_U64 = float(np.finfo(np.float64).eps) / 2
#: beyond this many candidates per query, uncertified queries fall back to a float64 scan
_MAX_CANDIDATES = 4096
#: float64 elements per work chunk (about 64 MiB)
_CHUNK_ELEMENTS = 1 << 23
#: default bytes of float32 points read per block when an index is built (``build_block_rows``)
BUILD_BLOCK_BYTES = 1 << 26

IndexKind = Literal["exact", "ann"]
AnnMethod = Literal["hnsw", "ivf"]


class IndexMismatchError(CurvalignError, ValueError):
    """A query, an added batch or a file does not fit the index (dimension, geometry, curvature)."""


# --- the transform and the exact distance ------------------------------------------------------
# ``lorentz_time``, ``database_vectors``, ``query_vectors``, ``lorentz_excess``,
# ``distance_from_excess``, ``lorentz_distance`` and ``poincare_ball`` are ``geometry.lorentz``
# in float64 returned as numpy (``curvalign.geometries``, imported above): one copy of the math.


# --- input checks --------------------------------------------------------------------------------


def _as_points(points: ArrayLike, name: str, dim: int | None = None) -> np.ndarray:
    """Array-like ``[n, d]`` (a single ``[d]`` row is promoted) -> C-contiguous float32, checked."""
    if isinstance(points, dict):
        raise IndexMismatchError(
            f"{name} is an embedding dict with keys {sorted(points)}; pass the Lorentz points "
            f"themselves (an array of space components [n, d])"
        )
    if hasattr(points, "detach"):  # torch.Tensor, without importing torch here
        points = points.detach().cpu().numpy()
    arr = np.asarray(points)
    if arr.dtype.kind not in "fiu":
        raise IndexMismatchError(f"{name} must be a numeric array, got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise IndexMismatchError(
            f"{name} must have shape [n, d] (space components of Lorentz points), got shape "
            f"{list(arr.shape)}"
            + (
                "; product-manifold points [n, k, d] need a per-factor "
                "index (see curvalign.index.RecipeIndex)"
                if arr.ndim == 3
                else ""
            )
        )
    if dim is not None and arr.shape[1] != dim:
        raise IndexMismatchError(
            f"{name} has dimension {arr.shape[1]} but the index holds Lorentz points of dimension {dim}"
        )
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).any(axis=1).sum())
        raise IndexMismatchError(f"{name} has {bad} row(s) with non-finite values (NaN or inf)")
    return arr


def _as_ids(ids: ArrayLike | None, n: int, start: int) -> np.ndarray:
    if ids is None:
        return np.arange(start, start + n, dtype=np.int64)
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.shape != (n,):
        raise IndexMismatchError(
            f"ids must be {n} integers (one per point), got dtype {arr.dtype} "
            f"and shape {list(arr.shape)}"
        )
    return arr.astype(np.int64)


def _check_curvature(c: float) -> float:
    # a recipe's learnable curvature arrives as a tensor that requires grad; the index stores a number
    c = float(c.detach()) if hasattr(c, "detach") else float(c)
    if not (math.isfinite(c) and c > 0):
        raise IndexMismatchError(
            f"curvature c must be a positive finite number (sectional curvature -c), got {c}"
        )
    return c


def build_block_rows(dim: int, budget_bytes: int | None = None) -> int:
    """Rows of ``dim`` float32 values per build block: ``budget_bytes`` (default
    ``BUILD_BLOCK_BYTES``, 64 MiB) over the bytes of one transformed row ``4 (dim + 1)``."""
    budget = BUILD_BLOCK_BYTES if budget_bytes is None else int(budget_bytes)
    if budget < 1:
        raise InputError(f"the build's memory budget must be positive, got {budget} bytes")
    return max(1, budget // (4 * (dim + 1)))


def point_blocks(points: Any, block_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, block)`` over ``points`` ``[N, d]`` (an array, a memory map, a tensor: anything
    with ``shape`` and row slices), each block ``[<= block_rows, d]`` float32, checked
    (``_as_points``). Only one block is in memory at a time."""
    n = int(points.shape[0]) if hasattr(points, "shape") else len(points)
    for start in range(0, n, block_rows):
        yield start, _as_points(points[start : start + block_rows], "points")


def _rows_of(points: Any) -> tuple[int, int]:
    """``(N, d)`` of array-like points without reading them (a list is converted)."""
    if hasattr(points, "shape") and len(points.shape) == 2:
        return int(points.shape[0]), int(points.shape[1])
    return _as_points(points, "points").shape


# --- the index -----------------------------------------------------------------------------------


@dataclass
class IndexInfo:
    """What a saved index is; written as ``index.json`` next to the Faiss file."""

    geometry: str
    curvature: float
    dim: int
    count: int
    kind: str
    method: str | None
    options: dict[str, Any]
    max_norm: float
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    #: SHA-256 of index.faiss and ids.npy, checked before they are read (empty: older index)
    sha256: dict[str, str] = field(default_factory=dict)
    #: [size, mtime_ns] of the same files when written: a match skips the hash at open
    file_stats: dict[str, list[int]] = field(default_factory=dict)


class LorentzIndex:
    """Search over Lorentz points (space components ``[N, d]``, curvature ``-c``).

    ``search(queries, k)`` returns ``(distances [n, k] float64, ids [n, k] int64)`` in ascending
    hyperbolic distance, ties broken by ascending id. Build one with ``build_index`` or
    ``load_index``. ``meta`` is free JSON (recipe, embedding key, run directory, ...).
    """

    def __init__(
        self, faiss_index: faiss.Index | FlatFile, info: IndexInfo, ids: np.ndarray
    ) -> None:
        self._index = faiss_index
        self.info = info
        self._ids = ids
        self._id_set: set[int] | None = None

    # -- facts --
    @property
    def curvature(self) -> float:
        return self.info.curvature

    @property
    def dim(self) -> int:
        return self.info.dim

    @property
    def kind(self) -> str:
        return self.info.kind

    @property
    def meta(self) -> dict[str, Any]:
        return self.info.meta

    @property
    def ids(self) -> np.ndarray:
        """External id of each stored point, in insertion order ``[N]``."""
        return self._ids

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def __repr__(self) -> str:
        method = f", method={self.info.method!r}" if self.info.method else ""
        return (
            f"LorentzIndex(kind={self.kind!r}{method}, count={len(self)}, dim={self.dim}, "
            f"c={self.curvature:g})"
        )

    # -- options --
    def set_options(self, **options: int) -> None:
        """Change search-time options: ``ef_search`` (HNSW), ``nprobe`` (IVF)."""
        for key, value in options.items():
            if key == "ef_search" and self.info.method == "hnsw":
                self._faiss_hnsw().hnsw.efSearch = int(value)
            elif key == "nprobe" and self.info.method == "ivf":
                assert not isinstance(self._index, FlatFile)  # a flat file is exact, never IVF
                faiss.extract_index_ivf(self._index).nprobe = int(value)
            else:
                raise InputError(
                    f"option {key!r} does not apply to a {self.kind} index"
                    + (f" ({self.info.method})" if self.info.method else "")
                )
            self.info.options[key] = int(value)

    def _faiss_hnsw(self) -> faiss.IndexHNSW:
        return hnsw_graph(self._index)

    # -- adding --
    def add(self, points: ArrayLike, ids: ArrayLike | None = None) -> None:
        """Add ``points`` ``[m, d]`` with external ``ids`` ``[m]`` (default: continue from N).

        Ids must be unique across the index. No index is rebuilt: a flat index appends, IVF files
        the points under their nearest hyperbolic Voronoi cell, and HNSW inserts the new points
        into the existing graph (by L2 on Poincare-ball coordinates, as it was built).
        """
        x = _as_points(points, "points", self.dim)
        new_ids = _as_ids(ids, x.shape[0], int(self._ids.max()) + 1 if len(self._ids) else 0)
        if len(np.unique(new_ids)) != len(new_ids):
            raise IndexMismatchError("ids to add contain duplicates")
        if self._id_set is None:
            self._id_set = set(self._ids.tolist())
        clash = [i for i in new_ids.tolist() if i in self._id_set]
        if clash:
            raise IndexMismatchError(
                f"ids already in the index: {clash[:5]}{' ...' if len(clash) > 5 else ''}"
            )
        c = self.curvature
        self._index = in_memory(self._index)  # a flat file is read whole to grow it
        if self.info.method == "hnsw":
            self._index = _hnsw_insert(self._index, x, c)
        elif self.info.method == "ivf":
            _ivf_add(self._index, x, c)
        else:
            self._index.add(database_vectors(x, c))
        self._ids = np.concatenate([np.asarray(self._ids), new_ids])
        self._id_set.update(new_ids.tolist())
        self.info.count = len(self)
        self.info.max_norm = max(self.info.max_norm, _max_transformed_norm(x, c))

    # -- search --
    def search(
        self,
        queries: ArrayLike,
        k: int,
        *,
        geometry: str | None = None,
        curvature: float | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``k`` nearest stored points of each query ``[n, d]``.

        ``geometry`` / ``curvature``, when given, say what the queries are; a mismatch with the
        index is refused rather than searched. Returns float64 distances and int64 external ids,
        both ``[n, min(k, N)]``, ascending distance, ties by id.
        """
        if geometry is not None and geometry != GEOMETRY:
            raise IndexMismatchError(
                f"queries are {geometry} points but the index holds Lorentz points (curvature "
                f"-{self.curvature:g}); embed the queries with a Lorentz recipe or use a matching index"
            )
        if curvature is not None and not math.isclose(
            float(curvature), self.curvature, rel_tol=1e-5
        ):
            raise IndexMismatchError(
                f"queries live on the hyperboloid of curvature -{float(curvature):g} but the index "
                f"holds points of curvature -{self.curvature:g}"
            )
        if int(k) < 1:
            raise InputError(f"k must be at least 1, got {k}")
        y = _as_points(queries, "query", self.dim)
        n, N = y.shape[0], len(self)
        k = min(int(k), N)
        if N == 0 or n == 0:
            return np.zeros((n, 0)), np.zeros((n, 0), dtype=np.int64)
        positions, z = self._search_exact(y, k) if self.kind == "exact" else self._search_ann(y, k)
        return distance_from_excess(z, self.curvature), np.asarray(self._ids)[positions]

    def _search_exact(self, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        N, c = len(self), self.curvature
        out_pos = np.zeros((y.shape[0], k), dtype=np.int64)
        out_z = np.zeros((y.shape[0], k))
        todo = np.arange(y.shape[0])
        budget = min(N, k + max(16, k))
        while len(todo):
            yq = y[todo]
            scores, cand = self._index.search(query_vectors(yq, c), budget)
            pos, z = self._rerank(yq, cand, k)
            if budget >= N:
                certified = np.ones(len(todo), dtype=bool)
            else:
                # Smallest excess any point outside the candidates can have (see module docstring).
                err = self._score_error(yq)
                z_floor = -c * (scores[:, -1].astype(np.float64) + err) - 1.0
                certified = z[:, -1] < z_floor - 8 * _U64 * (1.0 + np.abs(z_floor))
            out_pos[todo[certified]], out_z[todo[certified]] = pos[certified], z[certified]
            todo = todo[~certified]
            if len(todo) and budget * 4 > _MAX_CANDIDATES and budget < N:
                for q in todo:
                    out_pos[q], out_z[q] = self._scan(y[q], k)
                break
            budget = min(N, budget * 4)
        return out_pos, out_z

    def _search_ann(self, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        budget = min(len(self), k + max(16, k))
        _, cand = self._index.search(query_vectors(y, self.curvature), budget)
        return self._rerank(y, cand, k)

    def _score_error(self, y: np.ndarray) -> np.ndarray:
        """Bound on |float32 score - <x,y>_L| for any stored x, per query ``[n]``."""
        n_terms = self.dim + 4
        gamma = n_terms * _U32 / (1 - n_terms * _U32)
        qnorm = np.sqrt(
            2 * np.einsum("ij,ij->i", y.astype(np.float64), y.astype(np.float64))
            + 1 / self.curvature
        )
        return 1.01 * gamma * self.info.max_norm * qnorm

    def _reconstruct(self, positions: np.ndarray) -> np.ndarray:
        """Stored space components of internal ``positions`` (any shape) -> ``[..., d]`` float32."""
        flat = positions.reshape(-1)
        uniq, inverse = np.unique(flat, return_inverse=True)
        rows = self._index.reconstruct_batch(uniq.astype(np.int64))[:, : self.dim]
        return rows[inverse].reshape(*positions.shape, self.dim)

    def _rerank(self, y: np.ndarray, cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact float64 excess of each candidate, sorted by (excess, id); keeps ``k`` per row.

        Missing candidates (Faiss's -1 when an ANN search finds fewer) sort last with +inf.
        """
        n, m = cand.shape
        z = np.full((n, m), np.inf)
        ext = np.full((n, m), np.iinfo(np.int64).max)
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, m * self.dim))
        ids = np.asarray(self._ids)
        for start in range(0, n, rows_per_chunk):
            sl = slice(start, start + rows_per_chunk)
            block = cand[sl]
            valid = block >= 0
            safe = np.where(valid, block, 0)
            x = self._reconstruct(safe)
            zb = lorentz_excess(x, y[sl, None, :], self.curvature)
            z[sl] = np.where(valid, zb, np.inf)
            ext[sl] = np.where(valid, ids[safe], np.iinfo(np.int64).max)
        order = np.lexsort((ext, z), axis=-1)[:, :k]
        pos = np.take_along_axis(cand, order, axis=1)
        zk = np.take_along_axis(z, order, axis=1)
        if (pos < 0).any():
            raise InputError(
                f"the approximate index found fewer than k={k} candidates for some queries; "
                f"raise ef_search (HNSW) or nprobe (IVF)"
            )
        return pos, zk

    def _scan(self, y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One query against every stored point in float64 (the certified fallback).

        The naive float64 inner product selects every point within its error bound of the k-th
        best; the stable excess then ranks those exactly.
        """
        c, N = self.curvature, len(self)
        y64 = y.astype(np.float64)
        ty = lorentz_time(y64, c)
        chunk = max(1, _CHUNK_ELEMENTS // (self.dim + 1))
        inner = np.empty(N)
        for start in range(0, N, chunk):
            x = self._reconstruct(np.arange(start, min(N, start + chunk))).astype(np.float64)
            inner[start : start + len(x)] = x @ y64 - lorentz_time(x, c) * ty
        n_terms = self.dim + 4
        err = 2 * n_terms * _U64 * self.info.max_norm * math.sqrt(2 * float(y64 @ y64) + 1 / c)
        kth = np.partition(inner, N - k)[N - k]
        cand = np.nonzero(inner >= kth - 2 * err)[0]
        pos, z = self._rerank(y[None, :], cand[None, :], k)
        return pos[0], z[0]

    # -- persistence --
    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path/`` = ``index.faiss`` + ``ids.npy`` + ``index.json``, atomically.

        Everything goes to a temporary sibling directory first, which then replaces ``path``.
        """
        path = Path(path)
        _refuse_foreign(path)
        with staged_directory(path) as tmp:
            faiss.write_index(in_memory(self._index), str(tmp / "index.faiss"))
            np.save(tmp / "ids.npy", np.asarray(self._ids))
            self.info.sha256 = file_checksums(tmp, ["index.faiss", "ids.npy"])
            self.info.file_stats = seal_files(tmp, ["index.faiss", "ids.npy"])
            (tmp / "index.json").write_text(
                json.dumps(self.info.__dict__, indent=2, sort_keys=True)
            )
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        return path


def load_index(path: str | os.PathLike, *, verify: bool = False) -> LorentzIndex:
    """Read an index written by ``LorentzIndex.save``.

    Its files are checked against ``index.json`` by size and modification time; their SHA-256
    is computed only when those differ or ``verify`` is true (``curvalign.index.checked``).
    """
    path = Path(path)
    meta_file = path / "index.json"
    if not meta_file.exists():
        raise NotFoundError(
            f"{path} is not a curvalign index (no index.json); build one with "
            f"`curvalign index build` or LorentzIndex.save"
        )
    raw = read_json_file(meta_file, "build the index again with `curvalign index build`")
    raw = raw if isinstance(raw, dict) else {}
    if raw.get("format_version") != FORMAT_VERSION:
        raise IndexMismatchError(
            f"{path}: index format version {raw.get('format_version')} is not "
            f"supported (expected {FORMAT_VERSION})"
        )
    if raw.get("geometry") != GEOMETRY:
        raise IndexMismatchError(f"{path} holds {raw.get('geometry')} points, not Lorentz points")
    info = IndexInfo(**raw)
    redo = "build the index again with `curvalign index build`"
    for name in ("index.faiss", "ids.npy"):  # before faiss or numpy reads a byte of them
        check_file(path / name, info.sha256, info.file_stats, str(meta_file), redo, full=verify)
    try:
        # a flat (exact) index is scanned from the file in chunks, never loaded whole
        faiss_index = read_flat_or_faiss(path / "index.faiss")
        ids = np.load(path / "ids.npy", mmap_mode="r")
    except (RuntimeError, OSError, ValueError) as err:
        raise DamagedFileError(
            f"{path}: index.faiss or ids.npy cannot be read ({str(err).splitlines()[0]}); {redo}"
        ) from None
    if faiss_index.ntotal != info.count or len(ids) != info.count or faiss_index.d != info.dim + 1:
        raise IndexMismatchError(
            f"{path}: index.faiss ({faiss_index.ntotal} x {faiss_index.d}), ids.npy "
            f"({len(ids)}) and index.json ({info.count} x {info.dim} + 1) disagree"
        )
    return LorentzIndex(faiss_index, info, ids)


# --- flat index files scanned in chunks ----------------------------------------------------------

#: bytes of stored vectors read per chunk of a flat scan (plus its [queries, rows] scores)
FLAT_CHUNK_BYTES = 1 << 25
#: float32 scores per chunk of a flat scan ([queries, rows])
FLAT_SCORE_ELEMENTS = 1 << 24


class FlatFile:
    """A Faiss flat inner-product index file (``IndexFlatIP``) searched without loading it.

    ``faiss.read_index`` reads the whole file into memory (2 GB for 1M x 512 float32), and
    memory-mapping it (``IO_FLAG_MMAP_IFC``) does not help a search: a flat scan touches every
    page, and the mapped pages then count in the process's resident memory until it exits
    (measured: the same peak RSS either way). This reads the stored vectors with plain file
    reads into one reused buffer of ``FLAT_CHUNK_BYTES`` (the page cache holds the file, not
    the process) and keeps a running top-k, so resident memory is one chunk plus the
    ``[n, k]`` answer, whatever N.
    The file is the one ``faiss.write_index`` wrote (its vectors are its last ``N * d`` floats,
    checked against the header's count and against Faiss's own reading of the first and last
    rows), so indexes built before this existed are searched the same way.

    It offers what ``LorentzIndex`` and ``RecipeIndex`` ask of a flat Faiss index: ``ntotal``,
    ``d``, ``search(queries, k) -> (scores [n, k] float32, rows [n, k] int64)`` best first, and
    ``reconstruct_batch``/``reconstruct_n``. Changing it (``add``) goes through ``to_faiss()``,
    which reads it whole.
    """

    def __init__(self, path: Path, ntotal: int, d: int, offset: int) -> None:
        self.path, self.ntotal, self.d, self.offset = path, int(ntotal), int(d), int(offset)

    @classmethod
    def open(cls, path: str | os.PathLike) -> FlatFile | None:
        """The flat index in ``path``, or None when the file holds another kind of Faiss index."""
        path = Path(path)
        # IO_FLAG_MMAP_IFC maps the vectors instead of reading them: only the header is read
        header = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
        flat = faiss.downcast_index(header)
        if type(flat) is not faiss.IndexFlatIP:
            return None
        n, d = int(flat.ntotal), int(flat.d)
        offset = path.stat().st_size - 4 * n * d
        with open(path, "rb") as fh:
            fh.seek(offset - 8)
            recorded = int(np.frombuffer(fh.read(8), dtype=np.uint64)[0])
        out = cls(path, n, d, offset)
        if recorded != n * d or (
            n
            and not (
                np.array_equal(out.reconstruct_batch(np.array([0]))[0], flat.reconstruct(0))
                and np.array_equal(
                    out.reconstruct_batch(np.array([n - 1]))[0], flat.reconstruct(n - 1)
                )
            )
        ):
            return None  # a layout this reader does not know: let Faiss read it
        return out

    def _rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Stored rows ``start:stop`` ``[m, d]`` float32, read from the file (into ``out``'s
        first rows when given, a buffer of at least ``m`` rows)."""
        m = max(0, stop - start)
        rows = np.empty((m, self.d), dtype=np.float32) if out is None else out[:m]
        # numpy's stubs make ndarray a Buffer only for Python >= 3.12 (PEP 688); it is one
        view = memoryview(rows.reshape(-1)).cast("B")  # type: ignore[arg-type]
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(self.offset + 4 * self.d * start)
            done = 0
            while done < len(view):
                got = fh.readinto(view[done:])
                if not got:
                    raise IndexMismatchError(f"{self.path}: the file ends inside its vectors")
                done += got
        return rows

    def reconstruct_batch(self, rows: np.ndarray) -> np.ndarray:
        """Stored vectors of ``rows`` ``[m]`` -> ``[m, d]`` float32, one read per distinct row
        (not a memory map: the kernel maps the neighbours of every touched page as well, which
        for scattered rows grew the resident memory by hundreds of MB)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        uniq, inverse = np.unique(rows, return_inverse=True)
        out = np.empty((len(uniq), self.d), dtype=np.float32)
        width = 4 * self.d
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for j, row in enumerate(uniq.tolist()):
                data = os.pread(fd, width, self.offset + width * row)
                if len(data) != width:
                    raise IndexMismatchError(f"{self.path}: the file ends inside its vectors")
                out[j] = np.frombuffer(data, dtype=np.float32)
        finally:
            os.close(fd)
        return out[inverse]

    def reconstruct_n(self, start: int, count: int) -> np.ndarray:
        return self._rows(int(start), int(start) + int(count))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Largest inner products: ``(scores [n, k] float32, rows [n, k] int64)``, best first
        (``k`` is at most ``ntotal``). Chunk by chunk with a running top-k."""
        import torch

        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        n, k = q.shape[0], min(int(k), self.ntotal)
        best = torch.full((n, k), -torch.inf)
        best_rows = torch.full((n, k), -1, dtype=torch.long)
        if n == 0 or k == 0:
            return best.numpy(), best_rows.numpy()
        step = max(
            1,
            min(FLAT_CHUNK_BYTES // (4 * self.d), FLAT_SCORE_ELEMENTS // max(1, n)),
        )
        buffer = np.empty((min(step, self.ntotal), self.d), dtype=np.float32)  # reused
        for start in range(0, self.ntotal, step):
            chunk = torch.from_numpy(self._rows(start, min(self.ntotal, start + step), buffer))
            scores = q @ chunk.T
            top = torch.topk(scores, min(k, scores.shape[1]), dim=1)
            merged = torch.cat([best, top.values], dim=1)
            merged_rows = torch.cat([best_rows, top.indices + start], dim=1)
            keep = torch.topk(merged, k, dim=1).indices
            best = torch.gather(merged, 1, keep)
            best_rows = torch.gather(merged_rows, 1, keep)
        return best.numpy(), best_rows.numpy()

    def to_faiss(self) -> faiss.Index:
        """The index read whole into memory (to change it)."""
        return faiss.read_index(str(self.path))


def _flat_header(d: int, n: int) -> bytes:
    """The bytes ``faiss.write_index`` puts before the vectors of an ``IndexFlatIP`` of ``n``
    rows of width ``d``: Faiss's own header of an empty index with its two counts (rows, and
    floats of the vector block) set, located by comparing it with a one-row index."""
    empty = faiss.serialize_index(faiss.IndexFlatIP(d)).tobytes()
    one_index = faiss.IndexFlatIP(d)
    one_index.add(np.zeros((1, d), dtype=np.float32))
    one = faiss.serialize_index(one_index).tobytes()[: len(empty)]

    def at(data: bytes, i: int) -> int:
        return int(np.frombuffer(data[i : i + 8], dtype=np.uint64)[0])

    rows_at = next(i for i in range(len(empty) - 7) if at(empty, i) == 0 and at(one, i) == 1)
    floats_at = len(empty) - 8
    if at(one, floats_at) != d:
        raise IndexMismatchError("unexpected Faiss flat index layout; write the index with Faiss")
    header = bytearray(empty)
    header[rows_at : rows_at + 8] = np.uint64(n).tobytes()
    header[floats_at:] = np.uint64(n * d).tobytes()
    return bytes(header)


def write_flat_index(path: str | os.PathLike, d: int, chunks: Any) -> FlatFile:
    """Write a Faiss ``IndexFlatIP`` file from ``chunks`` (an iterable of ``[m, d]`` float32
    arrays) without holding more than one chunk: the index of any size that ``FlatFile``
    searches (and ``faiss.read_index`` reads). Written to a temporary name, then renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    n = 0
    with open(tmp, "wb") as fh:
        fh.write(_flat_header(d, 0))
        for chunk in chunks:
            rows = np.ascontiguousarray(chunk, dtype=np.float32)
            if rows.ndim != 2 or rows.shape[1] != d:
                raise IndexMismatchError(f"chunk of shape {list(rows.shape)}; [m, {d}] expected")
            fh.write(rows.tobytes())
            n += rows.shape[0]
        fh.seek(0)
        fh.write(_flat_header(d, n))  # the counts, now known (same length)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    flat = FlatFile.open(path)
    if flat is None or flat.ntotal != n:
        raise IndexMismatchError(f"{path}: the written flat index does not read back")
    return flat


def read_flat_or_faiss(path: str | os.PathLike) -> faiss.Index | FlatFile:
    """A Faiss index file for searching: a flat one as a ``FlatFile`` (memory bounded by a
    chunk), any other read by Faiss."""
    flat = FlatFile.open(path)
    return flat if flat is not None else faiss.read_index(str(path))


def in_memory(index: faiss.Index | FlatFile) -> faiss.Index:
    """``index`` as a Faiss index in memory (a ``FlatFile`` is read whole), to add to or save."""
    return index.to_faiss() if isinstance(index, FlatFile) else index


# --- construction --------------------------------------------------------------------------------


def _max_transformed_norm(x: np.ndarray, c: float) -> float:
    """max |[x, t(x)]| = sqrt(2|x|^2 + 1/c) over rows (0 for no rows)."""
    if len(x) == 0:
        return 0.0
    x64 = x.astype(np.float64)
    return float(np.sqrt(2 * np.einsum("ij,ij->i", x64, x64).max() + 1 / c))


def hnsw_graph(index: faiss.Index | FlatFile) -> faiss.IndexHNSW:
    """``index`` as the HNSW index it is (``faiss.downcast_index``, which Faiss's type stubs
    declare as returning the base class); ``IndexMismatchError`` for any other kind.

    A downcast is a second Python view of the same C++ index, owned by ``index``: the caller
    keeps ``index`` alive while it uses the result (an index Faiss read or deserialised is
    already of its own class and is returned as it is)."""
    if isinstance(index, faiss.IndexHNSW):
        return index
    graph = None if isinstance(index, FlatFile) else faiss.downcast_index(index)
    if not isinstance(graph, faiss.IndexHNSW):
        raise IndexMismatchError(f"an HNSW index was expected, got {type(index).__name__}")
    return graph


def _hnsw_with_storage(index: faiss.Index, vectors: np.ndarray, metric: int) -> faiss.IndexHNSW:
    """A copy of ``index``'s HNSW graph over a new flat storage of ``vectors`` with ``metric``.

    Faiss caches per-index state set up at construction; a serialisation round trip gives an
    index whose graph, storage and metric are consistent (swapping in place does not search).
    """
    copy = faiss.deserialize_index(faiss.serialize_index(index))  # owns the graph below
    graph = hnsw_graph(copy)
    storage = faiss.IndexFlat(vectors.shape[1], metric)
    storage.add(np.ascontiguousarray(vectors, dtype=np.float32))
    # Ownership: Python now frees both storages; the graph frees none.
    graph.own_fields = False
    graph.storage.this.own(True)  # type: ignore[attr-defined]  # SWIG's handle: not in the stubs
    graph.storage = storage
    graph.metric_type = metric
    return hnsw_graph(faiss.deserialize_index(faiss.serialize_index(graph)))


def _pad_to(vectors: np.ndarray, width: int) -> np.ndarray:
    """Rows padded with zero columns to ``width`` (a graph space narrower than the search space:
    Faiss keeps one dimension per index); L2 between rows is unchanged."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.shape[1] > width:
        raise ValueError(f"graph coordinates of width {vectors.shape[1]} exceed {width}")
    if vectors.shape[1] == width:
        return vectors
    return np.hstack([vectors, np.zeros((len(vectors), width - vectors.shape[1]), np.float32)])


def _ball_vectors(x: np.ndarray, c: float) -> np.ndarray:
    """``[N, d + 1]`` Poincare-ball coordinates padded to the transform's width (graph space)."""
    return _pad_to(poincare_ball(x, c), x.shape[1] + 1)


def build_hnsw_graph(
    graph_vectors: np.ndarray, search_vectors: np.ndarray, *, M: int, ef_construction: int
) -> faiss.IndexHNSW:
    """HNSW whose graph links neighbours by L2 on ``graph_vectors`` ``[N, D]`` and whose search
    walks it by the inner product with ``search_vectors`` ``[N, D]`` (same rows)."""
    graph_vectors = _pad_to(graph_vectors, search_vectors.shape[1])
    graph = faiss.IndexHNSWFlat(graph_vectors.shape[1], M)
    graph.hnsw.efConstruction = ef_construction
    graph.add(graph_vectors)
    return _hnsw_with_storage(graph, search_vectors, faiss.METRIC_INNER_PRODUCT)


def hnsw_insert_graph(
    index: faiss.Index, graph_vectors_all: np.ndarray, search_vectors_new: np.ndarray
) -> faiss.IndexHNSW:
    """Insert rows into an index of ``build_hnsw_graph`` without rebuilding its graph.

    ``graph_vectors_all`` ``[N + m, D]``: graph coordinates of the stored rows then the new ones;
    ``search_vectors_new`` ``[m, D]``. The graph is put over L2 storage of the stored rows, the
    new rows are inserted (Faiss's own HNSW insertion, linking only them), and the storage is
    swapped back to the inner-product vectors of all rows.
    """
    n = int(index.ntotal)
    graph_vectors_all = _pad_to(graph_vectors_all, index.d)
    ef_search = hnsw_graph(index).hnsw.efSearch
    stored = hnsw_graph(index).storage.reconstruct_n(0, n) if n else None
    graph = _hnsw_with_storage(index, graph_vectors_all[:n], faiss.METRIC_L2)
    graph.add(np.ascontiguousarray(graph_vectors_all[n:], dtype=np.float32))
    everything = search_vectors_new if stored is None else np.vstack([stored, search_vectors_new])
    out = _hnsw_with_storage(graph, everything, faiss.METRIC_INNER_PRODUCT)
    out.hnsw.efSearch = ef_search
    return out


def _build_hnsw(x: np.ndarray, c: float, *, M: int, ef_construction: int) -> faiss.IndexHNSW:
    """HNSW whose graph is built by L2 on Poincare-ball coordinates and searched by the transform."""
    return build_hnsw_graph(
        _ball_vectors(x, c), database_vectors(x, c), M=M, ef_construction=ef_construction
    )


def _hnsw_insert(index: faiss.Index, x: np.ndarray, c: float) -> faiss.IndexHNSW:
    n, d = int(index.ntotal), x.shape[1]
    stored = hnsw_graph(index).storage.reconstruct_n(0, n)[:, :d] if n else x[:0]
    return hnsw_insert_graph(
        index, _ball_vectors(np.vstack([stored, x]), c), database_vectors(x, c)
    )


def _ivf_add(index: faiss.Index, x: np.ndarray, c: float) -> None:
    """Add to a Lorentz-Voronoi IVF: each point goes to the centroid of largest ``<x, centroid>_L``."""
    from faiss.contrib.ivf_tools import add_preassigned

    ivf = faiss.extract_index_ivf(index)
    _, assign = ivf.quantizer.search(query_vectors(x, c), 1)
    add_preassigned(ivf, database_vectors(x, c), assign.ravel())


def ann_method(name: str) -> AnnMethod:
    """``name`` as a Lorentz index's ANN method ("hnsw" or "ivf"); InputError otherwise."""
    if name == "hnsw":
        return "hnsw"
    if name == "ivf":
        return "ivf"
    raise InputError(f"unknown ANN method {name!r}; expected 'hnsw' or 'ivf'")


def build_index(
    points: Any,
    c: float,
    kind: IndexKind = "exact",
    ids: ArrayLike | None = None,
    *,
    method: AnnMethod = "hnsw",
    M: int = 32,
    ef_construction: int = 80,
    ef_search: int = 128,
    nlist: int | None = None,
    nprobe: int = 16,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
    block_rows: int | None = None,
) -> LorentzIndex:
    """Index ``points`` ``[N, d]`` (Lorentz space components, curvature ``-c``).

    kind="exact"   Faiss flat inner-product search on the transform, certified float64 rerank.
    kind="ann"     ``method="hnsw"`` (``M``, ``ef_construction``, ``ef_search``) or ``method="ivf"``
                   (``nlist``, default ``min(4 sqrt(N), N / 39)``; ``nprobe``), candidates re-ranked
                   exactly.
    ids            external int ids ``[N]`` (default ``0..N-1``), unique; returned by ``search``.
    meta           free JSON saved with the index (recipe, embedding key, run directory, ...).
    block_rows     points read, checked and transformed per block (default: 64 MiB of float32,
                   ``build_block_rows``). Exact and IVF builds hold one float32 copy of the
                   transformed points (the index itself) plus one block, whatever ``points`` is
                   (a memory map is read block by block); HNSW reads the points whole.
    """
    c = _check_curvature(c)
    if kind == "ann" and method == "hnsw":
        points = _as_points(points, "points")
    N, d = _rows_of(points)
    if not hasattr(points, "shape") or len(points.shape) != 2:
        points = _as_points(points, "points")
    block = int(block_rows) if block_rows else build_block_rows(d)
    if block < 1:
        raise InputError(f"block_rows must be positive, got {block_rows}")
    max_norm = 0.0
    ext_ids = _as_ids(ids, N, 0)
    if len(np.unique(ext_ids)) != N:
        raise IndexMismatchError("ids contain duplicates; each point needs its own id")
    options: dict[str, Any] = {}
    if kind == "exact":
        index: faiss.Index = faiss.IndexFlatIP(d + 1)
        for _, xb in point_blocks(points, block):
            index.add(database_vectors(xb, c))
            max_norm = max(max_norm, _max_transformed_norm(xb, c))
        method_name = None
    elif kind == "ann":
        if method == "hnsw":
            options = {
                "M": int(M),
                "ef_construction": int(ef_construction),
                "ef_search": int(ef_search),
            }
            index = _build_hnsw(points, c, M=M, ef_construction=ef_construction)
            index.hnsw.efSearch = int(ef_search)
            max_norm = _max_transformed_norm(points, c)
        elif method == "ivf":
            # 4 sqrt(N) cells, but at least 39 training points per cell (Faiss's k-means minimum)
            nlist = int(nlist or max(1, min(round(4 * math.sqrt(max(N, 1))), N // 39)))
            if N < nlist:
                raise IndexMismatchError(
                    f"IVF needs at least nlist={nlist} points to train, got {N}"
                )
            options = {"nlist": nlist, "nprobe": int(nprobe)}
            rng = np.random.default_rng(seed)
            # faiss wants >= 39 per cell; only the sampled rows are read
            sample = _as_points(
                points[rng.choice(N, size=min(N, 40 * nlist), replace=False)], "points"
            )
            kmeans = faiss.Kmeans(d, nlist, niter=10, seed=seed, verbose=False)
            kmeans.train(sample)
            quantizer = faiss.IndexFlatIP(d + 1)
            assert kmeans.centroids is not None  # set by train()
            quantizer.add(database_vectors(kmeans.centroids, c))
            index = faiss.IndexIVFFlat(quantizer, d + 1, nlist, faiss.METRIC_INNER_PRODUCT)
            index.own_fields = True
            # the IVF index owns (and frees, and saves) its quantizer; `this`: SWIG's handle
            quantizer.this.disown()  # type: ignore[attr-defined]
            index.is_trained = True
            index.make_direct_map(True)  # reconstruct_batch for the exact rerank
            for _, xb in point_blocks(points, block):
                _ivf_add(index, xb, c)
                max_norm = max(max_norm, _max_transformed_norm(xb, c))
            index.nprobe = int(nprobe)
        else:
            raise InputError(f"unknown ANN method {method!r}; expected 'hnsw' or 'ivf'")
        method_name = method
    else:
        raise InputError(f"unknown index kind {kind!r}; expected 'exact' or 'ann'")
    info = IndexInfo(
        geometry=GEOMETRY,
        curvature=c,
        dim=d,
        count=N,
        kind=kind,
        method=method_name,
        options=options,
        max_norm=max_norm,
        meta=dict(meta or {}),
    )
    return LorentzIndex(index, info, ext_ids)


def _refuse_foreign(path: Path) -> None:
    if path.exists() and not (path / "index.json").exists() and any(path.iterdir()):
        raise OverwriteError(f"{path} exists and is not a curvalign index; not overwriting it")


def save_exact_index(
    path: str | os.PathLike,
    points: Any,
    c: float,
    *,
    meta: dict[str, Any] | None = None,
    block_rows: int | None = None,
) -> Path:
    """Write the exact index of ``points`` ``[N, d]`` (ids ``0..N-1``) to ``path`` without
    building it in memory: each block of ``block_rows`` rows (default ``build_block_rows``,
    64 MiB of float32) is read, checked, transformed and appended to ``index.faiss``. Memory
    outside the maps of ``points`` is one block, whatever N. The directory is the one
    ``LorentzIndex.save`` writes (``load_index`` reads it; its search scans the file)."""
    c = _check_curvature(c)
    path = Path(path)
    N, d = _rows_of(points)
    block = int(block_rows) if block_rows else build_block_rows(d)
    if block < 1:
        raise InputError(f"block_rows must be positive, got {block_rows}")
    _refuse_foreign(path)
    max_norm = 0.0

    def vectors() -> Iterator[np.ndarray]:
        nonlocal max_norm
        for _, xb in point_blocks(points, block):
            max_norm = max(max_norm, _max_transformed_norm(xb, c))
            yield database_vectors(xb, c)

    with staged_directory(path) as tmp:
        write_flat_index(tmp / "index.faiss", d + 1, vectors())
        np.save(tmp / "ids.npy", np.arange(N, dtype=np.int64))
        info = IndexInfo(
            geometry=GEOMETRY,
            curvature=c,
            dim=d,
            count=N,
            kind="exact",
            method=None,
            options={},
            max_norm=max_norm,
            meta=dict(meta or {}),
        )
        info.sha256 = file_checksums(tmp, ["index.faiss", "ids.npy"])
        info.file_stats = seal_files(tmp, ["index.faiss", "ids.npy"])
        (tmp / "index.json").write_text(json.dumps(info.__dict__, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    return path


__all__ = [
    "GEOMETRY",
    "IndexInfo",
    "IndexMismatchError",
    "LorentzIndex",
    "FlatFile",
    "build_index",
    "database_vectors",
    "distance_from_excess",
    "load_index",
    "lorentz_distance",
    "lorentz_excess",
    "lorentz_time",
    "poincare_ball",
    "query_vectors",
    "read_flat_or_faiss",
    "save_exact_index",
    "write_flat_index",
    "build_block_rows",
]
