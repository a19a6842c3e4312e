"""Feature statistics that a recipe's initialisation is resolved from (docs/methods.md,
"Initialisation that fits the data").

A head that scales its features before ``expmap0`` puts its step-0 points at a radius
proportional to the input norm. The papers' scales assume their encoders' outputs (LayerNorm
outputs of norm about ``sqrt(D)``); frozen unit-norm features are 20x smaller. The recipes
therefore resolve their scales from ``FeatureNorms``, read on the train rows only (never on
validation's hold-out choice or on test: the statistics are unlabelled, but test stays unread).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from curvalign.data.alignment import MAX_FIT_PAIRS, spread_runs
from curvalign.data.features import FeatureStore

#: rows read for the statistics at most (every train row up to this many; above it, runs of
#: neighbouring rows of the warm start's fit sample, ``norm_sample``)
MAX_ROWS = 20_000


@dataclass(frozen=True)
class FeatureNorms:
    """Mean Euclidean norm of the image and text features on the train rows.

    image_norm, text_norm   mean ``|f|`` over the rows read ([N, D] -> scalar)
    image_dim, text_dim     D of each side
    image_rows, text_rows   how many rows the means are over
    """

    image_norm: float
    text_norm: float
    image_dim: int
    text_dim: int
    image_rows: int
    text_rows: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def norm_sample(index: Tensor) -> Tensor:
    """The rows of ``index`` ``[N]`` (train image or text ids) that the statistics read:
    every one when ``N <= MAX_ROWS``; above that, ``MAX_ROWS`` of the rows the warm start's fit
    reads (``alignment.spread_runs(index, MAX_FIT_PAIRS)``: runs of ``SAMPLE_RUN_ROWS``
    consecutive ids at evenly spaced starts), taken as evenly spaced runs of
    ``SAMPLE_RUN_ROWS`` neighbouring entries of that sample (``spread_runs`` again), in order.

    Why runs: a row drawn alone from a memory-mapped shard costs a 4 KiB page for its 1 KiB
    (512-d float16); a run of 64 rows reads 17 pages for 16 pages of rows. Why the fit's rows:
    the check for held-out images copied from train has read the fit's image rows before the
    statistics are taken and the fit reads both sides' rows after them, so on a one-caption-per-
    image store (clip-retrieval's layout) the statistics read no page of their own.

    Accuracy: the mean norm of the sample is an unbiased systematic estimate of the train
    rows' mean. Where neighbouring rows' norms are alike (a dump written in crawl order), the
    sample counts as its ~``MAX_ROWS / SAMPLE_RUN_ROWS`` = 313 runs: a relative standard error
    of (coefficient of variation of the norms) / sqrt(313), under 1% while the norms vary by
    less than 17% between runs (unit-norm rows: 0; raw CLIP features: a few %). Independent
    rows give the 20,000 rows' error, as the strided sample did
    (``test_norm_runs_estimate_the_mean_norm_of_a_large_store``)."""
    if len(index) <= MAX_ROWS:
        return index
    fit = spread_runs(index, MAX_FIT_PAIRS)
    return fit[spread_runs(torch.arange(len(fit)), MAX_ROWS)]


def _mean_norm(features: Any, index: Tensor) -> tuple[float, int]:
    """(mean ``|f|`` of ``features[norm_sample(index)]`` ([n, D] -> scalar), n)."""
    index = norm_sample(index)
    rows = torch.as_tensor(features[index]).double()
    if rows.numel() == 0:
        return float("nan"), 0
    return float(torch.linalg.vector_norm(rows, dim=-1).mean()), len(index)


def feature_norms(store: FeatureStore) -> FeatureNorms:
    """``FeatureNorms`` of ``store``'s "train" split (every row when it has no splits)."""
    has_train = bool(store.split_names) and "train" in (store.split_names or [])
    if has_train:
        images, texts = store.split_image_ids("train"), store.texts_of_split("train")
    else:
        images, texts = torch.arange(store.num_images), torch.arange(store.num_texts)
    image_norm, image_rows = _mean_norm(store.image_features, images)
    text_norm, text_rows = _mean_norm(store.text_features, texts)
    return FeatureNorms(
        image_norm=image_norm,
        text_norm=text_norm,
        image_dim=store.image_dim,
        text_dim=store.text_dim,
        image_rows=image_rows,
        text_rows=text_rows,
    )


__all__ = ["MAX_ROWS", "FeatureNorms", "feature_norms", "norm_sample"]
