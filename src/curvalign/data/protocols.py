"""The standard retrieval protocols the papers report, by name.

* ``coco-5k``: COCO 5k, the 5,000 val2017 images (= Karpathy's COCO test split), 5 captions
  per image (the first five: a few images have six or seven).
* ``flickr30k-1k``: Flickr30k 1k, the 1,000 images of Karpathy's Flickr30k test split, 5
  captions per image.

Both report Recall@1/5/10 text->image and image->text (CLIP, ProCLIP's table shows R@1/R@10);
the MERU family (MERU, HyCoCLIP, AtMG, PHyCLIP, AGR) reports R@5/R@10 only. Which K a method's
paper shows is the recipe's ``reported_recall_ks``; every K is computed either way.

A store is evaluated under a protocol when its ``meta["protocol"]`` names one (``curvalign
extract --protocol``) or when ``curvalign eval --protocol`` asks for it. The split must then hold
exactly the protocol's number of images, each with at least its number of captions: anything
else is an error, never a silently different benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from curvalign.errors import CurvalignError

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore


class ProtocolError(CurvalignError, ValueError):
    """A store that does not have the shape of the retrieval protocol it is evaluated under."""


@dataclass(frozen=True)
class RetrievalProtocol:
    key: str
    title: str
    images: int
    captions_per_image: int
    ks: tuple[int, ...] = (1, 5, 10)


PROTOCOLS: dict[str, RetrievalProtocol] = {
    "coco-5k": RetrievalProtocol("coco-5k", "COCO 5k val2017", 5000, 5),
    "flickr30k-1k": RetrievalProtocol("flickr30k-1k", "Flickr30k 1k Karpathy test", 1000, 5),
}


def get_protocol(name: str) -> RetrievalProtocol:
    if name not in PROTOCOLS:
        raise ProtocolError(f"unknown retrieval protocol {name!r}; known: {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def protocol_store(
    store: FeatureStore, protocol: RetrievalProtocol, split: str = "test"
) -> FeatureStore:
    """The split of ``store`` cut to the protocol: its images, each with its first
    ``captions_per_image`` captions (in store order). Only the retrieval fields are kept.

    Raises ProtocolError when the split has another number of images or an image with fewer
    captions than the protocol needs.
    """
    from curvalign.data.features import FeatureStore, TextPart

    if store.split_names is not None and split not in store.split_names:
        raise ProtocolError(
            f"{protocol.title}: the store has no split {split!r} (it has {store.split_names})"
        )
    image_ids = store.split_image_ids(split)
    if len(image_ids) != protocol.images:
        raise ProtocolError(
            f"{protocol.title} evaluates {protocol.images} images; split {split!r} of this store "
            f"has {len(image_ids)}"
        )
    local = torch.full((store.num_images,), -1, dtype=torch.long)
    local[image_ids] = torch.arange(len(image_ids))
    owner = local[store.text_to_image.long()]
    keep: list[int] = []
    taken = torch.zeros(len(image_ids), dtype=torch.long)
    for text, image in enumerate(owner.tolist()):
        if image >= 0 and taken[image] < protocol.captions_per_image:
            taken[image] += 1
            keep.append(text)
    short = torch.nonzero(taken < protocol.captions_per_image).flatten()
    if len(short):
        raise ProtocolError(
            f"{protocol.title} needs {protocol.captions_per_image} captions per image; "
            f"{len(short)} image(s) of split {split!r} have fewer (first: image {int(image_ids[short[0]])} "
            f"with {int(taken[short[0]])})"
        )
    rows = torch.tensor(keep, dtype=torch.long)
    return FeatureStore(
        image_features=store.image_features[image_ids],
        text=TextPart(store.text_features[rows]),
        text_to_image=owner[rows],
        meta={**store.meta, "protocol": protocol.key},
    )


__all__ = ["PROTOCOLS", "ProtocolError", "RetrievalProtocol", "get_protocol", "protocol_store"]
