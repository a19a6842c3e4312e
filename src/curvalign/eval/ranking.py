"""Binary ranking metrics with ties handled explicitly: average precision, ROC AUC, tie counts.

Used by the entailment evaluation (``eval/entailment.py``: is the general text above the
specific item?) and by multi-label mAP (``eval/multilabel.py``: images ranked per class).

Ties, the rule everywhere here: items with the same score are one block that no ordering inside
it may favour.

- ``roc_auc``: the Mann-Whitney statistic with **averaged ranks** (midranks): a (positive,
  negative) pair with equal scores counts 1/2. ``AUROC = (sum of the positives' midranks -
  P(P+1)/2) / (P N)``.
- ``average_precision``: every distinct score is one threshold (a tied block enters the ranking
  all at once), ``AP = sum_t (R_t - R_{t-1}) P_t`` over the distinct scores in descending order,
  with ``P_t``, ``R_t`` the precision and recall of "score >= t". This is scikit-learn's
  ``average_precision_score`` convention, which the HierarCaps and multi-label (VOC/COCO
  classification) numbers people compare against use. A constant score gives AP = the share of
  positives (the chance level), never a lucky 1.
- ``tie_diagnostics``: the number of distinct scores and the modal-score fraction (the share of
  items carrying the most frequent score value). A model whose quantity saturates (every pair
  inside its cone scores the same) shows it here: few distinct scores, a large modal fraction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvalign.errors import InputError


def _check(scores: Tensor, positive: Tensor) -> tuple[Tensor, Tensor]:
    if scores.ndim != 1 or positive.shape != scores.shape:
        raise InputError(
            f"scores and positive must be [n] and [n]; got {tuple(scores.shape)} and "
            f"{tuple(positive.shape)}"
        )
    if not bool(torch.isfinite(scores).all()):
        raise InputError("scores contain NaN or infinite values; the ranking is undefined")
    return scores.double(), positive.bool()


def _blocks(scores: Tensor, positive: Tensor, descending: bool) -> tuple[Tensor, Tensor]:
    """(count of items, count of positives) of each block of equal scores, in score order."""
    order = torch.sort(scores, descending=descending, stable=True).indices
    values, counts = torch.unique_consecutive(scores[order], return_counts=True)
    block = torch.repeat_interleave(torch.arange(len(values)), counts)
    pos = torch.zeros(len(values), dtype=torch.float64)
    pos.index_add_(0, block, positive[order].double())
    return counts.double(), pos


def average_precision(scores: Tensor, positive: Tensor) -> float:
    """AP of ``scores`` [n] (higher = more likely positive) against the labels ``positive`` [n]
    (bool), ties as one threshold (module docstring). Needs at least one positive."""
    scores, positive = _check(scores, positive)
    total_pos = int(positive.sum())
    if total_pos == 0:
        raise InputError("no positive item: average precision is undefined")
    counts, pos = _blocks(scores, positive, descending=True)
    tp = pos.cumsum(0)
    seen = counts.cumsum(0)
    precision = tp / seen
    return float((pos / total_pos * precision).sum())


def roc_auc(scores: Tensor, positive: Tensor) -> float:
    """Area under the ROC curve with averaged ranks for ties (module docstring). Needs at least
    one positive and one negative."""
    scores, positive = _check(scores, positive)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise InputError(
            f"ROC AUC needs positives and negatives; got {n_pos} positive and {n_neg} negative"
        )
    counts, pos = _blocks(scores, positive, descending=False)
    start = counts.cumsum(0) - counts  # items strictly below each block
    midrank = start + (counts + 1) / 2  # 1-based average rank of the block
    rank_sum = float((pos * midrank).sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def tie_diagnostics(scores: Tensor) -> dict[str, float]:
    """{"distinct_scores": number of distinct values, "modal_fraction": share of items with the
    most frequent value} of ``scores`` [n] (exact equality, in float64)."""
    if scores.numel() == 0:
        raise InputError("no scores: tie diagnostics are undefined")
    _, counts = torch.unique(scores.double(), return_counts=True)
    return {
        "distinct_scores": float(len(counts)),
        "modal_fraction": float(counts.max()) / scores.numel(),
    }


def binary_ranking_metrics(scores: Tensor, positive: Tensor) -> dict[str, float]:
    """{"AP", "AUROC", "positives", "negatives", "distinct_scores", "modal_fraction"}."""
    n_pos = int(positive.bool().sum())
    return {
        "AP": average_precision(scores, positive),
        "AUROC": roc_auc(scores, positive),
        "positives": float(n_pos),
        "negatives": float(positive.numel() - n_pos),
        **tie_diagnostics(scores),
    }


__all__ = ["average_precision", "binary_ranking_metrics", "roc_auc", "tie_diagnostics"]
