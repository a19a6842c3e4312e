"""Losses: score matrices and points in, scalars out. Each cites the paper equation it implements.

contrastive   info_nce, symmetric_info_nce      (CLIP / MERU Eq. 3 / PHyCLIP Eq. 3 / ProCLIP Eq. 5)
entailment    entailment_cone_loss              (MERU, HyCoCLIP, PHyCLIP Eq. 5)
angle         angle_contrastive_loss,           (AtMG Eq. 11)
              matched_angle_loss                (AtMG authors' code)
              centroid_radius_loss              (AtMG Eq. 12)

Modules added by other parts of the project (routing, multiloss) are imported from their own
files (``curvalign.losses.routing`` ...).
"""

from curvalign.losses.angle import (
    angle_contrastive_loss,
    centroid_radius_loss,
    matched_angle_loss,
    target_radius,
)
from curvalign.losses.contrastive import info_nce, symmetric_info_nce
from curvalign.losses.entailment import entailment_cone_loss

__all__ = [
    "angle_contrastive_loss",
    "centroid_radius_loss",
    "entailment_cone_loss",
    "info_nce",
    "matched_angle_loss",
    "symmetric_info_nce",
    "target_radius",
]
