"""Raw items of a feature store, encoded by towers into training and validation features.

A store made by ``curvalign extract`` keeps its manifest beside the features: ``image_paths``
(relative to ``meta["images_root"]``) and the caption strings ``texts``; a store of texts
standing for images (``wordnet:``) keeps ``image_texts``. The sampler's index stream
(``BatchSampler.next_indices``: which images, which caption of each) is the same whether the
features come from the store or from towers, so a tower run draws exactly the rows a
feature-store run draws; only the rows' features are computed here, by the current towers.

Training rows are decoded, cropped, augmented and tokenised by ``curvalign.towers.loader``
(DataLoader workers); validation encodes its split here with the evaluation transform.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from curvalign.data.batch import Batch
from curvalign.data.features import FeatureStore
from curvalign.towers.base import TowerError, Towers


class StoreItems:
    """The raw items of ``store``: ``images(ids)`` (paths, or texts standing for images) and
    ``texts(ids)``; TowerError at once when the store has no manifest."""

    def __init__(self, store: FeatureStore, data: str = "the data") -> None:
        if store.texts is None:
            raise TowerError(
                f"{data}: training towers needs the caption strings of the store (its manifest "
                "'texts'); extract the store with `curvalign extract` from images and captions"
            )
        if store.image_paths is not None:
            root = store.meta.get("images_root")
            if not root:
                raise TowerError(
                    f"{data}: the store lists image_paths but no meta['images_root'] to read them from"
                )
            base = Path(root)
            self._images: list[Any] = [str(base / p) for p in store.image_paths]
        elif store.image_texts is not None:
            self._images = list(store.image_texts)
        else:
            raise TowerError(
                f"{data}: training towers needs the image files (manifest 'image_paths') or the "
                "texts standing for images ('image_texts'); this store has neither"
            )
        self._texts = list(store.texts)

    def images(self, ids: Tensor | Sequence[int]) -> list[Any]:
        return [self._images[int(i)] for i in ids]

    def texts(self, ids: Tensor | Sequence[int]) -> list[str]:
        return [self._texts[int(i)] for i in ids]


def check_recipe_parts(requires: Iterable[str], recipe: str, streamed: bool = False) -> None:
    """TowerError before any training when the recipe needs a part tower batches lack: boxes
    and text pairs when the pairs are streamed from webdataset shards (they hold images and
    captions only). Token-level text features need no check: the towers give the text tower's
    token states (``Towers.encode_text_tokens``)."""
    if not streamed:
        return
    what = {"boxes": "box crops and their phrases", "text_pairs": "scored text pairs"}
    missing = [what[p] for p in sorted(requires) if p in what]
    if missing:
        raise TowerError(
            f"recipe {recipe} trains on {', '.join(missing)}; tower training does not build "
            "those from webdataset shards (train it on a feature store's manifest, or "
            "configure it without them)"
        )


def tower_batch(
    towers: Towers, items: StoreItems, indices: dict[str, Tensor], text_tokens: bool = False
) -> Batch:
    """The Batch of ``indices`` (``BatchSampler.next_indices`` rows, this rank's share) with
    features from ``towers``: image [B, Di], text [B, Dt], carrying gradients to the towers;
    with ``text_tokens`` (a recipe that pools tokens) text is the text tower's token states
    [B, L, Dk] and ``text_mask`` [B, L] (``Towers.encode_text_tokens``)."""
    image = towers.encode_images(items.images(indices["image"]))
    texts = items.texts(indices["text"])
    if text_tokens:
        tokens, mask = towers.encode_text_tokens(texts)
        return Batch(image=image, text=tokens, text_mask=mask)
    return Batch(image=image, text=towers.encode_texts(texts))


__all__ = ["StoreItems", "check_recipe_parts", "tower_batch"]
