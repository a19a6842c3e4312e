"""Raw training rows into the towers: a DataLoader whose workers decode, crop, augment and
tokenise each step's rows.

Per step (in one process, or on each rank)::

    source.next_rows(step) -> StepRows   training process: which rows (this rank's share of the
                                         global batch): the store sampler's index stream
                                         (``StoreRows``), or the next samples of streamed
                                         webdataset shards (``curvalign.towers.stream``)
    prepare_rows(StepRows) -> dict       DataLoader worker: decode the images, cut the box crops
                                         from their corners, augment, preprocess, tokenise
    RawBatchLoader.next_batch(step)      training process: the towers encode the prepared rows
                                         into a ``Batch`` (with gradients)

Determinism. The random resized crop and flip of a row are drawn from a generator seeded by
(train seed, step, kind, the row's position in the *global* batch), never from a worker's or the
process's random state: the batches are the same with 0 or N workers, with 1 or N processes,
and after a resume. The DataLoader runs ahead of training (``prefetch_factor`` steps per
worker), so the source is further on than the step trained; ``state_dict`` is the source's state
right after the last step handed to training, which is what a checkpoint records (the
sampler's state, or the stream's position) and a resume starts from.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from curvalign.data.batch import Batch
from curvalign.data.features import FeatureStore, present
from curvalign.data.sampling import BatchSampler
from curvalign.towers.base import InputPreparer, TowerError, Towers
from curvalign.towers.data import StoreItems

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage


@dataclass(frozen=True)
class Augment:
    """A random resized crop (area fraction in ``scale``, aspect ratio in ``ratio``, as
    torchvision's ``RandomResizedCrop``) resized to a square, then a horizontal flip with
    probability ``flip``. The square goes through the tower's own evaluation transform (resize
    and centre crop: the whole square, normalise), so the tower sees what ``RandomResizedCrop``
    at its input size would give. MERU, AtMG and HyCoCLIP: scale 0.5 to 1.0, no flip."""

    scale: tuple[float, float] = (0.5, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.0

    def __call__(self, image: PILImage, generator: torch.Generator) -> PILImage:
        from PIL import Image

        width, height = image.size
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        box = None
        for _ in range(10):  # torchvision's rejection sampling, with this row's generator
            u = torch.rand(4, generator=generator, dtype=torch.float64).tolist()
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[0])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[1])
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                x = min(int(u[2] * (width - w + 1)), width - w)
                y = min(int(u[3] * (height - h + 1)), height - h)
                box = (x, y, x + w, y + h)
                break
        if box is None:  # torchvision's fallback: the centre crop of the clamped aspect ratio
            aspect = min(max(width / height, self.ratio[0]), self.ratio[1])
            w, h = (
                (width, round(width / aspect))
                if width / height < aspect
                else (
                    round(height * aspect),
                    height,
                )
            )
            w, h = min(w, width), min(h, height)
            x, y = (width - w) // 2, (height - h) // 2
            box = (x, y, x + w, y + h)
        side = max(1, round(math.sqrt((box[2] - box[0]) * (box[3] - box[1]))))
        out = image.crop(box).resize((side, side), Image.Resampling.BICUBIC)
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < self.flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return out


def row_generator(seed: int, step: int, kind: str, position: int) -> torch.Generator:
    """The generator of one row's augmentation: a function of (seed, step, kind, position in the
    global batch) only, so no worker schedule, process count or resume changes it."""
    digest = hashlib.blake2b(f"{seed}:{step}:{kind}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass
class StepRows:
    """This rank's raw rows of one step (picklable: it is sent to a DataLoader worker).

    images       image items: file paths, encoded image bytes (webdataset), or the texts that
                 stand for images when ``images_are_texts`` (a text-only encoder)
    texts        one caption per image
    box_images, box_corners, box_phrases   the image item each box is cut from, its corners
                 (x0, y0, x1, y1) in pixels, its phrase (None: the recipe trains on no boxes)
    pair_a, pair_b, pair_scores            scored text pairs (None: no pairs)
    offset       global batch position of this rank's first image (and box): the rows'
                 augmentation is drawn from their global positions
    """

    step: int
    images: list[Any]
    texts: list[str]
    offset: int = 0
    images_are_texts: bool = False
    box_images: list[Any] | None = None
    box_corners: list[tuple[float, float, float, float]] | None = None
    box_phrases: list[str] | None = None
    pair_a: list[str] | None = None
    pair_b: list[str] | None = None
    pair_scores: Tensor | None = None


def decode_item(item: PILImage | str | os.PathLike[str] | bytes | bytearray) -> PILImage:
    """A PIL RGB image from a path, a PIL image or encoded bytes (a webdataset member)."""
    import io

    from curvalign.data.readers import open_image

    if isinstance(item, bytes | bytearray):
        return open_image(io.BytesIO(item))
    from curvalign.data.encoders import load_image

    return load_image(item)


class _RowError(Exception):
    """A row that cannot be decoded or cropped (reported by the training process)."""


class RowPreparer:
    """What a worker runs on a ``StepRows`` (``torch.utils.data.Dataset`` protocol: the DataLoader
    asks for ``self[rows]``): the prepared inputs of the step, as a dict."""

    def __init__(
        self,
        inputs: InputPreparer,
        augment: Augment | None,
        seed: int,
        text_tokens: bool = False,
    ) -> None:
        self.inputs = inputs
        self.augment = augment
        self.seed = int(seed)
        #: the recipe pools text tokens: captions and pair texts stay strings here and the
        #: training process encodes them with ``Towers.encode_text_tokens`` (states + masks)
        self.text_tokens = bool(text_tokens)

    def _texts(self, texts: Sequence[str]) -> Any:
        """Texts the recipe reads as text (captions, pair texts): tokenised, or kept as
        strings for ``encode_text_tokens`` when the recipe pools tokens."""
        return [str(t) for t in texts] if self.text_tokens else self.inputs.texts(texts)

    def _images(
        self,
        items: Sequence[Any],
        step: int,
        kind: str,
        offset: int,
        crops: Sequence[tuple[float, float, float, float]] | None = None,
    ) -> Any:
        """Decode ``items`` (cut ``crops`` from them), augment each by its global position
        ``offset + k``, then the tower's input transform."""
        from curvalign.data.extract import crop_box

        images = []
        for k, item in enumerate(items):
            try:
                image = decode_item(item)
                if crops is not None:
                    image = crop_box(image, crops[k])
            except (OSError, ValueError) as err:
                what = "a webdataset image" if isinstance(item, bytes | bytearray) else repr(item)
                raise _RowError(f"{kind} {what} cannot be used ({err})") from None
            if self.augment is not None:
                image = self.augment(image, row_generator(self.seed, step, kind, offset + k))
            images.append(image)
        return self.inputs.images(images)

    def __getitem__(self, rows: StepRows) -> dict[str, Any]:
        try:
            return self._prepare(rows)
        except _RowError as err:  # one line in the training process, not a worker traceback
            return {"step": rows.step, "error": str(err)}

    def _prepare(self, rows: StepRows) -> dict[str, Any]:
        out: dict[str, Any] = {"step": rows.step}
        if rows.images_are_texts:
            out["image"] = self.inputs.texts(rows.images)
        else:
            out["image"] = self._images(rows.images, rows.step, "image", rows.offset)
        out["text"] = self._texts(rows.texts)
        if rows.box_images is not None:
            out["box_image"] = self._images(
                rows.box_images, rows.step, "box", rows.offset, rows.box_corners
            )
            out["box_text"] = self.inputs.texts(rows.box_phrases or [])
        if rows.pair_a is not None:
            out["pair_a"] = self._texts(rows.pair_a)
            out["pair_b"] = self._texts(rows.pair_b or [])
            out["pair_score"] = rows.pair_scores
        out["images_are_texts"] = rows.images_are_texts
        out["text_tokens"] = self.text_tokens
        return out


