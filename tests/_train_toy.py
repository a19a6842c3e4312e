"""Test-only recipes and stores for the trainer's tests (registered under names starting with "_").

``ToyRecipe``: linear heads, unit vectors, symmetric InfoNCE with a learnable log-temperature,
and dropout (so that resume must restore the global RNG). ``nan_at_step`` makes the term
``"bad"`` NaN at that 1-based step (``mode="nan_grad"``: finite, with a NaN gradient). ``ToyBoxRecipe`` also trains on boxes and text pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvalign.recipes as recipes
from curvalign.data.features import FeatureStore, TextPart
from curvalign.recipes.base import Batch, Gather, LossOutput, Progress, Recipe


@dataclass
class ToyConfig:
    dim: int = 8
    temperature_init: float = 0.1
    dropout: float = 0.1
    nan_at_step: int = -1
    widths: tuple[int, ...] = (8,)
    mode: Literal["nan_loss", "nan_grad"] = "nan_loss"
    warmup: int = 0  # same name as a TrainConfig key, for the ambiguity test
    scale: float | None = None


class ToyRecipe(Recipe):
    name = "_toy"
    Config = ToyConfig

    def __init__(self, config: ToyConfig, image_dim: int, text_dim: int) -> None:
        super().__init__(config, image_dim, text_dim)
        self.image_head = nn.Linear(image_dim, config.dim)
        self.text_head = nn.Linear(text_dim, config.dim)
        self.log_temperature = nn.Parameter(torch.tensor(float(config.temperature_init)).log())
        self.dropout = nn.Dropout(config.dropout)

    def embed_images(self, features):
        return {"point": F.normalize(self.image_head(self.dropout(features)), dim=-1)}

    def embed_texts(self, features):
        return {"point": F.normalize(self.text_head(self.dropout(features)), dim=-1)}

    def scores(self, texts, images, query="text"):
        return texts["point"] @ images["point"].T

    def pair_scores(self, texts, images, query="text"):
        return (texts["point"] * images["point"]).sum(-1)

    def _clip(self, images, texts):
        logits = self.scores(texts, images) / self.log_temperature.exp()
        target = torch.arange(len(logits))
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))

    def loss(self, batch: Batch, progress: Progress, gather: Gather | None = None) -> LossOutput:
        terms = {
            "contrastive": self._clip(self.embed_images(batch.image), self.embed_texts(batch.text))
        }
        if self.config.nan_at_step == progress.step + 1:
            if self.config.mode == "nan_loss":
                terms["bad"] = terms["contrastive"] * float("nan")
            else:  # finite value 0, gradient 0 * inf = nan
                terms["bad"] = 0.0 * (self.log_temperature - self.log_temperature.detach()).sqrt()
        total = sum(terms.values())
        return LossOutput(total, terms, {"batch_rows": float(len(batch.image))})

    def log_values(self):
        return {"temperature": float(self.log_temperature.detach().exp())}


class ToyBoxRecipe(ToyRecipe):
    name = "_toy_boxes"
    requires = frozenset({"boxes", "text_pairs"})

    def loss(self, batch, progress, gather=None):
        out = super().loss(batch, progress, gather)
        box = self._clip(self.embed_images(batch.box_image), self.embed_texts(batch.box_text))
        a, b = self.embed_texts(batch.pair_a)["point"], self.embed_texts(batch.pair_b)["point"]
        pairs = F.mse_loss((a * b).sum(-1), batch.pair_score)
        out.terms.update(box=box, pairs=pairs)
        return LossOutput(out.total + box + pairs, out.terms, out.logs)


TOY_RECIPES = (ToyRecipe, ToyBoxRecipe)


def register_toys() -> None:
    for cls in TOY_RECIPES:
        recipes._REGISTRY[cls.name] = cls


@pytest.fixture
def toy_recipes(monkeypatch):
    """Only the toy recipes in the registry (the real ones are tested by their own files and by
    the every-recipe smoke test), removed afterwards."""
    monkeypatch.setattr(recipes, "_REGISTRY", {})
    monkeypatch.setattr(recipes, "_load_all", lambda: None)
    register_toys()
    yield


def unregister_toys() -> None:
    for cls in TOY_RECIPES:
        recipes._REGISTRY.pop(cls.name, None)


def toy_store(
    num_images: int = 40,
    captions: int = 2,
    image_dim: int = 6,
    text_dim: int = 5,
    boxes: bool = False,
    pairs: int = 0,
    seed: int = 0,
    test_images: int = 0,
) -> FeatureStore:
    """A small random store: ``num_images`` train images (+ ``test_images``), ``captions`` each."""
    g = torch.Generator().manual_seed(seed)
    n = num_images + test_images
    store = FeatureStore(
        image_features=torch.randn(n, image_dim, generator=g),
        text=TextPart(torch.randn(n * captions, text_dim, generator=g)),
        text_to_image=torch.arange(n).repeat_interleave(captions),
        image_split=torch.cat([torch.zeros(num_images), torch.ones(test_images)]).long(),
        split_names=["train", "test"],
    )
    if boxes:
        owners = torch.arange(n).repeat_interleave(2)
        store.box_image_features = torch.randn(len(owners), image_dim, generator=g)
        store.box_text_features = torch.randn(len(owners), text_dim, generator=g)
        store.box_to_image = owners
    if pairs:
        store.pair_a = TextPart(torch.randn(pairs, text_dim, generator=g))
        store.pair_b = TextPart(torch.randn(pairs, text_dim, generator=g))
        store.pair_scores = torch.rand(pairs, generator=g)
    return store
