"""curvalign.index: retrieval serving in the learned geometry.

``build_index(points, c, kind="exact")`` -> ``LorentzIndex`` over Lorentz points (space components
``[N, d]``); ``index.search(queries, k)`` -> ``(distances [n, k], ids [n, k])``, ascending distance,
ties by id; ``kind="ann"`` for HNSW / IVF with the same interface; ``load_index(path)``.
``RecipeIndex(recipe, database, side)`` ranks with any recipe's own score (proxy candidates, exact
rerank with ``pair_scores``); ``rerank_recall`` measures it against the exhaustive ranking.
"""

from curvalign.index.rerank import (
    RecipeIndex,
    default_proxy,
    exhaustive_topk,
    rerank_recall,
    search_images_to_texts,
    search_texts_to_images,
)
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

__all__ = [
    "RecipeIndex",
    "default_proxy",
    "exhaustive_topk",
    "rerank_recall",
    "search_images_to_texts",
    "search_texts_to_images",
    "GEOMETRY",
    "IndexInfo",
    "IndexMismatchError",
    "LorentzIndex",
    "build_index",
    "database_vectors",
    "distance_from_excess",
    "load_index",
    "lorentz_distance",
    "lorentz_excess",
    "lorentz_time",
    "query_vectors",
]
