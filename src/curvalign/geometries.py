"""Geometries as values: what each embedding key of a recipe lives in, and what an index stores.

A recipe names a ``Geometry`` per embedding key (``Recipe.geometries()``): its ``kind`` (the
name written into embedding files), its curvature and the curvature's bounds, the pairwise and
matched-row scores (higher is better), the distance to the origin (None where the space has
none), tangent features for spectra, the *lift* an index stores for it (``Lift``: vectors whose
dot product ranks like the score) and the coordinates an approximate candidate graph is built
on. ``eval/`` and ``index/`` ask these objects, never a closed list of kinds, so that a method
in a geometry this package does not have (a Poincare ball, a Klein model) brings its own
``Geometry`` and ``Lift`` in its recipe file and needs no edit here, in ``eval/`` or in
``index/`` (tests/plugin_poincare.py is such a method).

The built-in geometries (``Sphere``, ``Euclidean``, ``Lorentz``, ``LorentzProduct``,
``Features``) and lifts (``CosineLift``, ``LorentzLift``, ``AngleLift``, ``ProductLorentzLift``,
``MixedLift``; ``BUILTIN_LIFTS`` by the ``IndexProxy.kind`` that names them) are the ones the
eight recipes use. Pure math stays in ``geometry/``; this module turns it into values, and its
numpy adapters (``lorentz_time``, ``database_vectors``, ``query_vectors``, ``lorentz_excess``,
``distance_from_excess``, ``lorentz_distance``, ``poincare_ball``) are ``geometry.lorentz``
evaluated in float64 and returned as the arrays Faiss reads.

Floor: one above ``scores`` (whose score functions the built-ins compose) and ``geometry``,
below ``losses``/``data`` and ``recipes`` (which name geometries), so ``recipes``, ``eval`` and
``index`` all import it (pyproject.toml's layer contract).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from curvalign.errors import InputError
from curvalign.geometry import euclidean, lorentz
from curvalign.scores import (
    cosine_pair_scores,
    cosine_scores,
    lorentz_distance_pair_scores,
    lorentz_distance_scores,
    product_average_distance_pair_scores,
    product_average_distance_scores,
)

#: an embedding as the geometries see it: key -> ``[N, ...]`` tensor (``recipes.base.Embedding``)
Embedding = Mapping[str, Tensor]

# --- numpy adapters over geometry.lorentz (float64 math, float32 vectors for Faiss) -----------


def _t64(x: np.ndarray | Tensor) -> Tensor:
    """``x`` as a float64 tensor (a read-only memory map is wrapped, not written)."""
    if isinstance(x, Tensor):
        return x.detach().to("cpu", torch.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))


def _np32(x: np.ndarray | Tensor) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x, dtype=np.float32)


#: float64 elements per call into ``geometry.lorentz`` from the numpy adapters (16 MiB): row-wise
#: results do not depend on it; blocks keep torch's reduction temporaries small (one call over
#: 200k x 64 rows was ~4x slower than 4096-row blocks) and few enough that intra-op threading
#: costs little per call (4096-row blocks were ~6x slower than 32768-row ones on a busy machine)
BLOCK_ELEMENTS = 1 << 21


def _rowwise(fn: Callable[..., Tensor], *arrays: np.ndarray, last: int = 1) -> np.ndarray:
    """``fn`` over float64 row blocks of ``arrays`` broadcast over their leading dimensions (the
    last ``last`` axes are per-row: 1 for points ``[..., d]``, 0 for scalars ``[...]``) ->
    float64 ``[...]`` (or ``[..., d]`` where ``fn`` keeps the row's axis)."""
    arrays = tuple(np.asarray(a) for a in arrays)
    lead = np.broadcast_shapes(*(a.shape[: a.ndim - last] for a in arrays))
    if 0 in lead:
        full = [np.broadcast_to(a, lead + a.shape[a.ndim - last :]) for a in arrays]
        return fn(*(_t64(f) for f in full)).numpy()
    if len(lead) > 1:  # one leading index at a time: blocks stay views where they can
        full = [np.broadcast_to(a, lead + a.shape[a.ndim - last :]) for a in arrays]
        return np.stack([_rowwise(fn, *(f[i] for f in full), last=last) for i in range(lead[0])])
    n = lead[0] if lead else 1
    rows = [np.broadcast_to(a, (n, *a.shape[a.ndim - last :])) for a in arrays]
    step = max(1, BLOCK_ELEMENTS // max(1, math.prod(rows[0].shape[1:])))
    blocks = [fn(*(_t64(r[i : i + step]) for r in rows)).numpy() for i in range(0, n, step)]
    out = np.concatenate(blocks) if blocks else fn(*(_t64(r) for r in rows)).numpy()
    return out if lead else out[0]


def lorentz_time(x: np.ndarray, c: float) -> np.ndarray:
    """Time component ``sqrt(1/c + |x|^2)`` in float64, ``[..., d] -> [...]`` (``lorentz.time``)."""
    return _rowwise(lambda x: lorentz.time(x, float(c)), x)


def database_vectors(x: np.ndarray, c: float) -> np.ndarray:
    """``[N, d]`` space components -> ``[N, d + 1]`` float32 ``[x, t(x)]``."""
    x = np.asarray(x)
    return np.ascontiguousarray(
        np.hstack([x.astype(np.float32), lorentz_time(x, c)[:, None].astype(np.float32)])
    )


def query_vectors(y: np.ndarray, c: float) -> np.ndarray:
    """``[n, d]`` space components -> ``[n, d + 1]`` float32 ``[y, -t(y)]``: ``u(x).v(y) = <x,y>_L``."""
    y = np.asarray(y)
    return np.ascontiguousarray(
        np.hstack([y.astype(np.float32), -lorentz_time(y, c)[:, None].astype(np.float32)])
    )


def lorentz_excess(x: np.ndarray, y: np.ndarray, c: float) -> np.ndarray:
    """``z = -c <x,y>_L - 1 >= 0`` in float64, row-wise over broadcast ``[..., d]`` inputs,
    without cancellation (``lorentz.excess``): near-duplicates far from the origin keep their
    relative precision. ``d(x, y) = acosh(1 + z) / sqrt(c)``."""
    return _rowwise(lambda x, y: lorentz.excess(x, y, float(c)), x, y)


def distance_from_excess(z: np.ndarray, c: float) -> np.ndarray:
    """``acosh(1 + z) / sqrt(c)`` as ``log1p(z + sqrt(z (z + 2)))``: exact near ``z = 0``."""
    return _rowwise(lambda z: lorentz.dist_from_excess(z, float(c)), z, last=0)


def lorentz_distance(x: np.ndarray, y: np.ndarray, c: float) -> np.ndarray:
    """Row-wise hyperbolic distance in float64, ``[..., d] x [..., d] -> [...]``."""
    return distance_from_excess(lorentz_excess(x, y, c), c)


def poincare_ball(x: np.ndarray, c: float) -> np.ndarray:
    """Space components -> Poincare-ball coordinates ``x / (1 + sqrt(c) t(x))`` (float32)."""
    return _rowwise(lambda x: lorentz.poincare(x, float(c)), x).astype(np.float32)


# --- lifts: what an index stores ----------------------------------------------------------------


class Lift:
    """Vectors whose dot product ranks items like a score (an index's *proxy*).

    ``database(emb)`` ``[N, D]`` float32 (stored), ``query(emb)`` ``[n, D]`` float32 (searched
    with; a lift whose score is a ratio of two linear functionals returns ``[n, 2, D]`` float64
    functionals instead, ranked by Dinkelbach rounds), ``graph(emb)`` ``[N, D']`` float32
    coordinates whose L2 proximity follows the score's (an HNSW candidate graph is built on
    them). ``exact``: the dot product ranks exactly like the score (no rerank needed).
    """

    exact: bool = False

    def database(self, emb: Embedding) -> np.ndarray:
        raise NotImplementedError

    def query(self, emb: Embedding) -> np.ndarray:
        raise NotImplementedError

    def graph(self, emb: Embedding) -> np.ndarray:
        return self.database(emb)


def _c_scalar(c: np.ndarray) -> float:
    return float(np.atleast_1d(c)[0])


@dataclass(frozen=True)
class CosineLift(Lift):
    """Unit vectors of ``key``: ``u.v`` is the cosine itself (exact)."""

    key: str = "point"
    exact: bool = True

    def database(self, emb: Embedding) -> np.ndarray:
        x = _np32(emb[self.key])
        return np.ascontiguousarray(x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30))

    def query(self, emb: Embedding) -> np.ndarray:
        return self.database(emb)


@dataclass(frozen=True)
class LorentzLift(Lift):
    """Lorentz ``[x, t]`` / ``[y, -t]`` of ``key`` at curvature ``c``: ``u.v = <x,y>_L``, exact
    for ``-d_L``; the graph on Poincare-ball coordinates (conformal)."""

    key: str
    curvature: np.ndarray
    exact: bool = False

    def database(self, emb: Embedding) -> np.ndarray:
        return database_vectors(_np32(emb[self.key]), _c_scalar(self.curvature))

    def query(self, emb: Embedding) -> np.ndarray:
        return query_vectors(_np32(emb[self.key]), _c_scalar(self.curvature))

    def graph(self, emb: Embedding) -> np.ndarray:
        return poincare_ball(_np32(emb[self.key]), _c_scalar(self.curvature))


@dataclass(frozen=True)
class AngleLift(LorentzLift):
    """AtMG's exterior angle (Eq. 9) over Lorentz points: the database is lifted like
    ``LorentzLift``; a query is the pair of functionals ``q_a, q_b`` ``[n, 2, d+1]`` with
    ``[y, t(y)].q_a = a = sqrt(c) (t(x) xhat.y - |x| t(y))`` and
    ``[y, t(y)].q_b = b = c (t(x) t(y) - x.y)``; the angle at ``x`` has
    ``cos = sqrt(c) a / sqrt(b^2 - 1)`` (``index/rerank.py`` ranks the ratio)."""

    def query(self, emb: Embedding) -> np.ndarray:
        return np.stack(self.functionals(_np32(emb[self.key]), _c_scalar(self.curvature)), axis=1)

    @staticmethod
    def functionals(x: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
        x64 = x.astype(np.float64)
        norm = np.linalg.norm(x64, axis=1, keepdims=True)
        t = lorentz_time(x64, c)[:, None]
        xhat = x64 / np.maximum(norm, np.finfo(np.float32).tiny)
        return math.sqrt(c) * np.hstack([t * xhat, -norm]), c * np.hstack([-x64, t])


@dataclass(frozen=True)
class ProductLorentzLift(Lift):
    """Per factor ``[x_f, t_f]`` / ``c_f [y_f, -t_f]`` concatenated (points ``[N, k, d]`` of
    ``key``): ``u.v = sum_f c_f <x_f, y_f>_L = -sum_f cosh(sqrt(c_f) d_f)``."""

    key: str
    curvature: np.ndarray
    exact: bool = False

    def _factors(self, emb: Embedding) -> tuple[np.ndarray, np.ndarray]:
        x = _np32(emb[self.key])  # [N, k, d]
        return x, np.broadcast_to(np.atleast_1d(self.curvature), (x.shape[1],))

    def database(self, emb: Embedding) -> np.ndarray:
        x, c = self._factors(emb)
        parts = [database_vectors(x[:, f], float(c[f])) for f in range(x.shape[1])]
        return np.ascontiguousarray(np.hstack(parts), dtype=np.float32)

    def query(self, emb: Embedding) -> np.ndarray:
        x, c = self._factors(emb)
        parts = [float(c[f]) * query_vectors(x[:, f], float(c[f])) for f in range(x.shape[1])]
        return np.ascontiguousarray(np.hstack(parts), dtype=np.float32)

    def graph(self, emb: Embedding) -> np.ndarray:
        x, c = self._factors(emb)
        return np.hstack([poincare_ball(x[:, f], float(c[f])) for f in range(x.shape[1])])


@dataclass(frozen=True)
class MixedLift(Lift):
    """ProCLIP's weighted H x E x S product over the keys "hyperbolic", "euclidean", "sphere":
    ``2 a_H <x,y>_L + a_E (2 e.e' - |e'|^2) + 2 a_S s.s'``, first-order in the hyperbolic and
    spherical parts, exact (up to a per-query constant) in the Euclidean one (database
    ``[x, t, e, |e|^2, s]``, query ``[2a_H y, -2a_H t, 2a_E e, -a_E, 2a_S s]``)."""

    weights: Mapping[str, float]
    curvature: np.ndarray | None = None
    exact: bool = False

    def _c(self) -> float:
        if self.curvature is None:
            raise InputError("a mixed proxy with a hyperbolic part needs the recipe's curvature")
        return _c_scalar(self.curvature)

    def _vectors(self, emb: Embedding, database: bool) -> np.ndarray:
        w = dict(self.weights)
        parts = []
        if "hyperbolic" in emb:
            h = _np32(emb["hyperbolic"])
            parts.append(
                database_vectors(h, self._c())
                if database
                else 2 * w["hyperbolic"] * query_vectors(h, self._c())
            )
        if "euclidean" in emb:
            e = _np32(emb["euclidean"])
            if database:
                sq = (e.astype(np.float64) ** 2).sum(1, keepdims=True).astype(np.float32)
                parts.append(np.hstack([e, sq]))
            else:
                column = np.full((len(e), 1), -w["euclidean"], np.float32)
                parts.append(np.hstack([2 * w["euclidean"] * e, column]))
        if "sphere" in emb:
            s = _np32(emb["sphere"])
            parts.append(s if database else 2 * w["sphere"] * s)
        return np.ascontiguousarray(np.hstack(parts), dtype=np.float32)

    def database(self, emb: Embedding) -> np.ndarray:
        return self._vectors(emb, database=True)

    def query(self, emb: Embedding) -> np.ndarray:
        return self._vectors(emb, database=False)

    def graph(self, emb: Embedding) -> np.ndarray:
        w = dict(self.weights)
        parts = []
        if "hyperbolic" in emb:
            ball = poincare_ball(_np32(emb["hyperbolic"]), self._c())
            parts.append(math.sqrt(w["hyperbolic"]) * ball)
        for part in ("euclidean", "sphere"):
            if part in emb:
                parts.append(math.sqrt(w[part]) * _np32(emb[part]))
        return np.ascontiguousarray(np.hstack(parts), dtype=np.float32)


def _needs_curvature(curvature: np.ndarray | None, owner: str) -> np.ndarray:
    if curvature is None:
        raise InputError(f"recipe {owner!r} has no hyperbolic part: no Lorentz proxy applies")
    return curvature


#: the lifts the built-in ``IndexProxy`` kinds name: ``(key, curvature, weights, exact, owner)``
#: -> ``Lift`` (a recipe with its own geometry passes ``IndexProxy(..., lift=...)`` instead)
BUILTIN_LIFTS: dict[str, Callable[..., Lift]] = {
    "cosine": lambda key, c, weights, exact, owner: CosineLift(key, exact=exact),
    "lorentz": lambda key, c, weights, exact, owner: LorentzLift(
        key, _needs_curvature(c, owner), exact=exact
    ),
    "angle": lambda key, c, weights, exact, owner: AngleLift(
        key, _needs_curvature(c, owner), exact=exact
    ),
    "product-lorentz": lambda key, c, weights, exact, owner: ProductLorentzLift(
        key, _needs_curvature(c, owner), exact=exact
    ),
    "mixed": lambda key, c, weights, exact, owner: MixedLift(dict(weights or {}), c, exact=exact),
}


# --- geometries: what an embedding key lives in -------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """The space one embedding key's points live in.

    kind       the name written into embedding files and shown in messages ("sphere",
               "lorentz", ..., or a plug-in's own, e.g. "poincare")
    curvature  the positive curvature ``c`` (sectional curvature ``-c``), detached float64:
               a scalar, ``[k]`` per factor, or None for a flat space / no curvature
    bounds     ``(min, max)`` clamp of a learned curvature, None when it is not learned

    Methods take points ``[N, ...]`` as the recipe's embedding holds them. The base class is
    a geometry that is only named (``Features``-like): no score, no origin, flattened tangent
    features, no lift; subclasses answer what their space has.
    """

    kind: ClassVar[str] = "features"
    curvature: Tensor | None = None
    bounds: tuple[float, float] | None = None

    def scores(self, x: Tensor, y: Tensor) -> Tensor:
        """``[N, M]`` score of every pair, higher is better."""
        raise InputError(f"a {self.kind!r} embedding has no score of its own")

    def pair_scores(self, x: Tensor, y: Tensor) -> Tensor:
        """``[n]`` score of matched rows: the diagonal of ``scores``."""
        raise InputError(f"a {self.kind!r} embedding has no score of its own")

    def distance_to_origin(self, x: Tensor) -> Tensor | None:
        """``[N]`` float64 distance to the origin, or None where the space has no origin."""
        return None

    def tangent(self, x: Tensor) -> Tensor:
        """``[N, D]`` float64 flat vectors at the origin (spectra); default: ``x`` flattened."""
        x = x.detach().double()
        return x.reshape(x.shape[0], -1)

    def lift(self, key: str) -> Lift | None:
        """What an index stores for points of this geometry under ``key`` (None: none)."""
        return None


@dataclass(frozen=True)
class Features(Geometry):
    """Raw features a method keeps beside its points (AGR's context vectors)."""

    kind: ClassVar[str] = "features"


@dataclass(frozen=True)
class Sphere(Geometry):
    """Unit vectors ranked by cosine (CLIP, DualPath; AGR's Euclidean head). No origin."""

    kind: ClassVar[str] = "sphere"

    def scores(self, x: Tensor, y: Tensor) -> Tensor:
        return cosine_scores(x, y)

    def pair_scores(self, x: Tensor, y: Tensor) -> Tensor:
        return cosine_pair_scores(x, y)

    def lift(self, key: str) -> Lift | None:
        return CosineLift(key)


@dataclass(frozen=True)
class Euclidean(Geometry):
    """Points of R^d ranked by minus the squared distance; the origin is 0."""

    kind: ClassVar[str] = "euclidean"

    def scores(self, x: Tensor, y: Tensor) -> Tensor:
        return -euclidean.pairwise_sqdist(x, y)

    def pair_scores(self, x: Tensor, y: Tensor) -> Tensor:
        return -euclidean.sqdist(x, y)

    def distance_to_origin(self, x: Tensor) -> Tensor | None:
        return torch.linalg.vector_norm(x.detach().double(), dim=-1)

    def lift(self, key: str) -> Lift | None:
        return _EuclideanKeyLift(key)


@dataclass(frozen=True)
class _EuclideanKeyLift(Lift):
    """``[e, |e|^2]`` / ``[2 e', -1]``: ``u.v = |e'|^2 - |e - e'|^2`` (exact up to a per-query
    constant)."""

    key: str
    exact: bool = True

    def database(self, emb: Embedding) -> np.ndarray:
        return MixedLift({"euclidean": 1.0}).database({"euclidean": emb[self.key]})

    def query(self, emb: Embedding) -> np.ndarray:
        return MixedLift({"euclidean": 1.0}).query({"euclidean": emb[self.key]})


@dataclass(frozen=True)
class Lorentz(Geometry):
    """Lorentz space components ``[N, d]`` at curvature ``c``, ranked by ``-d_L``."""

    kind: ClassVar[str] = "lorentz"

    def _c(self) -> Tensor:
        if self.curvature is None:
            raise InputError("a Lorentz geometry needs its curvature")
        return self.curvature

    def scores(self, x: Tensor, y: Tensor) -> Tensor:
        return lorentz_distance_scores(x, y, self._c().to(x.dtype))

    def pair_scores(self, x: Tensor, y: Tensor) -> Tensor:
        return lorentz_distance_pair_scores(x, y, self._c().to(x.dtype))

    def distance_to_origin(self, x: Tensor) -> Tensor | None:
        return lorentz.dist0(x.detach().double(), self._c())

    def tangent(self, x: Tensor) -> Tensor:
        return lorentz.logmap0(x.detach().double(), self._c())

    def lift(self, key: str) -> Lift | None:
        return LorentzLift(key, np.atleast_1d(self._c().cpu().numpy()), exact=True)


@dataclass(frozen=True)
class LorentzProduct(Lorentz):
    """k Lorentz factors ``[N, k, d]``, curvature ``[k]`` (PHyCLIP): ranked by minus the mean
    factor distance; distance to the origin is the mean over factors."""

    kind: ClassVar[str] = "lorentz-product"

    def scores(self, x: Tensor, y: Tensor) -> Tensor:
        return product_average_distance_scores(x, y, self._c().to(x.dtype))

    def pair_scores(self, x: Tensor, y: Tensor) -> Tensor:
        return product_average_distance_pair_scores(x, y, self._c().to(x.dtype))

    def distance_to_origin(self, x: Tensor) -> Tensor | None:
        return lorentz.dist0(x.detach().double(), self._c()).mean(dim=-1)

    def tangent(self, x: Tensor) -> Tensor:
        v = lorentz.logmap0(x.detach().double(), self._c())
        return v.reshape(v.shape[0], -1)

    def lift(self, key: str) -> Lift | None:
        return ProductLorentzLift(key, np.atleast_1d(self._c().cpu().numpy()))


@dataclass(frozen=True)
class _Named(Geometry):
    """A geometry known by name only (an embedding file's record of a plug-in's kind)."""

    name: str = "unknown"

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.name


#: the geometries the built-in recipes name in ``Recipe.embedding_geometry``
BUILTIN_GEOMETRIES: dict[str, type[Geometry]] = {
    g.kind: g for g in (Sphere, Euclidean, Lorentz, LorentzProduct, Features)
}


def named_geometry(
    kind: str, curvature: Tensor | None = None, bounds: tuple[float, float] | None = None
) -> Geometry:
    """The built-in geometry called ``kind`` (with the recipe's curvature where it has one), or
    a geometry known by its name only."""
    cls = BUILTIN_GEOMETRIES.get(kind)
    if cls is None:
        return _Named(curvature, bounds, name=kind)
    if issubclass(cls, Lorentz):
        return cls(curvature, bounds)
    return cls()


__all__ = [
    "AngleLift",
    "BUILTIN_GEOMETRIES",
    "BUILTIN_LIFTS",
    "CosineLift",
    "Euclidean",
    "Features",
    "Geometry",
    "Lift",
    "Lorentz",
    "LorentzLift",
    "LorentzProduct",
    "MixedLift",
    "ProductLorentzLift",
    "Sphere",
    "database_vectors",
    "distance_from_excess",
    "lorentz_distance",
    "lorentz_excess",
    "lorentz_time",
    "named_geometry",
    "poincare_ball",
    "query_vectors",
]
