"""AtMG's losses (seed 001, "Accept the Modality Gap", Sec. 4).

Angle contrastive loss (Eq. 11, docs/design.md's reading)
    L_angle = 1/2 [ CE_{T->I}(-alpha / tau) + CE_{I->T}(beta / tau) ]
    alpha(t, y) = ext(t, y): exterior angle at the text t towards the image y (Eq. 9)
    beta(y, t)  = ext(y, t): exterior angle at the image y towards the text t
The text->image rows rank images by small alpha; the image->text rows rank texts by large beta
(near pi when the text lies between the origin and the image). Eq. 11's literal
``beta = pi - alpha`` would make the second term a copy of the first (a softmax ignores a
constant shift), so the project follows the authors' code, which takes beta at the image.
The factor 1/2 follows that code too (Eq. 11 writes the sum).

Matched-pair angle term (the authors' code, not in the paper)
    L_pair = mean_i alpha(t_i, y_i) - mean_i beta(y_i, t_i)
The authors' training code adds this, with weight 0.2, to Eq. 11: it pulls each matched image
onto its text's outward axis directly. Without it, training from small norms can settle in the
inverted configuration (texts outside their images, every alpha near pi), where the softmax
still separates pairs by small angular differences but held-out ranking is at chance.

Centroid regulariser (Eq. 12, docs/design.md's reading)
    L_centroid = |dist0(mid(T)) - r_q| + |dist0(mid(I)) - r_p|,  r_s = acosh(c s) / sqrt(c),  p > q
with ``mid`` the Einstein midpoint of the batch (Eq. 6). Eq. 12 subtracts a scalar from a point;
the reading penalises the gap between each centroid's distance to the origin and its target
radius, so images' centroid sits further out than texts'.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from curvalign.geometry import lorentz
from curvalign.losses.contrastive import symmetric_info_nce
from curvalign.scores import (
    angle_at_image_pair_scores,
    angle_at_image_scores,
    angle_at_text_pair_scores,
    angle_at_text_scores,
    angle_scores_both,
)


def angle_contrastive_loss(
    texts: Tensor,
    images: Tensor,
    all_texts: Tensor,
    all_images: Tensor,
    c: float | Tensor,
    temperature: float | Tensor,
    offset: int = 0,
) -> Tensor:
    """AtMG Eq. 11 (docs/design.md's reading), local rows against gathered columns.

    texts, images          [B, d]         this process's matched pairs (row i with row i)
    all_texts, all_images  [B_global, d]  the gathered batch; local row i is global row i + offset
    """
    if texts is all_texts and images is all_images:
        # one process: both matrices score the same pairs, from one Gram matrix
        text_to_image, image_to_text = angle_scores_both(texts, images, c)
    else:
        text_to_image = angle_at_text_scores(texts, all_images, c)  # [B, B_global]  -alpha
        image_to_text = angle_at_image_scores(images, all_texts, c)  # [B, B_global]  +beta
    return symmetric_info_nce(text_to_image, image_to_text, temperature, offset)


def matched_angle_loss(texts: Tensor, images: Tensor, c: float | Tensor) -> Tensor:
    """``mean_i alpha(t_i, y_i) - mean_i beta(y_i, t_i)`` over matched rows ``[B, d]`` (the AtMG
    authors' code: minimise the angle at the text, maximise the angle at the image)."""
    alpha = -angle_at_text_pair_scores(texts, images, c)
    beta = angle_at_image_pair_scores(images, texts, c)
    return alpha.mean() - beta.mean()


def target_radius(level: float, c: float | Tensor) -> Tensor:
    """AtMG Eq. 12's target ``acosh(c s) / sqrt(c)``, in float32 at least.

    ``c s < 1`` has no acosh; the argument is floored at 1 (radius 0, the origin)."""
    c_t = torch.as_tensor(c)
    work = torch.promote_types(c_t.dtype, torch.float32)
    c_t = c_t.to(work)
    return torch.acosh((c_t * level).clamp_min(1.0)) / c_t.sqrt()


def centroid_radius_loss(
    texts: Tensor, images: Tensor, c: float | Tensor, text_level: float, image_level: float
) -> Tensor:
    """AtMG Eq. 12 (docs/design.md's reading): ``|dist0(mid T) - r_q| + |dist0(mid I) - r_p|``.

    texts, images  [N, d]  Lorentz space components (pass the gathered batch, so the centroid is
                           the global batch's)
    text_level q, image_level p with p > q: target radii ``acosh(c q)/sqrt(c)`` and
    ``acosh(c p)/sqrt(c)``.
    """
    if (
        not (math.isfinite(text_level) and math.isfinite(image_level))
        or not image_level > text_level
    ):
        raise ValueError(
            f"centroid_radius_loss needs image_level p > text_level q (images further "
            f"out), got p={image_level}, q={text_level}"
        )
    text_mid = lorentz.einstein_midpoint(texts, c)
    image_mid = lorentz.einstein_midpoint(images, c)
    text_gap = lorentz.dist0(text_mid, c) - target_radius(text_level, c)
    image_gap = lorentz.dist0(image_mid, c) - target_radius(image_level, c)
    return (text_gap.abs() + image_gap.abs()).sum()


__all__ = ["angle_contrastive_loss", "centroid_radius_loss", "matched_angle_loss", "target_radius"]
