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
        """Rows of ``columns()``: the query label on its first hit, ``*`` after true hits; every
        distance or score with 4 decimals (one column format, as ``curvalign search`` prints)."""
        for i, q in enumerate(self.labels):
            hits = zip(self.result.ids[i], self.result.scores[i], strict=True)
            for rank, (item, value) in enumerate(hits, start=1):
                mark = " *" if self.is_true_hit(i, item) else ""
                row = [str(q) if rank == 1 else "", str(rank), f"{int(item)}{mark}", f"{value:.4f}"]
                if self.truth is not None:
                    row.append(str(int(self.truth[i])) if rank == 1 else "")
                yield row


def load_query_points(path: str | os.PathLike) -> np.ndarray:
    """Query points ``[n, d]`` (float) from a ``.npy`` file; an ``InputError`` naming the file and
    what was expected for anything else (a missing file, other bytes, pickled objects, ints)."""
    path = Path(path)
    expected = "a .npy file of float query points [n, d] (np.save of a float array)"
    if not path.is_file():
        raise NotFoundError(f"--query-npy {path}: no such file; expected {expected}")
    try:
        points = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "allow_pickle" in reason:
            reason = "it holds pickled Python objects"
        raise InputError(f"--query-npy {path} is not {expected}: {reason}") from None
    if not isinstance(points, np.ndarray) or points.dtype.kind != "f" or points.ndim != 2:
        what = (
            f"an array of dtype {points.dtype} and shape {list(points.shape)}"
            if isinstance(points, np.ndarray)
            else f"a {type(points).__name__}"
        )
        raise InputError(f"--query-npy {path} holds {what}; expected {expected}")
    return points


def search_queries(
    index: str | os.PathLike,
    *,
    text_ids: Sequence[int] | None = None,
    image_ids: Sequence[int] | None = None,
    queries: str | os.PathLike | None = None,
    query_npy: str | os.PathLike | None = None,
    all_queries: bool = False,
    k: int = 10,
    candidates: int = 200,
) -> QueryResults:
    """Search ``index`` with rows ``text_ids`` / ``image_ids`` of the embeddings directory
    ``queries`` (default: the one the index was built from), with every row of the other side
    (``all_queries``), or with the Lorentz points of ``query_npy`` (Lorentz indexes only).
    Exactly one of the four must be given: no query is an error, not a search of everything."""
    given = sum(x is not None for x in (text_ids, image_ids, query_npy)) + int(all_queries)
    if given != 1:
        raise InputError(
            ("give only one" if given else "give a query: one")
            + " of --query-text-ids, --query-image-ids, --query-npy, --all-queries"
        )
    raw, lorentz = open_index(index)
    meta = raw["meta"]
    query_side = "texts" if meta["side"] == "images" else "images"
    if query_npy is not None:
        if lorentz is None:
            raise InputError(
                "--query-npy needs a Lorentz index; this one reranks with a recipe: "
                "use embedded queries"
            )
        points = load_query_points(Path(query_npy))
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
        query_weights=source.meta.get("weights_sha256"),
    )
    out = QueryResults(str(index), meta, rows, result)
    if query_side == "texts":
        out.truth = source.text_to_image()[rows]
    else:  # an image query: its own captions are the hits
        out.captions_of = source.text_to_image()
    return out


__all__ = ["QueryResults", "load_query_points", "search_queries"]
