"""Embedding a feature store through a trained recipe, to memory-mapped files; and serving them.

Layout of an embeddings directory (``curvalign embed``)::

    embedding.json          run_dir, recipe, step, data, counts, keys (shape, dtype, geometry),
                            curvature, lorentz_index_key, files
    images.<key>.npy        one file per embedding key and side, written through
    texts.<key>.npy         ``curvalign._io.NpyRowWriter`` batch by batch (never whole in memory;
                            plain writes, so a full disk is one error, not SIGBUS)
    box_images.<key>.npy    (with boxes)
    box_texts.<key>.npy
    text_to_image.npy       the store's caption -> image map (row ids are the store's row ids)

The directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from curvalign._io import (
    NpyRowWriter,
    file_checksums,
    read_json_file,
    staged_directory,
)
from curvalign.data.features import FeatureStore, present
from curvalign.data.sharded import advise_array
from curvalign.errors import (
    DamagedFileError,
    InputError,
    NonFiniteError,
    NotFoundError,
    OverwriteError,
)
from curvalign.index.checked import STATS_KEY, check_file, seal_files
from curvalign.index.rerank import (
    ArrayEmbedding,
    RecipeIndex,
    as_torch_embedding,
    default_proxy,
)
from curvalign.index.search import (
    GEOMETRY,
    FlatFile,
    IndexKind,
    IndexMismatchError,
    LorentzIndex,
    ann_method,
    build_block_rows,
    build_index,
    load_index,
    save_exact_index,
    write_flat_index,
)
from curvalign.readout import check_input_widths, embed_store_rows
from curvalign.recipes.base import Embedding, Recipe
from curvalign.runs import load_run

if TYPE_CHECKING:
    from curvalign.runs import LoadedRun

META_FILE = "embedding.json"
#: key of embedding.json / index.json that records the SHA-256 of each file written beside it
CHECKSUMS_KEY = "sha256"
FORMAT_VERSION = 1
SIDES = ("images", "texts", "box_images", "box_texts")

Side = Literal["images", "texts"]


def _curvature_list(recipe: Recipe) -> list[float] | None:
    c = recipe.curvature_value()
    if c is None:
        return None
    return [float(v) for v in np.atleast_1d(c.cpu().numpy())]


def _lorentz_index_key(recipe: Recipe) -> str | None:
    """The key whose Lorentz distance *is* the recipe's score (its default index proxy is an exact
    Lorentz proxy): a ``LorentzIndex`` over that key alone answers exactly, approximate search
    included. None for every other recipe (served by proxy candidates + rerank)."""
    proxies = recipe.index_proxies()
    default = next(iter(proxies.values()), None)
    if default is not None and default.kind == "lorentz" and default.exact:
        return default.key
    return None


@torch.no_grad()
def embed_store(
    recipe: Recipe,
    store: FeatureStore,
    out: str | os.PathLike,
    *,
    batch_size: int = 1024,
    boxes: bool = False,
    info: dict[str, Any] | None = None,
    progress: Callable[[str, int], Any] | None = None,
) -> Path:
    """Embed ``store``'s images and texts (and boxes) with ``recipe`` into the directory ``out``.

    ``progress(label, total)`` may return a callable ``advance(n)`` (the CLI passes a rich bar).
    ``info`` is merged into ``embedding.json`` (run_dir, step, data spec).
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be positive, got {batch_size}")
    if boxes and not store.has_boxes:
        raise InputError("--boxes: the feature store has no box-level pairs")
    recipe.eval()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not (out / META_FILE).exists() and any(out.iterdir()):
        raise OverwriteError(f"{out} exists and is not an embeddings directory; not overwriting it")
    check_input_widths(recipe, store)
    if boxes and recipe.text_tokens:
        raise InputError(
            f"--boxes: {recipe.name} reads text tokens and box texts have no token features"
        )

    def rows_of(part: str) -> Callable[[slice], Embedding]:
        # pooled features or tokens + masks, each batch float32 (float16 stores): readout's
        return lambda rows: embed_store_rows(recipe, store, part, rows)

    parts: list[tuple[str, int, Callable[[slice], Embedding]]] = [
        ("images", store.num_images, rows_of("image")),
        ("texts", store.num_texts, rows_of("text")),
    ]
    if boxes:
        n_boxes = int(present(store.box_image_features, "box image features").shape[0])
        parts += [
            ("box_images", n_boxes, rows_of("box_image")),
            ("box_texts", n_boxes, rows_of("box_text")),
        ]
    keys: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    # digests taken as the files are written: hashing them afterwards read back 4 GB at 1M
    # pairs (512-d float32 per side), from disk once they no longer fit the page cache
    digests: dict[str, str] = {}
    files: dict[str, dict[str, str]] = {}
    geometry = {key: g.kind for key, g in recipe.geometries().items()}
    with staged_directory(out) as tmp:
        for side, n, embed_rows in parts:
            counts[side] = n
            files[side] = {}
            maps: dict[str, NpyRowWriter] = {}
            advance = progress(f"embedding {side}", n) if progress else None
            for start in range(0, n, batch_size):
                emb = embed_rows(slice(start, min(n, start + batch_size)))
                for key, tensor in emb.items():
                    value = tensor.detach().float().cpu().numpy()
                    if key not in maps:
                        name = f"{side}.{key}.npy"
                        maps[key] = NpyRowWriter(tmp / name, (n, *value.shape[1:]))
                        files[side][key] = name
                        keys.setdefault(
                            key,
                            {
                                "shape": list(value.shape[1:]),
                                "dtype": "float32",
                                "geometry": geometry.get(key, "unknown"),
                            },
                        )
                    if not np.isfinite(value).all():
                        raise NonFiniteError(
                            f"recipe {recipe.name!r} produced non-finite {side} "
                            f"embeddings ({key!r}) in rows {start}..{start + len(value) - 1}"
                        )
                    maps[key][start : start + len(value)] = value
                if advance:
                    advance(min(n, start + batch_size) - start)
            for m in maps.values():
                m.flush()
                digests[m.path.name] = m.sha256()
            del maps
        np.save(tmp / "text_to_image.npy", np.asarray(store.text_to_image, dtype=np.int64))
        written = [name for side_files in files.values() for name in side_files.values()]
        meta = {
            CHECKSUMS_KEY: {**digests, **file_checksums(tmp, ["text_to_image.npy"])},
            STATS_KEY: seal_files(tmp, [*written, "text_to_image.npy"]),
            "format_version": FORMAT_VERSION,
            "recipe": recipe.name,
            "counts": counts,
            "keys": keys,
            "files": files,
            "curvature": _curvature_list(recipe),
            "lorentz_index_key": _lorentz_index_key(recipe),
            **(info or {}),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    return out


@dataclass
class Embeddings:
    """An embeddings directory, opened with memory maps (nothing is read until touched).

    ``verify``: hash every file it reads against ``embedding.json`` (otherwise a file whose
    size and modification time are the recorded ones is not read to check it).
    """

    path: Path
    meta: dict[str, Any]
    _verified: set[str] = field(default_factory=set, repr=False)
    verify: bool = False

    @property
    def recipe_name(self) -> str:
        return self.meta["recipe"]

    @property
    def curvature(self) -> list[float] | None:
        return self.meta.get("curvature")

    def side(self, side: str, mmap: bool = True) -> dict[str, np.ndarray]:
        """``{key: [N, ...]}`` arrays of one side (memory-mapped, read-only)."""
        if side not in self.meta["files"]:
            raise InputError(
                f"{self.path} has no {side} embeddings; it has {sorted(self.meta['files'])}"
            )
        return {
            key: self._load(name, mmap_mode="r" if mmap else None)
            for key, name in self.meta["files"][side].items()
        }

    def text_to_image(self) -> np.ndarray:
        return self._load("text_to_image.npy")

    def _load(self, name: str, mmap_mode: Literal["r"] | None = None) -> np.ndarray:
        """``np.load`` of one file, after it was checked against ``embedding.json`` (once per
        file and object: by size and time, or its SHA-256 where those differ or ``verify``);
        a damaged or truncated file is named in one line."""
        path = self.path / name
        redo = "write the embeddings again with `curvalign embed`"
        if name not in self._verified:
            check_file(
                path,
                self.meta.get(CHECKSUMS_KEY),
                self.meta.get(STATS_KEY),
                str(self.path / META_FILE),
                redo,
                full=self.verify,
            )
            self._verified.add(name)
        try:
            return np.load(path, mmap_mode=mmap_mode)
        except (OSError, ValueError, EOFError) as err:
            raise DamagedFileError(
                f"{path} cannot be read as an array ({str(err).splitlines()[0]}): damaged or "
                f"truncated; {redo}"
            ) from None

    def geometry(self, key: str) -> str:
        return self.meta["keys"].get(key, {}).get("geometry", "unknown")


def load_embeddings(path: str | os.PathLike, *, verify: bool = False) -> Embeddings:
    """The embeddings directory ``path`` (``verify``: hash each file read, see ``Embeddings``)."""
    path = Path(path)
    if not (path / META_FILE).exists():
        raise NotFoundError(
            f"{path} is not an embeddings directory (no {META_FILE}); "
            f"write one with `curvalign embed`"
        )
    meta = read_json_file(path / META_FILE, "write the embeddings again with `curvalign embed`")
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("format_version") != FORMAT_VERSION:
        raise IndexMismatchError(
            f"{path}: embeddings format {meta.get('format_version')} is not supported"
        )
    return Embeddings(path, meta, verify=verify)


# --- serving: build and search from an embeddings directory ---------------------------------------


def index_side(name: str) -> Side:
    """``name`` as the side of an embeddings directory an index holds; InputError otherwise."""
    if name == "images":
        return "images"
    if name == "texts":
        return "texts"
    raise InputError(f"--side must be images or texts, got {name!r}")


def build_from_embeddings(
    emb: Embeddings,
    out: str | os.PathLike,
    *,
    side: Side = "images",
    kind: IndexKind = "exact",
    method: str = "hnsw",
    **options: Any,
) -> Path:
    """Index one side of ``emb`` into ``out``.

    Recipes whose score is the Lorentz distance of one key (``lorentz_index_key`` in
    ``embedding.json``) get a ``LorentzIndex`` (exact or ANN). Every other recipe is served by
    ``RecipeIndex`` (proxy candidates + exact rerank with the recipe,
    reloaded from the run directory at search time): its index directory records what to load.
    """
    if side not in ("images", "texts"):
        raise InputError(f"--side must be images or texts, got {side!r}")
    recipe = emb.recipe_name
    base_meta = {
        "recipe": recipe,
        "side": side,
        "embeddings": str(Path(emb.path).resolve()),
        "run_dir": emb.meta.get("run_dir"),
        "step": emb.meta.get("step"),
        "weights_sha256": emb.meta.get("weights_sha256"),
        "weights": emb.meta.get("weights"),
    }
    block_rows = options.pop("block_rows", None)
    key = emb.meta.get("lorentz_index_key")
    if key is not None:
        points = emb.side(side)[key]
        lorentz_meta = {**base_meta, "key": key, "mode": "lorentz"}
        if emb.curvature is None:
            raise InputError(f"{emb.path} names a Lorentz key but records no curvature")
        if kind == "exact":  # written block by block, never built in memory
            return save_exact_index(
                out, points, emb.curvature[0], meta=lorentz_meta, block_rows=block_rows
            )
        index = build_index(
            points,
            emb.curvature[0],
            kind=kind,
            method=ann_method(method),
            **options,
            meta=lorentz_meta,
            block_rows=block_rows,
        )
        return index.save(out)
    if kind != "exact" and method not in ("hnsw", "ivfpq"):
        raise InputError(
            f"{recipe!r} is served by proxy candidates and a rerank with its own score; its "
            f"approximate candidate index is HNSW (--ann hnsw) or IVF-PQ (--ann ivfpq), "
            f"not {method!r}"
        )
    if not base_meta["run_dir"]:
        raise InputError(
            f"{emb.path} does not name the run it came from; {recipe!r} needs the recipe to rerank"
        )
    # embeddings record which weights they came from; older ones came from the last weights
    run = load_run(base_meta["run_dir"], weights=base_meta.get("weights") or "last")
    check_same_run(base_meta, run, f"the embeddings {emb.path}", "index build")
    known = ("M", "ef_construction", "ef_search") if method == "hnsw" else ("nlist", "nprobe")
    out = Path(out)
    if out.exists() and not (out / "index.json").exists() and any(out.iterdir()):
        raise OverwriteError(f"{out} exists and is not a curvalign index; not overwriting it")
    with staged_directory(out) as tmp:
        # The proxy vectors depend on the run's learned curvature / weights: computed once, here.
        if kind == "exact":  # a flat proxy, written block by block (never whole in memory)
            database = as_torch_embedding(emb.side(side))
            proxy_file = write_proxy_blocks(
                tmp / "proxy.faiss", run.recipe, database, block_rows=block_rows
            )
            engine = RecipeIndex(run.recipe, database, side, proxy_index=proxy_file)
        else:
            engine = RecipeIndex(
                run.recipe,
                emb.side(side),
                side,
                candidate_index=method,
                **{k: v for k, v in options.items() if k in known and v is not None},
            )
            engine.save_proxy(str(tmp / "proxy.faiss"))
        (tmp / "index.json").write_text(
            json.dumps(
                {
                    CHECKSUMS_KEY: file_checksums(tmp, ["proxy.faiss"]),
                    STATS_KEY: seal_files(tmp, ["proxy.faiss"]),
                    "format_version": 1,
                    "geometry": "recipe",
                    "mode": "rerank",
                    "proxy": engine.proxy.name,
                    "candidate_index": engine.candidate_index,
                    "count": emb.meta["counts"][side],
                    "meta": base_meta,
                },
                indent=2,
            )
        )
    return out


def write_proxy_blocks(
    path: Path, recipe: Recipe, database: Embedding, *, block_rows: int | None = None
) -> FlatFile:
    """Write the flat proxy index of ``database`` (one side's embedding, ``[N, ...]`` per key)
    for ``recipe`` to ``path``, ``block_rows`` items at a time (default: 64 MiB of float32 per
    block, ``build_block_rows``); returns it opened as a ``FlatFile``. Memory outside the
    embedding's maps is one block of proxy vectors."""
    proxy = default_proxy(recipe)
    n = int(next(iter(database.values())).shape[0])
    first = proxy.database({key: v[:1] for key, v in database.items()})
    block = int(block_rows) if block_rows else build_block_rows(first.shape[1] - 1)

    def vectors() -> Iterator[np.ndarray]:
        for start in range(0, n, block):
            yield proxy.database({key: v[start : start + block] for key, v in database.items()})

    return write_flat_index(path, first.shape[1], vectors())


def check_same_run(recorded: dict[str, Any], run: LoadedRun, what: str, redo: str) -> None:
    """Raise ``IndexMismatchError`` unless the loaded ``run`` (a LoadedRun) is the one
    ``recorded`` (``recipe``, ``step``, ``weights_sha256`` of the weights embedded) names: a run
    directory replaced since by another run must not be used to rerank silently. The message
    lists each thing that differs; ``redo`` says which commands to run again."""
    differs = []
    if recorded.get("recipe") is not None and run.config.recipe != recorded["recipe"]:
        differs.append(f"recipe {recorded['recipe']!r} -> {run.config.recipe!r}")
    if recorded.get("step") is not None and run.step != recorded["step"]:
        differs.append(f"step {recorded['step']} -> {run.step}")
    built = recorded.get("weights_sha256")
    if built and run.weights_sha256 and run.weights_sha256 != built:
        differs.append(f"weights SHA-256 {built[:12]}... -> {run.weights_sha256[:12]}...")
    if differs:
        raise IndexMismatchError(
            f"{what} was made from the run {run.run_dir}, which has changed since "
            f"({'; '.join(differs)}): {redo} again from the run as it is now"
        )


@dataclass
class SearchResult:
    scores: np.ndarray  # [n, k]: distance (Lorentz index, ascending) or recipe score (descending)
    ids: np.ndarray  # [n, k] row ids of the indexed side
    score_name: str  # "distance" or "score"


def open_index(
    path: str | os.PathLike, *, verify: bool = False
) -> tuple[dict[str, Any], LorentzIndex | None]:
    """``(index.json contents, LorentzIndex or None for a rerank index)``; ``verify``: hash its
    files even where size and modification time match the recorded ones."""
    path = Path(path)
    if not (path / "index.json").exists():
        raise NotFoundError(
            f"{path} is not an index (no index.json); build one with `curvalign index build`"
        )
    raw = read_json_file(path / "index.json", "build the index again with `curvalign index build`")
    if isinstance(raw, dict) and raw.get("mode") == "rerank":
        return raw, None
    index = load_index(path, verify=verify)
    if not isinstance(raw, dict):
        raise DamagedFileError(
            f"{path / 'index.json'} is not a JSON object; build the index again with "
            "`curvalign index build`"
        )
    return {**raw, "meta": index.meta}, index


def search_index(
    path: str | os.PathLike,
    queries: ArrayEmbedding,
    *,
    k: int = 10,
    candidates: int = 200,
    query_recipe: str | None = None,
    query_curvature: list[float] | None = None,
    query_geometries: Iterable[str] = (),
    query_weights: str | None = None,
) -> SearchResult:
    """Search the index at ``path`` with ``queries`` (an Embedding of the other side).

    ``query_recipe`` / ``query_curvature`` / ``query_geometries`` (the kinds of point the query
    embeddings hold, from their ``embedding.json``) / ``query_weights`` (SHA-256 of the weights
    that embedded them) say where the queries came from; a recipe, curvature or weights other
    than the index's are refused (a clear message, no search).
    """
    raw, index = open_index(path)
    meta = raw["meta"]
    recipe = meta["recipe"]
    built_from = meta.get("weights_sha256")
    if query_weights and built_from and query_weights != built_from and query_recipe == recipe:
        raise IndexMismatchError(
            f"the queries were embedded with other weights of {recipe!r} (SHA-256 "
            f"{query_weights[:12]}...) than the index {path} ({built_from[:12]}...); scores of "
            "different runs do not compare: embed the queries with the index's run"
        )
    if query_recipe is not None and query_recipe != recipe:
        kinds = set(query_geometries)
        if index is not None and GEOMETRY not in kinds:
            raise IndexMismatchError(
                f"queries are {'/'.join(sorted(kinds)) or 'unknown'} embeddings ({query_recipe!r}) "
                f"but the index holds Lorentz points ({recipe!r}); embed the queries with the index's run"
            )
        raise IndexMismatchError(
            f"queries were embedded by {query_recipe!r} but the index holds {recipe!r} embeddings; "
            f"scores of different runs do not compare: embed the queries with the index's run"
        )
    if index is not None:
        key = meta["key"]
        if key not in queries:
            raise IndexMismatchError(
                f"queries lack the embedding key {key!r} (they have {sorted(queries)}); "
                f"the index holds Lorentz points under {key!r}"
            )
        c = query_curvature[0] if query_curvature else None
        d, ids = index.search(queries[key], k, geometry=GEOMETRY, curvature=c)
        return SearchResult(d, ids, "distance")
    engine = open_rerank_engine(
        path, raw, load_run(meta["run_dir"], weights=meta.get("weights") or "last")
    )
    scores, ids = engine.search(as_torch_embedding(queries), k, candidates)
    return SearchResult(scores, ids, "score")


def index_sources(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The embeddings directories an index's ids come from, in id order: ``[{"embeddings": DIR,
    "first_id": i0, "count": n}, ...]`` (one for a freshly built index; ``add_embeddings`` appends)."""
    if meta.get("sources"):
        return list(meta["sources"])
    emb = load_embeddings(meta["embeddings"])
    return [
        {"embeddings": meta["embeddings"], "first_id": 0, "count": emb.meta["counts"][meta["side"]]}
    ]


def source_side(sources: list[dict[str, Any]], side: str) -> dict[str, np.ndarray]:
    """One side of every source, concatenated in id order (memory maps when there is one source)."""
    parts = [load_embeddings(s["embeddings"]).side(side) for s in sources]
    if len(parts) == 1:
        return parts[0]
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def add_embeddings(path: str | os.PathLike, emb: Embeddings) -> int:
    """Append the indexed side of ``emb`` (embeddings of the same run) to the index at ``path``.

    No index is rebuilt (``LorentzIndex.add``, ``RecipeIndex.add``); new ids continue after the
    last one, and ``index.json`` records the new source so that search can name the new items.
    Returns the number of items added.
    """
    path = Path(path)
    raw, lorentz = open_index(path)
    meta = raw["meta"]
    side = meta["side"]
    if emb.recipe_name != meta["recipe"]:
        raise IndexMismatchError(
            f"{emb.path} holds {emb.recipe_name!r} embeddings but the index holds {meta['recipe']!r}"
        )
    built, new_sha = meta.get("weights_sha256"), emb.meta.get("weights_sha256")
    if (meta.get("step") is not None and emb.meta.get("step") != meta["step"]) or (
        built and new_sha and built != new_sha
    ):
        raise IndexMismatchError(
            f"{emb.path} was embedded at step {emb.meta.get('step')} but the index at step "
            f"{meta['step']} (or by other weights of that step); items embedded by other "
            "weights do not compare"
        )
    sources = index_sources(meta)
    new = emb.side(side)
    m = int(next(iter(new.values())).shape[0])
    first = sources[-1]["first_id"] + sources[-1]["count"]
    source = {"embeddings": str(Path(emb.path).resolve()), "first_id": first, "count": m}
    if lorentz is not None:
        lorentz.add(new[meta["key"]], ids=np.arange(first, first + m))
        lorentz.info.meta["sources"] = sources + [source]
        lorentz.save(path)
        return m
    from curvalign.runs import load_run

    engine = open_rerank_engine(
        path, raw, load_run(meta["run_dir"], weights=meta.get("weights") or "last")
    )
    engine.add(new, ids=np.arange(first, first + m))
    with staged_directory(path) as tmp:
        engine.save_proxy(str(tmp / "proxy.faiss"))
        updated = {**raw, "count": len(engine), "meta": {**meta, "sources": sources + [source]}}
        updated[CHECKSUMS_KEY] = file_checksums(tmp, ["proxy.faiss"])
        updated[STATS_KEY] = seal_files(tmp, ["proxy.faiss"])
        updated["candidate_index"] = engine.candidate_index
        (tmp / "index.json").write_text(json.dumps(updated, indent=2))
    return m


def open_rerank_engine(path: str | os.PathLike, raw: dict[str, Any], run: LoadedRun) -> RecipeIndex:
    """The ``RecipeIndex`` a rerank index directory describes (``raw`` = its index.json), scoring
    with ``run``'s recipe; refused if the run has trained further since the embeddings."""
    from curvalign.index.search import read_flat_or_faiss

    meta = raw["meta"]
    check_same_run(meta, run, f"the index {path}", "embed and index build")
    database = source_side(index_sources(meta), meta["side"])
    for rows in database.values():
        # the rerank reads a few hundred scattered rows a query: their pages, not the kernel's
        # read-ahead around each (which read the whole file from a cold cache)
        advise_array(rows, "random")
    proxy_file = Path(path) / "proxy.faiss"
    if proxy_file.exists():  # checked before faiss reads a byte of it
        check_file(
            proxy_file,
            raw.get(CHECKSUMS_KEY),
            raw.get(STATS_KEY),
            str(Path(path) / "index.json"),
            "build the index again with `curvalign index build`",
        )
    return RecipeIndex(
        run.recipe,
        database,
        meta["side"],
        proxy=raw.get("proxy"),
        # a flat proxy is scanned from the file in chunks, never loaded whole (FlatFile)
        proxy_index=read_flat_or_faiss(proxy_file) if proxy_file.exists() else None,
    )


