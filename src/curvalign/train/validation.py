"""Validation during training: the split it runs on and the metric that selects the model.

The metric is the one ProCLIP selects models with (Sec. 3.3): mean of text->image and
image->text recall@1 on the validation split, ranked with the recipe's own ``scores`` (distance,
angle, routed score), never a cosine stand-in. Ties count against the model and images without
captions take no part in image->text recall, as in ``curvalign.eval.retrieval`` (one rank
definition, ``curvalign.readout``).

The split: a store's own "val" split when it has one (the synthetic world and ``wordnet:`` make
one), checked to be non-empty and to share no image with "test"; otherwise a seeded hold-out of
``val_fraction`` of the store's train images, which the trainer then does not train on. Which of
the two was used, and how many images, is recorded in the run's meta.json.

The metric's rank definition, the embedding of the split and the tiled scoring are
``curvalign.readout``'s (shared with ``eval/``, which ``train/`` must not import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from curvalign.config import TrainConfig
from curvalign.data.features import FeatureStore
from curvalign.data.validation_split import (  # noqa: F401 (re-exported: the split is data)
    MAX_SHARED,
    MIN_TRAIN_IMAGES,
    VAL_SPLIT,
    validation_split,
)
from curvalign.errors import ConfigError
from curvalign.readout import (
    embed_store_part,
    image_to_text_ranks,
    recall_from_ranks,
    retrieval_ranks,
    text_to_image_ranks,
)

if TYPE_CHECKING:
    from curvalign.recipes.base import Embedding, Recipe

#: most validation images scored per validation (a seeded subsample of a larger split): the cost
#: of a validation does not grow with the store
VAL_MAX_IMAGES = TrainConfig.val_max_images


def validation_store(
    store: FeatureStore,
    fraction: float,
    seed: int,
    data: str = "the data",
    max_images: int = VAL_MAX_IMAGES,
) -> tuple[FeatureStore, dict[str, Any]]:
    """``store`` with a non-empty "val" split, and a record of where it came from.

    Returns (store, {"source": "store" | "holdout" | "none", "images": n, ...}). A store without
    a "val" split gets a seeded hold-out of ``fraction`` of its "train" images (at least one;
    every image counts when it has no splits); the returned store labels them "val" so the
    sampler skips them. A store too small to spare them (fewer than ``MIN_TRAIN_IMAGES`` would
    be left) is returned as it is with source "none": the run trains without validation.
    A split of more than ``max_images`` images is scored on a seeded subsample of that size
    (``ValidationSet`` with the same ``max_images`` and ``seed``), recorded as
    ``{"scored_images": max_images, "subsample_seed": seed}``.
    """
    store, info = validation_split(store, fraction, seed, data)
    if max_images and info["images"] > max_images:
        info.update(scored_images=int(max_images), subsample_seed=int(seed))
    return store, info


class ValidationSet:
    """The validation images and captions of a store: ``score(recipe)`` -> mean R@1 in [0, 1].

    Bounded by a budget, not by the store: at most ``max_images`` images are scored (a seeded
    subsample of a larger split, the same one at every validation, ``subsample`` says which),
    their features are read from the store batch by batch at each validation (float16 and
    memory-mapped stores included), and the ranks come in tiles of at most
    ``readout.PAIR_BUDGET`` pairs: never a dense N x N matrix.
    """

    def __init__(
        self,
        store: FeatureStore,
        batch_size: int = 1024,
        text_tokens: bool = False,
        max_images: int = VAL_MAX_IMAGES,
        seed: int = 0,
    ) -> None:
        image_ids = store.split_image_ids(VAL_SPLIT)
        self.subsample: dict[str, Any] | None = None
        if max_images and len(image_ids) > max_images:
            image_ids = scored_subsample(image_ids, max_images, seed)
            self.subsample = {
                "images": len(image_ids),
                "of": store.split_image_ids(VAL_SPLIT).numel(),
                "seed": int(seed),
            }
        local = torch.full((store.num_images,), -1, dtype=torch.long)
        local[image_ids] = torch.arange(len(image_ids))
        owner = local[store.text_to_image.long()]
        text_ids = torch.nonzero(owner >= 0).flatten()
        if len(text_ids) == 0:
            raise ConfigError("the validation split has no captions: nothing to validate on")
        self.store = store
        self.image_ids = image_ids
        self.text_ids = text_ids
        self.text_to_image = owner[text_ids]  # [Nt] local image index
        self.batch_size = batch_size
        # kept for callers that ask; the recipe itself says whether it reads tokens + masks
        self.text_tokens = text_tokens

    @property
    def num_images(self) -> int:
        return int(self.image_ids.shape[0])

    def embeddings(self, recipe: Recipe) -> tuple[Embedding, Embedding]:
        """(images, texts) of the scored split embedded by ``recipe``: the store's features
        (a subclass that re-encodes raw items, as tower training does, overrides this)."""
        images = embed_store_part(recipe, self.store, "image", self.image_ids, self.batch_size)
        texts = embed_store_part(recipe, self.store, "text", self.text_ids, self.batch_size)
        return images, texts

    @torch.no_grad()
    def score(self, recipe: Recipe) -> float:
        """Mean of T2I and I2T recall@1 with ``recipe.scores``; the recipe's mode is restored."""
        was_training = recipe.training
        recipe.eval()
        try:
            images, texts = self.embeddings(recipe)
            t_ranks, i_ranks = retrieval_ranks(recipe, texts, images, self.text_to_image)
            recall = recall_from_ranks(t_ranks, i_ranks, ks=(1,))
        finally:
            recipe.train(was_training)
        return (recall["t2i@1"] + recall["i2t@1"]) / 2


def scored_subsample(image_ids: Tensor, count: int, seed: int) -> Tensor:
    """``count`` of ``image_ids``, drawn with ``seed`` (the same draw for the same seed), sorted."""
    gen = torch.Generator().manual_seed(int(seed))
    return image_ids[torch.randperm(len(image_ids), generator=gen)[:count]].sort().values


def recall_at_1_text_query(scores: Tensor, text_to_image: Tensor) -> float:
    """Share of texts whose own image scores strictly above every other image. [Nt, Ni] scores.
    (``readout``'s rank definition, the one ``eval.retrieval`` uses.)"""
    return float((text_to_image_ranks(scores, text_to_image.long()) < 1).float().mean())


def recall_at_1_image_query(scores: Tensor, text_to_image: Tensor) -> float:
    """Share of images one of whose captions scores strictly above every caption of another
    image. ``scores`` [Nt, Ni] with the image as the query; images without captions are left
    out (``readout``'s rank definition, the one ``eval.retrieval`` uses)."""
    ranks = image_to_text_ranks(scores, text_to_image.long())
    return float((ranks[ranks >= 0] < 1).float().mean())
