"""Zero-shot classification from the recipe's own class scores.

The class scores come from ``Recipe.zero_shot_scores`` (each method's protocol: MERU averages the
prompts' tangent vectors, AtMG averages the angle over a class's prompts, ...). Ties are counted
pessimistically, as in retrieval: a wrong class with the same score as the right one ranks above it.
The predicted class (for the hierarchical metrics) is the arg-max, ties broken by the lowest index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from curvalign.errors import InputError


def class_ranks(class_scores: Tensor, labels: Tensor) -> Tensor:
    """[n] rank (0 = first) of each sample's true class, ties pessimistic.

    class_scores: [n, C], higher is better; labels: [n] in [0, C).
    """
    if class_scores.ndim != 2 or labels.shape != class_scores.shape[:1]:
        raise InputError(
            f"class_scores must be [n, C] and labels [n]; got {tuple(class_scores.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= class_scores.shape[1]):
        raise InputError(f"labels must lie in [0, {class_scores.shape[1]})")
    if not bool(torch.isfinite(class_scores).all()):
        raise InputError(
            "class scores contain NaN or infinite values; the model's scores are not usable"
        )
    right = class_scores.gather(1, labels.long()[:, None])
    return (class_scores >= right).sum(1) - 1


def topk_accuracy(
    class_scores: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)
) -> dict[str, float]:
    """{"top1": ..., "top5": ...}: share of samples whose class is among the k best, in [0, 1].

    Samples with label -1 (no class) are left out. A k >= C gives 1.0 by definition.
    """
    keep = labels >= 0
    ranks = class_ranks(class_scores[keep], labels[keep].long())
    if len(ranks) == 0:
        raise InputError("no labelled samples (every label is -1); zero-shot accuracy is undefined")
    return {f"top{k}": float((ranks < k).float().mean()) for k in ks}


def predict(class_scores: Tensor) -> Tensor:
    """[n] predicted class: the arg-max, ties by the lowest class index."""
    best = class_scores.max(dim=1, keepdim=True).values
    # first index attaining the max (torch.argmax does not document its tie rule)
    return (class_scores >= best).long().argmax(dim=1)
