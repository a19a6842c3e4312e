"""Multi-label classification mAP (an image holds several classes: COCO instances).

For each class c, the images are ranked by the recipe's own class score ``s[:, c]``
(``Recipe.zero_shot_scores``: the same score as zero-shot top-1) and the images annotated with c
are the positives; the class's AP is tie-aware (``eval/ranking.average_precision``: a block of
equal scores is one threshold). ``mAP`` is the mean over the classes with at least one positive
image (the VOC/COCO multi-label classification convention). Only images with at least one
annotation take part: an unannotated image is unknown, not a negative of every class.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvalign.errors import InputError
from curvalign.eval.ranking import average_precision


def label_matrix(
    label_image: Tensor, label_class: Tensor, num_images: int, num_classes: int
) -> Tensor:
    """[num_images, num_classes] bool from (image, class) annotation pairs ([Nl] each)."""
    if label_image.shape != label_class.shape or label_image.ndim != 1:
        raise InputError(
            f"label_image and label_class must be [Nl] each; got {tuple(label_image.shape)} and "
            f"{tuple(label_class.shape)}"
        )
    out = torch.zeros(num_images, num_classes, dtype=torch.bool)
    out[label_image.long(), label_class.long()] = True
    return out


def multilabel_map(class_scores: Tensor, labels: Tensor) -> dict[str, float]:
    """{"mAP": mean over classes of the per-class AP, "classes": number of classes averaged}.

    class_scores: [n, C] (higher = more likely); labels: [n, C] bool (image i holds class c).
    Rows without any label are left out.
    """
    if class_scores.ndim != 2 or labels.shape != class_scores.shape:
        raise InputError(
            f"class_scores and labels must both be [n, C]; got {tuple(class_scores.shape)} and "
            f"{tuple(labels.shape)}"
        )
    labels = labels.bool()
    annotated = labels.any(1)
    scores, labels = class_scores[annotated], labels[annotated]
    present = torch.nonzero(labels.any(0)).flatten().tolist()
    if not present:
        raise InputError("no image holds any label: multi-label mAP is undefined")
    aps = [average_precision(scores[:, c], labels[:, c]) for c in present]
    return {"mAP": sum(aps) / len(aps), "classes": float(len(aps))}


__all__ = ["label_matrix", "multilabel_map"]