# --- what `curvalign embed` and `curvalign index build` do, beyond parsing ------------------------


@dataclass(frozen=True)
class RunEmbedding:
    """What ``embed_run`` wrote: the embeddings directory and what it holds."""

    path: Path
    recipe: str
    step: int
    num_images: int
    num_texts: int


def embed_run(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    data: str | None = None,
    weights: str = "best",
    batch_size: int = 4096,
    boxes: bool = False,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    on_loaded: Callable[[Any], None] | None = None,
) -> RunEmbedding:
    """``curvalign embed``: the store ``data`` (a data spec; default the run's own) through the
    recipe of the run at ``run_dir`` (its ``weights``: best or last) into ``out``
    (``embed_store``); ``embedding.json`` records the run, step, data and weights it came from,
    so that an index and a search can check they use the same run. ``on_loaded(run)`` is
    called once the run is loaded (its notes, before the store is read)."""
    from curvalign.data import load_data

    run = load_run(run_dir, weights=weights)
    if on_loaded is not None:
        on_loaded(run)
    spec = run.data_spec(data)
    store = load_data(spec)
    info = {
        "run_dir": str(Path(run_dir).resolve()),
        "step": run.step,
        "data": spec,
        "weights": run.weights,
        "weights_sha256": run.weights_sha256,
    }
    path = embed_store(
        run.recipe, store, out, batch_size=batch_size, boxes=boxes, info=info, progress=progress
    )
    return RunEmbedding(path, run.config.recipe, run.step, store.num_images, store.num_texts)


