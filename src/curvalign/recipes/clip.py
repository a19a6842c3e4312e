"""CLIP (Radford et al. 2021): cosine InfoNCE on the unit sphere, learnable temperature.

Embedding  {"point": [N, d]} unit vectors.
Score      cosine similarity (the logit is cosine / tau).
Loss       symmetric InfoNCE (mean of image->text and text->image), local rows vs gathered columns.
Zero-shot  class embedding = mean of the class's normalised prompt embeddings, renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from curvalign.data.alignment import LinearAlignment
from curvalign.losses import symmetric_info_nce
from curvalign.nn.heads import CosineHead, share_input_preserving_projection
from curvalign.nn.scalars import LearnableScalar
from curvalign.recipes import register
from curvalign.recipes.base import (
    Batch,
    CosineRecipe,
    Embedding,
    Gather,
    LossOutput,
    Progress,
    check_batch,
    check_head_init,
    check_scalar_range,
    learnable_temperature,
    set_projections,
)
from curvalign.scores import cosine_scores


@dataclass
class ClipConfig:
    """CLIP's defaults (MERU's CLIP baseline): 512-d embedding, temperature 0.07 learnable,
    floored at 0.01 (logit scale <= 100)."""

    embed_dim: int = 512
    temperature_init: float = 0.07
    temperature_min: float = 0.01
    learn_temperature: bool = True
    #: "align" (default): the heads start at the data's linear alignment (``Recipe.warm_start``);
    #: "paper": random projections (CLIP's init); "input": image and text heads start at one
    #: shared orthonormal projection, i.e. at the frozen features' cosine ranking when the two
    #: sides share a space (same dimension); docs/methods.md says why "align" is the default
    head_init: str = "align"

    def __post_init__(self) -> None:
        check_head_init(self.head_init, self.embed_dim)
        check_scalar_range("temperature", self.temperature_init, self.temperature_min)


@register
class Clip(CosineRecipe):
    name = "clip"
    Config = ClipConfig
    temperature_knob = "temperature_init"
    #: MERU's CLIP baseline schedule (Desai et al. 2023, as restated by AtMG App. B): AdamW
    #: lr 5e-4, weight decay 0.2, linear warm-up over 4000 of 120000 steps, cosine to 0, no clipping
    train_defaults = {
        "lr": 5e-4,
        "weight_decay": 0.2,
        "warmup": 0.033,
        "min_lr_ratio": 0.0,
        "grad_clip": 0.0,
    }

    def __init__(self, config: ClipConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        self.image_head = CosineHead(image_dim, config.embed_dim)
        self.text_head = CosineHead(text_dim, config.embed_dim)
        if config.head_init == "input":
            share_input_preserving_projection([self.image_head, self.text_head])
        self.temperature = learnable_temperature(config)

    def warm_start(self, alignment: LinearAlignment) -> str:
        """Both heads' projections at the alignment's (``set_projections``): the step-0 cosine
        is the alignment's own where ``embed_dim`` >= the text width (an isometry), and its
        projection onto the ``embed_dim`` leading directions otherwise."""
        set_projections([self.image_head, self.text_head], alignment)
        exact = self.image_head.out_dim >= alignment.text_dim
        return "cosine heads at the alignment" + ("" if exact else ", reduced to embed_dim")

    def logit_temperature(self, progress: Progress) -> float:
        return float(self.temperature.value)

    def step0_scalars(self) -> dict[str, tuple[LearnableScalar, str]]:
        return {"temperature": (self.temperature, "temperature_init")}

    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": self.image_head(features)}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"point": self.text_head(features)}

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name)
        local = {"image": self.image_head(batch.image), "text": self.text_head(batch.text)}
        everyone = gather(local)
        offset = gather.offset(batch.image.shape[0])
        tau = self.temperature()
        contrastive = symmetric_info_nce(
            cosine_scores(local["image"], everyone["text"]),
            cosine_scores(local["text"], everyone["image"]),
            temperature=tau,
            offset=offset,
        )
        return LossOutput(
            total=contrastive,
            terms={"contrastive": contrastive},
            logs={"temperature": float(tau.detach())},
        )

    def log_values(self) -> dict[str, float]:
        return self.temperature.summary("temperature")

    @classmethod
    def search_space(cls) -> dict:
        """The shared nuisance knobs only (lr, weight decay, temperature): the baseline gets the
        same tuning budget as every method (``curvalign benchmark --tune``)."""
        from curvalign.recipes.base import shared_search_space

        return shared_search_space(cls)


__all__ = ["Clip", "ClipConfig"]
