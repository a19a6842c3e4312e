"""DualPath's losses (viPolyQwen, seed 004, Sec. 4.4).

    L_text   = InfoNCE + lambda_s MSE(score) + lambda_r L_rank        scored text pairs
    L_visual = InfoNCE + lambda_t L_triplet                           image-text pairs

The paper names the terms without formulas; the readings taken:

score_weighted_info_nce  InfoNCE over a pair batch (a_p's positive is b_p, the other b's are
                         negatives), each row weighted by the pair's score in [0, 1]:
                         ``sum_p s_p CE_p / sum_p s_p``. A pair of unrelated texts (score ~ 0) is
                         no positive; with every score 1 it is the plain InfoNCE.
score_mse                ``mean_p (cos(a_p, b_p) - s_p)^2``: the cosine regressed onto the score.
pair_ranking             ``mean over (p, q) with s_p > s_q of max(0, (s_p - s_q) - (cos_p - cos_q))``:
                         a pair scored higher must have a cosine higher by at least the score gap
                         (ordering preservation, with a margin that grows with the gap).
hardest_negative_triplet ``max(0, m - cos(a_i, b_i) + max_{j != i} cos(a_i, b_j))`` per row, the
                         hardest in-batch negative (VSE++), margin m (0.2).

All take cosine *score matrices* or pair cosines (``curvalign.scores``), local rows against
gathered columns with ``offset`` as in ``losses.contrastive``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from curvalign.losses.contrastive import check_logits


def score_weighted_info_nce(
    scores: Tensor,
    pair_scores: Tensor,
    temperature: float | Tensor,
    offset: int = 0,
    weight_mean: Tensor | None = None,
) -> Tensor:
    """One direction of InfoNCE with rows weighted by ``pair_scores``.

    scores       [P, P_global]  cosine of local a's against all gathered b's
    pair_scores  [P]            weight of row p (the pair's similarity score, >= 0)
    weight_mean  the mean weight over the *global* batch (``Gather.average(pair_scores.mean())``);
                 default the local mean
    Returns ``mean_p(s_p CE_p) / weight_mean``: over one process ``sum_p s_p CE_p / sum_p s_p``,
    and the mean of the ranks' values is that ratio on the global batch (0 when every score is 0).
    """
    check_logits(scores, offset, "score_weighted_info_nce scores")
    if pair_scores.shape != scores.shape[:1]:
        raise ValueError(
            f"score_weighted_info_nce: {scores.shape[0]} rows but pair_scores of shape "
            f"{tuple(pair_scores.shape)}"
        )
    work = torch.promote_types(scores.dtype, torch.float32)
    targets = torch.arange(scores.shape[0], device=scores.device) + offset
    ce = F.cross_entropy(scores.to(work) / temperature, targets, reduction="none")
    weights = pair_scores.to(work).clamp_min(0.0)
    mean = weights.mean() if weight_mean is None else weight_mean.to(work)
    return (weights * ce).mean() / mean.clamp_min(torch.finfo(work).tiny)


def score_mse(pair_cosines: Tensor, pair_scores: Tensor) -> Tensor:
    """``mean (cos_p - s_p)^2`` over pairs. [P], [P] -> scalar."""
    if pair_cosines.shape != pair_scores.shape:
        raise ValueError(
            f"score_mse: cosines {tuple(pair_cosines.shape)} and scores "
            f"{tuple(pair_scores.shape)} differ in shape"
        )
    work = torch.promote_types(pair_cosines.dtype, torch.float32)
    return F.mse_loss(pair_cosines.to(work), pair_scores.to(work))


def pair_ranking(
    pair_cosines: Tensor,
    pair_scores: Tensor,
    all_cosines: Tensor | None = None,
    all_scores: Tensor | None = None,
    world_size: int = 1,
) -> Tensor:
    """Margin ranking over ordered pairs of pairs:
    ``mean_{s_p > s_q} max(0, (s_p - s_q) - (cos_p - cos_q))``; 0 when no two scores differ.

    pair_cosines, pair_scores  [P] the local pairs (the higher-scored side ``p`` of each term)
    all_cosines, all_scores    [P_global] every process's pairs (gathered, cosines with
                               gradients); default the local ones
    world_size                 number of processes: every ordered pair is counted once, on the
                               process holding its higher-scored member, and normalised by the
                               global count, so the mean over processes is the global value.
    Memory: a [P, P_global] matrix (a pair batch is small).
    """
    if pair_cosines.shape != pair_scores.shape or pair_cosines.ndim != 1:
        raise ValueError(
            f"pair_ranking: expected cosines and scores of one shape [P], got "
            f"{tuple(pair_cosines.shape)}, {tuple(pair_scores.shape)}"
        )
    all_cosines = pair_cosines if all_cosines is None else all_cosines
    all_scores = pair_scores if all_scores is None else all_scores
    work = torch.promote_types(pair_cosines.dtype, torch.float32)
    cos, s = pair_cosines.to(work), pair_scores.to(work)
    cos_all, s_all = all_cosines.to(work), all_scores.to(work)
    score_gap = s.unsqueeze(1) - s_all.unsqueeze(0)  # [P, P_global]: s_p - s_q
    cos_gap = cos.unsqueeze(1) - cos_all.unsqueeze(0)
    ordered = score_gap > 0
    count = (s_all.unsqueeze(1) > s_all.unsqueeze(0)).sum()
    if int(count) == 0:
        return cos.sum() * 0.0
    return F.relu(score_gap - cos_gap).masked_fill(~ordered, 0.0).sum() * (
        world_size / count.to(work)
    )


def hardest_negative_triplet(scores: Tensor, margin: float = 0.2, offset: int = 0) -> Tensor:
    """VSE++ triplet loss with the hardest in-batch negative, mean over local rows.

    scores  [B, B_global]  cosines of local anchors against all gathered candidates; row i's
                           positive is column ``i + offset``.
    """
    check_logits(scores, offset, "hardest_negative_triplet scores")
    if scores.shape[1] < 2:
        raise ValueError("hardest_negative_triplet needs at least two candidates per row")
    work = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(work)
    rows = torch.arange(s.shape[0], device=s.device)
    positive = s[rows, rows + offset]
    negatives = s.index_put(
        (rows, rows + offset), torch.tensor(-torch.inf, dtype=work, device=s.device)
    )
    return F.relu(margin - positive + negatives.max(dim=1).values).mean()


__all__ = ["hardest_negative_triplet", "pair_ranking", "score_mse", "score_weighted_info_nce"]
