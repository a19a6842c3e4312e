"""curvalign.index: retrieval serving in the learned geometry.

``build_index(points, c, kind="exact")`` -> ``LorentzIndex`` over Lorentz points (space components
``[N, d]``); ``index.search(queries, k)`` -> ``(distances [n, k], ids [n, k])``, ascending distance,
ties by id; ``kind="ann"`` for HNSW / IVF with the same interface; ``load_index(path)``.
"""

from curvalign.index.search import (
    GEOMETRY,
    IndexInfo,
    IndexMismatchError,
    LorentzIndex,
    build_index,
    database_vectors,
    distance_from_excess,
    load_index,
    lorentz_distance,
    lorentz_excess,
    lorentz_time,
    query_vectors,
)

__all__ = ["GEOMETRY", "IndexInfo", "IndexMismatchError", "LorentzIndex", "build_index", "database_vectors",
           "distance_from_excess", "load_index", "lorentz_distance", "lorentz_excess", "lorentz_time",
           "query_vectors"]
