"""Search a person can use: free text or image files in, named items out.

``Searcher.open(run_dir, index_dir)`` ties together the three things a query passes through:

1. the **local encoder** that made the run's features (recorded in the run's ``meta.json`` as
   ``encoder`` by training, from the feature store's ``meta["encoder"]``; or an explicit spec),
   which turns a text or an image into a feature row ``[1, D]``;
2. the **run's recipe**, whose head maps that row into its geometry (an ``Embedding``);
3. the **index** built over one side of the run's embeddings (``curvalign index build``), which
   ranks with the recipe's own score: an exact or ANN ``LorentzIndex`` (Lorentz distance,
   ascending) or a ``RecipeIndex`` (proxy candidates, exact rerank with ``pair_scores``,
   score descending).

Each hit carries the item's rank, its distance (Lorentz indexes) and score (higher is better:
``-distance`` for Lorentz indexes), and what a person recognises it by: caption, image path
(relative to the store's ``images_root``), class name and synset (taxonomy node), read from the
feature store the embeddings were made from.

Checks, each one clear error before any heavy work: a query of the wrong modality for the index
(an index of images answers texts), an encoder spec naming files that are not on disk (checked
without importing any model library), an encoder whose feature dimension is not the run's, an
image file that cannot be decoded. A ``Searcher`` is safe to share between threads (one lock
around encoder, head and index: tokenizers and Faiss parameter changes are not re-entrant).
"""

from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from numpy.typing import ArrayLike

from curvalign.errors import CurvalignError
from curvalign.index.embed import (
    check_same_run,
    index_sources,
    load_embeddings,
    open_index,
    open_rerank_engine,
    source_side,
)
from curvalign.index.rerank import as_torch_embedding
from curvalign.index.search import IndexMismatchError, poincare_ball
from curvalign.readout import embed_rows
from curvalign.recipes.base import Embedding

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

    from curvalign.data.encoders import Encoder
    from curvalign.data.features import FeatureStore
    from curvalign.recipes.base import Recipe
    from curvalign.runs import LoadedRun

    #: an image query: a path, raw bytes or a PIL image
    ImageQuery = str | os.PathLike[str] | bytes | bytearray | PILImage

Modality = Literal["text", "image"]


class SearchError(CurvalignError, ValueError):
    """A query, encoder, run or index that cannot answer a search; the message says which."""


@dataclass(frozen=True)
class Item:
    """What a person recognises an indexed row by (fields are None where the store lacks them).

    id          row id in the indexed side (the feature store's row)
    side        "image" or "text"
    caption     a text row's string; for an image row its own text (WordNet's lemma names) or
                its first caption
    path        image file relative to ``images_root`` (a text row: its image's file)
    class_name  the image's class (``class_names[image_labels]``)
    synset      the class's taxonomy node (``taxonomy_names[class_to_node]``), e.g. dog.n.01
    """

    id: int
    side: str
    caption: str | None = None
    path: str | None = None
    class_name: str | None = None
    synset: str | None = None


@dataclass(frozen=True)
class Hit:
    """One result: ``rank`` from 1; ``score`` higher is better; ``distance`` (Lorentz indexes)."""

    rank: int
    id: int
    score: float
    distance: float | None
    item: Item


@dataclass
class SearchResults:
    """The hits of one query, best first. ``disk``: a Poincaré-disk picture (hyperbolic runs)."""

    query: str
    modality: str
    ranked_by: str  # "distance" (ascending) or "score" (descending)
    hits: list[Hit]
    disk: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    #: the columns of ``table_rows``, after ``rank`` and ``ranked_by``
    ITEM_COLUMNS = ("caption", "image", "class")

    def table_rows(self) -> list[tuple[str, ...]]:
        """One row of strings per hit: rank, distance or score (4 decimals), the caption (or
        ``(row ID)``), the image path, the class (with its synset when that differs)."""
        rows: list[tuple[str, ...]] = []
        for hit in self.hits:
            value = hit.distance if hit.distance is not None else hit.score
            item = hit.item
            label = item.class_name or ""
            if item.synset and item.synset != item.class_name:
                label = f"{item.class_name} ({item.synset})"
            caption = item.caption or f"(row {item.id})"
            rows.append((str(hit.rank), f"{value:.4f}", caption, item.path or "", label))
        return rows


