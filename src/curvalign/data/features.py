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
multi-labels (optional; multi-label mAP, e.g. COCO instances: several classes per image; needs
the classes group)
    multilabel_to_image long [Nl]      the image of each (image, class) annotation
    multilabel_class    long [Nl]      its class, in [0, C)
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
text tokens (optional; token-level features for attention pooling, DualPath seed 004)
    text_token_features float [Nt, L, Dk]  the encoder's last hidden states of each text,
                                           right-padded to the longest text (Dk may differ
                                           from Dt: hidden width, not the projection)
    text_token_mask     long  [Nt, L]      1 for a real token, 0 for padding; >= 1 per row
  the other text parts may carry tokens the same way, each part its own optional group with its
  own L (a recipe that reads tokens, ``Recipe.reads_text_tokens``, embeds every text from them):
    pair_tokens      pair_a_token_features [Np, La, Dk], pair_a_token_mask [Np, La],
                     pair_b_token_features [Np, Lb, Dk], pair_b_token_mask [Np, Lb]
    prompt_tokens    prompt_token_features [Nq, Lq, Dk], prompt_token_mask [Nq, Lq]
    negative_tokens  negative_token_features [Nn, Ln, Dk], negative_token_mask [Nn, Ln]
  every token part has the same Dk; image rows stay pooled vectors (there are no image tokens).
text chains (optional; hierarchy ordering, seed 001)
    chain_features   float [Nc, L, Dt] texts from general to specific (attribute -> noun -> caption)
image chains use the boxes: crop (general) -> full image (specific).

