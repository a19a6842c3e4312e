"""The validation split of a feature store: the store's own "val" split, or a seeded hold-out.

Pure data: which images validate a run, decided from the store, a fraction and a seed. The
trainer's ``curvalign.train.validation`` scores the split; ``curvalign.config`` reads it too, to
resolve the validation cadence (``TrainConfig.val_every``, one validation per epoch) before a run
starts, so that ``--print-config`` shows the value the run will use.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
from torch import Tensor

from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError

VAL_SPLIT = "val"
#: share of validation images identical to test images above which the split counts as overlapping
#: test (below it they are the data's own duplicates, e.g. WordNet synsets with the same names)
MAX_SHARED = 0.05
#: a seeded hold-out must leave at least this many train images (else no validation, with a note)
MIN_TRAIN_IMAGES = 8


def validation_split(
    store: FeatureStore, fraction: float, seed: int, data: str
) -> tuple[FeatureStore, dict[str, Any]]:
    """``store`` with its validation images labelled "val", and where they came from.

    Returns (store, {"source": "store" | "holdout" | "none", "images": n, ...}): the store's own
    non-empty "val" split (checked to share no image with "test"), else a seeded hold-out of
    ``fraction`` of its train images, else (fewer than ``MIN_TRAIN_IMAGES`` would be left) the
    store unchanged with source "none" and a reason.
    """
    names = list(store.split_names or [])
    if VAL_SPLIT in names:
        val_ids = store.split_image_ids(VAL_SPLIT)
        if len(val_ids) == 0:
            raise ConfigError(
                f"{data}: its {VAL_SPLIT!r} split is empty; give it images, or remove the split "
                "so that a seeded hold-out of the train images (val_fraction) is used"
            )
        info: dict[str, Any] = {"source": "store", "images": len(val_ids)}
        if "test" in names:
            shared = _shared_rows(store.image_features, val_ids, store.split_image_ids("test"))
            if shared > max(1, round(MAX_SHARED * len(val_ids))):
                raise ConfigError(
                    f"{data}: {shared} of the {len(val_ids)} images of its {VAL_SPLIT!r} split are "
                    "identical to test images: the validation split overlaps test (a copied "
                    "split?); validation must not see the test set"
                )
            if shared:  # a few items with identical features are the data's own duplicates
                info["identical_to_test"] = shared
        return store, info
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"val_fraction must lie in (0, 1), got {fraction}")
    if store.image_split is None or not names:
        train_ids = torch.arange(store.num_images)
        image_split = torch.zeros(store.num_images, dtype=torch.long)
        names = ["train"]
    else:
        train_ids = store.split_image_ids("train") if "train" in names else torch.arange(0)
        image_split = store.image_split.clone()
    count = max(1, round(fraction * len(train_ids)))
    if len(train_ids) - count < MIN_TRAIN_IMAGES:
        # too small to hold anything out: train on everything, without model selection
        return store, {
            "source": "none",
            "images": 0,
            "reason": f"{len(train_ids)} train images are too few to hold out a validation split",
        }
    gen = torch.Generator().manual_seed(int(seed))
    held = train_ids[torch.randperm(len(train_ids), generator=gen)[:count]]
    image_split[held] = len(names)
    out = dataclasses.replace(store, image_split=image_split, split_names=names + [VAL_SPLIT])
    return out, {"source": "holdout", "images": count, "fraction": fraction, "seed": int(seed)}


def _shared_rows(features: Tensor, a: Tensor, b: Tensor) -> int:
    """How many rows ``features[a]`` are byte-identical to some row ``features[b]``."""

    def digests(ids: Tensor) -> list[bytes]:
        out = []
        for start in range(0, len(ids), 4096):  # a batch at a time: memory bounded, not by N
            rows = features[ids[start : start + 4096]].detach().cpu().contiguous().numpy()
            out += [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows]
        return out

    seen = set(digests(b))
    return sum(d in seen for d in digests(a))


def train_image_count(store: FeatureStore) -> int:
    """Images a run trains on: the "train" split's (every image when the store has no splits).
    Read on the store ``validation_split`` returns, it excludes the held-out images."""
    names = list(store.split_names or [])
    if store.image_split is None or not names:
        return int(store.num_images)
    return int(len(store.split_image_ids("train"))) if "train" in names else 0
