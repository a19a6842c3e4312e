"""AtMG, "Accept the Modality Gap" (seed 001): angle-based contrastive learning in the Lorentz model.

Embedding, head, curvature and temperature as MERU (``LorentzRecipe``; the authors' code is a
MERU fork).
Score      ``-alpha(t, y)``: the exterior angle at the text t towards the image y, smallest
           first (Sec. 6.1-6.2, docs/design.md), whichever side is the query. ``image_query_score =
           "beta"`` ranks texts for an image query by the angle at the image instead (the
           image->text training logit).
Loss       Eq. 11 (docs/design.md's reading): ``1/2 [CE_{T->I}(-alpha / tau) + CE_{I->T}(beta / tau)]``
           with beta the exterior angle at the image; plus 0.2 x the matched-pair angle term
           ``mean alpha(t_i, y_i) - mean beta(y_i, t_i)`` of the authors' code (not in the paper;
           ``pair_angle_weight=0`` gives Eq. 13 exactly, see docs/methods.md for why it is on);
           plus ``lambda`` x the centroid regulariser
           (Eq. 12 reading: ``|dist0(mid T) - r_q| + |dist0(mid I) - r_p|``), off by default
           (lambda = 0; the authors' code does not use it).
Zero-shot  ``zero_shot_scores`` averages alpha over each class's prompts (Sec. 6.1) and ranks by
           minus that mean; ``class_embedding`` (used by nothing here) is MERU's tangent mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from curvalign.geometry import lorentz
from curvalign.losses import angle_contrastive_loss, centroid_radius_loss, matched_angle_loss
from curvalign.recipes import register
from curvalign.recipes.base import (
    AngleScore,
    Batch,
    Embedding,
    Gather,
    IndexProxy,
    LorentzConfig,
    LorentzRecipe,
    LossOutput,
    Progress,
    Query,
    check_batch,
    sum_terms,
)
from curvalign.scores import (
    angle_at_image_pair_scores,
    angle_at_image_scores,
    angle_at_text_pair_scores,
    angle_at_text_scores,
)


@dataclass
class AtmgConfig(LorentzConfig):
    """AtMG: LorentzConfig (MERU's setup, App. B) plus the centroid regulariser.

    pair_angle_weight     weight of ``mean alpha(t_i, y_i) - mean beta(y_i, t_i)`` over matched
                          pairs (0.2, the authors' code; 0 = the paper's Eq. 13). Without it,
                          training from the MERU initialisation can settle with texts outside
                          their images (held-out R@1 at chance on the synthetic world).
    centroid_weight       lambda of Eq. 13 (0.0: off; the paper gives no value)
    centroid_text_level   q of Eq. 12; target radius acosh(c q)/sqrt(c)
    centroid_image_level  p > q of Eq. 12. Defaults cosh(0.5) and cosh(2): at c = 1 the targets
                          are radii 0.5 (texts) and 2 (images), the values in the authors'
                          (commented-out) code; the paper gives none.
    image_query_score     "alpha" (rank by the angle at the text, docs/design.md) or "beta" (rank texts
                          for an image query by the angle at the image)
    text_radius_ratio     texts' step-0 radius over the images' (0.25, not LorentzConfig's 1): at
                          equal radii the angle at the text equals the angle at the image, so
                          the two directions of the loss cancel and it sits at log B. 0.25 is
                          the ratio of the authors' centroid targets (texts at radius 0.5,
                          images at 2, their code) and Sec. 4's picture of texts nearer the
                          origin than their images; each side keeps one radius, so the step-0
                          ranking is still the frozen features' for unit-norm features
    """

    text_radius_ratio: float = 0.25

    pair_angle_weight: float = 0.2
    centroid_weight: float = 0.0
    centroid_text_level: float = math.cosh(0.5)
    centroid_image_level: float = math.cosh(2.0)
    image_query_score: str = "alpha"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pair_angle_weight < 0:
            raise ValueError(f"pair_angle_weight must be >= 0, got {self.pair_angle_weight}")
        if self.centroid_weight < 0:
            raise ValueError(f"centroid_weight must be >= 0, got {self.centroid_weight}")
        if not self.centroid_image_level > self.centroid_text_level:
            raise ValueError(
                "centroid_image_level p must exceed centroid_text_level q (images further "
                f"out), got p={self.centroid_image_level}, q={self.centroid_text_level}"
            )
        if self.image_query_score not in ("alpha", "beta"):
            raise ValueError(
                f"image_query_score must be 'alpha' or 'beta', got {self.image_query_score!r}"
            )


@register
class Atmg(LorentzRecipe):
    name = "atmg"
    #: seed 001, Sec. 6.2 / Table 2: recall@5 and @10, MERU's splits
    reported_recall_ks = (5, 10)
    #: AtMG App. B ("our training setups closely resemble those of MERU"): AdamW
    #: lr 5e-4, weight decay 0.2, linear warm-up over 4000 of 120000 steps, cosine to 0, no clipping
    train_defaults = {
        "lr": 5e-4,
        "weight_decay": 0.2,
        "warmup": 0.033,
        "min_lr_ratio": 0.0,
        "grad_clip": 0.0,
    }
    Config = AtmgConfig
    radius_gap_knob = "text_radius_ratio"

    entailment_measure = "minus the exterior angle at the text towards the item (alpha, Eq. 9)"

    def entailment_scores(
        self, general: Embedding, specific: Embedding, specific_modality: Query = "image"
    ) -> Tensor:
        g, s = general["point"].detach().double(), specific["point"].detach().double()
        return -lorentz.exterior_angle(g, s, self.curvature_value())

    def _use_beta(self, query: Query) -> bool:
        return query == "image" and self.config.image_query_score == "beta"

    def scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        c = self.curvature()
        if self._use_beta(query):
            return angle_at_image_scores(images["point"], texts["point"], c).T
        return angle_at_text_scores(texts["point"], images["point"], c)

    def pair_scores(self, texts: Embedding, images: Embedding, query: Query = "text") -> Tensor:
        c = self.curvature()
        if self._use_beta(query):
            return angle_at_image_pair_scores(images["point"], texts["point"], c)
        return angle_at_text_pair_scores(texts["point"], images["point"], c)

    def index_proxies(self) -> dict[str, IndexProxy]:
        """The angle is no inner product of fixed vectors: candidates by the angle itself (flat
        scan) or its two linear functionals (Dinkelbach rounds, ``index/rerank.py``), or by
        distance, reranked exactly. Text queries: minus the angle at the text, the query. Image
        queries: minus the angle at the text, now the database item, or with
        ``image_query_score="beta"`` plus the angle at the image, the query."""
        beta = self.config.image_query_score == "beta"
        angle: dict[Query, AngleScore] = {
            "text": AngleScore("query"),
            "image": AngleScore("query", larger_is_better=True) if beta else AngleScore("database"),
        }
        return {
            "angle": IndexProxy("angle", "point", angle=angle),
            "lorentz": IndexProxy("lorentz", "point"),
        }

    def zero_shot_scores(
        self, images: Embedding, prompts: Embedding, prompt_to_class: Tensor, num_classes: int
    ) -> Tensor:
        """[Ni, C]: minus the mean over each class's prompts of alpha(prompt, image) (Sec. 6.1)."""
        prompt_to_class = prompt_to_class.long().to(prompts["point"].device)
        counts = torch.bincount(prompt_to_class, minlength=num_classes)
        if prompt_to_class.numel() and (
            prompt_to_class.min() < 0 or prompt_to_class.max() >= num_classes
        ):
            raise ValueError(
                f"prompt_to_class must lie in [0, {num_classes}), got values "
                f"{int(prompt_to_class.min())}..{int(prompt_to_class.max())}"
            )
        if (counts == 0).any():
            missing = torch.nonzero(counts == 0).flatten()[:5].tolist()
            raise ValueError(
                f"zero-shot classes without prompts: {missing} (every class needs one)"
            )
        alpha = -angle_at_text_scores(
            prompts["point"], images["point"], self.curvature()
        )  # [Nq, Ni]
        total = torch.zeros(num_classes, alpha.shape[1], dtype=alpha.dtype, device=alpha.device)
        total.index_add_(0, prompt_to_class, alpha)
        return -(total / counts.unsqueeze(1).to(alpha.dtype)).T

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name)
        cfg: AtmgConfig = self.config
        c, tau = self.curvature(), self.temperature()
        local = {"image": self.image_head(batch.image, c), "text": self.text_head(batch.text, c)}
        everyone = gather(local)
        offset = gather.offset(batch.image.shape[0])
        terms = {
            "angle": angle_contrastive_loss(
                local["text"], local["image"], everyone["text"], everyone["image"], c, tau, offset
            )
        }
        logs = {"temperature": float(tau.detach()), "curvature": float(c.detach())}
        if cfg.pair_angle_weight > 0:
            terms["pair_angle"] = cfg.pair_angle_weight * matched_angle_loss(
                local["text"], local["image"], c
            )
        if cfg.centroid_weight > 0:
            # Centroids of the gathered batch, so multi-process training matches the global batch.
            centroid = centroid_radius_loss(
                everyone["text"],
                everyone["image"],
                c,
                cfg.centroid_text_level,
                cfg.centroid_image_level,
            )
            terms["centroid"] = cfg.centroid_weight * centroid
            logs["centroid_unweighted"] = float(centroid.detach())
        with torch.no_grad():
            logs["radius/text"] = float(lorentz.dist0(local["text"], c).mean())
            logs["radius/image"] = float(lorentz.dist0(local["image"], c).mean())
        return LossOutput(total=sum_terms(terms), terms=terms, logs=logs)

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs plus the matched-pair angle weight, the centroid weight (Eq. 13's
        lambda, for which the paper gives no value) and the texts' radius gap (the knob the
        step-0 check names)."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "pair_angle_weight": Knob(
                "float", 0.0, 1.0, role="method", why="0 = Eq. 13 exactly; default 0.2"
            ),
            "centroid_weight": Knob(
                "float", 0.0, 1.0, role="method", why="Eq. 13's lambda: no paper value"
            ),
            # the step-0 check names it when texts and images start at one radius
            "text_radius_ratio": Knob(
                "float", 0.05, 0.8, log=True, why="texts' step-0 radius gap; default 0.25"
            ),
        }


__all__ = ["Atmg", "AtmgConfig"]