def parse_corners(text: str) -> tuple[float, float, float, float]:
    """``"x0 y0 x1 y1"`` (a store's ``box_corners`` entry) -> the four numbers."""
    x0, y0, x1, y1 = (float(v) for v in text.split())
    return (x0, y0, x1, y1)


class StoreRows:
    """The rows of a feature store's manifest, in the order of the store sampler's index stream
    (``BatchSampler.next_indices``, the same draws as a feature-store run); this rank's share."""

    def __init__(
        self, sampler: BatchSampler, rank: int = 0, world_size: int = 1, data: str = "the data"
    ) -> None:
        store: FeatureStore = sampler.store
        self.sampler = sampler
        self.rank, self.world_size = int(rank), int(world_size)
        self.items = StoreItems(store, data)
        self.images_are_texts = store.image_paths is None
        self._box_owner: list[int] | None = None
        self._box_corners: list[tuple[float, float, float, float]] | None = None
        self._box_phrases: list[str] | None = None
        if "boxes" in sampler.requires:
            if store.box_phrases is None or store.box_corners is None or self.images_are_texts:
                raise TowerError(
                    f"{data}: the recipe trains on box crops; training towers needs the image "
                    "files and each box's corners and phrase (manifest 'box_corners', "
                    "'box_phrases': extract the store again with this version)"
                )
            owners = present(store.box_to_image, "box_to_image")
            self._box_owner = [int(i) for i in owners.tolist()]
            self._box_corners = [parse_corners(c) for c in store.box_corners]
            self._box_phrases = list(store.box_phrases)
        self._pairs: tuple[list[str], list[str], Tensor] | None = None
        if "text_pairs" in sampler.requires:
            if store.pair_a_texts is None or store.pair_b_texts is None:
                raise TowerError(
                    f"{data}: the recipe trains on scored text pairs; training towers needs "
                    "their texts (manifest 'pair_a_texts', 'pair_b_texts': extract the store "
                    "again with this version)"
                )
            self._pairs = (
                list(store.pair_a_texts),
                list(store.pair_b_texts),
                present(store.pair_scores, "pair_scores"),
            )

    def _local(self, ids: Tensor) -> tuple[Tensor, int]:
        size = len(ids) // self.world_size
        return ids[self.rank * size : (self.rank + 1) * size], self.rank * size

    def next_rows(self, step: int) -> StepRows:
        indices = self.sampler.next_indices()
        images, offset = self._local(indices["image"])
        texts, _ = self._local(indices["text"])
        rows = StepRows(
            step,
            images=self.items.images(images),
            texts=self.items.texts(texts),
            offset=offset,
            images_are_texts=self.images_are_texts,
        )
        if self._box_owner is not None and "box" in indices:
            boxes, _ = self._local(indices["box"])
            ids = [int(i) for i in boxes]
            assert self._box_corners is not None and self._box_phrases is not None
            rows.box_images = self.items.images([self._box_owner[i] for i in ids])
            rows.box_corners = [self._box_corners[i] for i in ids]
            rows.box_phrases = [self._box_phrases[i] for i in ids]
        if self._pairs is not None and "pair" in indices:
            pairs, _ = self._local(indices["pair"])
            a, b, scores = self._pairs
            rows.pair_a = [a[int(i)] for i in pairs]
            rows.pair_b = [b[int(i)] for i in pairs]
            rows.pair_scores = torch.as_tensor(scores[pairs]).float()
        return rows

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class _Steps:
    """The DataLoader's sampler: the loader's stream of ``StepRows``."""

    def __init__(self, loader: RawBatchLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[StepRows]:
        return self.loader._draw()


class RawBatchLoader:
    """Batches of raw rows encoded by ``towers`` (see the module docstring).

    source     ``StoreRows`` or ``WebDatasetRows``: ``next_rows(step)``, ``state_dict``,
               ``load_state_dict``
    workers    DataLoader worker processes (0: prepare in this process)
    augment    an ``Augment``, or None (rows as the evaluation transform sees them)
    seed       the run's seed (the augmentation generators are derived from it)
    text_tokens  the recipe reads text tokens (``Recipe.text_tokens``): captions and pair
               texts are encoded as the text tower's token states + masks
    """

    def __init__(
        self,
        towers: Towers,
        source: Any,
        *,
        workers: int = 0,
        augment: Augment | None = None,
        seed: int = 0,
        text_tokens: bool = False,
    ) -> None:
        self.towers = towers
        self.source = source
        self.workers = int(workers)
        self.seed = int(seed)
        self.preparer = RowPreparer(towers.input_preparer(), augment, seed, text_tokens)
        self._iterator: Iterator[dict[str, Any]] | None = None
        self.reset(0)

    def reset(self, step: int) -> None:
        """Drop the rows drawn ahead (and the workers); the next batch is ``step``'s, drawn from
        the source's current state."""
        self._stop()
        self._start = self._next = int(step)
        self._consumed = self.source.state_dict()
        self._after: dict[int, Any] = {}

    def close(self) -> None:
        """Stop the worker processes and rewind the source to right after the last step handed
        out (the rows drawn ahead are dropped): a later ``next_batch`` continues there."""
        if self._iterator is None:
            return
        self._stop()
        self.source.load_state_dict(self._consumed)
        self._start = self._next
        self._after = {}

    def _stop(self) -> None:
        iterator, self._iterator = self._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _draw(self) -> Iterator[StepRows]:
        step = self._start
        while True:
            rows = self.source.next_rows(step)
            self._after[step] = self.source.state_dict()
            yield rows
            step += 1

    def _start_iterator(self) -> Iterator[dict[str, Any]]:
        loader: torch.utils.data.DataLoader[dict[str, Any]] = torch.utils.data.DataLoader(
            self.preparer,  # type: ignore[arg-type]  # a map-style dataset keyed by StepRows
            batch_size=None,
            sampler=_Steps(self),
            num_workers=self.workers,
            # its own generator: creating the iterator must not draw from torch's global one
            generator=torch.Generator().manual_seed(self.seed),
            prefetch_factor=2 if self.workers else None,
        )
        return iter(loader)

    def next_prepared(self, step: int) -> dict[str, Any]:
        """The prepared rows of ``step`` (the step after the last one handed out)."""
        if self._iterator is None:
            self._iterator = self._start_iterator()
        prepared = next(self._iterator)
        if "error" in prepared:
            raise TowerError(prepared["error"])
        got = int(prepared["step"])
        if got != step:
            raise TowerError(f"the raw-row loader handed out step {got} for step {step}")
        self._consumed = self._after.pop(got)
        self._next = got + 1
        return prepared

    def next_batch(self, step: int) -> Batch:
        """The Batch of ``step``: this rank's rows encoded by the towers, with gradients."""
        return encode_prepared(self.towers, self.next_prepared(step))

    def state_dict(self) -> Any:
        """The source's state after the last step handed out (what a checkpoint records)."""
        return self._consumed


def encode_prepared(towers: Towers, prepared: dict[str, Any]) -> Batch:
    """Prepared rows -> Batch: image [B, Di], text [B, Dt] (+ box_image [B, Di], box_text
    [B, Dt]; pair_a, pair_b [P, Dt], pair_score [P]), carrying gradients to the towers. Rows
    prepared for a recipe that pools text tokens (``prepared["text_tokens"]``): text [B, L, Dk]
    with text_mask [B, L], pair_a / pair_b [P, L, Dk] with their masks
    (``Towers.encode_text_tokens``); images stay pooled vectors."""
    encode_image = (
        towers.encode_prepared_texts
        if prepared.get("images_are_texts")
        else towers.encode_prepared_images
    )
    image = encode_image(prepared["image"])
    if prepared.get("text_tokens"):
        text, text_mask = towers.encode_text_tokens(prepared["text"])
        batch = Batch(image=image, text=text, text_mask=text_mask)
    else:
        batch = Batch(image=image, text=towers.encode_prepared_texts(prepared["text"]))
    if "box_image" in prepared:
        batch.box_image = towers.encode_prepared_images(prepared["box_image"])
        batch.box_text = towers.encode_prepared_texts(prepared["box_text"])
    if "pair_a" in prepared:
        if prepared.get("text_tokens"):
            batch.pair_a, batch.pair_a_mask = towers.encode_text_tokens(prepared["pair_a"])
            batch.pair_b, batch.pair_b_mask = towers.encode_text_tokens(prepared["pair_b"])
        else:
            batch.pair_a = towers.encode_prepared_texts(prepared["pair_a"])
            batch.pair_b = towers.encode_prepared_texts(prepared["pair_b"])
        batch.pair_score = prepared["pair_score"].to(batch.text.device)
    return batch


__all__ = [
    "Augment",
    "RawBatchLoader",
    "RowPreparer",
    "StepRows",
    "StoreRows",
    "decode_item",
    "encode_prepared",
    "parse_corners",
    "row_generator",
]
