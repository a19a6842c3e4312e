"""Answering ``curvalign index search``: pick the queries (row ids of an embeddings directory, or
a ``.npy`` of Lorentz points), search the index, and mark the true hits.

``search_queries`` returns a ``QueryResults``: per query its label (row id), the hit ids and
scores, and the ground truth where the embeddings carry it (a caption's image; an image's
captions); ``to_json`` / ``table_rows`` render it. The command line only parses and prints.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from curvalign.errors import InputError, NotFoundError
from curvalign.index.embed import SearchResult, load_embeddings, open_index, search_index


@dataclass
class QueryResults:
    """What one ``index search`` found.

    meta         the index's meta (recipe, side, ...)
    labels       [n] query labels: row ids of the query side (or positions in a .npy)
    result       hit ids and scores, ``[n, k]`` each
    truth        [n] true image of each text query, or None
    captions_of  caption -> image map, for image queries (a hit is true if it is a caption of
                 the query image), or None
    """

    index: str
    meta: dict[str, Any]
    labels: list[int]
    result: SearchResult
    truth: np.ndarray | None = None
    captions_of: np.ndarray | None = None

    def is_true_hit(self, i: int, item: int) -> bool:
        if self.truth is not None:
            return int(item) == int(self.truth[i])
        if self.captions_of is not None:
            return int(self.captions_of[int(item)]) == int(self.labels[i])
        return False

    @property
    def truth_note(self) -> str | None:
        if self.truth is not None:
            return "* = the caption's true image"
        if self.captions_of is not None:
            return "* = a caption of the query image"
        return None

    def to_json(self) -> dict[str, Any]:
        score_key = self.result.score_name + "s"
        return {
            "index": self.index,
            "recipe": self.meta["recipe"],
            "side": self.meta["side"],
            "results": [
                {
                    "query": int(q),
                    **({"true_image": int(self.truth[i])} if self.truth is not None else {}),
                    "ids": self.result.ids[i].tolist(),
                    score_key: self.result.scores[i].tolist(),
                }
                for i, q in enumerate(self.labels)
            ],
        }

    def columns(self) -> tuple[str, ...]:
        return ("query", "rank", "id", self.result.score_name) + (
            ("true image",) if self.truth is not None else ()
        )

    def table_rows(self) -> Iterator[list[str]]:
        """Rows of ``columns()``: the query label on its first hit, ``*`` after true hits."""
        for i, q in enumerate(self.labels):
            hits = zip(self.result.ids[i], self.result.scores[i], strict=True)
            for rank, (item, value) in enumerate(hits, start=1):
                mark = " *" if self.is_true_hit(i, item) else ""
                row = [str(q) if rank == 1 else "", str(rank), f"{int(item)}{mark}", f"{value:.6g}"]
                if self.truth is not None:
                    row.append(str(int(self.truth[i])) if rank == 1 else "")
                yield row


def _load_points(path: Path) -> np.ndarray:
    """A ``.npy`` of query points; one clear error for a missing or unreadable file."""
    if not path.is_file():
        raise NotFoundError(f"--query-npy {path}: no such file (expected a .npy of points [n, d])")
    try:
        return np.load(path)
    except (OSError, ValueError) as err:
        raise InputError(f"--query-npy {path} is not a readable .npy file ({err})") from None


def search_queries(
    index: str | os.PathLike,
    *,
    text_ids: Sequence[int] | None = None,
    image_ids: Sequence[int] | None = None,
    queries: str | os.PathLike | None = None,
    query_npy: str | os.PathLike | None = None,
    k: int = 10,
    candidates: int = 200,
) -> QueryResults:
    """Search ``index`` with rows ``text_ids`` / ``image_ids`` of the embeddings directory
    ``queries`` (default: the one the index was built from; every row of the other side when no
    ids are given), or with the Lorentz points of ``query_npy`` (Lorentz indexes only)."""
    if sum(x is not None for x in (text_ids, image_ids, query_npy)) > 1:
        raise InputError("give one of --query-text-ids, --query-image-ids, --query-npy")
    raw, lorentz = open_index(index)
    meta = raw["meta"]
    query_side = "texts" if meta["side"] == "images" else "images"
    if query_npy is not None:
        if lorentz is None:
            raise InputError(
                "--query-npy needs a Lorentz index; this one reranks with a recipe: "
                "use embedded queries"
            )
        points = _load_points(Path(query_npy))
        result = search_index(index, {meta["key"]: points}, k=k)
        return QueryResults(str(index), meta, list(range(len(points))), result)

    source = load_embeddings(queries or meta["embeddings"])
    wanted = "texts" if text_ids is not None else "images" if image_ids is not None else query_side
    if wanted != query_side:
        raise InputError(
            f"the index holds {meta['side']}; query it with {query_side} "
            f"(--query-{query_side[:-1]}-ids), not {wanted}"
        )
    side = source.side(query_side)
    n = next(iter(side.values())).shape[0]
    rows = text_ids if text_ids is not None else image_ids
    rows = list(rows) if rows is not None else list(range(n))
    bad = [r for r in rows if not 0 <= r < n]
    if bad:
        raise InputError(
            f"query row ids {bad[:5]} out of range: {Path(source.path)} has {n} {query_side}"
        )
    result = search_index(
        index,
        {key: np.asarray(v[rows]) for key, v in side.items()},
        k=k,
        candidates=candidates,
        query_recipe=source.recipe_name,
        query_curvature=source.curvature,
        query_geometries=[source.geometry(key) for key in side],
    )
    out = QueryResults(str(index), meta, rows, result)
    if query_side == "texts":
        out.truth = source.text_to_image()[rows]
    else:  # an image query: its own captions are the hits
        out.captions_of = source.text_to_image()
    return out


__all__ = ["QueryResults", "search_queries"]
