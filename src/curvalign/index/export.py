"""Out to a vector database: a Lorentz index's points in a Qdrant collection.

Qdrant ranks by an inner product when a collection uses ``Distance.DOT``. The transform of
``search.py`` makes that inner product the Minkowski one:

    stored vector   u(x) = [x, t(x)]        (d + 1 floats, t(x) = sqrt(1/c + |x|^2))
    query vector    v(y) = [y, -t(y)]
    DB score        s = u(x).v(y) = x.y - t(x) t(y) = <x, y>_L   (always <= -1/c)

so Qdrant's descending score order is ascending Lorentz distance, and a score turns back into
the distance by ``d = acosh(-c s) / sqrt(c)`` (``distance_from_score``; clamp ``-c s >= 1``
against float32 rounding). Qdrant computes ``s`` in float32: far from the origin its order can
differ from the exact one between near-ties (``LorentzIndex`` certifies its answers; the
database does not), so for exact answers rerank the database's top candidates with
``lorentz_distance``.

``export_qdrant`` writes into Qdrant's embedded local mode (``QdrantClient(path=...)``: files on
disk, no server, no network); the same collection layout serves a Qdrant server or cluster
(pass ``client=QdrantClient(url=...)``). Payloads carry what a person recognises an item by
(caption, path, class, synset). ``pip install 'curvalign[qdrant]'``; imported only here.

Out to hyperbolic visualisers: ``export_poincare`` writes an index's points as Poincare-ball
coordinates (NumPy ``.npz``, or Parquet when pyarrow is installed). With curvature ``-c`` the
ball has radius ``1/sqrt(c)``:

    p = x / (1 + sqrt(c) t(x))                    (Lorentz space part x -> ball)
    x = 2 p / (1 - c |p|^2)                       (back: ``lorentz_from_poincare``)
    d(p, q) = acosh(1 + 2 c |p - q|^2 / ((1 - c|p|^2)(1 - c|q|^2))) / sqrt(c)

all in float64 (the ball crowds far points against its edge: float32 would lose them); a
tool that wants the unit ball takes ``sqrt(c) p`` (distances then scale by ``sqrt(c)``). Each
row also carries ``dist0``, its geodesic distance to the origin in the manifold's own units
(``asinh(sqrt(c) |x|) / sqrt(c)``), never a database score.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from curvalign.errors import InputError, OverwriteError
from curvalign.index.embed import index_sources, open_index, source_side
from curvalign.index.search import (
    IndexMismatchError,
    database_vectors,
    lorentz_time,
    query_vectors,
)

EXPORT_INFO = "curvalign-export.json"


def _qdrant() -> Any:
    try:
        import qdrant_client
    except ImportError:
        raise IndexMismatchError(
            "exporting to Qdrant needs qdrant-client: pip install 'curvalign[qdrant]'"
        ) from None
    return qdrant_client


def qdrant_query_vector(y: np.ndarray, c: float) -> np.ndarray:
    """Queries ``[n, d]`` (Lorentz space components) -> ``[n, d + 1]`` ``[y, -t(y)]``."""
    return query_vectors(np.atleast_2d(np.asarray(y, dtype=np.float32)), c)


def distance_from_score(score: ArrayLike, c: float) -> np.ndarray:
    """Qdrant's DOT score ``s = <x,y>_L`` -> Lorentz distance ``acosh(-c s) / sqrt(c)``."""
    arg = np.maximum(-c * np.asarray(score, dtype=np.float64), 1.0)
    return np.arccosh(arg) / math.sqrt(c)


@dataclass
class QdrantExport:
    path: Path | None
    collection: str
    count: int
    dim: int
    curvature: float


def _fast_local_writes(client: Any, collection: str) -> None:
    """Qdrant's embedded mode stores each point with its own synchronous SQLite commit (about
    30 ms a point on our disk: 45 s for 1500 points); an export is written once and re-run from
    scratch if interrupted, so it turns the per-commit sync off on that collection's file (65x
    faster in our check). Reaches into qdrant-client's local storage: when its layout changes,
    the export still works, only slower."""
    try:
        connection = client._client.collections[collection].storage.storage
        connection.execute("PRAGMA synchronous=OFF")
    except (AttributeError, KeyError, TypeError):
        pass
    except Exception as exc:  # sqlite3.Error without importing sqlite3 here
        if type(exc).__module__ != "sqlite3":
            raise