class _StoreItems:
    """Row -> Item for one side of one feature store (string lists and labels, no features)."""

    def __init__(self, store: FeatureStore | None, side: str) -> None:
        self.side = side
        self.images_root = store.meta.get("images_root") if store is not None else None
        self.store = store
        if store is None:
            return
        t2i = store.text_to_image.numpy()
        self.text_to_image = t2i
        first = np.full(store.num_images, -1, dtype=np.int64)
        order = np.arange(len(t2i))[::-1]  # reversed writes leave each image's first caption
        first[t2i[order]] = order
        self.first_caption = first

    def _image_facts(self, i: int) -> dict[str, Any]:
        s = self.store
        facts: dict[str, Any] = {}
        if s is None:  # no store: the item has its id alone
            return facts
        if s.image_paths is not None:
            facts["path"] = s.image_paths[i]
        if s.image_labels is not None and s.class_names is not None:
            label = int(s.image_labels[i])
            if label >= 0:
                facts["class_name"] = s.class_names[label]
                if s.class_to_node is not None and s.taxonomy_names is not None:
                    facts["synset"] = s.taxonomy_names[int(s.class_to_node[label])]
        return facts

    def __call__(self, item_id: int, row: int) -> Item:
        if self.store is None:
            return Item(id=item_id, side=self.side)
        s = self.store
        if self.side == "image":
            caption = None
            if s.image_texts is not None:
                caption = s.image_texts[row]
            elif s.texts is not None and self.first_caption[row] >= 0:
                caption = s.texts[int(self.first_caption[row])]
            return Item(id=item_id, side="image", caption=caption, **self._image_facts(row))
        caption = s.texts[row] if s.texts is not None else None
        return Item(
            id=item_id,
            side="text",
            caption=caption,
            **self._image_facts(int(self.text_to_image[row])),
        )


class _Items:
    """Id -> Item over the index's sources (each an embeddings directory of one store)."""

    def __init__(self, parts: list[tuple[int, int, _StoreItems]], side: str) -> None:
        self.parts = parts
        self.side = side
        self.starts = np.array([p[0] for p in parts], dtype=np.int64)
        # one images root serves the page; items of a source under another root carry their
        # absolute path (shown, but not served as thumbnails)
        self.images_root = parts[0][2].images_root if parts else None

    def __call__(self, item_id: int) -> Item:
        if not self.parts:
            return Item(id=item_id, side=self.side)
        at = int(np.searchsorted(self.starts, item_id, side="right")) - 1
        first, count, items = self.parts[max(at, 0)]
        if not 0 <= item_id - first < count:
            return Item(id=item_id, side=self.side)
        item = items(item_id, item_id - first)
        if item.path is not None and items.images_root not in (None, self.images_root):
            item = Item(**{**asdict(item), "path": str(Path(items.images_root) / item.path)})
        return item


def index_items(meta: dict[str, Any]) -> _Items:
    """Id -> Item for an index (its ``index.json`` ``meta``), from the stores of its sources."""
    side = "image" if meta["side"] == "images" else "text"
    parts = []
    for source in index_sources(meta):
        store = _load_store(load_embeddings(source["embeddings"]).meta.get("data"))
        parts.append((source["first_id"], source["count"], _StoreItems(store, side)))
    return _Items(parts, side)


def _load_store(spec: str | None) -> FeatureStore | None:
    if not spec or spec.startswith("<"):
        return None  # an in-memory store: nothing to read items from
    from curvalign.data import load_data

    try:
        return load_data(spec)
    except (ValueError, OSError) as exc:
        raise SearchError(
            f"cannot read the items of the indexed store {spec!r} ({exc}); "
            "results would have no captions or paths"
        ) from None


