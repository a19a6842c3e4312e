"""MERU (Desai et al. 2023): Lorentz embeddings, distance InfoNCE, text-entails-image cones.

Embedding  {"point": [N, d]} Lorentz space components (time component derived).
Head       linear projection, learnable per-modality scale (init 1/sqrt(d), at most 1),
           ``expmap0`` with the learnable curvature c (init 1, clamped to [0.1, 10]).
Score      ``-d_L(t, y)``; the logit is ``-d_L / tau``.
Loss       symmetric InfoNCE on ``-d_L / tau`` + 0.2 * mean ``max(0, ext(t, y) - aper(t))``:
           the text is the general side (the cone's apex), the image the specific one.
Zero-shot  class embedding = ``expmap0`` of the mean of the prompts' tangent vectors
           (``logmap0``), MERU's protocol.
Logged     temperature, curvature (MERU's learned curvature drifts to its lower bound 0.1;
           the clamp makes it sit exactly on 0.1, visibly), the two head scales.

``LorentzRecipe`` holds what MERU, HyCoCLIP and AtMG share: heads, curvature, temperature,
embeddings, class embeddings and logging.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from curvalign.geometry import lorentz
from curvalign.losses import entailment_cone_loss, symmetric_info_nce
from curvalign.nn.heads import LorentzHead
from curvalign.nn.scalars import LearnableScalar, scalar_parameter_names
from curvalign.recipes import register
from curvalign.recipes.base import (
    Batch,
    Embedding,
    Gather,
    HyperbolicRecipe,
    IndexProxy,
    LossOutput,
    Progress,
    Query,
    check_batch,
)
from curvalign.scores import lorentz_distance_pair_scores, lorentz_distance_scores


@dataclass
class LorentzConfig:
    """Fields shared by the Lorentz recipes (MERU, HyCoCLIP, AtMG); defaults from MERU/HyCoCLIP.

    embed_dim         d, the hyperboloid's space dimension (512)
    curvature_*       c init 1.0, learnable, clamped to [0.1, 10] (DESIGN.md; MERU's code: init/10,
                      init*10); ``learn_curvature=False`` fixes it (the curvature study)
    temperature_*     tau init 0.07, learnable, floored at 0.01
    scale_init        per-modality scale before ``expmap0``; None = 1/sqrt(embed_dim)
    scale_max         the scale's upper bound (MERU: 1, it may only shrink features)
    clip_norm         optional bound kappa on the tangent norm before ``expmap0`` (None = off)
    aperture_K        the cone constant K of the half-aperture (0.1)
    """

    embed_dim: int = 512
    curvature_init: float = 1.0
    curvature_min: float = 0.1
    curvature_max: float = 10.0
    learn_curvature: bool = True
    temperature_init: float = 0.07
    temperature_min: float = 0.01
    learn_temperature: bool = True
    scale_init: float | None = None
    scale_max: float | None = 1.0
    clip_norm: float | None = None
    aperture_K: float = 0.1

    def __post_init__(self) -> None:
        if self.embed_dim <= 0:
            raise ValueError(f"embed_dim must be positive, got {self.embed_dim}")
        if not 0 < self.curvature_min <= self.curvature_init <= self.curvature_max:
            raise ValueError(
                f"need 0 < curvature_min <= curvature_init <= curvature_max, got "
                f"{self.curvature_min}, {self.curvature_init}, {self.curvature_max}"
            )
        if not 0 < self.temperature_min <= self.temperature_init:
            raise ValueError(
                f"need 0 < temperature_min <= temperature_init, got "
                f"{self.temperature_min}, {self.temperature_init}"
            )
        if self.aperture_K <= 0:
            raise ValueError(f"aperture_K must be positive, got {self.aperture_K}")


@dataclass
class MeruConfig(LorentzConfig):
    """MERU: LorentzConfig plus the entailment term.

    entailment_weight  weight of the cone loss (0.2)
    entailment_eta     aperture multiplier (1.0: MERU's cone has no margin)
    """

    entailment_weight: float = 0.2
    entailment_eta: float = 1.0


class LorentzRecipe(HyperbolicRecipe):
    """Image and text ``LorentzHead``s sharing one learnable curvature, and a temperature.
    Ranked by ``-d_L`` of ``point``: a Lorentz index answers exactly."""

    embedding_geometry = {"point": "lorentz"}

    def __init__(self, config: LorentzConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        head = dict(
            scale_init=config.scale_init, scale_max=config.scale_max, clip_norm=config.clip_norm
        )
        self.image_head = LorentzHead(image_dim, config.embed_dim, **head)
        self.text_head = LorentzHead(text_dim, config.embed_dim, **head)
        self.curvature = LearnableScalar(
            config.curvature_init,
            min=config.curvature_min,
            max=config.curvature_max,
            learnable=config.learn_curvature,
        )
        self.temperature = LearnableScalar(
            config.temperature_init, min=config.temperature_min, learnable=config.learn_temperature
        )

    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": self.image_head(features, self.curvature())}

    def embed_texts(self, features: Tensor) -> Embedding:
        return {"point": self.text_head(features, self.curvature())}

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return lorentz_distance_scores(texts["point"], images["point"], self.curvature())

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        return lorentz_distance_pair_scores(texts["point"], images["point"], self.curvature())

    def class_embedding(self, prompts: Embedding) -> Embedding:
        return {"point": lorentz.tangent_mean(prompts["point"], self.curvature())}

    def index_proxies(self) -> dict[str, IndexProxy]:
        return {"lorentz": IndexProxy("lorentz", "point", exact=True)}

    def log_values(self) -> dict[str, float]:
        return {
            **self.temperature.summary("temperature"),
            **self.curvature.summary("curvature"),
            **self.image_head.scale.summary("scale/image"),
            **self.text_head.scale.summary("scale/text"),
        }

    def no_decay_parameter_names(self) -> set[str]:
        return scalar_parameter_names(self) | super().no_decay_parameter_names()

    def _distance_info_nce(
        self,
        local: dict[str, Tensor],
        everyone: dict[str, Tensor],
        c: Tensor,
        tau: Tensor,
        offset: int,
    ) -> Tensor:
        """Symmetric InfoNCE on ``-d_L / tau``: local images vs all texts, local texts vs all images."""
        return symmetric_info_nce(
            lorentz_distance_scores(local["image"], everyone["text"], c),
            lorentz_distance_scores(local["text"], everyone["image"], c),
            temperature=tau,
            offset=offset,
        )


@register
class Meru(LorentzRecipe):
    name = "meru"
    #: MERU (Desai et al., 2023) Table 2: R@5 and R@10 both ways
    reported_recall_ks = (5, 10)
    Config = MeruConfig

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name)
        cfg: MeruConfig = self.config
        c, tau = self.curvature(), self.temperature()
        local = {"image": self.image_head(batch.image, c), "text": self.text_head(batch.text, c)}
        everyone = gather(local)
        contrastive = self._distance_info_nce(
            local, everyone, c, tau, gather.offset(batch.image.shape[0])
        )
        # MERU Eq. 7: the text (general) is the apex, the image (specific) should lie in its cone.
        entail = entailment_cone_loss(
            local["text"], local["image"], c, eta=cfg.entailment_eta, K=cfg.aperture_K
        )
        terms = {"contrastive": contrastive, "entailment": cfg.entailment_weight * entail}
        return LossOutput(
            total=terms["contrastive"] + terms["entailment"],
            terms=terms,
            logs={
                "temperature": float(tau.detach()),
                "curvature": float(c.detach()),
                "entailment_unweighted": float(entail.detach()),
            },
        )


__all__ = ["LorentzConfig", "LorentzRecipe", "Meru", "MeruConfig"]