def export_points(
    points: np.ndarray,
    c: float,
    collection: str,
    *,
    path: str | os.PathLike | None = None,
    client: Any = None,
    ids: np.ndarray | None = None,
    payloads: list[dict[str, Any]] | None = None,
    batch_size: int = 1024,
) -> QdrantExport:
    """Write Lorentz points ``[N, d]`` into a new Qdrant collection (DOT) of ``[x, t(x)]``.

    ``path``: a directory for Qdrant's embedded local mode; or ``client``: any QdrantClient.
    """
    qc = _qdrant()
    from qdrant_client import models

    if (path is None) == (client is None):
        raise InputError("give exactly one of path (embedded local mode) or client")
    points = np.asarray(points)
    if points.ndim != 2:
        raise IndexMismatchError(
            f"points must be [N, d] Lorentz space components, got {list(points.shape)}"
        )
    n, d = points.shape
    ids = np.arange(n) if ids is None else np.asarray(ids, dtype=np.int64)
    if client is None and path is not None:  # exactly one of the two (checked above)
        Path(path).mkdir(parents=True, exist_ok=True)
        client = qc.QdrantClient(path=str(path))
    if client.collection_exists(collection):
        raise OverwriteError(
            f"the Qdrant collection {collection!r} exists already; not overwriting it"
        )
    client.create_collection(
        collection, vectors_config=models.VectorParams(size=d + 1, distance=models.Distance.DOT)
    )
    if path is not None:
        _fast_local_writes(client, collection)
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        vectors = database_vectors(np.asarray(points[start:stop], dtype=np.float32), c)
        client.upsert(
            collection,
            points=models.Batch(
                ids=[int(i) for i in ids[start:stop]],
                vectors=vectors.tolist(),
                payloads=payloads[start:stop] if payloads is not None else None,
            ),
            wait=True,
        )
    if path is not None:
        info = {
            "collection": collection,
            "curvature": c,
            "dim": d,
            "count": n,
            "database_vector": "[x, t(x)]",
            "query_vector": "[y, -t(y)]",
            "score": "<x,y>_L; distance = acosh(-c * score) / sqrt(c)",
        }
        (Path(path) / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        client.close()
    return QdrantExport(Path(path) if path is not None else None, collection, n, d, c)


def export_qdrant(
    index_dir: str | os.PathLike,
    path: str | os.PathLike,
    collection: str | None = None,
    *,
    items: bool = True,
    batch_size: int = 1024,
) -> QdrantExport:
    """Export the points of a Lorentz index (its sources' embeddings) with item payloads."""
    raw, lorentz = open_index(index_dir)
    meta = raw["meta"]
    if lorentz is None:
        raise IndexMismatchError(
            f"{index_dir} ranks {meta['recipe']!r} by its own score after proxy candidates; only "
            "Lorentz-distance indexes export to an inner-product database exactly"
        )
    sources = index_sources(meta)
    points = source_side(sources, meta["side"])[meta["key"]]
    ids = np.concatenate([np.arange(s["first_id"], s["first_id"] + s["count"]) for s in sources])
    payloads = None
    if items:
        from curvalign.index.searcher import index_items

        named = index_items(meta)
        payloads = []
        for i in ids.tolist():
            item = named(i)
            payloads.append({k: v for k, v in item.__dict__.items() if v is not None})
    name = collection or f"curvalign-{meta['recipe']}-{meta['side']}"
    return export_points(
        points,
        lorentz.curvature,
        name,
        path=path,
        ids=ids,
        payloads=payloads,
        batch_size=batch_size,
    )


def poincare_coordinates(x: np.ndarray, c: float) -> np.ndarray:
    """Lorentz space components ``[N, d]`` -> Poincare-ball points ``[N, d]`` (float64, radius
    ``1/sqrt(c)``): ``x / (1 + sqrt(c) t(x))``."""
    x64 = np.asarray(x, dtype=np.float64)
    return x64 / (1.0 + math.sqrt(c) * lorentz_time(x64, c))[..., None]


def lorentz_from_poincare(p: np.ndarray, c: float) -> np.ndarray:
    """Poincare-ball points ``[N, d]`` -> Lorentz space components ``2 p / (1 - c |p|^2)``."""
    p64 = np.asarray(p, dtype=np.float64)
    return 2.0 * p64 / (1.0 - c * np.einsum("...i,...i->...", p64, p64))[..., None]


def geodesic_dist0(x: np.ndarray, c: float) -> np.ndarray:
    """Geodesic distance to the origin of Lorentz points ``[N, d]``: ``asinh(sqrt(c)|x|)/sqrt(c)``
    (equal to ``acosh(sqrt(c) t(x)) / sqrt(c)``, without acosh's loss near the origin)."""
    norm = np.linalg.norm(np.asarray(x, dtype=np.float64), axis=-1)
    return np.arcsinh(math.sqrt(c) * norm) / math.sqrt(c)


@dataclass
class PoincareExport:
    path: Path
    format: str  # "npz" or "parquet"
    count: int
    dim: int
    curvature: float


def _index_points(
    index_dir: str | os.PathLike,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray, float]:
    """(index meta, Lorentz points [N, d], ids [N], curvature) of a Lorentz index."""
    raw, lorentz = open_index(index_dir)
    meta = raw["meta"]
    if lorentz is None:
        raise IndexMismatchError(
            f"{index_dir} ranks {meta['recipe']!r} by its own score after proxy candidates; only "
            "an index of Lorentz points (meru, hycoclip, atmg) has Poincare coordinates"
        )
    sources = index_sources(meta)
    points = source_side(sources, meta["side"])[meta["key"]]
    ids = np.concatenate([np.arange(s["first_id"], s["first_id"] + s["count"]) for s in sources])
    return meta, np.asarray(points), ids, float(lorentz.curvature)


def export_poincare(
    index_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    items: bool = True,
    overwrite: bool = False,
) -> PoincareExport:
    """Write the points of a Lorentz index as Poincare-ball coordinates (module docstring).

    ``path`` ending in ``.parquet``: a Parquet table (pyarrow) with columns ``id``,
    ``poincare`` (list of d float64), ``dist0`` and the items' strings (``caption``, ``path``,
    ...), the curvature and radius in the schema metadata. Otherwise a NumPy ``.npz`` with
    arrays ``ids [N]``, ``poincare [N, d]``, ``dist0 [N]``, ``curvature []`` and one string
    array ``item_FIELD [N]`` per item field ("" where a row has none). Written atomically.
    """
    target = Path(path)
    fmt = "parquet" if target.suffix == ".parquet" else "npz"
    if fmt == "npz" and target.suffix != ".npz":
        raise InputError(f"--path {target}: expected a file ending in .npz or .parquet")
    if target.exists() and not overwrite:
        raise OverwriteError(f"{target} exists already; not overwriting it")
    if fmt == "parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise IndexMismatchError(
                f"{target}: writing Parquet needs pyarrow (pip install pyarrow); a .npz path "
                "needs nothing more"
            ) from None
    meta, points, ids, c = _index_points(index_dir)
    ball = poincare_coordinates(points, c)
    dist0 = geodesic_dist0(points, c)
    strings: dict[str, list[str]] = {}
    if items:
        from curvalign.index.searcher import index_items

        named = index_items(meta)
        rows = [named(int(i)).__dict__ for i in ids]
        fields = [k for k in rows[0] if k != "id" and any(r.get(k) is not None for r in rows)]
        strings = {k: ["" if r.get(k) is None else str(r[k]) for r in rows] for k in fields}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    info = {
        "curvature": c,
        "radius": 1.0 / math.sqrt(c),
        "recipe": meta.get("recipe"),
        "side": meta.get("side"),
        "dist0": "geodesic distance to the origin, in the manifold's units",
    }
    if fmt == "npz":
        with open(tmp, "wb") as handle:
            np.savez(
                handle,
                ids=ids.astype(np.int64),
                poincare=ball,
                dist0=dist0,
                curvature=np.float64(c),
                info=np.array(json.dumps(info)),
                # numpy's stubs read ** as possibly `allow_pickle`; these keys are item_*
                **{f"item_{k}": np.array(v, dtype=str) for k, v in strings.items()},  # type: ignore[arg-type]
            )
    else:
        d = ball.shape[1]
        table = pa.table(
            {
                "id": pa.array(ids.astype(np.int64)),
                "poincare": pa.FixedSizeListArray.from_arrays(pa.array(ball.reshape(-1)), d),
                "dist0": pa.array(dist0),
                **{k: pa.array(v) for k, v in strings.items()},
            }
        ).replace_schema_metadata({"curvalign": json.dumps(info)})
        pq.write_table(table, tmp)
    os.replace(tmp, target)
    return PoincareExport(target, fmt, int(ball.shape[0]), int(ball.shape[1]), c)


__all__ = [
    "EXPORT_INFO",
    "PoincareExport",
    "export_poincare",
    "geodesic_dist0",
    "lorentz_from_poincare",
    "poincare_coordinates",
    "QdrantExport",
    "distance_from_score",
    "export_points",
    "export_qdrant",
    "qdrant_query_vector",
]
