"""Retrieval with a recipe's own score: candidates by an inner-product proxy, exact rerank.

Only some scores are inner products of fixed vectors (cosine; Lorentz distance through the
transform of ``search.py``). The others (AtMG's exterior angle, PHyCLIP's l1 sum of factor
distances, ProCLIP's weighted squared product distance, AGR's routed score) are ranked in two
stages: a Faiss inner-product search over *proxy* vectors returns ``candidates`` items per
query, and the recipe's ``pair_scores`` ranks those exactly (AGR's router runs on the K
candidates only). With ``candidates >= N`` the result equals an exhaustive ranking with
``recipe.scores``; ``rerank_recall`` measures how close smaller K gets.

Proxies (database vector ``u``, query vector ``v``, ``u.v`` large = likely a good match)
    A recipe names the proxies that apply to it (``Recipe.index_proxies()``: an ``IndexProxy``
    with a kind, the embedding key it reads and whether it is exact). The vectors come from a
    ``Lift`` (``curvalign.geometries``): the one the proxy carries (``IndexProxy.lift``, for a
    method in a geometry of its own, e.g. tests/plugin_poincare.py's Poincare ball), else the
    built-in lift its kind names (``BUILTIN_LIFTS``); this module ranks with them and never
    switches on the kind. The built-in kinds:

    cosine           unit vectors of ``key``: ``u.v`` is the cosine itself.
    lorentz          Lorentz ``[x, t]`` / ``[y, -t]`` of ``key``: ``u.v = <x,y>_L``, exact for
                     ``-d_L``.
    angle            the exterior angle (AtMG Eq. 9); the recipe says per query side where its
                     vertex is and its sign (``IndexProxy.angle``, an ``AngleScore``). With
                     ``b = -c <x, y>_L`` (``x`` the query, ``y`` the database item; one matrix
                     product) and ``c t^2 = 1 + c |.|^2``, the cosine of the angle at ``x``
                     towards ``y`` is ``(t_y - t_x b) / (|x| sqrt(b^2 - 1))`` and at ``y``
                     towards ``x`` ``(t_x - t_y b) / (|y| sqrt(b^2 - 1))``. A flat candidate
                     index scans every item anyway, so it ranks by that cosine itself
                     (``RecipeIndex._angle_scan``; ``t_y`` and ``|y|`` stored per row, in the
                     database's precision): the ranking is the angle's own. An HNSW candidate
                     index can only answer inner products: the angle at ``x`` is
                     ``cos = sqrt(c) a / sqrt(b^2 - 1)`` with two *linear* functionals of the
                     lifted ``y``, ``a = <y, r>_L`` (``r`` the outward radial unit vector at
                     ``x``) and ``b``, and candidates come from a Dinkelbach iteration for the
                     ratio: search ``max a - lam b``, set ``lam`` to the best ratio found times the
                     slope of ``sqrt(b^2 - 1)`` at the best item (the tangent of the concave
                     denominator), repeat (``ANGLE_ROUNDS`` rounds, ``lam = 0`` first); the union of
                     the rounds' hit lists, last round first, is the candidate list. ``a`` is
                     negated where the best items have a large angle at the query: a score of
                     ``+angle`` at the query (exact), or ``-angle`` at the database item, where
                     the rounds are a heuristic (a small angle at ``y`` towards ``x`` puts ``x``
                     beyond ``y`` on ``y``'s ray, where the angle at ``x`` is near pi). (The plain
                     distance proxy fails here: the best angles belong to images far out along the
                     text's axis, not near it; recall@10 was about 0.01 at K = 200 in our check.)
    product-lorentz  per factor ``[x_f, t_f]`` / ``c_f [y_f, -t_f]`` concatenated:
                     ``u.v = sum_f c_f <x_f, y_f>_L = -sum_f cosh(sqrt(c_f) d_f)``.
    mixed            ``2 a_H <x,y>_L + a_E (2 e.e' - |e'|^2) + 2 a_S s.s'``: first-order in the
                     hyperbolic and spherical parts, exact (up to a per-query constant) in the
                     Euclidean one (database ``[x, t, e, |e|^2, s]``, query
                     ``[2a_H y, -2a_H t, 2a_E e, -a_E, 2a_S s]``) over the keys "hyperbolic",
                     "euclidean", "sphere" with the proxy's part weights.

    The curvature of the Lorentz kinds is ``recipe.curvature_value()``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import faiss
import numpy as np
import torch
from torch import Tensor

from curvalign.errors import InputError, NonFiniteError
from curvalign.geometries import BUILTIN_LIFTS, AngleLift, Lift
from curvalign.index.search import (
    FlatFile,
    IndexMismatchError,
    build_hnsw_graph,
    hnsw_graph,
    hnsw_insert_graph,
    in_memory,
)
from curvalign.recipes.base import Embedding, IndexProxy, Query, Recipe

Side = Literal["images", "texts"]

#: Dinkelbach rounds of the AtMG angle proxy over an HNSW candidate index (module docstring)
ANGLE_ROUNDS = 4

#: float32 elements of one block of proxy scores ``[queries, N]`` in a flat candidate scan
SCAN_BLOCK = 1 << 24
#: items whose proxy vectors are computed and added at a time to an IVF-PQ candidate index
IVFPQ_CHUNK = 1 << 16


def _np(t: Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def _curvature(recipe: Recipe) -> np.ndarray:
    c = recipe.curvature_value()
    if c is None:
        raise InputError(f"recipe {recipe.name!r} has no hyperbolic part: no Lorentz proxy applies")
    return np.atleast_1d(c.cpu().numpy())


@dataclass
class Proxy:
    """Maps an embedding to float32 vectors whose dot product ranks like the recipe's score.

    The vectors come from the proxy's ``Lift`` (``curvalign.geometries``): the one the recipe
    gives (``IndexProxy.lift``, a method in a geometry of its own), else the built-in lift its
    ``kind`` names (``BUILTIN_LIFTS``) at ``recipe.curvature_value()``.
    """

    recipe: Recipe
    name: str  # the name the recipe gives it in ``index_proxies()``
    spec: IndexProxy

    @property
    def exact(self) -> bool:
        return self.spec.exact

    @property
    def key(self) -> str:
        """The embedding key the proxy reads (every kind but "mixed" names one)."""
        if self.spec.key is None:
            raise InputError(
                f"proxy {self.name!r} of recipe {self.recipe.name!r} names no embedding key"
            )
        return self.spec.key

    @property
    def lift(self) -> Lift:
        if self.spec.lift is not None:
            return self.spec.lift
        make = BUILTIN_LIFTS.get(self.spec.kind)
        if make is None:
            raise InputError(
                f"unknown proxy kind {self.spec.kind!r} (recipe {self.recipe.name!r}): a proxy "
                f"of a kind other than {sorted(BUILTIN_LIFTS)} gives its vectors "
                "(IndexProxy(..., lift=...))"
            )
        c = self.recipe.curvature_value()
        curvature = None if c is None else np.atleast_1d(c.cpu().numpy())
        spec = self.spec
        return make(spec.key, curvature, spec.weights, spec.exact, self.recipe.name)

    def database(self, emb: Embedding) -> np.ndarray:
        return self.lift.database(emb)

    def query(self, emb: Embedding) -> np.ndarray:
        return self.lift.query(emb)

    def graph(self, emb: Embedding) -> np.ndarray:
        """Float32 coordinates whose L2 proximity follows the score's: an ANN candidate graph
        is built on them (``candidate_index="hnsw"``) and searched with the proxy vectors.

        Lorentz parts go to Poincare-ball coordinates (conformal: near in the ball is near on
        the hyperboloid); building by the proxy's own inner product would link every point to
        the far-out ones and lose them near the boundary. Unit vectors stay as they are; the
        parts of a mixed proxy are scaled by the square roots of its weights.
        """
        return self.lift.graph(emb)


def default_proxy(recipe: Recipe, proxy: str | None = None) -> Proxy:
    """The candidate proxy for ``recipe``: the first of ``recipe.index_proxies()``, or the one
    named ``proxy`` ("euclidean" is read as "cosine")."""
    proxies = recipe.index_proxies()
    if not proxies:
        raise InputError(
            f"recipe {recipe.name!r} declares no index proxy (Recipe.index_proxies): "
            "it cannot be served by an index"
        )
    if proxy is None:
        proxy = next(iter(proxies))
    if proxy == "euclidean" and "euclidean" not in proxies:
        proxy = "cosine"
    if proxy not in proxies:
        raise InputError(
            f"proxy {proxy!r} does not apply to recipe {recipe.name!r}; choose from {sorted(proxies)}"
        )
    return Proxy(recipe, proxy, proxies[proxy])


#: an Embedding whose values may also be numpy arrays (memory maps of ``curvalign embed``'s files)
ArrayEmbedding = Mapping[str, Tensor | np.ndarray]


def as_torch_embedding(emb: ArrayEmbedding) -> Embedding:
    """Every value as a torch tensor; numpy arrays and read-only memory maps are wrapped, not copied
    (nothing here writes to them)."""
    out = {}
    for key, v in emb.items():
        if not isinstance(v, Tensor):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                v = torch.from_numpy(np.asarray(v))
        out[key] = v
    return out


def _check_embedding(emb: Embedding, reference: Embedding, what: str) -> None:
    missing = sorted(set(reference) - set(emb))
    if missing:
        raise IndexMismatchError(
            f"{what} lacks embedding keys {missing}; the index was built from keys "
            f"{sorted(reference)} (embed the {what} with the same recipe)"
        )
    for key in reference:
        if tuple(emb[key].shape[1:]) != tuple(reference[key].shape[1:]):
            raise IndexMismatchError(
                f"{what}[{key!r}] has item shape {list(emb[key].shape[1:])} but the index "
                f"holds {list(reference[key].shape[1:])}"
            )


def _first_distinct(hits: np.ndarray, K: int) -> np.ndarray:
    """Per row, the first ``K`` distinct values of ``hits`` ``[n, m]`` in order (``m >= K``)."""
    n, m = hits.shape
    order = np.argsort(hits, axis=1, kind="stable")
    sorted_hits = np.take_along_axis(hits, order, 1)
    duplicate = np.zeros_like(hits, dtype=bool)
    duplicate[:, 1:] = sorted_hits[:, 1:] == sorted_hits[:, :-1]
    keep = np.empty_like(duplicate)
    np.put_along_axis(keep, order, ~duplicate, 1)
    # stable sort of "not kept" moves kept entries to the front in their original order
    front = np.argsort(~keep, axis=1, kind="stable")[:, :K]
    return np.take_along_axis(hits, front, 1)


class RecipeIndex:
    """Search ``database`` (one side's Embedding) with a recipe's own score.

    ``side`` says what the database holds: ``"images"`` (queries are texts, ``query="text"``)
    or ``"texts"`` (queries are images). ``search(queries, k, candidates=K)`` returns
    ``(scores [n, k], ids [n, k])``, scores higher-is-better, ties by id. ``ids`` are row
    numbers of ``database`` unless ``ids`` maps them. ``score_batch``: candidate pairs per
    ``recipe.pair_scores`` call in the rerank (the result does not depend on it; about a
    thousand pairs keeps the row-wise temporaries in cache, 65536 was 2-4x slower at K = 200).
    """

    def __init__(
        self,
        recipe: Recipe,
        database: ArrayEmbedding,
        side: Side = "images",
        *,
        proxy: str | None = None,
        ids: np.ndarray | None = None,
        score_batch: int = 1024,
        proxy_index: faiss.Index | FlatFile | None = None,
        candidate_index: str = "flat",
        M: int = 32,
        ef_construction: int = 80,
        ef_search: int = 256,
        nlist: int | None = None,
        nprobe: int = 32,
        seed: int = 0,
    ) -> None:
        if side not in ("images", "texts"):
            raise InputError(f"side must be 'images' or 'texts', got {side!r}")
        self.recipe = recipe.eval()
        self.database = as_torch_embedding(database)
        self.side = side
        self.query_side: Query = "text" if side == "images" else "image"
        self.proxy = default_proxy(recipe, proxy)
        #: "angle" proxies: where the ranked angle has its vertex, and its sign, for this side
        self.angle_score = self.proxy.spec.angle_score(self.query_side)
        n = next(iter(self.database.values())).shape[0]
        if proxy_index is not None:  # saved by save_proxy: the same vectors, not recomputed
            if proxy_index.ntotal != n:
                raise IndexMismatchError(
                    f"the saved proxy index holds {proxy_index.ntotal} items but the "
                    f"database has {n}; rebuild the index"
                )
            self._index = proxy_index
        elif candidate_index == "ivfpq":  # built chunk by chunk: no [N, D] copy of the proxy
            self._index = self._build_ivfpq(n, nlist, nprobe, seed)
        else:
            vectors = self.proxy.database(self.database)
            if candidate_index == "flat":
                self._index = faiss.IndexFlatIP(vectors.shape[1])
                self._index.add(vectors)
            elif candidate_index == "hnsw":
                self._index = build_hnsw_graph(
                    self.proxy.graph(self.database), vectors, M=M, ef_construction=ef_construction
                )
                self._index.hnsw.efSearch = int(ef_search)
            else:
                raise InputError(
                    f"candidate_index must be 'flat', 'hnsw' or 'ivfpq', got {candidate_index!r}"
                )
        self.ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        self.score_batch = score_batch
        self._vectors: Tensor | None = None  # the proxy vectors as a tensor, read on first search
        self._angle_row_cache: tuple[Tensor, Tensor, Tensor] | None = None  # y, t_y, |y|

    def _rows(self, start: int, stop: int) -> Embedding:
        return {key: v[start:stop] for key, v in self.database.items()}

    def _build_ivfpq(self, n: int, nlist: int | None, nprobe: int, seed: int) -> faiss.Index:
        """An IVF-PQ candidate index over the proxy vectors (approximate, for 10M+ items whose
        flat proxy would not fit in memory): ``nlist`` cells (default ``sqrt(N)``) by k-means on
        a seeded sample, each vector stored as ``D'/8`` one-byte PQ codes (the proxy padded with
        zero columns to ``D'``, a multiple of 8; padding changes no inner product), ``nprobe``
        cells visited per query. Vectors are computed and added ``IVFPQ_CHUNK`` rows at a time.
        The candidates are reranked with the recipe's exact score like any others; only recall
        is approximate (``benchmarks/data_scale.py`` measures it against the exact search)."""
        if isinstance(self.proxy.lift, AngleLift):
            raise InputError(
                f"recipe {self.recipe.name!r} ranks by an angle, whose candidates come from a "
                "flat scan or an HNSW graph; an IVF-PQ candidate index needs a dot-product proxy"
            )
        nlist = int(nlist or max(1, min(round(math.sqrt(n)), n // 39)))
        rng = np.random.default_rng(seed)
        sample_rows = np.sort(rng.choice(n, size=min(n, max(64 * nlist, 10_000)), replace=False))
        sample = self.proxy.database(
            {key: v[torch.from_numpy(sample_rows)] for key, v in self.database.items()}
        )
        d = sample.shape[1]
        padded = -(-d // 8) * 8
        # (d_in, d_out, uniform): an overload of the SWIG class that Faiss's stubs leave out
        remap = faiss.RemapDimensionsTransform(d, padded, False)  # type: ignore[arg-type]
        quantizer = faiss.IndexFlatIP(padded)
        ivf = faiss.IndexIVFPQ(quantizer, padded, nlist, padded // 8, 8, faiss.METRIC_INNER_PRODUCT)
        index = faiss.IndexPreTransform(remap, ivf)
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
        for start in range(0, n, IVFPQ_CHUNK):
            index.add(self.proxy.database(self._rows(start, min(n, start + IVFPQ_CHUNK))))
        ivf.nprobe = int(nprobe)
        # one self-contained object (it owns its quantizer and transform)
        return faiss.deserialize_index(faiss.serialize_index(index))

    def _stored(self) -> Tensor:
        """The proxy vectors ``[N, D]`` of a flat candidate index as a tensor (read once)."""
        if self._vectors is None:
            self._vectors = torch.from_numpy(self._index.reconstruct_n(0, len(self)))
        return self._vectors

    def _angle_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """The lifted database points ``u = [y, t_y]`` ``[N, d+1]`` of an "angle" proxy and, per
        row, ``t_y`` and ``|y|`` ``[N]`` (computed once per add), in the embedding's precision:
        float64 for a float64 database (whose far-out points float32 cannot separate), else
        float32 (then ``u`` replaces the copy of the Faiss vectors a flat scan reads)."""
        if self._angle_row_cache is None:
            y = self.database[self.proxy.key]
            dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
            y64 = y.double()
            c = float(_curvature(self.recipe)[0])
            t_y = torch.sqrt(1.0 / c + (y64 * y64).sum(1))
            norm_y = torch.linalg.vector_norm(y64, dim=1)
            u = torch.cat([y64, t_y[:, None]], dim=1).to(dtype)
            self._angle_row_cache = (u, t_y.to(dtype), norm_y.to(dtype))
        return self._angle_row_cache

    @property
    def _block(self) -> int:
        """Queries per block of a flat scan: its ``[block, N]`` scores hold ``SCAN_BLOCK`` floats."""
        return max(1, min(256, SCAN_BLOCK // max(1, len(self))))

    def _top_rows(self, vectors: np.ndarray, K: int) -> np.ndarray:
        """``[n, K]`` rows of the largest proxy inner products, best first (HNSW: approximate,
        a short answer padded with -1).

        A flat index is scanned as one matrix product and ``torch.topk`` per block of queries:
        Faiss's flat search keeps a heap per query and was ~10x slower at K = 200.
        """
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if self.candidate_index in ("hnsw", "ivfpq") or isinstance(self._index, FlatFile):
            # a flat index file is scanned in chunks with a running top-k (bounded memory)
            return self._index.search(vectors, K)[1]
        stored, queries = self._stored(), torch.from_numpy(vectors)
        rows = [
            torch.topk(queries[i : i + self._block] @ stored.T, K, dim=1).indices
            for i in range(0, len(queries), self._block)
        ]
        return torch.cat(rows).numpy()

    def _angle_scan(self, queries: Embedding, K: int) -> np.ndarray:
        """``[n, K]`` rows of a flat index by the exterior angle itself, best first.

        With ``b = -c <x, y>_L = c [-x, t_x] . [y, t_y]`` (one matrix product per block of
        queries over the stored ``[y, t_y]``; ``t_y``, ``|y|`` stored per row, ``_angle_rows``),
        AtMG Eq. 9 gives
        the cosine of the angle at either end:

        - at the query ``x`` towards ``y``: ``cos = (t_y - t_x b) / (|x| sqrt(b^2 - 1))``, ranked
          as ``cos |x|`` (``|x|`` is constant per query);
        - at the database item ``y`` towards ``x`` (``self.angle_score.vertex == "database"``):
          ``cos = (t_x - t_y b) / (|y| sqrt(b^2 - 1))``.

        Smallest angle first (largest cosine), or largest first when the score is ``+angle``
        (``self.angle_score.larger_is_better``). One scan instead of ``ANGLE_ROUNDS``
        Dinkelbach scans, and the angle's own order rather than a linearisation of it; in the
        database's precision (``_angle_rows``).
        """
        c = float(_curvature(self.recipe)[0])
        u, t_y, norm_y = self._angle_rows()
        x = queries[self.proxy.key].double()
        t_x = torch.sqrt(1.0 / c + (x * x).sum(1))[:, None]
        q_b = (c * torch.cat([-x, t_x], dim=1)).to(u.dtype)
        t_x = t_x.to(u.dtype)
        at_item = self.angle_score.vertex == "database"
        sign = -1.0 if self.angle_score.larger_is_better else 1.0
        # |y| = 0 has no ray: the angle there is pi/2 (cos 0), as in geometry.lorentz
        inv_norm_y = 1.0 / torch.clamp(norm_y, min=torch.finfo(u.dtype).tiny)
        rows = []
        for i in range(0, len(x), self._block):
            block = slice(i, i + self._block)
            b = q_b[block] @ u.T
            # b < 1 only by rounding (y at x, where the angle is undetermined): kept finite
            inv_sinh = torch.rsqrt(torch.clamp(b * b - 1.0, min=1e-12))
            if at_item:
                # clamped like the exhaustive score's cosine: rounding past +-1 ranks no item
                # above one at angle 0 (or pi)
                ratio = torch.clamp((t_x[block] - t_y * b) * inv_sinh * inv_norm_y, -1.0, 1.0)
            else:
                ratio = (t_y - t_x[block] * b) * inv_sinh
            rows.append(torch.topk(sign * ratio, K, dim=1).indices)
        return torch.cat(rows).numpy()

    @property
    def candidate_index(self) -> str:
        """``"flat"`` (exhaustive proxy scan) or ``"hnsw"`` (approximate candidate graph)."""
        if isinstance(self._index, FlatFile):
            return "flat"
        index = faiss.downcast_index(self._index)
        if isinstance(index, faiss.IndexPreTransform):
            return "ivfpq"
        return "hnsw" if isinstance(index, faiss.IndexHNSW) else "flat"

    def set_ef_search(self, ef_search: int) -> None:
        """HNSW candidate index: the search beam (at least the candidates asked for is used)."""
        if self.candidate_index != "hnsw":
            raise InputError("ef_search applies to an HNSW candidate index only")
        hnsw_graph(self._index).hnsw.efSearch = int(ef_search)

    def add(self, database: ArrayEmbedding, ids: np.ndarray | None = None) -> None:
        """Append items ``database`` (an Embedding of the indexed side) without a rebuild.

        A flat candidate index appends the proxy vectors; an HNSW one inserts them into its
        graph. ``ids`` default to continuing after the largest id.
        """
        new = as_torch_embedding(database)
        _check_embedding(new, self.database, "added items")
        m = next(iter(new.values())).shape[0]
        start = int(self.ids.max()) + 1 if len(self.ids) else 0
        new_ids = np.arange(start, start + m) if ids is None else np.asarray(ids, dtype=np.int64)
        if new_ids.shape != (m,) or np.isin(new_ids, self.ids).any():
            raise IndexMismatchError(f"ids to add must be {m} ids not already in the index")
        vectors = self.proxy.database(new)
        everything = {k: torch.cat([self.database[k], new[k]]) for k in self.database}
        self._index = in_memory(self._index)  # a flat index file is read whole to grow it
        if self.candidate_index == "hnsw":
            self._index = hnsw_insert_graph(self._index, self.proxy.graph(everything), vectors)
        else:
            self._index.add(vectors)
        self.database = everything
        self.ids = np.concatenate([self.ids, new_ids])
        self._vectors = self._angle_row_cache = None  # the flat scan reads the grown index again

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def save_proxy(self, path: str) -> None:
        """Write the proxy vectors' Faiss index (``RecipeIndex(..., proxy_index=faiss.read_index(path))``)."""
        faiss.write_index(in_memory(self._index), str(path))

    def candidates(self, queries: Embedding, K: int) -> np.ndarray:
        """``[n, K]`` database rows with the largest proxy inner product."""
        queries = as_torch_embedding(queries)
        _check_embedding(queries, self.database, "queries")
        K = min(int(K), len(self))
        if isinstance(self.proxy.lift, AngleLift) and self.candidate_index == "flat":
            return self._angle_scan(queries, K)
        vectors = self.proxy.query(queries)
        if vectors.ndim == 2:
            return self._top_rows(vectors, K)
        return self._dinkelbach_candidates(self._rounds_functionals(vectors), K)

    def _rounds_functionals(self, functionals: np.ndarray) -> np.ndarray:
        """``q_a, q_b`` ``[n, 2, D]`` float64 for the Dinkelbach rounds, which maximise
        ``a / sqrt(b^2 - 1)``, the cosine of the angle at the query: ``q_a`` negated where the
        best items have a large angle at the query. That is exact for a score of ``+angle`` at
        the query. For an angle at the database item it is a heuristic: a small angle at ``y``
        towards ``x`` puts ``x`` beyond ``y`` along ``y``'s ray, where the angle at ``x`` towards
        ``y`` is near pi (and the reverse for ``+angle``); the rounds rank by that angle at ``x``,
        and the rerank by the exact one (``benchmarks/search.py --sections candidates``
        measures the recall)."""
        spec = self.angle_score
        out = functionals.astype(np.float64)
        if spec.larger_is_better != (spec.vertex == "database"):
            out[:, 0] *= -1.0
        return out

    def _dinkelbach_candidates(self, functionals: np.ndarray, K: int) -> np.ndarray:
        """Candidates for ``max a / sqrt(b^2 - 1)`` (``functionals`` ``[n, 2, D]`` = ``q_a, q_b``)."""
        q_a, q_b = functionals[:, 0], functionals[:, 1]
        n = len(q_a)
        lam = np.zeros(n)
        rounds = []
        for _ in range(ANGLE_ROUNDS):
            query = np.ascontiguousarray((q_a - lam[:, None] * q_b).astype(np.float32))
            rows = self._top_rows(query, K)
            rounds.append(rows)
            # an approximate (HNSW) candidate index may find fewer than K: Faiss pads with -1
            valid = rows >= 0
            uniq, inverse = np.unique(np.where(valid, rows, 0), return_inverse=True)
            vec = self._index.reconstruct_batch(uniq)[
                inverse.reshape(rows.shape)
            ]  # [n, K, D] float32
            ab = np.matmul(vec, np.stack([q_a, q_b], axis=2).astype(np.float32)).astype(np.float64)
            a, b = ab[..., 0], ab[..., 1]
            # Best exact ratio a / h(b), h(b) = sqrt(b^2 - 1); the next round maximises a minus
            # that ratio times h linearised at the best item's b (h is concave: a tangent line).
            h = np.sqrt(np.maximum(b * b - 1.0, 1e-12))
            best = np.argmax(np.where(valid, a / h, -np.inf), axis=1)
            a0, b0, h0 = (np.take_along_axis(v, best[:, None], 1)[:, 0] for v in (a, b, h))
            lam = (a0 / h0) * (b0 / h0)
        return _first_distinct(np.concatenate(rounds[::-1], axis=1), K)

    @torch.no_grad()
    def rerank(self, queries: Embedding, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Score ``rows`` ``[n, K]`` with ``recipe.pair_scores``; top ``k`` by (score desc, id asc)."""
        queries = as_torch_embedding(queries)
        n, K = rows.shape
        valid = rows >= 0  # an HNSW candidate index pads a short answer with -1
        scores = np.empty((n, K), dtype=np.float64)
        flat = torch.from_numpy(np.where(valid, rows, 0).reshape(-1))
        q_index = torch.arange(n).repeat_interleave(K)
        for start in range(0, n * K, self.score_batch):
            sl = slice(start, start + self.score_batch)
            q = {key: v.index_select(0, q_index[sl]) for key, v in queries.items()}
            d = {key: v.index_select(0, flat[sl]) for key, v in self.database.items()}
            texts, images = (q, d) if self.query_side == "text" else (d, q)
            s = self.recipe.pair_scores(texts, images, query=self.query_side)
            scores.reshape(-1)[sl] = s.double().cpu().numpy()
        if not np.isfinite(scores[valid]).all():
            raise NonFiniteError(
                "recipe.pair_scores returned non-finite scores for some candidates"
            )
        if (valid.sum(axis=1) < k).any():
            raise InputError(
                f"the approximate candidate index found fewer than k={k} candidates for some "
                "queries; raise its ef_search (RecipeIndex.set_ef_search) or the candidates"
            )
        scores[~valid] = -np.inf
        ext = np.where(valid, self.ids[np.where(valid, rows, 0)], np.iinfo(np.int64).max)
        order = np.lexsort((ext, -scores), axis=-1)[:, :k]
        return np.take_along_axis(scores, order, 1), np.take_along_axis(ext, order, 1)

    def search(
        self, queries: Embedding, k: int = 10, candidates: int = 200
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` database items per query by the recipe's score, from ``candidates`` proxy hits."""
        if k < 1 or candidates < 1:
            raise InputError(
                f"k and candidates must be positive, got k={k}, candidates={candidates}"
            )
        rows = self.candidates(queries, max(k, candidates))
        return self.rerank(queries, rows, min(k, rows.shape[1]))


def search_texts_to_images(
    recipe: Recipe,
    images: Embedding,
    texts: Embedding,
    k: int = 10,
    candidates: int = 200,
    proxy: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Images for each text by ``recipe``'s text->image score: ``(scores [Nt, k], image rows [Nt, k])``."""
    return RecipeIndex(recipe, images, "images", proxy=proxy).search(texts, k, candidates)


def search_images_to_texts(
    recipe: Recipe,
    texts: Embedding,
    images: Embedding,
    k: int = 10,
    candidates: int = 200,
    proxy: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Texts for each image by ``recipe``'s image->text score: ``(scores [Ni, k], text rows [Ni, k])``."""
    return RecipeIndex(recipe, texts, "texts", proxy=proxy).search(images, k, candidates)


@torch.no_grad()
def exhaustive_topk(
    recipe: Recipe, queries: Embedding, database: Embedding, side: Side, k: int, chunk: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """Top ``k`` rows of ``database`` per query by the full ``recipe.scores`` matrix, ties by row."""
    queries, database = as_torch_embedding(queries), as_torch_embedding(database)
    out_s, out_i = [], []
    n = next(iter(queries.values())).shape[0]
    for start in range(0, n, chunk):
        q = {key: v[start : start + chunk] for key, v in queries.items()}
        s = (
            (
                recipe.scores(q, database, query="text")
                if side == "images"
                else recipe.scores(database, q, query="image").T
            )
            .double()
            .cpu()
            .numpy()
        )
        rows = np.broadcast_to(np.arange(s.shape[1]), s.shape)
        order = np.lexsort((rows, -s), axis=-1)[:, :k]
        out_s.append(np.take_along_axis(s, order, 1))
        out_i.append(order)
    return np.vstack(out_s), np.vstack(out_i)


def rerank_recall(
    recipe: Recipe,
    queries: Embedding,
    database: Embedding,
    side: Side = "images",
    *,
    k: int = 10,
    candidates: int = 200,
    proxy: str | None = None,
    engine: RecipeIndex | None = None,
) -> float:
    """Mean |top-k of the two-stage search  ∩  exhaustive top-k by ``recipe.scores``| / k."""
    engine = engine or RecipeIndex(recipe, database, side, proxy=proxy)
    _, got = engine.search(queries, k, candidates)
    _, want = exhaustive_topk(recipe, queries, database, side, k)
    return float(
        np.mean(
            [
                len(set(a.tolist()) & set(b.tolist())) / want.shape[1]
                for a, b in zip(got, want, strict=False)
            ]
        )
    )


__all__ = [
    "Proxy",
    "RecipeIndex",
    "default_proxy",
    "exhaustive_topk",
    "rerank_recall",
    "search_images_to_texts",
    "search_texts_to_images",
]
