"""The feature store: the one format, in memory and on disk, that every part of curvalign reads.

A store holds features from frozen encoders (or from the synthetic world) and the
structure that the evaluations need. Only the first three fields are required; every
other part is optional and travels as a group (all of its fields present, or none).

Shapes (Ni images, Nt texts, Di / Dt feature dimensions):

required
    image_features   float [Ni, Di]
    text_features    float [Nt, Dt]
    text_to_image    long  [Nt]        index of the image each caption describes (several per image)
splits (optional)
    image_split      long  [Ni]        index into ``split_names`` (e.g. ["train", "test"]); a text
                                       belongs to the split of its image
boxes (optional; HyCoCLIP / PHyCLIP box-level pairs)
    box_image_features float [Nb, Di]  an object crop
    box_text_features  float [Nb, Dt]  its noun phrase
    box_to_image       long  [Nb]      the image the crop was cut from
text pairs (optional; DualPath's scored text-text pairs)
    pair_a_features  float [Np, Dt]
    pair_b_features  float [Np, Dt]
    pair_scores      float [Np]        similarity in [0, 1]
zero-shot classes (optional)
    class_names      list[str] (C)
    prompt_features  float [Nq, Dt]    one row per (class, template)
    prompt_to_class  long  [Nq]        in [0, C)
    image_labels     long  [Ni]        class of each image, -1 when it has none
taxonomy (optional; hierarchical metrics)
    taxonomy_names   list[str] (T)     node names; the classes are nodes: class c is node
                                       ``class_to_node[c]``
    taxonomy_parents long  [T]         parent node of each node, -1 for a root
    class_to_node    long  [C]
hard negatives (optional; compositional evaluation)
    negative_features  float [Nn, Dt]  a perturbed caption
    negative_to_text   long  [Nn]      the true caption it competes with
    negative_kind      long  [Nn]      index into ``negative_kind_names``
                                       (e.g. ["object_replaced", "attribute_replaced", ...])
text chains (optional; hierarchy ordering, seed 001)
    chain_features   float [Nc, L, Dt] texts from general to specific (attribute -> noun -> caption)
image chains use the boxes: crop (general) -> full image (specific).

Free-form JSON-serialisable facts (encoder name, the synthetic world's seed and sizes, ...)
go in ``meta``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class FeatureStore:
    image_features: Tensor
    text_features: Tensor
    text_to_image: Tensor

    image_split: Tensor | None = None
    split_names: list[str] | None = None

    box_image_features: Tensor | None = None
    box_text_features: Tensor | None = None
    box_to_image: Tensor | None = None

    pair_a_features: Tensor | None = None
    pair_b_features: Tensor | None = None
    pair_scores: Tensor | None = None

    class_names: list[str] | None = None
    prompt_features: Tensor | None = None
    prompt_to_class: Tensor | None = None
    image_labels: Tensor | None = None

    taxonomy_names: list[str] | None = None
    taxonomy_parents: Tensor | None = None
    class_to_node: Tensor | None = None

    negative_features: Tensor | None = None
    negative_to_text: Tensor | None = None
    negative_kind: Tensor | None = None
    negative_kind_names: list[str] | None = None

    chain_features: Tensor | None = None

    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def image_dim(self) -> int:
        return int(self.image_features.shape[-1])

    @property
    def text_dim(self) -> int:
        return int(self.text_features.shape[-1])

    @property
    def num_images(self) -> int:
        return int(self.image_features.shape[0])

    @property
    def num_texts(self) -> int:
        return int(self.text_features.shape[0])

    @property
    def has_boxes(self) -> bool:
        return self.box_image_features is not None

    @property
    def has_text_pairs(self) -> bool:
        return self.pair_a_features is not None

    @property
    def has_classes(self) -> bool:
        return self.prompt_features is not None

    @property
    def has_taxonomy(self) -> bool:
        return self.taxonomy_parents is not None

    @property
    def has_negatives(self) -> bool:
        return self.negative_features is not None

    @property
    def has_chains(self) -> bool:
        return self.chain_features is not None

    def split_image_ids(self, name: str) -> Tensor:
        """Ids of the images in split ``name``; every image when the store has no splits."""
        if self.image_split is None or self.split_names is None:
            return torch.arange(self.num_images)
        if name not in self.split_names:
            raise ValueError(f"split {name!r} not in this store; it has {self.split_names}")
        return torch.nonzero(self.image_split == self.split_names.index(name)).flatten()