#: the approximate indexes ``curvalign index build --ann`` builds
ANN_METHODS = ("hnsw", "ivf", "ivfpq")


def index_build_options(
    ann: str | None,
    *,
    exact: bool = False,
    M: int = 32,
    ef_construction: int = 80,
    ef_search: int = 128,
    nlist: int | None = None,
    nprobe: int = 16,
) -> dict[str, Any]:
    """The keyword arguments of ``build_from_embeddings`` (``kind``, ``method`` and the options
    of that method) for an exact index (``ann=None``) or the approximate one ``ann``; the
    options of the other methods are dropped."""
    if exact and ann:
        raise InputError("--exact and --ann exclude each other")
    if ann is None:
        return {"kind": "exact", "method": "hnsw"}
    if ann not in ANN_METHODS:
        raise InputError(
            f"--ann must be {', '.join(ANN_METHODS[:-1])} or {ANN_METHODS[-1]}, got {ann!r}"
        )
    if ann == "hnsw":
        return {
            "kind": "ann",
            "method": ann,
            "M": M,
            "ef_construction": ef_construction,
            "ef_search": ef_search,
        }
    return {"kind": "ann", "method": ann, "nlist": nlist, "nprobe": nprobe}


__all__ = [
    "Embeddings",
    "SearchResult",
    "build_from_embeddings",
    "check_same_run",
    "embed_store",
    "load_embeddings",
    "open_index",
    "search_index",
    "add_embeddings",
    "index_sources",
    "open_rerank_engine",
    "source_side",
    "ANN_METHODS",
    "RunEmbedding",
    "embed_run",
    "index_build_options",
]