def _open_image(image: Any) -> Any:
    """A PIL RGB image from a path, raw bytes or a PIL image; SearchError if it cannot be decoded."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    name = "uploaded image" if isinstance(image, (bytes, bytearray)) else f"image {image}"
    try:
        source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
        with Image.open(source) as opened:
            opened.load()
            return opened.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise SearchError(f"{name}: cannot read it as an image ({exc})") from None


class Searcher:
    """Free-text and image search over an index of a trained run (see the module docstring)."""

    def __init__(
        self,
        run: LoadedRun,
        index_dir: Path,
        raw: dict[str, Any],
        engine: Any,
        items: _Items,
        encoder: Encoder | str | None,
        candidates: int,
        device: str,
    ) -> None:
        self.run = run
        self.index_dir = index_dir
        self.meta = raw["meta"]
        self._raw = raw
        self._engine = engine
        self._items = items
        self._encoder = encoder  # an Encoder, a spec string (loaded on first use) or None
        self.candidates = candidates
        self.device = device
        self._lock = threading.Lock()
        self.indexed: Modality = "image" if self.meta["side"] == "images" else "text"
        self.query_modality: Modality = "text" if self.indexed == "image" else "image"
        self._disk_source: tuple[np.ndarray, str, float] | None = None
        self._disk_ready = False

    # -- construction --
    @classmethod
    def open(
        cls,
        run_dir: str | os.PathLike,
        index_dir: str | os.PathLike,
        *,
        encoder: Encoder | str | None = None,
        candidates: int = 200,
        device: str = "cpu",
        items: bool = True,
    ) -> Searcher:
        """Open ``index_dir`` (``curvalign index build``) over embeddings of the run ``run_dir``.

        ``encoder``: a spec string or an ``Encoder``; default the one the run records. Its files
        are checked now (no model library imported); the model loads on the first query.
        ``items=False`` skips reading the store's captions and paths (results carry ids only).
        """
        from curvalign._encoder_spec import EncoderError, check_encoder_paths
        from curvalign.runs import load_run

        if candidates < 1:
            raise SearchError(f"candidates must be positive, got {candidates}")
        index_dir = Path(index_dir)
        raw, lorentz = open_index(index_dir)
        meta = raw["meta"]
        # the weights the index's embeddings came from (best by default; older indexes: last)
        run = load_run(run_dir, weights=meta.get("weights") or "last")
        if run.config.recipe != meta.get("recipe"):
            raise SearchError(
                f"the index {index_dir} holds {meta.get('recipe')!r} embeddings but the run "
                f"{run_dir} is a {run.config.recipe!r} run; open the index with its own run"
            )
        try:  # step and weights' SHA-256: the index must come from this run as it is now
            check_same_run(meta, run, f"the index {index_dir}", "embed and index build")
        except IndexMismatchError as exc:
            raise SearchError(str(exc)) from None
        spec = encoder if encoder is not None else run.meta.get("encoder")
        if isinstance(spec, str):
            try:
                check_encoder_paths(spec)
            except EncoderError as exc:
                raise SearchError(str(exc)) from None
        engine = lorentz if lorentz is not None else open_rerank_engine(index_dir, raw, run)
        side = "image" if meta["side"] == "images" else "text"
        named = index_items(meta) if items else _Items([], side)
        return cls(run, index_dir, raw, engine, named, spec, candidates, device)

    # -- facts --
    @property
    def recipe(self) -> Recipe:
        return self.run.recipe

    @property
    def images_root(self) -> str | None:
        return self._items.images_root

    @property
    def ranked_by(self) -> str:
        return "distance" if self._raw.get("mode") != "rerank" else "score"

    @property
    def encoder_spec(self) -> str | None:
        enc = self._encoder
        return enc if isinstance(enc, str) or enc is None else enc.spec

    def info(self) -> dict[str, Any]:
        """JSON facts for ``/health`` and the page."""
        return {
            "recipe": self.meta.get("recipe"),
            "run_dir": str(self.run.run_dir),
            "step": self.run.step,
            "index": str(self.index_dir),
            "indexed": self.indexed,
            "query_modality": self.query_modality,
            "count": len(self._engine),
            "ranked_by": self.ranked_by,
            "encoder": self.encoder_spec,
            "hyperbolic": self._disk_points() is not None,
        }

    # -- encoding --
    def encoder(self) -> Encoder:
        """The query encoder, loaded on first use."""
        if self._encoder is None:
            raise SearchError(self._no_encoder_message())
        if isinstance(self._encoder, str):
            from curvalign.data.encoders import EncoderError, load_encoder

            try:
                self._encoder = load_encoder(self._encoder, device=self.device)
            except EncoderError as exc:
                raise SearchError(str(exc)) from None
        return self._encoder

    def _no_encoder_message(self) -> str:
        """Why a free-text or image query cannot be encoded for this run, and what can be done:
        the message fits where the run's features came from (its recorded data spec)."""
        data = str(self.run.meta.get("data") or "")
        kind = self.query_modality
        by_id = (
            f"search with the row ids of embedded {kind}s instead (curvalign index search "
            f"{self.index_dir} --query-{kind}-ids 0,5) or with precomputed {kind} features "
            "(Searcher.search_features in Python)"
        )
        if data.startswith("synthetic"):
            return (
                f"the run {self.run.run_dir} was trained on synthetic data ({data}): no encoder "
                f"made its features, so a {kind} query cannot be encoded; {by_id}"
            )
        message = (
            f"the run {self.run.run_dir} was trained on {data or 'a store'}, whose features come "
            "from an encoder curvalign does not know (the store records none); a "
            f"{kind} query needs --encoder SPEC naming that same encoder (e.g. "
            f"open_clip:ARCH:CHECKPOINT), or {by_id}"
        )
        if data.startswith("clip-retrieval:"):
            # the README's promise: what search shows is the parquet's, whatever the encoder
            message += (
                "; the captions and paths in the results come from the layout's parquet "
                "metadata, not from an encoder"
            )
        return message

    def _check_modality(self, modality: Modality) -> None:
        if modality != self.query_modality:
            raise SearchError(
                f"the index {self.index_dir} holds {self.indexed}s, ranked for {self.query_modality} "
                f"queries; {'an' if modality == 'image' else 'a'} {modality} query does not fit "
                f"it (build an index of the "
                f"{'texts' if modality == 'image' else 'images'} side: "
                f"curvalign index build EMB --side {'texts' if modality == 'image' else 'images'})"
            )

    def _features(self, queries: Sequence[Any], modality: Modality) -> torch.Tensor:
        enc = self.encoder()
        if modality == "image":
            if not enc.encodes_images:
                raise SearchError(
                    f"encoder {enc.spec!r} encodes texts only; image queries need an image-text encoder"
                )
            images = [_open_image(q) for q in queries]
            feats = enc.encode_images(images)
        else:
            feats = enc.encode_texts(list(queries))
        want = int(self.run.meta["image_dim" if modality == "image" else "text_dim"])
        if feats.shape[-1] != want:
            raise SearchError(
                f"encoder {enc.spec!r} gives {modality} features of dimension {feats.shape[-1]} but "
                f"the run {self.run.run_dir} was trained on {want}-dimensional {modality} features; "
                "use the encoder its feature store was extracted with"
            )
        return feats.float()

    def embed(self, features: torch.Tensor, modality: Modality) -> Embedding:
        """Feature rows ``[n, D]`` of ``modality`` -> the run's Embedding (its head's output)."""
        emb = embed_rows(self.run.recipe, modality, features)
        return {k: v.detach().cpu() for k, v in emb.items()}

    # -- searching --
    def search_text(self, text: str, k: int = 10) -> SearchResults:
        return self.search_texts([text], k)[0]

    def search_image(self, image: ImageQuery, k: int = 10) -> SearchResults:
        """``image``: a path, raw bytes or a PIL image."""
        return self.search_images([image], k)[0]

    def search_texts(self, texts: Sequence[str], k: int = 10) -> list[SearchResults]:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not all(isinstance(t, str) and t.strip() for t in texts):
            raise SearchError("text queries must be non-empty strings")
        return self._search(texts, [t for t in texts], "text", k)

    def search_images(self, images: Sequence[ImageQuery], k: int = 10) -> list[SearchResults]:
        images = list(images)
        labels = [
            "uploaded image"
            if isinstance(im, (bytes, bytearray))
            else str(getattr(im, "filename", "") or im)
            for im in images
        ]
        return self._search(images, labels, "image", k)

    def search_features(
        self,
        features: ArrayLike,
        modality: Modality,
        k: int = 10,
        labels: Sequence[str] | None = None,
    ) -> list[SearchResults]:
        """Search with precomputed encoder features ``[n, D]`` (the encoder step excluded)."""
        self._check_modality(modality)
        if modality == "text" and self.run.recipe.text_tokens:
            raise SearchError(
                f"the run {self.run.run_dir} reads text tokens [n, L, D] with a mask; search it "
                "from text (the encoder gives the tokens), not with pooled text features"
            )
        feats = torch.as_tensor(np.asarray(features), dtype=torch.float32)
        want = int(self.run.meta["image_dim" if modality == "image" else "text_dim"])
        if feats.ndim != 2 or feats.shape[1] != want:
            raise SearchError(
                f"{modality} features must have shape [n, {want}] for this run, got {list(feats.shape)}"
            )
        labels = list(labels) if labels is not None else [f"row {i}" for i in range(len(feats))]
        with self._lock:
            return self._search_embedding(self.embed(feats, modality), labels, modality, k)

    def _search(
        self, queries: list[Any], labels: list[str], modality: Modality, k: int
    ) -> list[SearchResults]:
        self._check_modality(modality)
        if k < 1:
            raise SearchError(f"k must be at least 1, got {k}")
        if not queries:
            return []
        with self._lock:
            if modality == "text" and self.run.recipe.text_tokens:
                return self._search_embedding(self._embed_text_tokens(queries), labels, "text", k)
            feats = self._features(queries, modality)
            return self._search_embedding(self.embed(feats, modality), labels, modality, k)

    def _embed_text_tokens(self, queries: Sequence[str]) -> Embedding:
        """Text queries of a run that reads text tokens: the encoder's token features + mask."""
        enc = self.encoder()
        tokens, mask = enc.encode_text_tokens(list(queries))
        want = int(self.run.meta["text_dim"])
        if tokens.shape[-1] != want:
            raise SearchError(
                f"encoder {enc.spec!r} gives token features of dimension {tokens.shape[-1]} but "
                f"the run {self.run.run_dir} was trained on {want}-dimensional text tokens"
            )
        emb = embed_rows(self.run.recipe, "text", tokens, mask)
        return {k: v.detach().cpu() for k, v in emb.items()}

    def _search_embedding(
        self, emb: Embedding, labels: list[str], modality: Modality, k: int
    ) -> list[SearchResults]:
        if self.ranked_by == "distance":
            key = self.meta["key"]
            try:
                distances, ids = self._engine.search(emb[key].numpy(), k)
            except IndexMismatchError as exc:
                raise SearchError(str(exc)) from None
            scores = -distances
        else:
            scores, ids = self._engine.search(as_torch_embedding(emb), k, self.candidates)
            distances = None
        out = []
        for i, label in enumerate(labels):
            hits = [
                Hit(
                    rank=r + 1,
                    id=int(ids[i, r]),
                    score=float(scores[i, r]),
                    distance=float(distances[i, r]) if distances is not None else None,
                    item=self._items(int(ids[i, r])),
                )
                for r in range(ids.shape[1])
            ]
            out.append(
                SearchResults(
                    query=label,
                    modality=modality,
                    ranked_by=self.ranked_by,
                    hits=hits,
                    disk=self._disk(emb, i, ids[i]),
                )
            )
        return out

    # -- the Poincaré-disk picture --
    def _disk_points(self) -> tuple[np.ndarray, str, float] | None:
        """(database points [N, d] of the indexed side's Lorentz key, key, c), or None when the
        run's embedding has no single Lorentz point set (not a hyperbolic run)."""
        if self._disk_ready:
            return self._disk_source
        self._disk_ready = True
        try:
            sources = index_sources(self.meta)
            emb = load_embeddings(sources[0]["embeddings"])
        except (OSError, ValueError):
            return None
        curvature = emb.curvature
        for key, facts in emb.meta.get("keys", {}).items():
            if facts.get("geometry") == "lorentz" and len(facts.get("shape", [])) == 1:
                if curvature:
                    points = source_side(sources, self.meta["side"])[key]
                    self._disk_source = (points, key, float(curvature[0]))
                break
        return self._disk_source

    def _disk(self, emb: Embedding, row: int, ids: np.ndarray) -> dict[str, Any] | None:
        source = self._disk_points()
        if source is None:
            return None
        points, key, c = source
        if key not in emb:
            return None
        query = emb[key][row : row + 1].numpy().astype(np.float64)
        found = np.asarray(points[np.asarray(ids, dtype=np.int64)], dtype=np.float64)
        xy = poincare_disk_2d(np.vstack([query, found]), c)
        return {
            "curvature": c,
            "query": xy[0].tolist(),
            "hits": xy[1:].tolist(),
            "note": "radius exact (tanh of half the distance to the origin); angle projected",
        }


