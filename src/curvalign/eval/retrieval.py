"""Cross-modal retrieval: Recall@K from a score matrix.

Ties are counted **pessimistically**: a wrong candidate whose score equals the right one's ranks
above it. A constant score matrix therefore gives Recall@1 = 0 (not a lucky 1), so a model cannot
gain from collapsed or saturated scores. Rank = number of wrong candidates scoring at least as high
as the best right candidate; an item is found at K when that rank is below K.

Memory: the score matrix itself is the largest object; the comparisons run over row chunks, so a
few thousand by a few thousand stays far below a gigabyte.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from curvalign.errors import InputError

_CHUNK = 1024


def _check(scores: Tensor, text_to_image: Tensor, name: str) -> None:
    if scores.ndim != 2:
        raise InputError(
            f"{name} must be a [n_text, n_image] matrix, got shape {tuple(scores.shape)}"
        )
    if text_to_image.ndim != 1 or text_to_image.shape[0] != scores.shape[0]:
        raise InputError(
            f"text_to_image must have shape [{scores.shape[0]}] (one image per caption), "
            f"got {tuple(text_to_image.shape)}"
        )
    if scores.shape[0] and (
        int(text_to_image.min()) < 0 or int(text_to_image.max()) >= scores.shape[1]
    ):
        raise InputError(f"text_to_image holds image ids outside [0, {scores.shape[1]})")
    if not bool(torch.isfinite(scores).all()):
        raise InputError(
            f"{name} contains NaN or infinite values; the model's scores are not usable"
        )


def text_to_image_ranks(scores: Tensor, text_to_image: Tensor) -> Tensor:
    """[n_text] rank of each caption's image among all images (0 = first), ties pessimistic.

    scores: [n_text, n_image], higher is better; text_to_image: [n_text].
    """
    _check(scores, text_to_image, "scores")
    ranks = torch.empty(scores.shape[0], dtype=torch.long)
    for start in range(0, scores.shape[0], _CHUNK):
        rows = scores[start : start + _CHUNK]
        right = text_to_image[start : start + _CHUNK].to(rows.device)
        right_score = rows.gather(1, right[:, None])
        # every candidate at least as high, minus the right image itself
        ranks[start : start + _CHUNK] = ((rows >= right_score).sum(1) - 1).cpu()
    return ranks


def image_to_text_ranks(scores: Tensor, text_to_image: Tensor) -> Tensor:
    """[n_image] rank of the best of each image's captions among all captions, ties pessimistic;
    -1 for an image without captions (it takes no part in image->text recall).

    scores: [n_text, n_image] (computed with the image as query where the score depends on it).
    """
    _check(scores, text_to_image, "i2t scores")
    n_text, n_image = scores.shape
    t2i = text_to_image.to(scores.device)
    right_score = scores.gather(1, t2i[:, None]).squeeze(
        1
    )  # [n_text] score of each caption's own pair
    best = torch.full((n_image,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, t2i, right_score, reduce="amax")
    has_caption = torch.zeros(n_image, dtype=torch.bool, device=scores.device)
    has_caption[t2i] = True
    # right captions at least as high as the best right one (the best itself and exact ties)
    right_at_best = torch.zeros(n_image, dtype=torch.long, device=scores.device)
    right_at_best.scatter_add_(0, t2i, (right_score >= best[t2i]).long())
    at_least = torch.zeros(n_image, dtype=torch.long, device=scores.device)
    for start in range(0, n_text, _CHUNK):
        at_least += (scores[start : start + _CHUNK] >= best[None, :]).sum(0)
    ranks = at_least - right_at_best
    ranks[~has_caption] = -1
    return ranks.cpu()


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
    i_ranks = image_to_text_ranks(i2t, text_to_image)
    i_ranks = i_ranks[i_ranks >= 0]
    out: dict[str, float] = {}
    for k in ks:
        out[f"t2i@{k}"] = float((t_ranks < k).float().mean()) if len(t_ranks) else float("nan")
    for k in ks:
        out[f"i2t@{k}"] = float((i_ranks < k).float().mean()) if len(i_ranks) else float("nan")
    return out


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
