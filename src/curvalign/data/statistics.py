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

from curvalign.data.features import FeatureStore

#: rows read for the statistics (a seeded-free, evenly strided sample of the train rows: the
#: mean norm of 20 000 rows has a relative standard error well under 1%)
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


def _mean_norm(features: Any, index: torch.Tensor) -> float:
    if len(index) > MAX_ROWS:
        index = index[torch.linspace(0, len(index) - 1, MAX_ROWS).long()]
    rows = torch.as_tensor(features[index]).double()
    if rows.numel() == 0:
        return float("nan")
    return float(torch.linalg.vector_norm(rows, dim=-1).mean())


def feature_norms(store: FeatureStore) -> FeatureNorms:
    """``FeatureNorms`` of ``store``'s "train" split (every row when it has no splits)."""
    has_train = bool(store.split_names) and "train" in (store.split_names or [])
    if has_train:
        images, texts = store.split_image_ids("train"), store.texts_of_split("train")
    else:
        images, texts = torch.arange(store.num_images), torch.arange(store.num_texts)
    return FeatureNorms(
        image_norm=_mean_norm(store.image_features, images),
        text_norm=_mean_norm(store.text_features, texts),
        image_dim=store.image_dim,
        text_dim=store.text_dim,
        image_rows=min(len(images), MAX_ROWS),
        text_rows=min(len(texts), MAX_ROWS),
    )


__all__ = ["FeatureNorms", "feature_norms"]