def read_queries(texts: Sequence[str], queries_file: str | os.PathLike | None) -> list[str]:
    """The text queries of ``curvalign search``: ``texts``, then the non-blank lines of the UTF-8
    file ``queries_file`` (stripped), in that order."""
    queries = list(texts)
    if queries_file is not None:
        try:
            lines = Path(queries_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise SearchError(f"--queries-file {queries_file}: cannot read it ({err})") from None
        queries += [line.strip() for line in lines if line.strip()]
    return queries


def poincare_disk_2d(points: np.ndarray, c: float) -> np.ndarray:
    """Lorentz space components ``[n, d]`` -> ``[n, 2]`` in the unit Poincaré disk.

    The radius of each point is exact: ``sqrt(c) |p| = tanh(sqrt(c) d(o, x) / 2)`` with ``p``
    the point's Poincaré-ball coordinates; its angle is that of its direction projected on the
    two leading right singular vectors of the directions of all ``n`` points (a picture of the
    neighbourhood, not an isometry).
    """
    ball = poincare_ball(points.astype(np.float32), c).astype(np.float64) * math.sqrt(c)
    radius = np.linalg.norm(ball, axis=1)
    directions = ball / np.maximum(radius, 1e-12)[:, None]
    if points.shape[1] == 1:
        plane = np.hstack([directions, np.zeros_like(directions)])
    else:
        _, _, vt = np.linalg.svd(directions, full_matrices=False)
        plane = directions @ vt[:2].T
        if plane.shape[1] == 1:
            plane = np.hstack([plane, np.zeros_like(plane)])
    norm = np.linalg.norm(plane, axis=1)
    plane = np.where(norm[:, None] > 1e-9, plane / np.maximum(norm, 1e-12)[:, None], [1.0, 0.0])
    return plane * np.minimum(radius, 1 - 1e-9)[:, None]


__all__ = [
    "Hit",
    "Item",
    "SearchError",
    "SearchResults",
    "Searcher",
    "index_items",
    "poincare_disk_2d",
    "read_queries",
]
