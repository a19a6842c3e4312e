"""Cross-modal retrieval: Recall@K from a score matrix.

Ties are counted **pessimistically**: a wrong candidate whose score equals the right one's ranks
above it. A constant score matrix therefore gives Recall@1 = 0 (not a lucky 1), so a model cannot
gain from collapsed or saturated scores. Rank = number of wrong candidates scoring at least as high
as the best right candidate; an item is found at K when that rank is below K.

The rank definition lives one floor down (``curvalign.readout``: training's validation metric
uses it too); ``text_to_image_ranks`` and ``image_to_text_ranks`` are re-exported here. Given a
matrix, the comparisons run over tiles of it; for splits whose matrix would not fit,
``readout.retrieval_ranks`` computes the same ranks from the recipe without ever holding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from curvalign.errors import InputError
from curvalign.readout import image_to_text_ranks, recall_from_ranks, text_to_image_ranks
from curvalign.stats import ItemTotals


def recall_at_k(
    scores: Tensor,
    text_to_image: Tensor,
    ks: Sequence[int] = (1, 5, 10),
    i2t_scores: Tensor | None = None,
) -> dict[str, float]:
    """Recall@K in both directions.

    scores        [n_text, n_image], higher is better (text as query, for t2i)
    text_to_image [n_text] image id of each caption (several captions per image allowed)
    i2t_scores    optional [n_text, n_image] computed with the image as query (AGR, AtMG); the
                  image->text ranking uses it when given, ``scores`` otherwise
    Returns {"t2i@k": ..., "i2t@k": ...} in [0, 1]. t2i: a caption's image is in its top k.
    i2t: an image is found when any of its captions is in its top k; images without captions
    are left out of the i2t mean.
    """
    if any(int(k) < 1 for k in ks):
        raise InputError(f"ks must be positive integers, got {list(ks)}")
    text_to_image = text_to_image.long()
    i2t = scores if i2t_scores is None else i2t_scores
    if i2t.shape != scores.shape:
        raise InputError(
            f"i2t_scores must have the shape of scores {tuple(scores.shape)}, got {tuple(i2t.shape)}"
        )
    t_ranks = text_to_image_ranks(scores, text_to_image)
    return recall_from_ranks(t_ranks, image_to_text_ranks(i2t, text_to_image), ks)


def text_text_recall(
    scores: Tensor, groups: Tensor, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
    """Text->text retrieval among captions (DualPath's text-only capability, seed 004).

    scores [N, N] between captions (query rows, candidate columns), groups [N] (e.g. the image
    each caption describes: captions of one image are paraphrases). A query is found at k when a
    caption of its group other than itself is among its k best candidates; the query itself is
    never a candidate; ties pessimistic; queries without a paraphrase are left out.
    Returns {"t2t@k": ...}.
    """
    if scores.ndim != 2 or scores.shape[0] != scores.shape[1] or groups.shape != scores.shape[:1]:
        raise InputError(
            f"text-text scores must be [N, N] with groups [N]; got {tuple(scores.shape)} and "
            f"{tuple(groups.shape)}"
        )
    if not bool(torch.isfinite(scores).all()):
        raise InputError("text-text scores contain NaN or infinite values")
    n = scores.shape[0]
    same = groups[:, None] == groups[None, :]
    eye = torch.eye(n, dtype=torch.bool)
    right = same & ~eye
    has = right.any(dim=1)
    masked = scores.masked_fill(eye, float("-inf"))
    best = masked.masked_fill(~right, float("-inf")).max(dim=1, keepdim=True).values
    ranks = ((masked >= best) & ~right & ~eye).sum(dim=1)[has]
    if len(ranks) == 0:
        raise InputError("no caption has a paraphrase (another caption of its group)")
    return {f"t2t@{k}": float((ranks < k).float().mean()) for k in ks}


@dataclass(frozen=True)
class RetrievalItems:
    """Per-item retrieval results of one evaluation, the items behind its Recall@K: what a
    comparison needs to count the test items' sampling noise (``stats.two_level_difference``).

    t2i_rank       [Nt] rank of each caption's image among the split's images (0 = first)
    i2t_rank       [Ni] rank of each image's best caption among the captions; -1 for an image
                   without a caption (left out of the image->text mean)
    text_to_image  [Nt] local image index (into ``i2t_rank``) of each caption
    ``recall_from_ranks(t2i_rank, i2t_rank)`` is the evaluation's ``retrieval`` dict.
    """

    t2i_rank: Tensor
    i2t_rank: Tensor
    text_to_image: Tensor

    def hits(self, metric: str) -> Tensor:
        """The 0/1 hits behind ``metric`` ("t2i@k": [Nt], one per caption; "i2t@k": [n], one
        per image that has a caption)."""
        direction, k = _parse_metric(metric)
        if direction == "t2i":
            return (self.t2i_rank < k).float()
        return (self.i2t_rank[self.i2t_rank >= 0] < k).float()

    def totals(self, metric: str) -> ItemTotals:
        """``ItemTotals`` over the split's images (each image with its captions, so resampling
        an image takes its captions along): "t2i@k" and "i2t@k" one part each, "mean@k" both
        (the mean of T2I and I2T R@k, e.g. "mean@1" the benchmark's mean R@1)."""
        direction, k = _parse_metric(metric)
        n = len(self.i2t_rank)
        owner = self.text_to_image.long()
        t_sum = torch.zeros(n, dtype=torch.float64).index_add_(
            0, owner, (self.t2i_rank < k).double()
        )
        t_count = torch.bincount(owner, minlength=n).double()
        has = self.i2t_rank >= 0
        i_sum = ((self.i2t_rank < k) & has).double()
        i_count = has.double()
        parts = {"t2i": [(t_sum, t_count)], "i2t": [(i_sum, i_count)]}
        chosen = parts["t2i"] + parts["i2t"] if direction == "mean" else parts[direction]
        return ItemTotals(
            torch.stack([p[0] for p in chosen]).numpy(), torch.stack([p[1] for p in chosen]).numpy()
        )


def _parse_metric(metric: str) -> tuple[str, int]:
    direction, _, k = metric.partition("@")
    if direction not in ("t2i", "i2t", "mean") or not k.isdigit() or int(k) < 1:
        raise InputError(f"retrieval metric must be t2i@K, i2t@K or mean@K, got {metric!r}")
    return direction, int(k)


__all__ = [
    "RetrievalItems",
    "image_to_text_ranks",
    "recall_at_k",
    "text_text_recall",
    "text_to_image_ranks",
]
