"""Score matrices: two batches of manifold points in, ``[N, M]`` scores out, higher is better.

One function per geometry, plus a row-wise ``*_pair_scores`` version for matched rows (``[n]``,
equal to the diagonal of the matrix; used to rerank candidates). The scores are the bare
geometric quantities (a cosine, a negative distance, an angle): no temperature. The recipe
divides by its temperature when it turns scores into logits (``losses.info_nce(scores,
temperature=tau)``), so the ranking score that evaluation uses and the training logits differ
only by that positive factor.

Every matrix is built from ``curvalign.geometry``'s pairwise functions (matrix products plus
elementwise maps; no ``[N, M, d]`` intermediate).

    cosine            unit vectors [N, d]                           CLIP
    lorentz_distance  Lorentz space components [N, d]              MERU, HyCoCLIP: -d_L
    angle_at_text     [Nt, d] texts, [Ni, d] images                 AtMG text->image: -alpha
    angle_at_image    [Ni, d] images, [Nt, d] texts                 AtMG image->text: +beta
    product_average   [N, k, d] factors, c [k]                      PHyCLIP: -d_avg = -l1 / k
    mixed_sqdist      dict of parts                                 ProCLIP: -d_Z^2 (Eq. 4)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor

from curvalign.geometry import euclidean, lorentz, product

Curvature = float | Tensor


# --- cosine (CLIP) -----------------------------------------------------------------------------
def cosine_scores(x: Tensor, y: Tensor) -> Tensor:
    """[N, d], [M, d] -> [N, M] cosine similarity."""
    return euclidean.pairwise_cosine(x, y)


def cosine_pair_scores(x: Tensor, y: Tensor) -> Tensor:
    """[n, d], [n, d] -> [n] cosine similarity of matched rows."""
    return F.cosine_similarity(x, y, dim=-1)


# --- Lorentz distance (MERU, HyCoCLIP) ---------------------------------------------------------
def lorentz_distance_scores(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """[N, d], [M, d] -> [N, M] ``-d_L(x_i, y_j)`` (MERU Eq. 3 uses it as the contrastive logit)."""
    return lorentz.pairwise_dist(x, y, c, scale=-1.0)  # the sign folded into the kernel


def lorentz_distance_pair_scores(x: Tensor, y: Tensor, c: Curvature) -> Tensor:
    """[n, d], [n, d] -> [n] ``-d_L(x_i, y_i)``."""
    return -lorentz.dist(x, y, c)


# --- exterior angles (AtMG) --------------------------------------------------------------------
def angle_at_text_scores(texts: Tensor, images: Tensor, c: Curvature) -> Tensor:
    """[Nt, d], [Ni, d] -> [Nt, Ni] ``-alpha(t, y)``: minus the exterior angle at the text ``t``
    towards the image ``y`` (AtMG Fig. 3, Eq. 9). Small alpha (the image lies along the text's
    axis, outwards) is a good match; AtMG's ranking score and its text->image logit."""
    return -lorentz.pairwise_exterior_angle(texts, images, c)


def angle_at_text_pair_scores(texts: Tensor, images: Tensor, c: Curvature) -> Tensor:
    """[n, d], [n, d] -> [n] ``-alpha(t_i, y_i)``."""
    return -lorentz.exterior_angle(texts, images, c)


def angle_at_image_scores(images: Tensor, texts: Tensor, c: Curvature) -> Tensor:
    """[Ni, d], [Nt, d] -> [Ni, Nt] ``+beta(y, t)``: the exterior angle at the image ``y``
    towards the text ``t``. It is near pi when ``t`` lies between the origin and ``y`` on one
    geodesic, so larger is better: AtMG's image->text logit (docs/design.md's reading of Eq. 11,
    following the authors' code; Eq. 11's literal ``beta = pi - alpha`` would duplicate the
    text->image term)."""
    return lorentz.pairwise_exterior_angle(images, texts, c)


def angle_scores_both(texts: Tensor, images: Tensor, c: Curvature) -> tuple[Tensor, Tensor]:
    """``(angle_at_text_scores(texts, images, c), angle_at_image_scores(images, texts, c))``:
    [Nt, Ni] ``-alpha`` and [Ni, Nt] ``+beta`` from one Gram matrix
    (``lorentz.pairwise_exterior_angles``; on CPU one GEMM forward and two backward for both)."""
    alpha, beta = lorentz.pairwise_exterior_angles(texts, images, c)
    return -alpha, beta


def angle_at_image_pair_scores(images: Tensor, texts: Tensor, c: Curvature) -> Tensor:
    """[n, d], [n, d] -> [n] ``+beta(y_i, t_i)``."""
    return lorentz.exterior_angle(images, texts, c)


# --- l1 product of Lorentz factors (PHyCLIP) ---------------------------------------------------
def product_average_distance_scores(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """[N, k, d], [M, k, d], c [k] -> [N, M] ``-d_avg = -(1/k) sum_i d_{H_i}(x_i, y_i)``
    (PHyCLIP Eq. 2). The mean over factors keeps the logit scale independent of ``k``."""
    k = x.shape[-2]
    return product.l1_pairwise_dist(x, y, c, scale=-1.0 / k)  # -1/k folded into the kernel


def product_average_distance_pair_scores(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """[n, k, d], [n, k, d], c [k] -> [n] ``-d_avg`` of matched rows."""
    return -product.l1_dist(x, y, c) / x.shape[-2]


# --- weighted mixed-curvature product (ProCLIP) ------------------------------------------------
def mixed_sqdist_scores(
    x: Mapping[str, Tensor],
    y: Mapping[str, Tensor],
    weights: Mapping[str, Tensor],
    c: Curvature,
    radius: Curvature,
) -> Tensor:
    """Parts {"hyperbolic" [N, dH], "euclidean" [N, dE], "sphere" [N, dS]} of both sides,
    positive ``weights`` per part -> [N, M] ``-d_Z^2 = -(a_H d_H^2 + a_E |e1 - e2|^2 + a_S d_S^2)``
    (ProCLIP Eq. 4 and Sec. 2.2: ``s = -d_Z^2``). Parts absent from ``x`` are left out."""
    return -product.mixed_pairwise_sqdist(dict(x), dict(y), dict(weights), c=c, radius=radius)


def mixed_sqdist_pair_scores(
    x: Mapping[str, Tensor],
    y: Mapping[str, Tensor],
    weights: Mapping[str, Tensor],
    c: Curvature,
    radius: Curvature,
) -> Tensor:
    """Matched rows of ``mixed_sqdist_scores``: [n] (``geometry.product.mixed_sqdist``)."""
    return -product.mixed_sqdist(dict(x), dict(y), dict(weights), c=c, radius=radius)


__all__ = [
    "angle_at_image_pair_scores",
    "angle_at_image_scores",
    "angle_at_text_pair_scores",
    "angle_at_text_scores",
    "angle_scores_both",
    "cosine_pair_scores",
    "cosine_scores",
    "lorentz_distance_pair_scores",
    "lorentz_distance_scores",
    "mixed_sqdist_pair_scores",
    "mixed_sqdist_scores",
    "product_average_distance_pair_scores",
    "product_average_distance_scores",
]
