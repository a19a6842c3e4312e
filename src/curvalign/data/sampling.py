"""The training batch sampler: which images, captions, boxes and text pairs each step sees.

Per step the sampler draws ``batch_size`` distinct images of the "train" split and, for each, one
random caption (and one random box when the recipe requires "boxes"), plus ``pair_batch_size``
scored text pairs when it requires "text_pairs".

Epochs. Images are visited in a fresh random permutation per epoch, so each train image is
drawn exactly once per epoch, with one caption drawn at that visit ("one random caption per
image per epoch"). Batches do not drop the ragged tail: a batch that crosses an epoch boundary
takes the last images of one epoch and the first of the next, and the next permutation is
arranged so that none of those first images repeats one already in that batch (an image twice
in one batch would be its own negative). Text pairs are visited the same way, independently.

Values. Every drawn row is checked for NaN/inf (cheap: O(batch)); a bad one stops training with
the field and row named. (Stores loaded from disk are validated in full when loaded.)

Text tokens. For a recipe that reads token-level text features (``text_tokens=True``), the
captions and the text pairs of a batch are token features with their masks (``Batch.text_mask``,
``pair_a_mask``, ``pair_b_mask``), cut to the batch's longest sequence; the same rows are drawn
as with pooled features, so the draws do not depend on it. Images and boxes stay pooled vectors.

Boxes. When the recipe requires boxes, only images with at least one box are trained on (the
box terms need a crop of every image in the batch); how many were left out is reported in
``summary``. Images without any caption cannot form a pair and are left out likewise.

Shuffles. ``shuffle="rows"`` draws each epoch's images in a uniform random permutation.
``shuffle="chunks"`` cuts the train images (in row order) into runs of ``chunk_rows``
consecutive rows (default 64), puts the runs in a seeded random order and shuffles the rows
within each window of ``window_chunks`` consecutive runs of that order (default 64 runs, 4,096
rows): still every image once per epoch, but a batch of 256 holds rows of about 64 runs (about 4
neighbouring rows of each) and 16 consecutive batches share one window's 4,096 rows. Why:
memory-mapped shards (``ShardedRows``) are advised as randomly read (``madvise(MADV_RANDOM)``)
so that a gathered row costs the page it lies on, not a read-ahead window around it; a 4 KiB
page holds 4 rows of 512-d float16, so on data larger than the page cache uniformly random rows
read about 4 times the bytes they hold (each page is read again for each of its rows), where
runs read each page once an epoch (about 1.06 times, a run's first and last page shared with its
neighbours). The cost to the shuffle: rows that lie next to each other in the files (an
embedding dump's order, often a crawl's: same site, same language) meet in one batch and one
window more often than by chance; in-batch negatives are then slightly more alike.
``shuffle="auto"`` (the default) takes "chunks" where a batch's rows come from memory-mapped
shards (``clip-retrieval:DIR``) and "rows" otherwise: stores in memory draw the batches they
always did.

State. ``state_dict`` holds the generator state, the current permutations and positions, so a
resumed run draws exactly the batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from curvalign.data.batch import Batch
from curvalign.data.features import TEXT_PARTS, FeatureStore
from curvalign.data.sharded import ShardedRows, advise_rows
from curvalign.errors import CurvalignError

#: the store fields a batch gathers rows from
_ROW_FIELDS = (
    "image_features",
    "text_features",
    "box_image_features",
    "box_text_features",
    "pair_a_features",
    "pair_b_features",
)


class SamplingError(CurvalignError, ValueError):
    """The store cannot feed the requested batches (missing part, too few items, bad values)."""


#: the shuffles ``BatchSampler`` offers (``shuffle=``); "auto" picks one from the store
SHUFFLES = ("auto", "rows", "chunks")
#: "chunks": rows of the train images taken together, in file order (64 rows of 512-d float16
#: are 64 KiB: 16 pages, so a run costs about 17/16 of its bytes from a cold cache)
CHUNK_ROWS = 64
#: "chunks": runs shuffled together, each window of this many runs in a random order of its rows
WINDOW_CHUNKS = 64


class _EpochStream:
    """Indices ``0..n-1`` in a new random order per epoch, served in chunks of ``size`` that never
    repeat an index within one chunk."""

    #: what ``state_dict`` records as the order's kind (a resumed run keeps the one it had)
    shuffle = "rows"

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n = n
        self.generator = generator
        self.epoch = 0
        self.position = 0
        self.order = self._permutation()

    def _permutation(self) -> Tensor:
        """One epoch's order of ``0..n-1`` (a uniform permutation)."""
        return torch.randperm(self.n, generator=self.generator)

    def take(self, size: int) -> Tensor:
        chunk = self.order[self.position : self.position + size]
        self.position += len(chunk)
        if len(chunk) < size:
            order = self._permutation()
            seen = torch.isin(order, chunk)
            self.order = torch.cat([order[~seen], order[seen]])  # the chunk's indices go last
            self.epoch += 1
            rest = size - len(chunk)
            chunk = torch.cat([chunk, self.order[:rest]])
            self.position = rest
        return chunk

    def options(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle}

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "epoch": self.epoch,
            "position": self.position,
            "order": self.order.clone(),
            **self.options(),
        }

    def load_state_dict(self, state: dict[str, Any], what: str) -> None:
        if int(state["n"]) != self.n:
            raise SamplingError(
                f"sampler state is for {state['n']} {what}, this data has {self.n}: "
                "resume with the data the run was trained on"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.order = state["order"].clone()


class _ChunkedEpochStream(_EpochStream):
    """``_EpochStream`` whose epoch order keeps neighbouring indices near each other: ``0..n-1``
    cut into runs of ``chunk_rows`` consecutive indices, the runs in a random order, and each
    window of ``window_chunks`` consecutive runs of that order in a random order of its indices.
    Every index is still drawn once per epoch; a batch of ``B`` drawn inside a window holds
    about ``B / window_chunks`` indices of each of up to ``window_chunks`` runs."""

    shuffle = "chunks"

    def __init__(
        self, n: int, generator: torch.Generator, chunk_rows: int, window_chunks: int
    ) -> None:
        if chunk_rows < 1 or window_chunks < 1:
            raise SamplingError(
                f"chunk_rows and window_chunks must be positive, got {chunk_rows}, {window_chunks}"
            )
        self.chunk_rows, self.window_chunks = int(chunk_rows), int(window_chunks)
        super().__init__(n, generator)

    def _permutation(self) -> Tensor:
        runs = -(-self.n // self.chunk_rows)
        starts = torch.randperm(runs, generator=self.generator) * self.chunk_rows
        order = (starts[:, None] + torch.arange(self.chunk_rows)).reshape(-1)
        order = order[order < self.n]  # the last run may be short
        # windows of whole runs, wherever the short run fell in the order
        lengths = (self.n - starts).clamp(max=self.chunk_rows)
        padded = torch.nn.functional.pad(lengths, (0, -runs % self.window_chunks))
        sizes = padded.reshape(-1, self.window_chunks).sum(dim=1).tolist()
        parts = [
            part[torch.randperm(len(part), generator=self.generator)]
            for part in torch.split(order, sizes)
        ]
        return torch.cat(parts)

    def options(self) -> dict[str, Any]:
        return {
            "shuffle": self.shuffle,
            "chunk_rows": self.chunk_rows,
            "window_chunks": self.window_chunks,
        }


def _stream(n: int, generator: torch.Generator, options: dict[str, Any]) -> _EpochStream:
    """The epoch stream ``options`` (``_EpochStream.options()``) describe."""
    if options.get("shuffle", "rows") == "chunks":
        return _ChunkedEpochStream(
            n, generator, int(options["chunk_rows"]), int(options["window_chunks"])
        )
    return _EpochStream(n, generator)


def _memory_mapped(value: Any) -> bool:
    """True for rows read from memory-mapped shards (``ShardedRows``)."""
    return isinstance(value, ShardedRows)


def _shuffle_options(
    store: FeatureStore, shuffle: str, chunk_rows: int, window_chunks: int
) -> dict[str, Any]:
    """The stream options of ``shuffle`` on ``store``: "auto" is "chunks" where a batch's rows
    come from memory-mapped shards (the disk), "rows" otherwise."""
    if shuffle not in SHUFFLES:
        raise SamplingError(f"shuffle {shuffle!r}; expected one of {list(SHUFFLES)}")
    if shuffle == "auto":
        mapped = any(_memory_mapped(getattr(store, name, None)) for name in _ROW_FIELDS)
        shuffle = "chunks" if mapped else "rows"
    if shuffle == "rows":
        return {"shuffle": "rows"}
    if chunk_rows < 1 or window_chunks < 1:
        raise SamplingError(
            f"chunk_rows and window_chunks must be positive, got {chunk_rows}, {window_chunks}"
        )
    return {"shuffle": "chunks", "chunk_rows": int(chunk_rows), "window_chunks": int(window_chunks)}


def _grouped(owner: Tensor, n_owners: int) -> tuple[Tensor, Tensor, Tensor]:
    """Items grouped by owner: (items sorted by owner, start offset per owner, count per owner)."""
    owner = owner.long()
    # already grouped (one caption per image in order, as clip-retrieval's pairs are): no sort,
    # which at 10M items was most of the time before the first step
    if owner.numel() < 2 or bool((owner[1:] >= owner[:-1]).all()):
        order = torch.arange(owner.numel())
    else:
        order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=n_owners)
    starts = torch.cumsum(counts, 0) - counts
    return order, starts, counts


def _check_rows(name: str, rows: Tensor, index: Tensor) -> None:
    """SamplingError naming the store field and row if ``rows`` (= ``field[index]``) holds NaN/inf."""
    bad = ~torch.isfinite(rows)
    if bad.any():
        row = int(index[torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1))[0]])
        raise SamplingError(
            f"feature store field {name!r} has non-finite values (row {row}); "
            "clean the features before training"
        )


