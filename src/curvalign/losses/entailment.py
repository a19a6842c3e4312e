"""Hyperbolic entailment cones (Ganea et al. 2018; MERU Eq. 5-7; HyCoCLIP; PHyCLIP Eq. 5).

``parent`` is the general point (the cone's apex), ``child`` the specific one that should lie
inside the parent's cone. The loss of a pair is

    max(0, ext(parent, child) - eta * aper(parent))

with ``ext`` the exterior angle at the parent (``lorentz.exterior_angle``, AtMG Eq. 9 / PHyCLIP
Eq. 14) and ``aper`` the half-aperture ``asin(min(1, 2K / (sqrt(c) |parent|)))``
(``lorentz.half_aperture``, PHyCLIP Eq. 13). ``eta`` scales the aperture (HyCoCLIP's margin:
0.7 inter-modal, 1.2 intra-modal; MERU uses 1).

Points may carry factor dimensions: ``[B, k, d]`` with a curvature ``[k]`` gives PHyCLIP's
per-factor loss, and the mean over everything but ``d`` is Eq. 5's ``(1/k) sum_i`` averaged over
the batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from curvalign.geometry import lorentz


def entailment_cone_loss(
    parent: Tensor,
    child: Tensor,
    c: float | Tensor,
    eta: float = 1.0,
    K: float = 0.1,
    reduction: Literal["mean", "none"] = "mean",
) -> Tensor:
    """Cone violation of matched rows.

    parent, child  [..., d]  Lorentz space components (``[B, d]`` or ``[B, k, d]``)
    c              curvature broadcasting against ``parent.shape[:-1]`` (``[k]`` per factor)
    eta            aperture multiplier; K the aperture constant (0.1 in MERU/HyCoCLIP/PHyCLIP)

    Returns the mean over all leading dimensions (``reduction="mean"``) or the per-row,
    per-factor violation ``[...]`` (``"none"``).
    """
    if parent.shape != child.shape:
        raise ValueError(
            f"entailment_cone_loss: parent {tuple(parent.shape)} and child "
            f"{tuple(child.shape)} must have the same shape"
        )
    if eta < 0:
        raise ValueError(f"entailment_cone_loss: eta must be >= 0, got {eta}")
    angle = lorentz.exterior_angle(parent, child, c)
    aperture = lorentz.half_aperture(parent, c, K=K)
    violation = torch.relu(angle - eta * aperture)
    if reduction == "none":
        return violation
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return violation.mean()


__all__ = ["entailment_cone_loss"]
