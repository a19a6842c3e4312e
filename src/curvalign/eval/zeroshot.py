"""Zero-shot classification from the recipe's own class scores.

The class scores come from ``Recipe.zero_shot_scores`` (each method's protocol: MERU averages the
prompts' tangent vectors, AtMG averages the angle over a class's prompts, ...). Ties are counted
pessimistically, as in retrieval: a wrong class with the same score as the right one ranks above it.
The predicted class (for the hierarchical metrics) is the arg-max, ties broken by the lowest index.

Conventions people compare against (docs/evaluation.md, "Zero-shot conventions"):
``mean_per_class_recall`` is CLIP_benchmark's ``mean_per_class_recall`` (the top-1 recall of
each class, averaged over the classes present; equal to top-1 on balanced data);
``template_positions`` finds the prompt templates of a store (the j-th prompt of every class is
template j) for the prompt-sensitivity table.
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


def mean_per_class_recall(class_scores: Tensor, labels: Tensor) -> float:
    """Top-1 recall of each class, averaged over the classes with at least one labelled sample
    (CLIP_benchmark's ``mean_per_class_recall``, scikit-learn's balanced accuracy). Ties are
    pessimistic, as for ``top1``; samples labelled -1 are left out.

    class_scores: [n, C]; labels: [n].
    """
    keep = labels >= 0
    labels = labels[keep].long()
    ranks = class_ranks(class_scores[keep], labels)
    if len(ranks) == 0:
        raise InputError(
            "no labelled samples (every label is -1); mean per-class recall is undefined"
        )
    num_classes = class_scores.shape[1]
    hits = torch.zeros(num_classes, dtype=torch.float64)
    hits.index_add_(0, labels, (ranks < 1).double())
    counts = torch.bincount(labels, minlength=num_classes).double()
    present = counts > 0
    return float((hits[present] / counts[present]).mean())


def template_positions(prompt_to_class: Tensor, num_classes: int) -> Tensor | None:
    """[Nq] template index of every prompt: its position among its class's prompts (store order),
    when every class has the same number T >= 2 of prompts (the layout of ``extract`` and the
    synthetic world: one prompt per (class, template)); None otherwise (one template, or classes
    with different prompt counts, where "template j" would not name one template)."""
    p2c = prompt_to_class.long()
    counts = torch.bincount(p2c, minlength=num_classes)
    if (
        len(counts) != num_classes
        or int(counts.min()) < 2
        or int(counts.min()) != int(counts.max())
    ):
        return None
    order = torch.sort(p2c, stable=True).indices
    position = torch.empty_like(p2c)
    position[order] = torch.arange(len(p2c)) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    return position
