"""A recipe in a geometry the package does not have: the Poincare ball (tests/test_plugin_poincare.py).

Points live in the open ball ``{p : c |p|^2 < 1}`` of curvature ``-c`` (Nickel & Kiela 2017,
Ganea et al. 2018). Linear heads give tangent vectors at the origin, mapped by the ball's
exponential map ``expmap0(v) = tanh(sqrt(c)|v|) v / (sqrt(c)|v|)``; the score is minus the
ball's geodesic distance

    d(x, y) = acosh(1 + 2 c |x - y|^2 / ((1 - c|x|^2)(1 - c|y|^2))) / sqrt(c),

trained with symmetric InfoNCE on ``-d / tau`` and a learnable curvature clamped to its bounds.

Its geometry is its own ``Geometry`` (kind "poincare": scores, distance to the origin
``2 atanh(sqrt(c)|x|) / sqrt(c)``, tangent features ``logmap0``) and its index lift is its own
``Lift``: the ball is isometric to the hyperboloid by ``x = 2p / (1 - c|p|^2)``,
``t = (1 + c|p|^2) / (sqrt(c) (1 - c|p|^2))``, so the database vectors ``[x, t]`` and query
vectors ``[y, -t]`` have dot product ``<x, y>_L = -cosh(sqrt(c) d) / c``: an exact proxy for the
ball's distance. An approximate candidate graph is built on ``sqrt(c) p`` (the ball itself is
conformal).

Nothing in ``src/curvalign`` names it or its geometry: it registers itself, and the recipe
contract's defaults answer the geometry questions (scores, distance to the origin, tangent
features, index proxy) from its ``geometries()``: the ball's distance is written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from curvalign.geometries import Geometry, Lift
from curvalign.losses import symmetric_info_nce
from curvalign.nn.scalars import LearnableScalar
from curvalign.recipes.base import (
    Batch,
    Embedding,
    Gather,
    LossOutput,
    Progress,
    Recipe,
    check_batch,
)

NAME = "_plugin_poincare"
#: the largest sqrt(c)|v| the exponential map lets through: tanh(4) keeps 1 - c|p|^2 ~ 1e-3,
#: representable in float32 with room, so no point reaches the boundary (infinite distance)
MAX_RADIUS = 4.0


# --- the ball's own math (float32 at least; no [N, M, d] tensor) --------------------------------


def _sq(x: Tensor) -> Tensor:
    return (x * x).sum(-1)


def expmap0(v: Tensor, c: Tensor) -> Tensor:
    """``[..., d]`` tangent vectors at the origin -> ball points ``tanh(sqrt(c)|v|) v/(sqrt(c)|v|)``."""
    sc = c.sqrt()
    n = v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return torch.tanh((sc * n).clamp_max(MAX_RADIUS)) / sc * (v / n)


def logmap0(p: Tensor, c: Tensor) -> Tensor:
    """Inverse of ``expmap0``: ``atanh(sqrt(c)|p|) p / (sqrt(c)|p|)``."""
    sc = c.sqrt()
    n = p.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    r = (sc * n).clamp_max(1 - torch.finfo(p.dtype).eps)
    return torch.atanh(r) / (sc * n) * p


def _acosh_1p(z: Tensor, c: Tensor) -> Tensor:
    """``acosh(1 + z) / sqrt(c)`` as ``log1p(z + sqrt(z (z + 2)))``: exact near ``z = 0``."""
    z = z.clamp_min(0.0)
    return torch.log1p(z + torch.sqrt(z * (z + 2.0))) / c.sqrt()


def pairwise_dist(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """``[N, d], [M, d] -> [N, M]`` geodesic distances of the ball (one matrix product)."""
    sx, sy = _sq(x), _sq(y)
    diff = (sx[:, None] + sy[None, :] - 2.0 * x @ y.T).clamp_min(0.0)
    z = 2.0 * c * diff / ((1.0 - c * sx)[:, None] * (1.0 - c * sy)[None, :])
    return _acosh_1p(z, c)


def dist(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """Row-wise ``[n, d], [n, d] -> [n]`` geodesic distance of the ball."""
    z = 2.0 * c * _sq(x - y) / ((1.0 - c * _sq(x)) * (1.0 - c * _sq(y)))
    return _acosh_1p(z, c)


def dist0(p: Tensor, c: Tensor) -> Tensor:
    """``[N, d] -> [N]`` distance to the origin ``2 atanh(sqrt(c)|p|) / sqrt(c)``."""
    sc = c.sqrt()
    r = (sc * p.norm(dim=-1)).clamp_max(1 - torch.finfo(p.dtype).eps)
    return 2.0 * torch.atanh(r) / sc


def to_hyperboloid(p: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    """Ball points ``[N, d]`` -> hyperboloid space components ``[N, d]`` and times ``[N]``, float64."""
    p = np.asarray(p, dtype=np.float64)
    sq = c * (p * p).sum(1)
    return 2.0 * p / (1.0 - sq)[:, None], (1.0 + sq) / (math.sqrt(c) * (1.0 - sq))


# --- the geometry and its lift as values -------------------------------------------------------


@dataclass(frozen=True)
class PoincareLift(Lift):
    """``[x, t]`` / ``[y, -t]`` of the hyperboloid images of the ball points under ``key``."""

    key: str
    curvature: float
    exact: bool = True

    def _lifted(self, emb: Embedding, sign: float) -> np.ndarray:
        x, t = to_hyperboloid(emb[self.key].detach().double().cpu().numpy(), self.curvature)
        return np.ascontiguousarray(np.hstack([x, sign * t[:, None]]), dtype=np.float32)

    def database(self, emb: Embedding) -> np.ndarray:
        return self._lifted(emb, 1.0)

    def query(self, emb: Embedding) -> np.ndarray:
        return self._lifted(emb, -1.0)

    def graph(self, emb: Embedding) -> np.ndarray:
        p = emb[self.key].detach().double().cpu().numpy()
        return np.ascontiguousarray(math.sqrt(self.curvature) * p, dtype=np.float32)


@dataclass(frozen=True)
class PoincareBall(Geometry):
    kind: ClassVar[str] = "poincare"

    def _c(self, like: Tensor) -> Tensor:
        assert self.curvature is not None
        return self.curvature.to(like.dtype)

    def scores(self, x: Tensor, y: Tensor) -> Tensor:
        return -pairwise_dist(x, y, self._c(x))

    def pair_scores(self, x: Tensor, y: Tensor) -> Tensor:
        return -dist(x, y, self._c(x))

    def distance_to_origin(self, x: Tensor) -> Tensor | None:
        x = x.detach().double()
        return dist0(x, self._c(x))

    def tangent(self, x: Tensor) -> Tensor:
        x = x.detach().double()
        return logmap0(x, self._c(x))

    def lift(self, key: str) -> Lift | None:
        assert self.curvature is not None
        return PoincareLift(key, float(self.curvature))


# --- the recipe ---------------------------------------------------------------------------------


@dataclass
class PoincareConfig:
    embed_dim: int = 8
    curvature_init: float = 1.0
    curvature_min: float = 0.1
    curvature_max: float = 10.0
    temperature: float = 0.2

    def __post_init__(self) -> None:
        if self.embed_dim <= 0:
            raise ValueError(f"embed_dim must be positive, got {self.embed_dim}")
        if not 0 < self.curvature_min <= self.curvature_init <= self.curvature_max:
            raise ValueError("need 0 < curvature_min <= curvature_init <= curvature_max")


class PoincareInfoNCE(Recipe):
    name = NAME
    Config = PoincareConfig
    embedding_geometry = {"point": "poincare"}

    def __init__(self, config: PoincareConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        self.image_head = nn.Linear(image_dim, config.embed_dim)
        self.text_head = nn.Linear(text_dim, config.embed_dim)
        self.curvature = LearnableScalar(
            config.curvature_init, min=config.curvature_min, max=config.curvature_max
        )

    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": expmap0(self.image_head(features), self.curvature())}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"point": expmap0(self.text_head(features), self.curvature())}

    def class_embedding(self, prompts: Embedding) -> Embedding:
        c = self.curvature()
        return {"point": expmap0(logmap0(prompts["point"], c).mean(0, keepdim=True), c)}

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name)
        c = self.curvature()
        local = {"image": expmap0(self.image_head(batch.image), c)}
        local["text"] = expmap0(self.text_head(batch.text), c)
        everyone = gather(local)
        total = symmetric_info_nce(
            -pairwise_dist(local["image"], everyone["text"], c),
            -pairwise_dist(local["text"], everyone["image"], c),
            temperature=self.config.temperature,
            offset=gather.offset(batch.image.shape[0]),
        )
        return LossOutput(total=total, terms={"contrastive": total})

    def logit_temperature(self, progress: Progress) -> float:
        return self.config.temperature

    def log_values(self) -> dict[str, float]:
        return self.curvature.summary("curvature")

    # the contract's geometry questions (scores, distance to the origin, tangent features,
    # index proxies) are answered from this one object by the recipe's defaults
    def geometries(self) -> dict[str, Geometry]:
        return {"point": PoincareBall(self.curvature_value(), self.curvature_bounds())}

    def curvature_value(self) -> Tensor:
        with torch.no_grad():
            return self.curvature().detach().double()

    def curvature_bounds(self) -> tuple[float, float]:
        return (self.config.curvature_min, self.config.curvature_max)
