"""The frozen-features baseline: the input features themselves, ranked by cosine.

Not a method and not registered (it lives in eval/, not recipes/): nothing is trained. It answers the first question a comparison
must answer: does a trained head beat the encoder it starts from? It applies only where image and
text features share one space (one CLIP, one sentence encoder: a store's ``meta["shared_space"]``);
``shared_space_reason`` says why it is absent otherwise.

Embedding  {"point": [N, D]} the L2-normalised features.
Score      cosine similarity.
Zero-shot  class embedding = mean of the class's normalised prompts, renormalised (CLIP's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from curvalign.geometry import sphere
from curvalign.recipes.base import CosineRecipe, Embedding

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore

#: the row name benchmark tables give it
ROW_NAME = "frozen features"


class FrozenFeatures(CosineRecipe):
    name = "frozen"

    def __init__(self, image_dim: int, text_dim: int) -> None:
        if image_dim != text_dim:
            raise ValueError(
                f"frozen features need one space for both sides; got image dim {image_dim}, "
                f"text dim {text_dim}"
            )
        super().__init__(None, image_dim, text_dim)

    def embed_images(self, features: Tensor) -> Embedding:
        return {"point": sphere.project(features.float(), 1.0)}

    def embed_texts(self, features: Tensor, mask: Tensor | None = None) -> Embedding:
        return {"point": sphere.project(features.float(), 1.0)}


def shared_space_reason(store: FeatureStore) -> str | None:
    """None when the frozen-features baseline applies to ``store``; else why it does not."""
    if store.image_dim != store.text_dim:
        return (
            f"image and text features have different dimensions ({store.image_dim} vs "
            f"{store.text_dim}): no common space to rank by cosine"
        )
    shared = (store.meta or {}).get("shared_space")
    if shared is False:
        source = (store.meta or {}).get("source", "the store")
        return f"{source}: image and text features come from different encoders or maps"
    return None


__all__ = ["ROW_NAME", "FrozenFeatures", "shared_space_reason"]
