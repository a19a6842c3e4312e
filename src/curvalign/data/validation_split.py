"""The validation split of a feature store: the store's own "val" split, or a seeded hold-out.

Pure data: which images validate a run, decided from the store, a fraction and a seed. The
trainer's ``curvalign.train.validation`` scores the split; ``curvalign.config`` reads it too, to
resolve the validation cadence (``TrainConfig.val_every``, one validation per epoch) before a run
starts, so that ``--print-config`` shows the value the run will use.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvalign.data.alignment import MAX_FIT_PAIRS, spread_runs
from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError

VAL_SPLIT = "val"
#: share of validation images identical to test images above which the split counts as overlapping
#: test (below it they are the data's own duplicates, e.g. WordNet synsets with the same names)
MAX_SHARED = 0.05
#: a seeded hold-out must leave at least this many train images (else no validation, with a note)
MIN_TRAIN_IMAGES = 8
#: train images compared with the held-out splits by ``copies_of_train`` (above it, evenly spaced
#: runs of consecutive images, ``alignment.spread_runs``: the rows the warm start's fit reads,
#: so a memory-mapped store reads them once): one pass of a 64-bit fingerprint over these rows
TRAIN_ROWS_CHECKED = MAX_FIT_PAIRS
#: rows read at a time by the duplicate checks (memory bounded, not by N)
_CHUNK = 4096


def validation_split(
    store: FeatureStore, fraction: float, seed: int, data: str
) -> tuple[FeatureStore, dict[str, Any]]:
    """``store`` with its validation images labelled "val", and where they came from.

    Returns (store, {"source": "store" | "holdout" | "none", "images": n, ...}): the store's own
    non-empty "val" split (checked to share no image with "test"), else a seeded hold-out of
    ``fraction`` of its train images, else (fewer than ``MIN_TRAIN_IMAGES`` would be left) the
    store unchanged with source "none" and a reason.
    """
    if store.num_images == 0 or store.num_texts == 0:
        # said before any split is looked at ("its 'val' split is empty" would blame the split)
        raise ConfigError(
            f"{data} holds {store.num_images} images and {store.num_texts} captions: nothing to "
            "train or validate on (check the inputs it was built from)"
        )
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
            shared = _shared_rows(
                store.image_features, val_ids, store.split_image_ids("test"), data
            )
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


def _rows(features: Tensor | np.ndarray, ids: Tensor) -> Iterator[tuple[Tensor, np.ndarray]]:
    """``(ids chunk, features[chunk] as a contiguous numpy array)``, a chunk at a time."""
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        yield chunk, np.ascontiguousarray(torch.as_tensor(features[chunk]).detach().cpu().numpy())


def _digests(features: Tensor | np.ndarray, ids: Tensor, split: str, data: str) -> list[bytes]:
    """One 16-byte digest per row ``features[ids]``; a ConfigError naming the first row that
    holds NaN or inf (rows of NaN are all alike: comparing them would call the split a copy)."""
    out: list[bytes] = []
    for chunk, rows in _rows(features, ids):
        finite = np.isfinite(rows.reshape(len(rows), -1)).all(axis=1)
        if not finite.all():
            row = int(chunk[int(np.flatnonzero(~finite)[0])])
            raise ConfigError(
                f"{data}: image row {row} of its {split!r} split holds NaN or inf features "
                "(damaged features, not a split problem); fix or drop those rows"
            )
        out += [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows]
    return out


def _shared_rows(
    features: Tensor | np.ndarray, a: Tensor, b: Tensor, data: str = "the data"
) -> int:
    """How many rows ``features[a]`` ("val") are byte-identical to some row ``features[b]``
    ("test")."""
    seen = set(_digests(features, b, "test", data))
    return sum(d in seen for d in _digests(features, a, VAL_SPLIT, data))


def _fingerprints(rows: np.ndarray) -> np.ndarray:
    """``[n]`` uint64: a random linear hash (mod 2^64) of each row's bytes read as 64-bit words;
    equal rows have equal fingerprints, unequal ones almost never (candidates are confirmed)."""
    raw = rows.reshape(len(rows), -1).view(np.uint8)
    pad = (-raw.shape[1]) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((len(raw), pad), np.uint8)], axis=1)
    words = raw.view(np.uint64)
    weights = np.random.default_rng(0x36).integers(1, 2**63, size=words.shape[1], dtype=np.uint64)
    return (words * (weights | np.uint64(1))).sum(axis=1, dtype=np.uint64)  # wraps mod 2^64


def copies_of_train(
    store: FeatureStore, data: str, limit: int = TRAIN_ROWS_CHECKED
) -> dict[str, Any]:
    """How many images of the store's own "val" and "test" splits have image features
    byte-identical to a "train" image (a leak: those splits then score what was trained on).

    Returns ``{"val": k, "val_images": n_val, "test": k, "test_images": n_test,
    "train_checked": n, "train": N}`` (splits the store lacks are left out; ``{}`` without a
    "train" split). Cost: one fingerprint pass over at most ``limit`` train rows (above it,
    evenly spaced runs of consecutive rows) and a digest per val and test row.
    """
    names = list(store.split_names or [])
    held = [name for name in (VAL_SPLIT, "test") if name in names]
    if store.image_split is None or "train" not in names or not held:
        return {}
    features = store.image_features
    train_ids = store.split_image_ids("train")
    total = len(train_ids)
    # runs of consecutive train images spread over the whole store, the warm start's sample
    # (long runs under the maps' default read-around read several times their bytes)
    train_ids = spread_runs(train_ids, limit)
    out: dict[str, Any] = {"train_checked": len(train_ids), "train": total}
    targets = {name: store.split_image_ids(name) for name in held}
    digests = {name: _digests(features, ids, name, data) for name, ids in targets.items()}
    parts = [_fingerprints(rows) for ids in targets.values() for _, rows in _rows(features, ids)]
    wanted = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
    found: set[bytes] = set()
    for _, rows in _rows(features, train_ids):
        hits = np.flatnonzero(np.isin(_fingerprints(rows), wanted))
        found.update(hashlib.blake2b(rows[i].tobytes(), digest_size=16).digest() for i in hits)
    for name in held:
        out[name] = sum(d in found for d in digests[name])
        out[f"{name}_images"] = len(targets[name])
    return out


def describe_copies(copies: dict[str, Any], data: str) -> str | None:
    """A warning on what ``copies_of_train`` found, or None when no split shares images with
    train beyond the data's own duplicates (``MAX_SHARED``)."""
    parts = []
    for name in (VAL_SPLIT, "test"):
        if name not in copies:
            continue
        n = copies[name]
        size = copies.get(f"{name}_images", 0)
        # a sample of train finds that share of the copies: compare the estimate for all of it
        estimate = n * copies["train"] / max(1, copies["train_checked"])
        if n and estimate > max(1, round(MAX_SHARED * size)):
            parts.append(f"{n} of the {size} {name!r} images")
    if not parts:
        return None
    sample = (
        f" (among {copies['train_checked']:,} of its {copies['train']:,} train images, sampled)"
        if copies["train_checked"] < copies["train"]
        else ""
    )
    return (
        f"{data}: {' and '.join(parts)} have image features identical to train images{sample}: "
        "a leak from train into the held-out splits? Their scores would measure memory, not "
        "generalisation; remove the copies from train"
    )


def train_image_count(store: FeatureStore) -> int:
    """Images a run trains on: the "train" split's (every image when the store has no splits).
    Read on the store ``validation_split`` returns, it excludes the held-out images."""
    names = list(store.split_names or [])
    if store.image_split is None or not names:
        return int(store.num_images)
    return int(len(store.split_image_ids("train"))) if "train" in names else 0
