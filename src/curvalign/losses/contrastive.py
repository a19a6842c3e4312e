"""InfoNCE over score matrices, with gathered columns.

Every function takes *scores* (higher is better, e.g. from ``curvalign.scores``) and a
``temperature``; the logits are ``scores / temperature``, computed in at least float32. A
learnable temperature is a tensor with gradients; pass ``1.0`` when the scores are already
logits.

Distributed training: a process holds ``B`` local rows and scores them against all ``B_global``
gathered columns. Row ``i`` (local) matches column ``i + offset``, where ``offset`` is this
process's first row in the gathered batch (``Gather.offset(B)``). With ``offset = 0`` and
``B = B_global`` this is ordinary in-batch contrastive learning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def check_logits(scores: Tensor, offset: int, name: str) -> None:
    """One clear error unless ``scores`` is a [B_local, B_global] matrix that ``offset`` fits."""
    if not isinstance(scores, Tensor) or scores.ndim != 2:
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"{name} must be a [B_local, B_global] score matrix, got {shape}")
    rows, cols = scores.shape
    if not 0 <= offset <= cols - rows:
        raise ValueError(
            f"{name}: offset {offset} with {rows} local rows does not fit in {cols} "
            f"gathered columns (need 0 <= offset <= {cols - rows})"
        )


def info_nce(scores: Tensor, temperature: float | Tensor = 1.0, offset: int = 0) -> Tensor:
    """One direction of InfoNCE (CLIP; MERU Eq. 3; AtMG Eq. 7), mean over the local rows.

    scores      [B, B_global]  row i scored against every gathered column
    temperature scalar > 0     logits = scores / temperature
    offset      int            row i's positive is column i + offset

    ``-mean_i log softmax_j(scores[i, j] / tau)[i + offset]``.
    """
    check_logits(scores, offset, "info_nce scores")
    work = torch.promote_types(scores.dtype, torch.float32)
    logits = scores.to(work) / temperature
    targets = torch.arange(scores.shape[0], device=scores.device) + offset
    return F.cross_entropy(logits, targets)


def symmetric_info_nce(
    scores_a_to_b: Tensor, scores_b_to_a: Tensor, temperature: float | Tensor = 1.0, offset: int = 0
) -> Tensor:
    """CLIP's symmetric InfoNCE: the mean of the two directions (ProCLIP Eq. 5; AtMG Eq. 11 with
    its two angle scores).

    scores_a_to_b  [B, B_global]  local rows of modality a against all gathered b
    scores_b_to_a  [B, B_global]  local rows of modality b against all gathered a

    The two directions are averaged (factor 1/2, as CLIP's, MERU's and the AtMG authors' code do);
    the papers write the sum, a constant factor 2 that only rescales the learning rate.
    """
    return 0.5 * (
        info_nce(scores_a_to_b, temperature, offset) + info_nce(scores_b_to_a, temperature, offset)
    )


__all__ = ["info_nce", "symmetric_info_nce"]
