"""Validation during training: the split it runs on and the metric that selects the model.

The metric is the one ProCLIP selects models with (Sec. 3.3): mean of text->image and
image->text recall@1 on the validation split, ranked with the recipe's own ``scores`` (distance,
angle, routed score), never a cosine stand-in. Ties count against the model, as in
``curvalign.eval.retrieval``.

The split: a store's own "val" split when it has one (the synthetic world and ``wordnet:`` make
one), checked to be non-empty and to share no image with "test"; otherwise a seeded hold-out of
``val_fraction`` of the store's train images, which the trainer then does not train on. Which of
the two was used, and how many images, is recorded in the run's meta.json.

This module reads recipes and stores only (``train/`` must not import ``eval/``).
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
#: pairs scored per ``recipe.scores`` call (bounds per-pair routers such as AGR's)
PAIR_BUDGET = 1 << 20


def validation_store(
    store: FeatureStore, fraction: float, seed: int, data: str = "the data"
) -> tuple[FeatureStore, dict[str, Any]]:
    """``store`` with a non-empty "val" split, and a record of where it came from.

    Returns (store, {"source": "store" | "holdout" | "none", "images": n, ...}). A store without
    a "val" split gets a seeded hold-out of ``fraction`` of its "train" images (at least one;
    every image counts when it has no splits); the returned store labels them "val" so the
    sampler skips them. A store too small to spare them (fewer than ``MIN_TRAIN_IMAGES`` would
    be left) is returned as it is with source "none": the run trains without validation.
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
        rows = features[ids].detach().cpu().contiguous().numpy()
        return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows]

    seen = set(digests(b))
    return sum(d in seen for d in digests(a))


class ValidationSet:
    """The validation images and captions of a store: ``score(recipe)`` -> mean R@1 in [0, 1]."""

    def __init__(
        self, store: FeatureStore, batch_size: int = 1024, text_tokens: bool = False
    ) -> None:
        image_ids = store.split_image_ids(VAL_SPLIT)
        local = torch.full((store.num_images,), -1, dtype=torch.long)
        local[image_ids] = torch.arange(len(image_ids))
        owner = local[store.text_to_image.long()]
        text_ids = torch.nonzero(owner >= 0).flatten()
        if len(text_ids) == 0:
            raise ConfigError("the validation split has no captions: nothing to validate on")
        self.images = store.image_features[image_ids]
        self.texts = store.text_features[text_ids]
        self.text_to_image = owner[text_ids]  # [Nt] local image index
        self.batch_size = batch_size
        # a recipe that reads text tokens (Recipe.reads_text_tokens) gets tokens + masks
        self.text_tokens: tuple[Tensor, Tensor] | None = None
        if text_tokens:
            tokens, mask = store.text_rows("text", text_ids, tokens=True)
            self.text_tokens = (tokens, mask)

    @property
    def num_images(self) -> int:
        return int(self.images.shape[0])

    def _embed(self, fn: Any, features: Tensor, device: torch.device) -> dict[str, Tensor]:
        parts = [
            fn(features[i : i + self.batch_size].to(device))
            for i in range(0, features.shape[0], self.batch_size)
        ]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def _scores(self, recipe: Any, texts: dict, images: dict, query: str) -> Tensor:
        n_text, n_image = self.texts.shape[0], self.images.shape[0]
        rows = max(1, PAIR_BUDGET // max(1, n_image))
        out = torch.empty(n_text, n_image, dtype=torch.float32)
        for start in range(0, n_text, rows):
            part = {k: v[start : start + rows] for k, v in texts.items()}
            out[start : start + rows] = recipe.scores(part, images, query=query).float().cpu()
        return out

    @torch.no_grad()
    def score(self, recipe: Any) -> float:
        """Mean of T2I and I2T recall@1 with ``recipe.scores``; the recipe's mode is restored."""
        was_training = recipe.training
        recipe.eval()
        try:
            device = next((p.device for p in recipe.parameters()), torch.device("cpu"))
            images = self._embed(recipe.embed_images, self.images, device)
            if self.text_tokens is None:
                texts = self._embed(recipe.embed_texts, self.texts, device)
            else:
                tokens, mask = self.text_tokens
                parts = [
                    recipe.embed_texts(
                        tokens[i : i + self.batch_size].to(device),
                        mask[i : i + self.batch_size].to(device),
                    )
                    for i in range(0, tokens.shape[0], self.batch_size)
                ]
                texts = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            t2i = recall_at_1_text_query(
                self._scores(recipe, texts, images, "text"), self.text_to_image
            )
            i2t = recall_at_1_image_query(
                self._scores(recipe, texts, images, "image"), self.text_to_image
            )
        finally:
            recipe.train(was_training)
        return (t2i + i2t) / 2


def recall_at_1_text_query(scores: Tensor, text_to_image: Tensor) -> float:
    """Share of texts whose own image scores strictly above every other image. [Nt, Ni] scores."""
    rows = torch.arange(scores.shape[0])
    true = scores[rows, text_to_image]
    others = scores.clone()
    others[rows, text_to_image] = -torch.inf
    hit = true > others.max(dim=1).values
    return float(hit.float().mean())


def recall_at_1_image_query(scores: Tensor, text_to_image: Tensor) -> float:
    """Share of images one of whose captions scores strictly above every caption of another
    image. ``scores`` [Nt, Ni] with the image as the query."""
    n_image = scores.shape[1]
    own = text_to_image[:, None] == torch.arange(n_image)[None, :]  # [Nt, Ni]
    best_own = scores.masked_fill(~own, -torch.inf).max(dim=0).values
    best_other = scores.masked_fill(own, -torch.inf).max(dim=0).values
    return float((best_own > best_other).float().mean())
