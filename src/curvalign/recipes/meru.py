"""MERU (Desai et al. 2023): Lorentz embeddings, distance InfoNCE, text-entails-image cones.

Embedding  {"point": [N, d]} Lorentz space components (time component derived).
Head       linear projection, learnable per-modality scale (at most 1), ``expmap0`` with the
           learnable curvature c (init 1, clamped to [0.1, 10]). The scale starts where the
           step-0 tangent norm is 1 for the features at hand (resolved from their mean norm;
           MERU's 1/sqrt(d) for MERU's own features, docs/methods.md).
Score      ``-d_L(t, y)``; the logit is ``-d_L / tau``.
Loss       symmetric InfoNCE on ``-d_L / tau`` + 0.2 * mean ``max(0, ext(t, y) - aper(t))``:
           the text is the general side (the cone's apex), the image the specific one.
Zero-shot  class embedding = ``expmap0`` of the mean of the prompts' tangent vectors
           (``logmap0``), MERU's protocol.
Logged     temperature, curvature (MERU's learned curvature drifts to its lower bound 0.1;
           the clamp makes it sit exactly on 0.1, visibly), the two head scales.

``LorentzRecipe`` (``recipes/base.py``) holds what MERU, HyCoCLIP and AtMG share: heads,
curvature, temperature, embeddings, class embeddings and logging.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from curvalign.losses import entailment_cone_loss
from curvalign.recipes import register
from curvalign.recipes.base import (
    Batch,
    Embedding,
    Gather,
    LorentzConfig,
    LorentzRecipe,
    LossOutput,
    Progress,
    Query,
    check_batch,
    cone_margin,
)


@dataclass
class MeruConfig(LorentzConfig):
    """MERU: LorentzConfig plus the entailment term.

    entailment_weight  weight of the cone loss (0.2)
    entailment_eta     aperture multiplier (1.0: MERU's cone has no margin)
    """

    entailment_weight: float = 0.2
    entailment_eta: float = 1.0


@register
class Meru(LorentzRecipe):
    name = "meru"
    #: MERU (Desai et al., 2023) Table 2: R@5 and R@10 both ways
    reported_recall_ks = (5, 10)
    #: MERU's schedule (Desai et al. 2023, as restated by AtMG App. B): AdamW
    #: lr 5e-4, weight decay 0.2, linear warm-up over 4000 of 120000 steps, cosine to 0, no clipping
    train_defaults = {
        "lr": 5e-4,
        "weight_decay": 0.2,
        "warmup": 0.033,
        "min_lr_ratio": 0.0,
        "grad_clip": 0.0,
    }
    Config = MeruConfig
    entailment_measure = "cone margin eta aper(text) - ext(text, item) (Eq. 7 without its hinge)"

    def entailment_scores(
        self, general: Embedding, specific: Embedding, specific_modality: Query = "image"
    ) -> Tensor:
        cfg: MeruConfig = self.config
        return cone_margin(
            general["point"],
            specific["point"],
            self.curvature_value(),
            cfg.entailment_eta,
            cfg.aperture_K,
        )

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

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs plus the entailment weight (the paper fixes 0.2 for 120K-step
        runs on raw encoder outputs; other budgets and features leave it open)."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "entailment_weight": Knob(
                "float", 0.01, 1.0, log=True, role="method", why="paper 0.2, 20x below to 5x above"
            ),
        }


__all__ = ["LorentzConfig", "LorentzRecipe", "Meru", "MeruConfig"]  # the bases re-exported