items (optional; what a person recognises a row by, shown by ``curvalign search``; each
list is optional on its own and saved in ``items.json`` so that ``meta.json`` stays small)
    image_paths      list[str] (Ni)    image file of each image row, relative to
                                       ``meta["images_root"]`` (an absolute directory)
    image_texts      list[str] (Ni)    a text standing for an image row whose "image" is itself
                                       text (WordNet: the synset's lemma names)
    texts            list[str] (Nt)    the string of each text row (a caption, a gloss)
    box_phrases      list[str] (Nb)    the phrase of each box row (training towers from raw items)
    box_corners      list[str] (Nb)    "x0 y0 x1 y1": the box's pixel corners in its image
    pair_a_texts, pair_b_texts  list[str] (Np)  the two texts of each scored text pair
The class name and synset of an image row come from ``image_labels``/``class_names`` and
``class_to_node``/``taxonomy_names``; the local encoder that made the features is
``meta["encoder"]`` (a spec for ``curvalign.data.encoders.load_encoder``).

Free-form JSON-serialisable facts (encoder name, the synthetic world's seed and sizes, ...)
go in ``meta``.

Rules that ``validate`` enforces (see docs/data.md for the on-disk format): every optional
group is complete or absent; the taxonomy group needs the class group; features are finite
floats, index fields integers within range (``image_labels`` may be -1, ``taxonomy_parents``
is -1 exactly at roots and has no cycle); ``pair_scores`` lie in [0, 1]. An image without any
caption is legal: retrieval galleries may hold distractor images that no text describes.

In memory each text part (captions ``text``, ``pair_a``/``pair_b``, ``prompt``, ``negative``)
is one ``TextPart`` record (pooled features, token features, mask) rather than parallel fields;
the names above are the on-disk names (``TEXT_PARTS``), which ``FeatureStore.field``,
``fields``, ``from_fields`` and ``with_fields`` speak.

On disk a store is a directory: ``meta.json`` plus one ``.npy`` file per tensor field, so that
large feature arrays can be memory-mapped (``FeatureStore.load(path, mmap=True)``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from curvalign._io import staged_directory
from curvalign.data.sharded import (
    IndexedStrings,
    LazyStrings,
    ShardedRows,
    is_row_source,
)
from curvalign.errors import CurvalignError

FORMAT_NAME = "curvalign.feature_store"
FORMAT_VERSION = 1

# Tensor fields by kind. Float fields may be memory-mapped; index fields are small and always
# loaded into memory as int64.
FLOAT_FIELDS = (
    "image_features",
    "text_features",
    "box_image_features",
    "box_text_features",
    "pair_a_features",
    "pair_b_features",
    "pair_scores",
    "prompt_features",
    "negative_features",
    "chain_features",
    "text_token_features",
    "pair_a_token_features",
    "pair_b_token_features",
    "prompt_token_features",
    "negative_token_features",
)
INDEX_FIELDS = (
    "text_to_image",
    "image_split",
    "box_to_image",
    "prompt_to_class",
    "image_labels",
    "taxonomy_parents",
    "class_to_node",
    "negative_to_text",
    "negative_kind",
    "text_token_mask",
    "pair_a_token_mask",
    "pair_b_token_mask",
    "prompt_token_mask",
    "negative_token_mask",
    "multilabel_to_image",
    "multilabel_class",
)
TENSOR_FIELDS = FLOAT_FIELDS + INDEX_FIELDS
LIST_FIELDS = ("split_names", "class_names", "taxonomy_names", "negative_kind_names")
#: per-row strings for people (see the module docstring), each optional on its own
ITEM_FIELDS = (
    "image_paths",
    "image_texts",
    "texts",
    "box_phrases",
    "box_corners",
    "pair_a_texts",
    "pair_b_texts",
)
ITEMS_FILE = "items.json"
#: item lists of at least this many rows are saved as ``IndexedStrings`` (read on demand), not
#: in ``items.json`` (parsed whole when the store is opened)
INDEXED_ITEMS_MIN = 10_000

REQUIRED_FIELDS = ("image_features", "text_features", "text_to_image")
# Optional groups: all of a group's fields are present, or none.
GROUPS: dict[str, tuple[str, ...]] = {
    "splits": ("image_split", "split_names"),
    "boxes": ("box_image_features", "box_text_features", "box_to_image"),
    "text_pairs": ("pair_a_features", "pair_b_features", "pair_scores"),
    "classes": ("class_names", "prompt_features", "prompt_to_class", "image_labels"),
    "taxonomy": ("taxonomy_names", "taxonomy_parents", "class_to_node"),
    "negatives": ("negative_features", "negative_to_text", "negative_kind", "negative_kind_names"),
    "chains": ("chain_features",),
    "tokens": ("text_token_features", "text_token_mask"),
    "pair_tokens": (
        "pair_a_token_features",
        "pair_a_token_mask",
        "pair_b_token_features",
        "pair_b_token_mask",
    ),
    "prompt_tokens": ("prompt_token_features", "prompt_token_mask"),
    "negative_tokens": ("negative_token_features", "negative_token_mask"),
    "multilabels": ("multilabel_to_image", "multilabel_class"),
}
#: the text parts of a store: part -> (pooled features, token features, token mask, its group)
TEXT_PARTS: dict[str, tuple[str, str, str, str]] = {
    "text": ("text_features", "text_token_features", "text_token_mask", "tokens"),
    "pair_a": ("pair_a_features", "pair_a_token_features", "pair_a_token_mask", "pair_tokens"),
    "pair_b": ("pair_b_features", "pair_b_token_features", "pair_b_token_mask", "pair_tokens"),
    "prompt": ("prompt_features", "prompt_token_features", "prompt_token_mask", "prompt_tokens"),
    "negative": (
        "negative_features",
        "negative_token_features",
        "negative_token_mask",
        "negative_tokens",
    ),
}
# Rows per chunk when scanning float arrays for NaN/inf: bounded memory on memory-mapped stores.
_SCAN_ELEMENTS = 1 << 22
#: meta.json's record that ``save`` found every float finite (and the sizes of the files it
#: checked), so that ``load`` need not read every float again (docs/data.md, "The value scan")
VALUES_CHECKED_KEY = "values_checked"
#: set to 1 to force the NaN/inf scan on every store opened (``curvalign --check``)
CHECK_ENV = "CURVALIGN_CHECK_VALUES"


class FeatureStoreError(CurvalignError, ValueError):
    """A feature store (in memory or on disk) that breaks the format; the message names the field or file."""


_T = TypeVar("_T")


def present(value: _T | None, name: str) -> _T:
    """``value``, a store field that a ``has_*`` check (or validation) guarantees, typed as
    present; ``FeatureStoreError`` naming the field where it is absent after all."""
    if value is None:
        raise FeatureStoreError(f"the feature store has no {name}")
    return value


@dataclass(frozen=True, eq=False)  # eq: tensors have no single truth value
class TextPart:
    """One text part of a store (captions, text pairs' halves, prompts, hard negatives): the
    pooled features of its n texts and, optionally, the token features they were pooled from.

    features        float [n, Dt]
    token_features  float [n, L, Dk] or None   right-padded last hidden states (Dk: the
                                               encoder's hidden width, not the projection)
    token_mask      long  [n, L] or None       1 for a real token, 0 for padding; >= 1 per row

    Tokens and mask come together (``FeatureStore.validate`` names the file that lacks its
    partner). On disk each attribute is one ``.npy`` file named by ``TEXT_PARTS``.
    """

    features: Tensor
    token_features: Tensor | None = None
    token_mask: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def has_tokens(self) -> bool:
        return self.token_features is not None

    def __repr__(self) -> str:
        # The dataclass default would print every tensor in full.
        tokens = (
            "" if self.token_features is None else f", tokens={list(self.token_features.shape)}"
        )
        return f"TextPart(features={list(self.features.shape)}{tokens})"

    def take(self, ids: Tensor) -> TextPart:
        """The rows ``ids`` of every attribute (a copy)."""
        return TextPart(
            self.features[ids],
            None if self.token_features is None else self.token_features[ids],
            None if self.token_mask is None else self.token_mask[ids],
        )

    def tokens(self, index: Tensor | slice) -> tuple[Tensor, Tensor]:
        """Rows ``index`` as ``([n, L', Dk] float32 token features, [n, L'] long mask)``, cut to
        the longest sequence among these rows (L' <= L: columns that are padding in every row
        change nothing under a mask and cost time). The part must carry tokens."""
        assert self.token_features is not None and self.token_mask is not None
        m = torch.as_tensor(self.token_mask[index]).long()
        width = int((m != 0).long().cumsum(1).argmax(1).max()) + 1 if m.numel() else 1
        return torch.as_tensor(self.token_features[index][:, :width]).float(), m[:, :width]


#: on-disk field name -> (text part, attribute of its ``TextPart``)
_PART_FIELDS: dict[str, tuple[str, str]] = {
    name: (part, attribute)
    for part, names in TEXT_PARTS.items()
    for name, attribute in zip(names[:3], ("features", "token_features", "token_mask"), strict=True)
}


@dataclass
class FeatureStore:
    """The store; field by field in the module docstring. Each text part is one ``TextPart``
    (``text`` the captions; ``pair_a``/``pair_b``, ``prompt``, ``negative`` optional), named
    like the keys of ``TEXT_PARTS``; the other fields keep their on-disk names (``fields()``,
    ``from_fields`` and ``with_fields`` speak the on-disk names of every field)."""

    image_features: Tensor
    text: TextPart
    text_to_image: Tensor

    image_split: Tensor | None = None
    split_names: list[str] | None = None

    box_image_features: Tensor | None = None
    box_text_features: Tensor | None = None
    box_to_image: Tensor | None = None

    pair_a: TextPart | None = None
    pair_b: TextPart | None = None
    pair_scores: Tensor | None = None

    class_names: list[str] | None = None
    prompt: TextPart | None = None
    prompt_to_class: Tensor | None = None
    image_labels: Tensor | None = None

    taxonomy_names: list[str] | None = None
    taxonomy_parents: Tensor | None = None
    class_to_node: Tensor | None = None

    negative: TextPart | None = None
    negative_to_text: Tensor | None = None
    negative_kind: Tensor | None = None
    negative_kind_names: list[str] | None = None

    chain_features: Tensor | None = None

    multilabel_to_image: Tensor | None = None
    multilabel_class: Tensor | None = None

    image_paths: list[str] | None = None
    image_texts: list[str] | None = None
    texts: list[str] | None = None
    box_phrases: list[str] | None = None
    box_corners: list[str] | None = None
    pair_a_texts: list[str] | None = None
    pair_b_texts: list[str] | None = None

    meta: dict[str, Any] = field(default_factory=dict)

    # --- the on-disk names ----------------------------------------------------------------------

    @classmethod
    def from_fields(cls, meta: dict[str, Any] | None = None, **values: Any) -> FeatureStore:
        """A store from its fields under their on-disk names (``TENSOR_FIELDS``, ``LIST_FIELDS``,
        ``ITEM_FIELDS``; e.g. ``text_features``, ``text_token_mask``): each text part's files
        become one ``TextPart``. Not validated (``validate`` is)."""
        return cls(**_records(values, "feature store"), meta={} if meta is None else meta)

    def field(self, name: str) -> Any:
        """The field with on-disk name ``name`` (``text_token_mask`` is ``self.text.token_mask``),
        None when absent."""
        if name in _PART_FIELDS:
            part, attribute = _PART_FIELDS[name]
            record = getattr(self, part)
            return None if record is None else getattr(record, attribute)
        return getattr(self, name)

    def fields(self) -> dict[str, Any]:
        """Every field but ``meta`` under its on-disk name (None for an absent one)."""
        return {name: self.field(name) for name in TENSOR_FIELDS + LIST_FIELDS + ITEM_FIELDS}

    def with_fields(self, **changes: Any) -> FeatureStore:
        """A copy with the fields named (by their on-disk names, or ``meta``) replaced."""
        meta = changes.pop("meta", self.meta)
        return type(self).from_fields(meta=meta, **{**self.fields(), **changes})

    # --- sizes and parts ------------------------------------------------------------------------

    # Read access to the pooled features of each text part under their on-disk names: every
    # layer reads them (a hundred call sites), so they stay attributes.
    @property
    def text_features(self) -> Tensor:
        return self.text.features

    @property
    def pair_a_features(self) -> Tensor | None:
        return None if self.pair_a is None else self.pair_a.features

    @property
    def pair_b_features(self) -> Tensor | None:
        return None if self.pair_b is None else self.pair_b.features

    @property
    def prompt_features(self) -> Tensor | None:
        return None if self.prompt is None else self.prompt.features

    @property
    def negative_features(self) -> Tensor | None:
        return None if self.negative is None else self.negative.features

    @property
    def image_dim(self) -> int:
        return int(self.image_features.shape[-1])

    @property
    def text_dim(self) -> int:
        return int(self.text.features.shape[-1])

    @property
    def num_images(self) -> int:
        return int(self.image_features.shape[0])

    @property
    def num_texts(self) -> int:
        return self.text.num_rows

    @property
    def has_boxes(self) -> bool:
        return self.box_image_features is not None

    @property
    def has_text_pairs(self) -> bool:
        return self.pair_a is not None

    @property
    def has_classes(self) -> bool:
        return self.prompt is not None

    @property
    def has_taxonomy(self) -> bool:
        return self.taxonomy_parents is not None

    @property
    def has_negatives(self) -> bool:
        return self.negative is not None

    @property
    def has_chains(self) -> bool:
        return self.chain_features is not None

    @property
    def has_multilabels(self) -> bool:
        return self.multilabel_to_image is not None

    @property
    def has_tokens(self) -> bool:
        return self.text.has_tokens

    def text_part(self, part: str) -> TextPart | None:
        """Text part ``part`` (a key of ``TEXT_PARTS``), None when the store lacks it."""
        if part not in TEXT_PARTS:
            raise FeatureStoreError(
                f"unknown text part {part!r}; expected one of {', '.join(TEXT_PARTS)}"
            )
        record: TextPart | None = getattr(self, part)
        return record

    @property
    def token_dim(self) -> int | None:
        """Dk, the width of the token features (the same for every token part), or None."""
        for part in TEXT_PARTS:
            record = self.text_part(part)
            if record is not None and record.token_features is not None:
                return int(record.token_features.shape[-1])
        return None

    def has_text_tokens(self, part: str) -> bool:
        """True when text part ``part`` (a key of ``TEXT_PARTS``) carries token features."""
        record = self.text_part(part)
        return record is not None and record.has_tokens

    def input_dims(self, text_tokens: bool = False) -> tuple[int, int]:
        """(image, text) input widths of a recipe trained here: ``(Di, Dt)``, or ``(Di, Dk)`` when
        it reads text tokens (``text_tokens``); a store without caption tokens is then an error."""
        if not text_tokens:
            return self.image_dim, self.text_dim
        if not self.has_tokens:
            raise FeatureStoreError(
                "the recipe reads token-level text features but this store has none "
                "(text_token_features is absent); extract the texts with `curvalign extract "
                "--tokens` (an encoder that gives tokens: hf-clip, sentence-transformers), or "
                "configure the recipe for pooled features"
            )
        assert self.token_dim is not None
        return self.image_dim, self.token_dim

    def text_rows(
        self, part: str, index: Tensor | slice, tokens: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Rows ``index`` of text part ``part`` (a key of ``TEXT_PARTS``) as float32.

        ``tokens=False``: ``([n, Dt] pooled features, None)``. ``tokens=True``: ``([n, L', Dk]
        token features, [n, L'] mask)`` (``TextPart.tokens``).
        """
        record = self.text_part(part)
        features, token_field, _, group = TEXT_PARTS[part]
        if record is None:
            raise FeatureStoreError(f"this store has no {part} texts ({features} is absent)")
        if not tokens:
            return torch.as_tensor(record.features[index]).float(), None
        if not record.has_tokens:
            raise FeatureStoreError(
                f"the recipe reads token-level text features but this store's {part} texts have "
                f"none ({token_field} is absent, group {group!r}); extract them with "
                "`curvalign extract --tokens`"
            )
        return record.tokens(index)

    @property
    def groups(self) -> list[str]:
        """Names of the optional groups present (keys of ``GROUPS``)."""
        return [g for g, names in GROUPS.items() if self.field(names[0]) is not None]

    def split_image_ids(self, name: str) -> Tensor:
        """Ids of the images in split ``name``; every image when the store has no splits."""
        if self.image_split is None or self.split_names is None:
            return torch.arange(self.num_images)
        if name not in self.split_names:
            raise FeatureStoreError(f"split {name!r} not in this store; it has {self.split_names}")
        return torch.nonzero(self.image_split == self.split_names.index(name)).flatten()

    def texts_of_split(self, name: str) -> Tensor:
        """Ids of the texts whose image is in split ``name`` (every text when there are no splits)."""
        if self.image_split is None or self.split_names is None:
            return torch.arange(self.num_texts)
        in_split = torch.zeros(self.num_images, dtype=torch.bool)
        in_split[self.split_image_ids(name)] = True
        return torch.nonzero(in_split[self.text_to_image.long()]).flatten()

    def select_split(self, name: str) -> FeatureStore:
        """The store restricted to the images of split ``name`` (see ``subset``)."""
        return self.subset(self.split_image_ids(name))

    def prompt_ids_of_class(self, class_id: int) -> Tensor:
        """Rows of ``prompt_features`` that belong to class ``class_id``."""
        if self.prompt_to_class is None:
            raise FeatureStoreError(
                "this store has no zero-shot classes (prompt_features is absent)"
            )
        return torch.nonzero(self.prompt_to_class == class_id).flatten()

    def subset(self, image_ids: Tensor | Sequence[int]) -> FeatureStore:
        """A new store with the images ``image_ids`` (new image ``i`` is old ``image_ids[i]``).

        Captions, boxes and labels of those images are kept and reindexed; hard negatives follow
        their caption. Parts not tied to images (text pairs, prompts, taxonomy, chains) and
        ``meta`` are kept whole. Tensors are copied, so a subset of a memory-mapped store lives
        in memory.
        """
        ids = torch.as_tensor(image_ids, dtype=torch.long).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_images):
            raise ValueError(
                f"subset: image ids must lie in [0, {self.num_images}), got {int(ids.min())}..{int(ids.max())}"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("subset: image ids contain duplicates")
        new_image = torch.full((self.num_images,), -1, dtype=torch.long)
        new_image[ids] = torch.arange(ids.numel())

        text_ids = torch.nonzero(new_image[self.text_to_image.long()] >= 0).flatten()
        changes: dict[str, Any] = {
            "image_features": self.image_features[ids],
            "text": self.text.take(text_ids),
            "text_to_image": new_image[self.text_to_image[text_ids].long()],
            "meta": dict(self.meta),
        }
        if self.image_split is not None:
            changes["image_split"] = self.image_split[ids]
        if self.image_labels is not None:
            changes["image_labels"] = self.image_labels[ids]
        if self.multilabel_to_image is not None:
            assert self.multilabel_class is not None
            label_ids = torch.nonzero(new_image[self.multilabel_to_image.long()] >= 0).flatten()
            changes["multilabel_to_image"] = new_image[self.multilabel_to_image[label_ids].long()]
            changes["multilabel_class"] = self.multilabel_class[label_ids]
        if self.box_to_image is not None:
            assert self.box_image_features is not None and self.box_text_features is not None
            box_ids = torch.nonzero(new_image[self.box_to_image.long()] >= 0).flatten()
            changes["box_image_features"] = self.box_image_features[box_ids]
            changes["box_text_features"] = self.box_text_features[box_ids]
            changes["box_to_image"] = new_image[self.box_to_image[box_ids].long()]
            for name in ("box_phrases", "box_corners"):
                if getattr(self, name) is not None:
                    changes[name] = _take_items(getattr(self, name), box_ids)
        if self.negative_to_text is not None:
            assert self.negative is not None and self.negative_kind is not None
            new_text = torch.full((self.num_texts,), -1, dtype=torch.long)
            new_text[text_ids] = torch.arange(text_ids.numel())
            neg_ids = torch.nonzero(new_text[self.negative_to_text.long()] >= 0).flatten()
            changes["negative"] = self.negative.take(neg_ids)
            changes["negative_to_text"] = new_text[self.negative_to_text[neg_ids].long()]
            changes["negative_kind"] = self.negative_kind[neg_ids]
        for name in ("image_paths", "image_texts"):
            if getattr(self, name) is not None:
                changes[name] = _take_items(getattr(self, name), ids)
        if self.texts is not None:
            changes["texts"] = _take_items(self.texts, text_ids)
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        # The dataclass default would print every tensor in full.
        parts = [
            f"images={self.num_images}x{self.image_dim}",
            f"texts={self.num_texts}x{self.text_dim}",
        ]
        if self.has_boxes:
            parts.append(f"boxes={_rows(self.box_to_image)}")
        if self.has_text_pairs:
            parts.append(f"text_pairs={_rows(self.pair_scores)}")
        if self.class_names is not None:
            parts.append(f"classes={len(self.class_names)} prompts={_rows(self.prompt_features)}")
        if self.taxonomy_names is not None:
            parts.append(f"taxonomy_nodes={len(self.taxonomy_names)}")
        if self.has_negatives:
            parts.append(f"negatives={_rows(self.negative_features)}")
        if self.has_chains:
            assert self.chain_features is not None
            parts.append(f"chains={tuple(self.chain_features.shape[:2])}")
        if self.text.token_features is not None:
            parts.append(f"text_tokens={tuple(self.text.token_features.shape[1:])}")
        token_parts = [p for p in TEXT_PARTS if p != "text" and self.has_text_tokens(p)]
        if token_parts:
            parts.append(f"tokens_of={token_parts}")
        if self.split_names is not None:
            parts.append(f"splits={self.split_names}")
        return f"FeatureStore({', '.join(parts)})"

    # --- validation ---------------------------------------------------------------------------

    def validate(self, check_values: bool = True) -> None:
        """Raise ``FeatureStoreError`` naming the first field that breaks the format.

        ``check_values=False`` skips the scan of every float for NaN/inf (one pass over the data,
        the only check whose cost grows with the size of the features).
        """
        validate_store(self, lambda name: f"field {name!r}", "feature store", check_values)

    # --- persistence --------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the store as a directory ``path`` (``meta.json`` + one ``.npy`` per tensor field).

        The write is atomic: files go into a temporary sibling directory that is renamed into
        place at the end, so a crash never leaves a half-written store at ``path``. An existing
        ``path`` is an error unless ``overwrite=True``, and even then only an existing feature
        store or an empty directory is replaced. The store is validated first (NaN/inf included).
        Float features keep their dtype (bfloat16,
        which ``.npy`` cannot hold, is written as float32); index fields are written as int64.
        """
        self.validate()  # a store that load() would reject is never written
        if self.num_images == 0 or self.num_texts == 0:
            raise FeatureStoreError(
                f"not saving {path}: the store has {self.num_images} images and "
                f"{self.num_texts} captions; nothing could be trained or evaluated on it "
                "(check the inputs it was built from)"
            )
        target = Path(path).expanduser()
        if target.exists() or target.is_symlink():
            if not overwrite:
                raise FeatureStoreError(
                    f"{target} already exists; pass overwrite=True to replace it"
                )
            if not target.is_dir() or (
                any(target.iterdir()) and not (target / "meta.json").is_file()
            ):
                raise FeatureStoreError(
                    f"{target} exists and is not a feature store; not replacing it"
                )
        header = self._meta_json()
        with staged_directory(target) as tmp:
            for name in TENSOR_FIELDS:
                value = self.field(name)
                if isinstance(value, ShardedRows):
                    _save_rows(tmp / f"{name}.npy", value)  # chunk by chunk, never whole
                elif value is not None:
                    np.save(
                        tmp / f"{name}.npy",
                        _to_numpy(value, index=name in INDEX_FIELDS),
                        allow_pickle=False,
                    )
            items = {}
            for f in ITEM_FIELDS:
                value = getattr(self, f)
                if value is not None and len(value) >= INDEXED_ITEMS_MIN:
                    # long lists (a million captions): read lazily when the store is opened
                    IndexedStrings.write(value, *_indexed_item_files(tmp, f))
                elif value is not None:
                    items[f] = list(value)
            if items:
                (tmp / ITEMS_FILE).write_text(json.dumps(items))
            # validate() above scanned every float: record it with the sizes of the files it
            # covers, so that load() opens the store without reading them again
            header[VALUES_CHECKED_KEY] = {
                "nonfinite_rows": 0,
                "file_bytes": {
                    f"{name}.npy": (tmp / f"{name}.npy").stat().st_size
                    for name in FLOAT_FIELDS
                    if self.field(name) is not None
                },
            }
            # meta.json last: a directory with meta.json is complete.
            (tmp / "meta.json").write_text(json.dumps(header, indent=1) + "\n")
        return target

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], mmap: bool = False, check_values: bool | None = None
    ) -> FeatureStore:
        """Read a store written by ``save`` and validate it.

        ``mmap=True`` memory-maps the float arrays (copy-on-write: the files are never modified),
        so stores larger than memory can be read in chunks. The NaN/inf scan reads every float
        once; ``save`` records in meta.json that it ran (``values_checked``), and with
        ``check_values=None`` (the default) a store whose float files still have the recorded
        sizes is opened without it: O(1) in the size of the store. ``True`` forces the scan (as
        does the environment variable ``CURVALIGN_CHECK_VALUES=1``, ``curvalign --check``);
        ``False`` skips it. A store without the record (written before it existed) is scanned
        on every open, as before; saving it again records the scan.
        """
        root = Path(path).expanduser()
        where = f"feature store {root}"
        header = _read_header(root, where)
        values: dict[str, Any] = {
            name: _load_field(root, header, name, mmap, where)
            for name in _expected_fields(header, where)
        }
        meta = header.get("meta", {})
        if not isinstance(meta, dict):
            raise FeatureStoreError(f"{where}: meta.json 'meta' must be an object")
        values.update(_read_items(root, where))
        store = cls(**_records(values, where), meta=meta)
        if check_values is None:
            check_values = forced_value_check() or not _values_recorded(root, header)
        validate_store(store, _describe_on_disk, where, check_values)
        return store

    def _meta_json(self) -> dict[str, Any]:
        header: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "counts": {
                "images": self.num_images,
                "texts": self.num_texts,
                "boxes": _rows(self.box_to_image),
                "text_pairs": _rows(self.pair_scores),
                "classes": len(self.class_names) if self.class_names is not None else 0,
                "prompts": _rows(self.prompt_to_class),
                "taxonomy_nodes": _rows(self.taxonomy_parents),
                "negatives": _rows(self.negative_to_text),
                "chains": _rows(self.chain_features),
                "text_tokens": _rows(self.text.token_features),
            },
            "dims": {
                "image": self.image_dim,
                "text": self.text_dim,
                **({"token": self.token_dim} if self.token_dim is not None else {}),
            },
            "groups": self.groups,
            "arrays": {
                name: {"shape": list(value.shape), "dtype": _disk_dtype(value, name)}
                for name, value in self.fields().items()
                if name in TENSOR_FIELDS and value is not None
            },
        }
        for name in LIST_FIELDS:
            if getattr(self, name) is not None:
                header[name] = list(getattr(self, name))
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as exc:
            raise FeatureStoreError(
                f"feature store: field 'meta' is not JSON-serialisable ({exc})"
            ) from None
        header["meta"] = self.meta
        return header


# Deprecated constructor forms, kept for one release (0.2.0; remove in 0.3.0): before text parts
# became ``TextPart`` records, ``FeatureStore(...)`` took each part's fields under their on-disk
# names (``text_features=``, ``text_token_mask=``, ``pair_a_features=``, ...), and positionally a
# tensor of caption features where ``text`` now is. Both still build the same store, with a
# ``DeprecationWarning`` naming ``FeatureStore.from_fields`` and ``TextPart``.
_dataclass_init = FeatureStore.__init__


@functools.wraps(_dataclass_init)
def _init_accepting_old_keywords(self: FeatureStore, *args: Any, **kwargs: Any) -> None:
    old = [name for name in kwargs if name in _PART_FIELDS]
    if old:
        taken = sorted({_PART_FIELDS[n][0] for n in old} & kwargs.keys())
        if taken:
            raise TypeError(
                f"FeatureStore() got both {', '.join(old)} and {', '.join(taken)}: pass the "
                "text part once, as a TextPart"
            )
        warnings.warn(
            f"FeatureStore({'=..., '.join(old)}=...) is deprecated: pass each text part as a "
            "TextPart (FeatureStore(text=TextPart(features, token_features, token_mask), ...)) "
            "or use FeatureStore.from_fields(...) for the on-disk field names",
            DeprecationWarning,
            stacklevel=2,
        )
        kwargs = _records(kwargs, "FeatureStore()")
    if len(args) >= 2 and isinstance(args[1], Tensor):
        warnings.warn(
            "FeatureStore(image_features, text_features, ...) with a tensor as the second "
            "argument is deprecated: pass TextPart(text_features) (curvalign.data.features."
            "TextPart) or use FeatureStore.from_fields(...)",
            DeprecationWarning,
            stacklevel=2,
        )
        args = (args[0], TextPart(args[1]), *args[2:])
    _dataclass_init(self, *args, **kwargs)


FeatureStore.__init__ = _init_accepting_old_keywords  # type: ignore[method-assign]


# --- helpers ----------------------------------------------------------------------------------


#: ``load_data(spec, check=True)`` sets this while its loader runs
FORCE_VALUE_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "curvalign_force_value_check", default=False
)


def forced_value_check() -> bool:
    """True when the NaN/inf scan is asked for on every store opened: ``load_data(...,
    check=True)`` or the environment variable ``CURVALIGN_CHECK_VALUES=1``
    (``curvalign --check``, inherited by the processes of ``--nproc``)."""
    if FORCE_VALUE_CHECK.get():
        return True
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes")


def _values_recorded(root: Path, header: dict[str, Any]) -> bool:
    """True when meta.json records a clean NaN/inf scan of float files that still have the
    recorded sizes (one ``stat`` per file; a file rewritten to another size is scanned again)."""
    record = header.get(VALUES_CHECKED_KEY)
    if not isinstance(record, dict) or record.get("nonfinite_rows") != 0:
        return False
    sizes = record.get("file_bytes")
    if not isinstance(sizes, dict):
        return False
    present = {f"{name}.npy" for name in FLOAT_FIELDS if name in header.get("arrays", {})}
    if set(sizes) != present:
        return False
    try:
        return all((root / name).stat().st_size == size for name, size in sizes.items())
    except OSError:
        return False


def _read_header(root: Path, where: str) -> dict[str, Any]:
    """The parsed meta.json of the store directory ``root``, checked to describe a feature store
    of this format version."""
    if not root.is_dir():
        raise FeatureStoreError(
            f"{where}: no such directory" if not root.exists() else f"{where}: not a directory"
        )
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise FeatureStoreError(f"{where}: meta.json is missing (not a feature store directory?)")
    try:
        header = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatureStoreError(f"{where}: meta.json is not readable JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise FeatureStoreError(
            f"{where}: meta.json does not describe a curvalign feature store (format {FORMAT_NAME!r} expected)"
        )
    version = header.get("version")
    if version != FORMAT_VERSION:
        raise FeatureStoreError(
            f"{where}: meta.json has format version {version!r}; this curvalign reads version {FORMAT_VERSION}"
        )
    return header


def _expected_fields(header: dict[str, Any], where: str) -> list[str]:
    """The fields a store with meta.json ``header`` holds: the required ones, then those of
    every group it records, in that order."""
    groups = header.get("groups", [])
    arrays = header.get("arrays", {})
    if (
        not isinstance(groups, list)
        or not isinstance(arrays, dict)
        or any(g not in GROUPS for g in groups)
    ):
        raise FeatureStoreError(
            f"{where}: meta.json 'groups' must list names from {list(GROUPS)}, got {groups!r}"
        )
    return list(REQUIRED_FIELDS) + [f for g in groups for f in GROUPS[g]]


def _load_field(
    root: Path, header: dict[str, Any], name: str, mmap: bool, where: str
) -> list[str] | Tensor:
    """Field ``name`` of the store at ``root``: a list of strings from meta.json, or a tensor
    from ``name.npy`` (float fields memory-mapped copy-on-write when ``mmap``)."""
    if name in LIST_FIELDS:
        names = header.get(name)
        if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
            raise FeatureStoreError(
                f"{where}: meta.json lacks the list of strings {name!r} (group present)"
            )
        return names
    file = root / f"{name}.npy"
    if not file.is_file():
        raise FeatureStoreError(f"{where}: {file.name} is missing")
    try:
        array = np.load(
            file, mmap_mode="c" if mmap and name in FLOAT_FIELDS else None, allow_pickle=False
        )
    except (OSError, ValueError, EOFError) as exc:
        raise FeatureStoreError(
            f"{where}: {file.name} is not a readable .npy array ({exc})"
        ) from None
    recorded = header.get("arrays", {}).get(name, {})
    if list(array.shape) != recorded.get("shape", list(array.shape)):
        raise FeatureStoreError(
            f"{where}: {file.name} has shape {list(array.shape)} but meta.json records {recorded['shape']}"
        )
    return _from_numpy(array, name, f"{where}: {file.name}")


def _read_items(root: Path, where: str) -> dict[str, Any]:
    """The per-row strings of ``items.json`` (optional: stores written before it existed have
    none, and then this is empty)."""
    indexed = {
        f: IndexedStrings(*_indexed_item_files(root, f))
        for f in ITEM_FIELDS
        if _indexed_item_files(root, f)[1].is_file()
    }
    items_path = root / ITEMS_FILE
    if not items_path.is_file():
        return indexed
    try:
        items = json.loads(items_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatureStoreError(f"{where}: {ITEMS_FILE} is not readable JSON ({exc})") from None
    if not isinstance(items, dict) or set(items) - set(ITEM_FIELDS):
        raise FeatureStoreError(
            f"{where}: {ITEMS_FILE} must be an object with keys among {list(ITEM_FIELDS)}"
        )
    return {**items, **indexed}


def _indexed_item_files(root: Path, name: str) -> tuple[Path, Path]:
    """The files of an item list kept as ``IndexedStrings``: ``items.NAME.txt`` and
    ``items.NAME.offsets.npy``."""
    return root / f"items.{name}.txt", root / f"items.{name}.offsets.npy"


def _describe_on_disk(name: str) -> str:
    """Where field ``name`` of a store on disk lives, for error messages."""
    if name in TENSOR_FIELDS:
        return f"{name}.npy"
    if name in ITEM_FIELDS:
        return f"{ITEMS_FILE} {name!r}"
    return f"meta.json {name!r}"


def _save_rows(path: Path, rows: ShardedRows) -> None:
    """Write ``rows`` as one ``.npy`` file in chunks of about ``_SCAN_ELEMENTS`` values."""
    n, width = int(rows.shape[0]), int(rows.shape[1])
    out = np.lib.format.open_memmap(path, mode="w+", dtype=rows.shards[0].dtype, shape=(n, width))
    step = max(1, _SCAN_ELEMENTS // max(1, width))
    for start in range(0, n, step):
        out[start : start + step] = rows[start : start + step].numpy()
    out.flush()
    del out


def _take_items(values: Sequence[str], ids: Tensor) -> list[str]:
    """``[values[i] for i in ids]``; a lazy parquet column reads each of its shards once."""
    if isinstance(values, LazyStrings):
        return values.take(ids.numpy())
    return [values[i] for i in ids.tolist()]


def _rows(t: Tensor | None) -> int:
    return 0 if t is None else int(t.shape[0])


def _disk_dtype(t: Tensor, name: str) -> str:
    if name in INDEX_FIELDS:
        return "int64"
    return "float32" if t.dtype == torch.bfloat16 else str(t.dtype).removeprefix("torch.")


def _to_numpy(t: Tensor, index: bool) -> np.ndarray:
    t = t.detach().cpu()
    if index:
        t = t.long()
    elif t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def _from_numpy(array: np.ndarray, name: str, where: str) -> Tensor:
    if name in INDEX_FIELDS:
        if array.dtype.kind not in "iu":
            raise FeatureStoreError(f"{where} holds {array.dtype} values; integer indices expected")
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if array.dtype not in (np.float16, np.float32, np.float64):
        raise FeatureStoreError(
            f"{where} holds {array.dtype} values; float16, float32 or float64 expected"
        )
    return torch.from_numpy(array)


def _records(values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` (fields by on-disk name) with each text part's fields gathered into one
    ``TextPart``; token files without their part's pooled features are an error here (a
    ``TextPart`` cannot hold them)."""
    values = dict(values)
    parts: dict[str, dict[str, Any]] = {}
    for name in [n for n in values if n in _PART_FIELDS]:
        part, attribute = _PART_FIELDS[name]
        parts.setdefault(part, {})[attribute] = values.pop(name)
    for part, attributes in parts.items():
        features_field, token_field, mask_field, token_group = TEXT_PARTS[part]
        if attributes.get("features") is not None:
            values[part] = TextPart(**attributes)
            continue
        orphans = [
            name
            for name, attribute in ((token_field, "token_features"), (mask_field, "token_mask"))
            if attributes.get(attribute) is not None
        ]
        if orphans:
            needs = next((g for g, names in GROUPS.items() if features_field in names), None)
            raise FeatureStoreError(
                f"{where}: the {token_group} group needs "
                + (f"the {needs} group" if needs else features_field)
                + f" ({', '.join(orphans)} without {features_field}: tokens of texts it holds)"
            )
        values[part] = None
    return values


#: one rule of the format: the messages of what ``store`` breaks (fields named by ``describe``),
#: lazily, so that a rule may assume that every rule before it holds
_Rule = Callable[[FeatureStore, Callable[[str], str]], Iterator[str]]


def validate_store(
    store: FeatureStore, describe: Callable[[str], str], where: str, check_values: bool
) -> None:
    """All of the format's rules (:data:`_STRUCTURE_RULES`, then :data:`_VALUE_RULES` when
    ``check_values``), in an order that makes the first error the most basic one."""
    rules = _STRUCTURE_RULES + (_VALUE_RULES if check_values else ())
    for rule in rules:
        for message in rule(store, describe):
            raise FeatureStoreError(f"{where}: {message}")


def _required_present(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name in REQUIRED_FIELDS:
        if store.field(name) is None:
            yield f"{describe(name)} is required but missing"


def _groups_complete(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for group, names in GROUPS.items():
        present = [n for n in names if store.field(n) is not None]
        if present and len(present) != len(names):
            missing = [n for n in names if n not in present]
            yield (
                f"optional group {group!r} is only partly present: has {', '.join(present)} "
                f"but lacks {', '.join(missing)} (a group is all present or all absent)"
            )


def _group_dependencies(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    if store.taxonomy_parents is not None and store.class_names is None:
        yield "the taxonomy group needs the classes group (class_to_node maps classes to nodes)"
    if store.multilabel_to_image is not None and store.class_names is None:
        yield "the multilabels group needs the classes group (multilabel_class indexes classes)"


def _tensor_types(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name in TENSOR_FIELDS:
        value = store.field(name)
        if value is None:
            continue
        if not (is_row_source(value) if name in FLOAT_FIELDS else isinstance(value, Tensor)):
            yield f"{describe(name)} must be a torch.Tensor, got {type(value).__name__}"
        if name in FLOAT_FIELDS and not value.is_floating_point():
            yield f"{describe(name)} has dtype {value.dtype}; floating-point features expected"
        if name in INDEX_FIELDS and (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool
        ):
            yield f"{describe(name)} has dtype {value.dtype}; integer indices expected"


def _is_string_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value)


def _list_types(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name in LIST_FIELDS:
        value = store.field(name)
        if value is not None and not _is_string_list(value):
            yield f"{describe(name)} must be a list of strings"
    for name in ITEM_FIELDS:
        value = store.field(name)
        if value is not None and not isinstance(value, LazyStrings) and not _is_string_list(value):
            yield f"{describe(name)} must be a list of strings (one per row)"


def _item_lengths(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name, rows, what in (
        ("image_paths", store.num_images, "images"),
        ("image_texts", store.num_images, "images"),
        ("texts", store.num_texts, "texts"),
        ("box_phrases", _rows(store.box_to_image), "boxes"),
        ("box_corners", _rows(store.box_to_image), "boxes"),
        ("pair_a_texts", _rows(store.pair_scores), "text pairs"),
        ("pair_b_texts", _rows(store.pair_scores), "text pairs"),
    ):
        value = store.field(name)
        if value is not None and len(value) != rows:
            yield f"{describe(name)} has {len(value)} entries but the store has {rows} {what}"


def _meta_is_dict(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    if not isinstance(store.meta, dict):
        yield "meta must be a dict"


#: (field, number of dimensions, what they are), in the order they are checked; the text parts
#: are checked by ``_text_parts``
_NDIMS: tuple[tuple[str, int, str], ...] = (
    ("image_features", 2, "[images, image_dim]"),
    ("box_image_features", 2, "[boxes, image_dim]"),
    ("box_text_features", 2, "[boxes, text_dim]"),
    ("chain_features", 3, "[chains, chain_length, text_dim]"),
    *(
        (name, 1, "one entry per row")
        for name in ("pair_scores", *INDEX_FIELDS)
        if name not in _PART_FIELDS
    ),
)


def _dimensions(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name, expected, what in _NDIMS:
        value = store.field(name)
        if value is not None and value.dim() != expected:
            yield f"{describe(name)} must be {expected}-D ({what}), got shape {list(value.shape)}"


#: (field, the field whose feature dimension it shares)
_FEATURE_DIMS = (
    ("box_image_features", "image_features"),
    ("box_text_features", "text_features"),
    ("chain_features", "text_features"),
)


def _feature_dims(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name, reference in _FEATURE_DIMS:
        dim = store.image_dim if reference == "image_features" else store.text_dim
        value = store.field(name)
        if value is not None and value.shape[-1] != dim:
            yield (
                f"{describe(name)} has feature dimension {value.shape[-1]} but {reference} has {dim}"
            )


def _row_mismatch(
    store: FeatureStore, describe: Callable[[str], str], name: str, reference: str, what: str
) -> str | None:
    """The message when ``name`` and ``reference`` (both present) differ in rows, else None."""
    value, ref = store.field(name), store.field(reference)
    if value is not None and ref is not None and value.shape[0] != ref.shape[0]:
        return f"{describe(name)} has {value.shape[0]} entries but {describe(reference)} has {ref.shape[0]} rows ({what})"
    return None


#: (field, the field it has one entry per row of, why)
_SAME_ROWS = (
    ("text_to_image", "text_features", "one image index per text"),
    ("image_split", "image_features", "one split per image"),
    ("box_text_features", "box_image_features", "one noun phrase per crop"),
    ("box_to_image", "box_image_features", "one image index per box"),
    ("pair_b_features", "pair_a_features", "pairs come in two matching halves"),
    ("pair_scores", "pair_a_features", "one score per pair"),
    ("prompt_to_class", "prompt_features", "one class per prompt"),
    ("image_labels", "image_features", "one label per image"),
    ("negative_to_text", "negative_features", "one true text per negative"),
    ("negative_kind", "negative_features", "one kind per negative"),
    ("multilabel_class", "multilabel_to_image", "one class per annotation"),
)


def _row_counts(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name, reference, what in _SAME_ROWS:
        message = _row_mismatch(store, describe, name, reference, what)
        if message is not None:
            yield message


#: what the rows of each text part are, for messages
_PART_ROWS = {
    "text": "texts",
    "pair_a": "pairs",
    "pair_b": "pairs",
    "prompt": "prompts",
    "negative": "negatives",
}


def _parts_are_records(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for part in TEXT_PARTS:
        value = getattr(store, part)
        if value is not None and not isinstance(value, TextPart):
            yield f"text part {part!r} must be a TextPart, got {type(value).__name__}"


def _text_parts(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    """Each text part once: pooled features [rows, text_dim]; tokens [rows, L, Dk] of one Dk
    for every part, one sequence per row, with a 0/1 mask [rows, L] of >= 1 token per row."""
    token_dim: tuple[str, int] | None = None
    for part, (features_field, token_field, mask_field, _) in TEXT_PARTS.items():
        record = store.text_part(part)
        if record is None:
            continue
        features, tokens, mask = record.features, record.token_features, record.token_mask
        if features.dim() != 2:
            yield (
                f"{describe(features_field)} must be 2-D ([{_PART_ROWS[part]}, text_dim]), "
                f"got shape {list(features.shape)}"
            )
        if features.shape[-1] != store.text_dim:
            yield (
                f"{describe(features_field)} has feature dimension {features.shape[-1]} but "
                f"text_features has {store.text_dim}"
            )
        if tokens is None or mask is None:
            continue  # a token file without its partner: _groups_complete names it
        if tokens.dim() != 3:
            yield (
                f"{describe(token_field)} must be 3-D ([rows, tokens, token_dim]), "
                f"got shape {list(tokens.shape)}"
            )
        if mask.dim() != 2:
            yield f"{describe(mask_field)} must be 2-D ([rows, tokens]), got shape {list(mask.shape)}"
        if tokens.shape[0] != features.shape[0]:
            yield (
                f"{describe(token_field)} has {tokens.shape[0]} entries but "
                f"{describe(features_field)} has {features.shape[0]} rows "
                f"(one token sequence per {part} text)"
            )
        if token_dim is None:
            token_dim = (token_field, int(tokens.shape[-1]))
        elif tokens.shape[-1] != token_dim[1]:
            yield (
                f"{describe(token_field)} has token dimension {tokens.shape[-1]} but "
                f"{describe(token_dim[0])} has {token_dim[1]} (one encoder makes every token part)"
            )
        yield from _token_mask_rules(describe, part, tokens, mask, token_field, mask_field)


def _token_mask_rules(
    describe: Callable[[str], str],
    part: str,
    tokens: Tensor,
    mask: Tensor,
    token_field: str,
    mask_field: str,
) -> Iterator[str]:
    """What the mask ``mask_field`` [rows, tokens] of text part ``part`` breaks."""
    if mask.shape != tokens.shape[:2]:
        yield (
            f"{describe(mask_field)} has shape {list(mask.shape)} but "
            f"{describe(token_field)} has {list(tokens.shape[:2])} (rows, tokens)"
        )
    if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        yield f"{describe(mask_field)} must hold 0 (padding) or 1 (token) only"
    if mask.numel() and bool((mask.sum(dim=1) == 0).any()):
        first = int(torch.nonzero(mask.sum(dim=1) == 0)[0])
        what = "text" if part == "text" else f"{part} text"
        yield f"{describe(mask_field)}: {what} {first} has no token (an all-zero row)"


def _taxonomy_sizes(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    if store.taxonomy_parents is None:
        return
    assert (
        store.taxonomy_names is not None
        and store.class_to_node is not None
        and store.class_names is not None
    )
    if len(store.taxonomy_names) != store.taxonomy_parents.shape[0]:
        yield (
            f"{describe('taxonomy_parents')} has {store.taxonomy_parents.shape[0]} entries but "
            f"{describe('taxonomy_names')} names {len(store.taxonomy_names)} nodes"
        )
    if len(store.class_names) != store.class_to_node.shape[0]:
        yield f"{describe('class_to_node')} has {store.class_to_node.shape[0]} entries but there are {len(store.class_names)} classes"


def _out_of_range(
    store: FeatureStore,
    describe: Callable[[str], str],
    name: str,
    upper: int,
    what: str,
    allow_minus_one: bool = False,
) -> Iterator[str]:
    """The message when the index field ``name`` has an entry outside [0, upper) (or -1)."""
    value = store.field(name)
    if value is None or value.numel() == 0:
        return
    low = -1 if allow_minus_one else 0
    bad = (value < low) | (value >= upper)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        allowed = f"[{low}, {upper})" if upper > low else "nothing (there is nothing to point to)"
        yield f"{describe(name)} has {int(bad.sum())} entries outside {allowed} ({what}); first at row {first}: {int(value[first])}"


def _index_ranges(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    yield from _out_of_range(store, describe, "text_to_image", store.num_images, "image indices")
    yield from _out_of_range(store, describe, "box_to_image", store.num_images, "image indices")
    yield from _out_of_range(
        store, describe, "multilabel_to_image", store.num_images, "image indices"
    )
    if store.split_names is not None:
        yield from _out_of_range(
            store, describe, "image_split", len(store.split_names), "indices into split_names"
        )
    if store.class_names is not None:
        classes = len(store.class_names)
        yield from _out_of_range(store, describe, "prompt_to_class", classes, "class indices")
        yield from _out_of_range(store, describe, "multilabel_class", classes, "class indices")
        yield from _out_of_range(
            store, describe, "image_labels", classes, "class indices, -1 for none", True
        )
    if store.taxonomy_names is not None:
        nodes = len(store.taxonomy_names)
        yield from _out_of_range(store, describe, "class_to_node", nodes, "taxonomy node indices")
        yield from _out_of_range(
            store, describe, "taxonomy_parents", nodes, "parent node, -1 for a root", True
        )
        yield from _forest_cycle(store, describe)
    yield from _out_of_range(store, describe, "negative_to_text", store.num_texts, "text indices")
    if store.negative_kind_names is not None:
        yield from _out_of_range(
            store,
            describe,
            "negative_kind",
            len(store.negative_kind_names),
            "indices into negative_kind_names",
        )


def _forest_cycle(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    """The message when following parents from some node never reaches a root (-1): a cycle."""
    parents = store.taxonomy_parents
    assert parents is not None and store.taxonomy_names is not None
    n = parents.shape[0]
    if n == 0:
        return
    # Pointer doubling: node n is a sentinel above every root; after 2^k >= n jumps every node
    # of an acyclic forest sits on the sentinel.
    up = torch.cat(
        [torch.where(parents < 0, torch.full_like(parents, n), parents).long(), torch.tensor([n])]
    )
    for _ in range(max(1, math.ceil(math.log2(n + 1))) + 1):
        up = up[up]
    stuck = torch.nonzero(up[:n] != n).flatten()
    if stuck.numel():
        # Walk from a stuck node until a node repeats: that node lies on the cycle.
        seen: list[int] = []
        node = int(stuck[0])
        while node not in seen:
            seen.append(node)
            node = int(parents[node])
        cycle = seen[seen.index(node) :]
        names = " -> ".join(store.taxonomy_names[i] for i in cycle[:6]) + (
            " -> ..." if len(cycle) > 6 else ""
        )
        yield f"{describe('taxonomy_parents')} has a cycle ({names} -> {store.taxonomy_names[node]}); the taxonomy must be a forest"


def _finite_values(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    for name in FLOAT_FIELDS:
        value = store.field(name)
        if value is not None:
            bad_rows, first = _count_nonfinite_rows(value)
            if bad_rows:
                yield f"{describe(name)} has {bad_rows} row{'s' if bad_rows > 1 else ''} with NaN or inf values (first: row {first})"


def _pair_scores_in_unit(store: FeatureStore, describe: Callable[[str], str]) -> Iterator[str]:
    if store.pair_scores is not None and store.pair_scores.numel():
        scores = store.pair_scores
        bad = (scores < 0) | (scores > 1)
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0])
            yield f"{describe('pair_scores')} has {int(bad.sum())} scores outside [0, 1]; first at row {first}: {float(scores[first])}"


#: the rules on the structure of a store (cheap: no pass over the features), in order
_STRUCTURE_RULES: tuple[_Rule, ...] = (
    _parts_are_records,
    _required_present,
    _groups_complete,
    _group_dependencies,
    _tensor_types,
    _list_types,
    _item_lengths,
    _meta_is_dict,
    _dimensions,
    _text_parts,
    _feature_dims,
    _row_counts,
    _taxonomy_sizes,
    _index_ranges,
)
#: the rules on the values of the features (one pass over every float), after the structure
_VALUE_RULES: tuple[_Rule, ...] = (_finite_values, _pair_scores_in_unit)


def _count_nonfinite_rows(values: Tensor) -> tuple[int, int]:
    """(number of rows holding a NaN or inf, first such row), scanning in bounded chunks."""
    if values.numel() == 0:
        return 0, -1
    rows = values.shape[0]
    width = max(1, values.numel() // max(1, rows))
    step = max(1, _SCAN_ELEMENTS // width)
    count, first = 0, -1
    for start in range(0, rows, step):
        chunk = values[start : start + step]  # a copy of one chunk for sharded rows, else a view
        bad = ~torch.isfinite(chunk.reshape(chunk.shape[0], -1)).all(dim=1)
        n_bad = int(bad.sum())
        if n_bad and first < 0:
            first = start + int(torch.nonzero(bad)[0])
        count += n_bad
    return count, first
