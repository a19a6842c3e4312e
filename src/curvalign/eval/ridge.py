"""The linear baseline where the two sides share no space: ridge regression from image features
into the text space, fit on train, its strength chosen on validation.

Where image and text features come from different encoders (or widths), "frozen features" has no
meaning, but the question it answers still does: does a trained head beat the simplest map
between the two spaces? On real photos (EfficientNet image features, MiniLM texts) this one line
beat every trained head on T2I R@1 (issue 21). Not a method and not registered (it lives in eval/).

Fit      W, b = argmin sum over train captions |x_img W + b - t|^2 + lambda |W|^2 (closed form,
         centred features so the bias is not shrunk); lambda = alpha * trace(X^T X) / D_img with
         alpha from ``ALPHAS`` (scale-free), the one with the best mean of T2I and I2T R@1 on the
         "val" split (ranked by cosine).
Embedding images {"point": normalise(x W + b)}, texts {"point": normalise(t)}, both [N, D_text].
Score    cosine similarity (``CosineRecipe``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from curvalign.errors import InputError
from curvalign.eval.retrieval import recall_at_k
from curvalign.geometry import sphere
from curvalign.recipes.base import CosineRecipe, Embedding

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore

#: the row name benchmark tables give it
ROW_NAME = "ridge (image→text)"
#: relative ridge strengths tried on validation
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


class RidgeMap(CosineRecipe):
    """Images mapped into the text space by a fitted linear map; texts as they are."""

    #: the map [Di, Dt] and its bias [Dt] (buffers, registered in ``__init__``)
    weight: Tensor
    bias: Tensor

    name = "ridge"

    def __init__(self, weight: Tensor, bias: Tensor, alpha: float | None = None) -> None:
        super().__init__(None, int(weight.shape[0]), int(weight.shape[1]))
        self.register_buffer("weight", weight.float())
        self.register_buffer("bias", bias.float())
        self.alpha = alpha

    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": sphere.project(features.float() @ self.weight + self.bias, 1.0)}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"point": sphere.project(features.float(), 1.0)}


def _pairs(store: FeatureStore, split: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(image features [Ni, Di], text features [Nt, Dt], text_to_image [Nt] local ids, caption
    image rows [Nt, Di]) of ``split``."""
    image_ids = store.split_image_ids(split)
    local = torch.full((store.num_images,), -1, dtype=torch.long)
    local[image_ids] = torch.arange(len(image_ids))
    owner = local[store.text_to_image.long()]
    text_ids = torch.nonzero(owner >= 0).flatten()
    images = store.image_features[image_ids].double()
    texts = store.text_features[text_ids].double()
    return images, texts, owner[text_ids], images[owner[text_ids]]


def _solve(x: Tensor, y: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    mean_x, mean_y = x.mean(0), y.mean(0)
    xc, yc = x - mean_x, y - mean_y
    gram = xc.T @ xc
    lam = alpha * float(torch.trace(gram)) / gram.shape[0]
    weight = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc)
    return weight, mean_y - mean_x @ weight


def fit_ridge(store: FeatureStore, train_split: str = "train", val_split: str = "val") -> RidgeMap:
    """The ridge map fit on ``train_split`` captions, its strength chosen on ``val_split``."""
    _, texts, _, x = _pairs(store, train_split)
    if len(texts) < 2:
        raise InputError(f"the ridge baseline needs captions in the {train_split!r} split")
    val_images, val_texts, val_owner, _ = _pairs(store, val_split)
    if len(val_texts) == 0:
        raise InputError(f"the ridge baseline needs captions in the {val_split!r} split")
    best: tuple[float, float, Tensor, Tensor] | None = None
    for alpha in ALPHAS:
        weight, bias = _solve(x, texts, alpha)
        mapped = sphere.project((val_images @ weight + bias).float(), 1.0)
        scores = sphere.project(val_texts.float(), 1.0) @ mapped.T
        r = recall_at_k(scores, val_owner, ks=(1,))
        value = (r["t2i@1"] + r["i2t@1"]) / 2
        if best is None or value > best[0]:
            best = (value, alpha, weight, bias)
    assert best is not None
    return RidgeMap(best[2], best[3], alpha=best[1]).eval()


__all__ = ["ALPHAS", "ROW_NAME", "RidgeMap", "fit_ridge"]