class BatchSampler:
    """Draws training batches from a FeatureStore (see the module docstring).

    ``requires`` is the recipe's ``requires`` (subset of {"boxes", "text_pairs"});
    ``text_tokens`` is the recipe's ``text_tokens`` (texts as token features + masks); ``recipe``
    and ``data`` only name things in error messages.
    """

    def __init__(
        self,
        store: FeatureStore,
        batch_size: int,
        *,
        seed: int = 0,
        requires: Iterable[str] = (),
        pair_batch_size: int = 64,
        split: str = "train",
        recipe: str = "this recipe",
        data: str = "this data",
        text_tokens: bool = False,
        shuffle: str = "auto",
        chunk_rows: int = CHUNK_ROWS,
        window_chunks: int = WINDOW_CHUNKS,
    ) -> None:
        self.store = store
        self.text_tokens = bool(text_tokens)
        self.batch_size = int(batch_size)
        self.requires = frozenset(requires)
        self.pair_batch_size = int(pair_batch_size)
        unknown = self.requires - {"boxes", "text_pairs"}
        if unknown:
            raise SamplingError(f"recipe {recipe} requires unknown store part(s) {sorted(unknown)}")
        if "boxes" in self.requires and not store.has_boxes:
            raise SamplingError(
                f"recipe {recipe} trains on box-level pairs; data {data!r} has none "
                "(a feature store with box_image_features, box_text_features, box_to_image)"
            )
        if "text_pairs" in self.requires and not store.has_text_pairs:
            raise SamplingError(
                f"recipe {recipe} trains on scored text pairs; data {data!r} has none "
                "(a feature store with pair_a_features, pair_b_features, pair_scores)"
            )
        if self.text_tokens:
            parts = ["text"] + (["pair_a"] if "text_pairs" in self.requires else [])
            for part in parts:
                if not store.has_text_tokens(part):
                    raise SamplingError(
                        f"recipe {recipe} reads token-level text features; the {part} texts of "
                        f"data {data!r} have none (extract them with `curvalign extract "
                        "--tokens`, or configure the recipe for pooled features)"
                    )
        if split == "train" and (store.split_names is None or store.image_split is None):
            split_ids = torch.arange(store.num_images)
        elif store.split_names is not None and split not in store.split_names:
            raise SamplingError(
                f"data {data!r} has no {split!r} split (it has {store.split_names})"
            )
        else:
            split_ids = store.split_image_ids(split)

        self._caption_order, self._caption_start, caption_count = _grouped(
            store.text_to_image, store.num_images
        )
        self._caption_count = caption_count
        usable = caption_count[split_ids] > 0
        self.skipped_without_caption = int((~usable).sum())
        self.skipped_without_box = 0
        if "boxes" in self.requires:
            box_to_image = store.box_to_image
            assert box_to_image is not None  # has_boxes was checked above
            self._box_order, self._box_start, box_count = _grouped(box_to_image, store.num_images)
            self._box_count = box_count
            has_box = box_count[split_ids] > 0
            self.skipped_without_box = int((usable & ~has_box).sum())
            usable &= has_box
        self.image_ids = split_ids[usable]
        n = len(self.image_ids)
        if n < self.batch_size:
            raise SamplingError(
                f"batch_size {self.batch_size} is larger than the {n} usable {split} images "
                f"of data {data!r}; set batch_size to at most {n}"
            )
        n_pairs = 0
        if "text_pairs" in self.requires:
            n_pairs = len(store.field("pair_a_features"))
            if n_pairs < self.pair_batch_size:
                raise SamplingError(
                    f"pair_batch_size {self.pair_batch_size} is larger than the {n_pairs} "
                    f"text pairs of data {data!r}; set pair_batch_size to at most {n_pairs}"
                )

        # Scattered rows from memory-mapped shards: read only their pages, not the kernel's
        # read-ahead window around each (the rows drawn do not depend on it).
        for name in _ROW_FIELDS:
            advise_rows(getattr(store, name, None), "random")

        #: the shuffle asked for ("auto" lets a resumed state keep its own; load_state_dict)
        self.requested_shuffle = shuffle
        #: the stream options (``_EpochStream.options``) of this sampler's shuffle
        self.options = _shuffle_options(store, shuffle, chunk_rows, window_chunks)
        self.generator = torch.Generator().manual_seed(int(seed))
        self._images = _stream(n, self.generator, self.options)
        self._pairs = (
            _stream(n_pairs, self.generator, self.options)
            if "text_pairs" in self.requires
            else None
        )

    @property
    def epoch(self) -> int:
        """Completed passes over the train images."""
        return self._images.epoch

    def summary(self) -> dict[str, Any]:
        """What the sampler trains on, for meta.json and the user's notes."""
        out: dict[str, Any] = {
            "train_images": len(self.image_ids),
            "skipped_without_caption": self.skipped_without_caption,
            "skipped_without_box": self.skipped_without_box,
        }
        if self._pairs is not None:
            out["text_pairs"] = self._pairs.n
        if self.shuffle != "rows":
            out["shuffle"] = dict(self.options)
        return out

    def _pick(self, owners: Tensor, order: Tensor, start: Tensor, count: Tensor) -> Tensor:
        """One uniformly random item (caption or box) of each owner image."""
        u = torch.rand(len(owners), generator=self.generator, dtype=torch.float64)
        offset = torch.minimum((u * count[owners]).long(), count[owners] - 1)
        return order[start[owners] + offset]

    def next_indices(self) -> dict[str, Tensor]:
        """Row indices of the next batch: ``image``, ``text`` (and ``box``, ``pair`` when required)."""
        images = self.image_ids[self._images.take(self.batch_size)]
        out = {
            "image": images,
            "text": self._pick(
                images, self._caption_order, self._caption_start, self._caption_count
            ),
        }
        if "boxes" in self.requires:
            out["box"] = self._pick(images, self._box_order, self._box_start, self._box_count)
        if self._pairs is not None:
            out["pair"] = self._pairs.take(self.pair_batch_size)
        return out

    def next_batch(self) -> Batch:
        """The next step's Batch (features, float32)."""
        idx = self.next_indices()
        s = self.store

        def rows(name: str, index: Tensor) -> Tensor:
            out = torch.as_tensor(s.field(name)[index]).float()
            _check_rows(name, out, index)  # O(batch): a bad row is caught when it is first drawn
            return out

        def text_rows(part: str, index: Tensor) -> tuple[Tensor, Tensor | None]:
            out, mask = s.text_rows(part, index, tokens=self.text_tokens)
            _check_rows(TEXT_PARTS[part][1 if self.text_tokens else 0], out, index)
            return out, mask

        text, text_mask = text_rows("text", idx["text"])
        batch = Batch(image=rows("image_features", idx["image"]), text=text, text_mask=text_mask)
        if "box" in idx:
            batch.box_image = rows("box_image_features", idx["box"])
            batch.box_text = rows("box_text_features", idx["box"])
        if "pair" in idx:
            batch.pair_a, batch.pair_a_mask = text_rows("pair_a", idx["pair"])
            batch.pair_b, batch.pair_b_mask = text_rows("pair_b", idx["pair"])
            batch.pair_score = rows("pair_scores", idx["pair"])
        return batch

    def state_dict(self) -> dict[str, Any]:
        state = {"generator": self.generator.get_state(), "images": self._images.state_dict()}
        if self._pairs is not None:
            state["pairs"] = self._pairs.state_dict()
        return state

    @property
    def shuffle(self) -> str:
        """The shuffle the batches are drawn with: "rows" or "chunks" (module docstring)."""
        return self._images.shuffle

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (``state_dict``) left off: the same batches an uninterrupted
        run draws next, with the shuffle the state was saved with (a state without one was
        saved by the row shuffle, the only one there was). A shuffle asked for by name ("rows",
        "chunks") that is not the state's is a SamplingError; "auto" takes the state's."""
        saved = {
            k: v
            for k, v in state["images"].items()
            if k in ("shuffle", "chunk_rows", "window_chunks")
        }
        saved.setdefault("shuffle", "rows")
        if self.requested_shuffle not in ("auto", saved["shuffle"]):
            # an explicit shuffle that the state was not drawn with: continuing would draw other
            # batches than the saved run, switching would ignore the request
            raise SamplingError(
                f"the sampler state was saved with shuffle {saved['shuffle']!r}, not the "
                f"{self.requested_shuffle!r} asked for; resume with shuffle="
                f"{saved['shuffle']} or 'auto' (the state's own)"
            )
        if saved != self._images.options():
            self.options = saved
            self._images = _stream(self._images.n, self.generator, saved)
            if self._pairs is not None:
                self._pairs = _stream(self._pairs.n, self.generator, saved)
        self._images.load_state_dict(state["images"], "train images")
        if self._pairs is not None:
            if "pairs" not in state:
                raise SamplingError(
                    "sampler state has no text-pair stream; it was saved for another recipe"
                )
            self._pairs.load_state_dict(state["pairs"], "text pairs")
        self.generator.set_state(state["generator"])
