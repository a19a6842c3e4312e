"""A recipe defined outside ``src/``: the plug-in test's method (tests/test_plugin_recipe.py).

Euclidean-distance InfoNCE: linear heads into R^d, score ``-|t - y|^2``, symmetric InfoNCE on
``score / tau``. Its geometry has an origin (hierarchy ordering applies: distance ``|x|``), no
curvature, and an exact inner-product proxy (the "mixed" kind over a Euclidean part alone:
``2 e.e' - |e|^2 = |e'|^2 - |e - e'|^2``, a per-query constant away from the score).

Nothing in ``src/curvalign`` names it: it registers itself, and answers the contract's questions.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from curvalign.geometry import euclidean
from curvalign.losses import symmetric_info_nce
from curvalign.recipes.base import (
    Batch,
    Embedding,
    Gather,
    IndexProxy,
    LossOutput,
    Progress,
    Query,
    Recipe,
    check_batch,
)

NAME = "_plugin_euclidean"


@dataclass
class EuclideanConfig:
    embed_dim: int = 16
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.embed_dim <= 0:
            raise ValueError(f"embed_dim must be positive, got {self.embed_dim}")


class EuclideanInfoNCE(Recipe):
    name = NAME
    Config = EuclideanConfig
    embedding_geometry = {"euclidean": "euclidean"}

    def __init__(self, config: EuclideanConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        self.image_head = nn.Linear(image_dim, config.embed_dim)
        self.text_head = nn.Linear(text_dim, config.embed_dim)

    def embed_images(self, features: Tensor) -> Embedding:
        return {"euclidean": self.image_head(features)}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"euclidean": self.text_head(features)}

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return -euclidean.pairwise_sqdist(texts["euclidean"], images["euclidean"])

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return -euclidean.sqdist(texts["euclidean"], images["euclidean"])

    def class_embedding(self, prompts: Embedding) -> Embedding:
        return {"euclidean": prompts["euclidean"].mean(dim=0, keepdim=True)}

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name)
        local = {"image": self.image_head(batch.image), "text": self.text_head(batch.text)}
        everyone = gather(local)
        total = symmetric_info_nce(
            -euclidean.pairwise_sqdist(local["image"], everyone["text"]),
            -euclidean.pairwise_sqdist(local["text"], everyone["image"]),
            temperature=self.config.temperature,
            offset=gather.offset(batch.image.shape[0]),
        )
        return LossOutput(total=total, terms={"contrastive": total})

    # the contract's geometry questions
    def distance_to_origin(self, emb: Embedding) -> Tensor | None:
        points = emb.get("euclidean")
        return None if points is None else points.detach().double().norm(dim=-1)

    def index_proxies(self) -> dict[str, IndexProxy]:
        return {"mixed": IndexProxy("mixed", None, exact=True, weights={"euclidean": 1.0})}
