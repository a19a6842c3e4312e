"""HyCoCLIP (Pal et al. 2025): MERU plus box-level pairs (one object crop and its noun phrase).

Embedding, head, score, zero-shot and logging as MERU (``LorentzRecipe``).

Loss (docs/design.md; the HyCoCLIP code as reused by PHyCLIP)
    contrastive  0.25 x [ CE(image -> all texts) + CE(text -> all images)
                        + CE(box image -> all texts) + CE(box text -> all images) ]
                 on ``-d_L / tau``; box rows score against the *full* texts / images.
    entailment   gamma x 0.5 x [ cone(T -> I, eta 0.7) + cone(T_box -> I_box, eta 0.7)
                               + cone(I_box -> I, eta 1.2) + cone(T_box -> T, eta 1.2) ]
                 with ``cone(parent -> child, eta) = mean max(0, ext(parent, child) - eta aper(parent))``,
                 the parent being the general side; gamma 0.2.
``requires = {"boxes"}``: one box per image per sample (``Batch.box_image``, ``Batch.box_text``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from curvalign.losses import entailment_cone_loss, info_nce
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
    box_batch_points,
    check_batch,
    eta_cone_margin,
    sum_terms,
)
from curvalign.scores import lorentz_distance_scores

#: (term name, parent, child, which eta): the four entailment pairs, general side first.
ENTAILMENT_PAIRS = (
    ("entail_text_image", "text", "image", "inter"),
    ("entail_box_text_box_image", "box_text", "box_image", "inter"),
    ("entail_box_image_image", "box_image", "image", "intra"),
    ("entail_box_text_text", "box_text", "text", "intra"),
)

#: (term name, local rows, gathered columns): the four contrastive directions.
CONTRASTIVE_PAIRS = (
    ("contrast_image_text", "image", "text"),
    ("contrast_text_image", "text", "image"),
    ("contrast_box_image_text", "box_image", "text"),
    ("contrast_box_text_image", "box_text", "image"),
)


@dataclass
class HycoclipConfig(LorentzConfig):
    """HyCoCLIP: LorentzConfig plus the box-level terms.

    entailment_weight  gamma, the entailment weight (0.2; the four cone terms are summed and
                       halved, so each has weight 0.1, as in the HyCoCLIP code)
    eta_inter          aperture multiplier for T -> I and T_box -> I_box (0.7)
    eta_intra          aperture multiplier for I_box -> I and T_box -> T (1.2)
    """

    entailment_weight: float = 0.2
    eta_inter: float = 0.7
    eta_intra: float = 1.2


@register
class Hycoclip(LorentzRecipe):
    name = "hycoclip"
    #: HyCoCLIP follows MERU's table: R@5 and R@10
    reported_recall_ks = (5, 10)
    Config = HycoclipConfig
    requires = frozenset({"boxes"})
    #: the HyCoCLIP schedule PHyCLIP App. C.3 reuses: AdamW lr 5e-4, weight decay 0.2,
    #: warm-up 4000 of 500000 steps, cosine to 0, no clipping
    train_defaults = {
        "lr": 5e-4,
        "weight_decay": 0.2,
        "warmup": 0.008,
        "min_lr_ratio": 0.0,
        "grad_clip": 0.0,
    }
    entailment_measure = (
        "cone margin eta aper(text) - ext(text, item), eta_inter for an image, eta_intra for "
        "a text (the loss's cones without the hinge)"
    )

    def entailment_scores(
        self, general: Embedding, specific: Embedding, specific_modality: Query = "image"
    ) -> Tensor:
        return eta_cone_margin(self, general, specific, specific_modality)

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        gather = gather or Gather()
        check_batch(batch, self.name, boxes=True)
        cfg: HycoclipConfig = self.config
        c, tau = self.curvature(), self.temperature()
        local = box_batch_points(self.image_head, self.text_head, batch, c)
        everyone = gather({"image": local["image"], "text": local["text"]})
        offset = gather.offset(batch.image.shape[0])
        terms = {}
        matrices: dict[tuple[str, str], Tensor] = {}
        for name, rows, cols in CONTRASTIVE_PAIRS:
            if gather.world_size == 1 and (cols, rows) in matrices:
                # one process: the reverse direction's pairs, and the distance is symmetric:
                # its matrix transposed (half the B x B work)
                scores = matrices[(cols, rows)].T
            else:
                scores = lorentz_distance_scores(local[rows], everyone[cols], c)
            matrices[(rows, cols)] = scores
            terms[name] = 0.25 * info_nce(scores, temperature=tau, offset=offset)
        eta = {"inter": cfg.eta_inter, "intra": cfg.eta_intra}
        for name, parent, child, kind in ENTAILMENT_PAIRS:
            cone = entailment_cone_loss(
                local[parent], local[child], c, eta=eta[kind], K=cfg.aperture_K
            )
            terms[name] = cfg.entailment_weight * 0.5 * cone
        total = sum_terms(terms)
        return LossOutput(
            total=total,
            terms=terms,
            logs={"temperature": float(tau.detach()), "curvature": float(c.detach())},
        )

    @classmethod
    def search_space(cls) -> dict:
        """Shared nuisance knobs plus the entailment weight (around the paper's value)."""
        from curvalign.recipes.base import Knob, shared_search_space

        return {
            **shared_search_space(cls),
            "entailment_weight": Knob(
                "float", 0.02, 1.0, log=True, role="method", why="paper value within 10x/5x"
            ),
        }


__all__ = ["CONTRASTIVE_PAIRS", "ENTAILMENT_PAIRS", "Hycoclip", "HycoclipConfig"]
