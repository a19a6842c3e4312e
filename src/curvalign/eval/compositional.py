"""Compositional understanding: choosing the true caption over its hard negatives
(VL-CheckList / SugarCrepe protocol, seed 002 Table 3).

For each hard negative (a caption with one object or attribute replaced) the image is the query
and the model must score its true caption strictly above the negative, with the recipe's own
score. A tie counts as a failure (pessimistic, as everywhere in ``curvalign.eval``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from curvalign.errors import InputError


def hard_negative_accuracy(
    true_scores: Tensor,
    negative_scores: Tensor,
    negative_kind: Tensor | None = None,
    kind_names: Sequence[str] | None = None,
) -> dict[str, float]:
    """Share of (true, negative) pairs won by the true caption, overall and per negative kind.

    true_scores     [Nn] score of the true caption with its image, repeated for each negative
    negative_scores [Nn] score of the negative caption with the same image
    negative_kind   [Nn] kind id of each negative, names in ``kind_names``
    Returns {"overall": ..., "<kind name>": ...}; kinds without negatives are left out.
    """
    if true_scores.shape != negative_scores.shape or true_scores.ndim != 1:
        raise InputError(
            f"true_scores and negative_scores must both be [Nn]; got {tuple(true_scores.shape)} "
            f"and {tuple(negative_scores.shape)}"
        )
    if len(true_scores) == 0:
        raise InputError("no hard negatives: compositional accuracy is undefined")
    if not (
        bool(torch.isfinite(true_scores).all()) and bool(torch.isfinite(negative_scores).all())
    ):
        raise InputError("hard-negative scores contain NaN or infinite values")
    won = (true_scores > negative_scores).float()
    out = {"overall": float(won.mean())}
    if negative_kind is not None:
        if negative_kind.shape != won.shape:
            raise InputError(
                f"negative_kind must have shape {tuple(won.shape)}, got {tuple(negative_kind.shape)}"
            )
        for kind in sorted(set(negative_kind.tolist())):
            name = (
                kind_names[kind]
                if kind_names is not None and 0 <= kind < len(kind_names)
                else str(kind)
            )
            out[name] = float(won[negative_kind == kind].mean())
    return out
