"""The training batch: what the sampler draws and every recipe's ``loss`` receives.

It lives in ``data/`` (the layer that makes it), so ``data/`` imports nothing above it;
``curvalign.recipes`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Batch:
    """One training step's inputs (features, not points).

    image, text           [B, Di], [B, Dt]: B images, one of its captions each (row i with row i)
    box_image, box_text   [B, Di], [B, Dt]: one box per image, matched with its noun phrase;
                          ``box_image[i]`` is a crop of ``image[i]``
    pair_a, pair_b        [P, Dt], [P, Dt]: scored text-text pairs; ``pair_score`` [P] in [0, 1]
    text_mask, pair_a_mask, pair_b_mask
                          None, unless the recipe reads text tokens (``Recipe.reads_text_tokens``):
                          then ``text``, ``pair_a``, ``pair_b`` are token features [B, L, Dk]
                          ([P, L, Dk]) and these their masks [B, L] (1 = token, 0 = padding);
                          images (and boxes) stay pooled vectors
    """

    image: Tensor
    text: Tensor
    box_image: Tensor | None = None
    box_text: Tensor | None = None
    pair_a: Tensor | None = None
    pair_b: Tensor | None = None
    pair_score: Tensor | None = None
    text_mask: Tensor | None = None
    pair_a_mask: Tensor | None = None
    pair_b_mask: Tensor | None = None

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            **{k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        )


__all__ = ["Batch"]
