"""Images, captions and a local encoder -> a feature store on disk (``curvalign extract``).

Work is cut into shards (``shard_size`` rows of one kind: images, captions, box crops, box
phrases, class prompts). Each finished shard is written to ``STORE.partial/`` as a ``.npy``
file and recorded in ``manifest.json`` (atomic rewrite) there, so an interrupted extraction
restarts where it stopped: finished shards are never recomputed. The manifest carries a
fingerprint of the inputs and the encoder; a partial directory from a different extraction is
refused rather than mixed in. The final assembly reads the shards through memory maps and
writes the store with ``FeatureStore.save`` (atomic), then removes the partial directory.

An image that cannot be read (missing, truncated, not an image) is skipped: it is listed with
the reason in ``STORE/skipped_images.tsv``, counted in the summary and in
``meta["extract"]``, and its captions and boxes are dropped with it; every other row is kept.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from curvalign._encoder_spec import check_encoder_paths
from curvalign.data.encoders import Encoder, load_encoder, seen_in_training
from curvalign.data.features import FeatureStore
from curvalign.data.readers import (
    Box,
    CaptionedImages,
    ClassFolder,
    ReaderError,
    Taxonomy,
    TextPairs,
    open_image,
    read_boxes,
    read_captions,
    read_class_folder,
    read_edge_list,
    read_text_pairs,
    taxonomy_with_ancestors,
)
from curvalign.errors import CurvalignError

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

    from curvalign.data.webdataset import WdsDataset

MANIFEST_VERSION = 1
SKIPPED_REPORT = "skipped_images.tsv"
_SPLIT_ORDER = ("train", "val", "test")


class ExtractError(CurvalignError, ValueError):
    """Inputs that cannot make a feature store, or a partial directory that does not match."""


@dataclass
class ExtractSummary:
    store: Path
    images: int
    texts: int
    boxes: int
    classes: int
    skipped_images: list[tuple[str, str]] = field(default_factory=list)  # (image file, reason)
    skipped_boxes: list[tuple[str, str]] = field(default_factory=list)  # ("box K of FILE", reason)
    dropped_captions: int = 0
    dropped_boxes: int = 0
    shards_computed: int = 0
    shards_reused: int = 0
    items_encoded: int = 0  # images + texts through the encoder in this run (reused shards: 0)
    encode_seconds: float = 0.0  # wall time spent reading and encoding them

    @property
    def throughput(self) -> float | None:
        """Items encoded per second in this run (None when nothing was encoded)."""
        if self.items_encoded == 0 or self.encode_seconds <= 0:
            return None
        return self.items_encoded / self.encode_seconds

    def throughput_line(self) -> str:
        rate = self.throughput
        if rate is None:
            return "throughput: nothing encoded in this run (every shard reused)"
        return (
            f"throughput: {rate:.1f} items/s ({self.items_encoded} items encoded in "
            f"{self.encode_seconds:.1f}s)"
        )

    def contents(self, kind: str, text_only: bool = False) -> tuple[str, str]:
        """What ``curvalign extract KIND`` (a kind of ``curvalign._extract_kinds``) wrote, as
        ``(contents, skipped)``: the store's rows after its path, and the inputs it skipped
        ("" when none). ``text_only``: SugarCrepe without images (anchor captions)."""
        if kind == "wds":
            return (
                f": {self.images} images, {self.texts} captions, {self.classes} classes",
                f"{len(self.skipped_images)} unusable samples" if self.skipped_images else "",
            )
        if kind == "sugarcrepe":
            anchors = "anchor captions (text only)" if text_only else "images"
            return (
                f": {self.images} {anchors}, {self.texts} captions with one hard negative each",
                f"{len(self.skipped_images)} missing or unreadable images (dropping their "
                f"{self.dropped_captions} entries)"
                if self.skipped_images
                else "",
            )
        if kind == "texts":
            return (
                f" (text only): {self.images} anchor texts, {self.texts} texts, "
                f"{self.classes} classes",
                "",
            )
        return (
            f": {self.images} images, {self.texts} captions, {self.boxes} boxes, "
            f"{self.classes} classes",
            f"{len(self.skipped_images)} unreadable images (dropping their "
            f"{self.dropped_captions} captions) and {self.dropped_boxes} boxes"
            if self.skipped_images or self.skipped_boxes
            else "",
        )


@dataclass
class _Encoded:
    """What encoding one shard gave: one [rows, dim] array, or named arrays for a parts shard."""

    arrays: np.ndarray | dict[str, np.ndarray]
    items: int  # images + texts through the encoder (for the throughput line)
    skipped: dict[str, str] = field(default_factory=dict)  # input name -> reason
    info: dict[str, Any] = field(default_factory=dict)  # JSON kept in the manifest (parts only)


@dataclass
class _Job:
    """One shard of resumable work, saved in the partial directory under ``key``."""

    key: str
    size: int  # how far the progress bar advances past it
    encode: Callable[[], _Encoded]
    label: str = ""  # progress bar description; the key when empty
    parts: bool = False  # several named arrays (``_Shards.save_parts``), not one (``save``)


def _shard_jobs(
    kind: str,
    total: int,
    shard_size: int,
    encode: Callable[[range], _Encoded],
    parts: bool = False,
) -> list[_Job]:
    """Jobs ``KIND-00000``, ``KIND-00001``, ...: rows ``0..total`` cut into consecutive shards of
    at most ``shard_size`` rows, shard ``rows`` encoded by ``encode(rows)``."""
    return [
        _Job(f"{kind}-{n:05d}", len(rows), functools.partial(encode, rows), parts=parts)
        for n, rows in enumerate(
            range(start, min(total, start + shard_size)) for start in range(0, total, shard_size)
        )
    ]


def _run_jobs(shards: _Shards, jobs: Sequence[_Job], title: str, progress: bool) -> dict[str, Any]:
    """Encode and save every job in order under one progress bar titled ``title``.

    A job whose shard an earlier, interrupted run already saved is reused, never recomputed.
    Returns the run's counts as ``ExtractSummary`` fields: shards computed and reused, items
    encoded and the wall time of encoding them (saving the shard is not counted).
    """
    computed = reused = items = 0
    seconds = 0.0
    with _progress_bar(progress) as bar:
        task = bar.add_task(title, total=sum(job.size for job in jobs))
        for job in jobs:
            bar.update(task, description=job.label or job.key)
            if shards.parts_done(job.key) if job.parts else shards.done(job.key):
                reused += 1
            else:
                start = time.perf_counter()
                out = job.encode()
                seconds += time.perf_counter() - start
                items += out.items
                if job.parts:
                    assert isinstance(out.arrays, dict)  # a parts shard's named arrays
                    shards.save_parts(job.key, out.arrays, out.info, out.skipped)
                else:
                    assert not isinstance(out.arrays, dict)  # one [rows, dim] array
                    shards.save(job.key, out.arrays, out.skipped)
                computed += 1
            bar.advance(task, job.size)
    return {
        "shards_computed": computed,
        "shards_reused": reused,
        "items_encoded": items,
        "encode_seconds": seconds,
    }


def _check_protocol(protocol: str | None) -> None:
    """A retrieval protocol name (``curvalign.data.protocols``) recorded in ``meta["protocol"]``."""
    if protocol is None:
        return
    from curvalign.data.protocols import PROTOCOLS

    if protocol not in PROTOCOLS:
        raise ExtractError(
            f"unknown retrieval protocol {protocol!r}; known: {', '.join(PROTOCOLS)}"
        )


def _load(encoder: Encoder | str, device: str, images: bool) -> Encoder:
    """The encoder (loaded from its spec on ``device``); checks that it encodes images if needed."""
    enc = load_encoder(encoder, device=device) if isinstance(encoder, str) else encoder
    if images and not enc.encodes_images:
        raise ExtractError(
            f"encoder {enc.spec!r} encodes texts only; extraction needs an image-text encoder"
        )
    if not enc.encodes_texts:
        raise ExtractError(
            f"encoder {enc.spec!r} encodes images only; pair it with a text encoder "
            f"(IMAGE_SPEC+TEXT_SPEC, e.g. {enc.spec}+minilm)"
        )
    return enc


@dataclass
class _Plan:
    """Everything to encode, as plain lists, with the links between them."""

    image_files: list[str]
    captions: list[str]
    caption_to_image: list[int]
    image_splits: list[str] | None
    boxes: list[Box]
    box_to_image: list[int]
    classes: ClassFolder | None
    image_labels: list[int] | None
    taxonomy: Taxonomy | None
    class_to_node: list[int] | None
    captions_from_prompts: bool


def _fingerprint_file(path: str | os.PathLike[str] | None) -> list[str | int] | None:
    if path is None:
        return None
    p = Path(path).resolve()
    stat = p.stat()
    return [str(p), stat.st_size, stat.st_mtime_ns]


def _plan(
    images: Path,
    captions: str | os.PathLike[str] | None,
    layout: str | None,
    boxes: str | os.PathLike[str] | None,
    classes: str | os.PathLike[str] | None,
    templates: str | os.PathLike[str] | None,
    taxonomy: str | os.PathLike[str] | None,
) -> _Plan:
    if not images.is_dir():
        raise ExtractError(f"images folder {images}: no such directory")
    if (classes is None) != (templates is None):
        raise ExtractError("zero-shot classes need both --classes FILE and --templates FILE")
    if taxonomy is not None and classes is None:
        raise ExtractError(
            "--taxonomy maps classes onto tree nodes: it needs --classes and --templates"
        )
    folder = (
        read_class_folder(images, classes, templates)
        if classes is not None and templates is not None  # both or neither (checked above)
        else None
    )
    labels: list[int] | None = None
    from_prompts = False
    if captions is not None:
        captioned: CaptionedImages = read_captions(captions, layout)
        if folder is not None:
            # An image under a class sub-folder has that class; any other image has none (-1).
            by_folder = {name: c for c, name in enumerate(folder.class_folders)}
            labels = [
                by_folder.get(f.split("/", 1)[0], -1) if "/" in f else -1
                for f in captioned.image_files
            ]
    elif folder is not None:
        # A class folder without captions: each image is captioned by its class's first prompt.
        texts = [
            folder.templates[0].replace("{c}", folder.class_names[c]) for c in folder.image_labels
        ]
        captioned = CaptionedImages(folder.image_files, texts, list(range(len(texts))))
        labels = list(folder.image_labels)
        from_prompts = True
    else:
        raise ExtractError(
            "nothing to extract: give --captions FILE, or --classes FILE --templates FILE"
        )
    if not captioned.image_files:
        raise ExtractError(f"no images listed in {captions or images}")
    index = {f: i for i, f in enumerate(captioned.image_files)}
    box_list = read_boxes(boxes) if boxes is not None else []
    box_to_image = []
    for b in box_list:
        if b.image_file not in index:
            raise ExtractError(
                f"boxes file {boxes}: image {b.image_file!r} is not among the captioned images"
            )
        box_to_image.append(index[b.image_file])
    tree: Taxonomy | None = None
    class_to_node: list[int] | None = None
    if taxonomy is not None:
        assert folder is not None
        full = read_edge_list(taxonomy)
        keys = [(f, n) for f, n in zip(folder.class_folders, folder.class_names, strict=False)]
        known = full.index()
        missing = [f for f, n in keys if f not in known and n not in known]
        if missing:
            raise ExtractError(
                f"taxonomy file {taxonomy}: {len(missing)} classes are not nodes (by folder or class name), e.g. {missing[:3]}"
            )
        tree, nodes = taxonomy_with_ancestors(full, [f if f in known else n for f, n in keys])
        class_to_node = [nodes[f] if f in known else nodes[n] for f, n in keys]
    return _Plan(
        captioned.image_files,
        captioned.captions,
        captioned.caption_to_image,
        captioned.image_splits,
        box_list,
        box_to_image,
        folder,
        labels,
        tree,
        class_to_node,
        from_prompts,
    )


class _Shards:
    """The partial directory: shard files plus an atomically rewritten manifest."""

    def __init__(self, root: Path, fingerprint: str):
        self.root = root
        self.path = root / "manifest.json"
        if self.path.is_file():
            manifest = json.loads(self.path.read_text())
            if manifest.get("fingerprint") != fingerprint:
                raise ExtractError(
                    f"{root} holds shards of a different extraction (other inputs, encoder or shard size); "
                    "delete it to start over"
                )
            self.manifest = manifest
        else:
            root.mkdir(parents=True, exist_ok=True)
            self.manifest = {
                "version": MANIFEST_VERSION,
                "fingerprint": fingerprint,
                "done": {},
                "skipped": {},
            }
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp, self.path)

    def done(self, key: str) -> bool:
        return key in self.manifest["done"] and (self.root / f"{key}.npy").is_file()

    def save(self, key: str, rows: np.ndarray, skipped: dict[str, str] | None = None) -> None:
        tmp = self.root / f"{key}.tmp.npy"
        np.save(tmp, rows, allow_pickle=False)
        os.replace(tmp, self.root / f"{key}.npy")
        self.manifest["done"][key] = int(rows.shape[0])
        if skipped:
            self.manifest["skipped"].update(skipped)
        self._write()

    def load(self, key: str) -> np.ndarray:
        return np.load(self.root / f"{key}.npy", mmap_mode="r")

    # A unit of work that yields several arrays at once (one tar shard: images and captions)
    # is recorded under "parts": done only when every array of it is on disk.

    def parts_done(self, key: str) -> bool:
        parts = self.manifest.get("parts", {}).get(key)
        return parts is not None and all(
            (self.root / f"{key}.{name}.npy").is_file() for name in parts["arrays"]
        )

    def save_parts(
        self,
        key: str,
        arrays: dict[str, np.ndarray],
        info: dict[str, Any],
        skipped: dict[str, str] | None = None,
    ) -> None:
        """Write every array of ``key``, then record it (with JSON ``info``) in one manifest write."""
        for name, rows in arrays.items():
            tmp = self.root / f"{key}.{name}.tmp.npy"
            np.save(tmp, rows, allow_pickle=False)
            os.replace(tmp, self.root / f"{key}.{name}.npy")
        self.manifest.setdefault("parts", {})[key] = {"arrays": sorted(arrays), "info": info}
        if skipped:
            self.manifest["skipped"].update(skipped)
        self._write()

    def part_info(self, key: str) -> dict[str, Any]:
        return self.manifest["parts"][key]["info"]

    def load_part(self, key: str, name: str) -> np.ndarray:
        return np.load(self.root / f"{key}.{name}.npy", mmap_mode="r")


def crop_box(image: PILImage, box: tuple[float, float, float, float]) -> PILImage:
    """The PIL ``image`` cut to pixel corners ``box`` (x0, y0, x1, y1), clipped to the image;
    ValueError for a box that leaves less than one pixel."""
    x0, y0, x1, y1 = box
    w, h = image.size
    x0, y0, x1, y1 = max(0.0, x0), max(0.0, y0), min(float(w), x1), min(float(h), y1)
    if x1 - x0 < 1 or y1 - y0 < 1:
        raise ValueError(f"box {list(box)} lies outside the {w}x{h} image")
    return image.crop((round(x0), round(y0), round(x1), round(y1)))


def extract_features(
    encoder: Encoder | str,
    images: str | os.PathLike[str],
    out: str | os.PathLike[str],
    captions: str | os.PathLike[str] | None = None,
    layout: str | None = None,
    boxes: str | os.PathLike[str] | None = None,
    classes: str | os.PathLike[str] | None = None,
    templates: str | os.PathLike[str] | None = None,
    taxonomy: str | os.PathLike[str] | None = None,
    batch_size: int = 64,
    shard_size: int = 1024,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
    pairs: str | os.PathLike[str] | None = None,
    score_max: float = 1.0,
    protocol: str | None = None,
    tokens: bool = False,
) -> ExtractSummary:
    """Encode a collection into the feature store ``out``; resumable (see the module docstring).

    ``tokens`` also stores token-level features and masks of the captions, class prompts and
    text pairs (groups ``tokens``, ``prompt_tokens``, ``pair_tokens``), for a recipe that pools
    tokens (DualPath with ``pool_tokens=true``); images and box phrases stay pooled vectors.

    ``pairs`` adds scored text pairs (``curvalign.data.readers.read_text_pairs``): DualPath
    trains on them in its first phase and on the images in its second.

    ``encoder`` is an :class:`Encoder` or a spec string for ``load_encoder``. The store holds
    image features [Ni, Di], caption features [Nt, Dt] and ``text_to_image``; plus box pairs,
    zero-shot classes (prompts = every template for every class) and a taxonomy when given.
    """
    if batch_size < 1 or shard_size < 1:
        raise ExtractError(
            f"batch size and shard size must be >= 1, got {batch_size} and {shard_size}"
        )
    _check_protocol(protocol)
    images_dir = Path(images)
    target = Path(out)
    if target.exists() and not overwrite:
        raise ExtractError(f"{target} already exists; pass --overwrite to replace it")
    if isinstance(encoder, str):
        check_encoder_paths(encoder)  # a mistyped model path fails before the folder is scanned
    try:
        plan = _plan(images_dir, captions, layout, boxes, classes, templates, taxonomy)
        text_pairs = read_text_pairs(pairs, score_max) if pairs is not None else None
    except ReaderError as exc:
        raise ExtractError(str(exc)) from None
    enc = _load(encoder, device, images=True)
    if tokens:
        _check_tokens(enc)

    prompts, prompt_to_class = plan.classes.prompts() if plan.classes is not None else ([], [])
    fingerprint = hashlib.sha256(
        json.dumps(
            {
                "encoder": enc.spec,
                "images": str(images_dir.resolve()),
                "inputs": [
                    _fingerprint_file(p)
                    for p in (captions, boxes, classes, templates, taxonomy, pairs)
                ],
                "score_max": score_max,
                "layout": layout,
                "shard_size": shard_size,
                # only when asked: partial folders of earlier versions stay resumable
                **({"tokens": True} if tokens else {}),
                "counts": [
                    len(plan.image_files),
                    len(plan.captions),
                    len(plan.boxes),
                    len(prompts),
                ],
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    shards = _Shards(target.parent / f"{target.name}.partial", fingerprint)

    def encode_texts_shard(texts: Sequence[str]) -> _Encoded:
        return _Encoded(
            _encode_batched(enc.encode_texts, texts, enc.text_width(), batch_size), len(texts)
        )

    def add(
        kind: str, total: int, encode: Callable[[range], _Encoded], parts: bool = False
    ) -> None:
        jobs.extend(_shard_jobs(kind, total, shard_size, encode, parts))

    jobs: list[_Job] = []
    image_path = lambda i: images_dir / plan.image_files[i]  # noqa: E731
    add(
        "images",
        len(plan.image_files),
        lambda rows: _encode_images(
            enc,
            rows,
            lambda i: open_image(image_path(i)),
            lambda i: plan.image_files[i],
            batch_size,
        ),
    )
    add(
        "captions",
        len(plan.captions),
        lambda rows: encode_texts_shard([plan.captions[i] for i in rows]),
    )
    add(
        "box_images",
        len(plan.boxes),
        lambda rows: _encode_images(
            enc,
            rows,
            lambda i: crop_box(open_image(image_path(plan.box_to_image[i])), plan.boxes[i].box),
            lambda i: f"box {i} of {plan.boxes[i].image_file}",
            batch_size,
        ),
    )
    add(
        "box_phrases",
        len(plan.boxes),
        lambda rows: encode_texts_shard([plan.boxes[i].phrase for i in rows]),
    )
    add("prompts", len(prompts), lambda rows: encode_texts_shard([prompts[i] for i in rows]))

    def encode_rows_of(texts: Sequence[str], rows: range) -> _Encoded:
        return encode_texts_shard([texts[i] for i in rows])

    if text_pairs is not None:
        for side, pair_texts in (("pair_a", text_pairs.a), ("pair_b", text_pairs.b)):
            add(side, len(pair_texts), functools.partial(encode_rows_of, pair_texts))

    # token-level features of every text part but the box phrases (parts: tokens + mask)
    token_sources: dict[str, Sequence[str]] = {}
    if tokens:
        token_sources = {"caption": plan.captions, "prompt": prompts}
        if text_pairs is not None:
            token_sources.update(pair_a=text_pairs.a, pair_b=text_pairs.b)

    def encode_tokens_of(texts: Sequence[str], rows: range) -> _Encoded:
        return _Encoded(_encode_tokens(enc, [texts[i] for i in rows], batch_size), len(rows))

    for kind, token_texts in token_sources.items():
        add(
            f"{kind}_tokens",
            len(token_texts),
            functools.partial(encode_tokens_of, token_texts),
            parts=True,
        )
    counts = _run_jobs(shards, jobs, "rows", progress)

    summary = _assemble(
        plan,
        prompts,
        prompt_to_class,
        shards,
        jobs,
        enc,
        target,
        overwrite,
        text_pairs,
        protocol,
        images_dir.resolve(),
        token_keys={
            kind: [job.key for job in jobs if job.key.startswith(f"{kind}_tokens-")]
            for kind in token_sources
        },
    )
    shutil.rmtree(shards.root, ignore_errors=True)
    return dataclasses.replace(summary, **counts)


def _gather(shards: _Shards, jobs: list[_Job], kind: str, dim: int, keep: np.ndarray) -> Tensor:
    """The kept rows of every ``kind`` shard, copied shard by shard into one memory-mapped file.

    Peak memory is one shard, not the collection: the result is backed by
    ``STORE.partial/assembled-KIND.npy``, which ``FeatureStore.save`` streams into the store.
    """
    keys = [job.key for job in jobs if job.key.startswith(kind + "-")]
    out = np.lib.format.open_memmap(
        shards.root / f"assembled-{kind}.npy",
        mode="w+",
        dtype=np.float32,
        shape=(int(keep.sum()), dim),
    )
    row = start = 0
    for key in keys:
        part = shards.load(key)
        mask = keep[start : start + part.shape[0]]
        n = int(mask.sum())
        out[row : row + n] = part[mask]
        row, start = row + n, start + part.shape[0]
    out.flush()
    return torch.from_numpy(out)


def _assemble(
    plan: _Plan,
    prompts: list[str],
    prompt_to_class: list[int],
    shards: _Shards,
    jobs: list[_Job],
    enc: Encoder,
    target: Path,
    overwrite: bool,
    text_pairs: TextPairs | None = None,
    protocol: str | None = None,
    images_root: Path | None = None,
    token_keys: dict[str, list[str]] | None = None,
) -> ExtractSummary:
    skipped_files = shards.manifest["skipped"]
    image_ok = np.array([f not in skipped_files for f in plan.image_files], dtype=bool)
    box_ok = np.array(
        [
            image_ok[i] and f"box {k} of {plan.boxes[k].image_file}" not in skipped_files
            for k, i in enumerate(plan.box_to_image)
        ],
        dtype=bool,
    )
    new_id = np.cumsum(image_ok) - 1  # old image index -> new one (valid where image_ok)
    caption_owner = np.asarray(plan.caption_to_image, dtype=np.int64)
    caption_ok = image_ok[caption_owner] if len(caption_owner) else np.zeros(0, dtype=bool)

    fields: dict[str, Any] = {
        "image_features": _gather(shards, jobs, "images", enc.image_dim or 0, image_ok),
        "text_features": _gather(shards, jobs, "captions", enc.text_width(), caption_ok),
        "text_to_image": torch.from_numpy(new_id[caption_owner[caption_ok]]),
    }
    # What a person recognises each kept row by (curvalign search shows it).
    fields["image_paths"] = [f for f, ok in zip(plan.image_files, image_ok, strict=True) if ok]
    fields["texts"] = [t for t, ok in zip(plan.captions, caption_ok, strict=True) if ok]
    if plan.image_splits is not None:
        present = sorted(
            set(plan.image_splits),
            key=lambda s: (_SPLIT_ORDER.index(s) if s in _SPLIT_ORDER else 99, s),
        )
        fields["split_names"] = present
        fields["image_split"] = torch.tensor(
            [present.index(s) for s in plan.image_splits], dtype=torch.long
        )[torch.from_numpy(image_ok)]
    if plan.boxes:
        owners = np.asarray(plan.box_to_image, dtype=np.int64)
        fields["box_image_features"] = _gather(
            shards, jobs, "box_images", enc.image_dim or 0, box_ok
        )
        fields["box_text_features"] = _gather(shards, jobs, "box_phrases", enc.text_width(), box_ok)
        fields["box_to_image"] = torch.from_numpy(new_id[owners[box_ok]])
        # the raw box items, so towers can train on the crops and phrases themselves
        kept_boxes = [b for b, ok in zip(plan.boxes, box_ok, strict=True) if ok]
        fields["box_phrases"] = [b.phrase for b in kept_boxes]
        fields["box_corners"] = [" ".join(f"{v:g}" for v in b.box) for b in kept_boxes]
    if plan.classes is not None:
        assert plan.image_labels is not None
        fields["class_names"] = list(plan.classes.class_names)
        fields["prompt_features"] = _gather(
            shards, jobs, "prompts", enc.text_width(), np.ones(len(prompts), dtype=bool)
        )
        fields["prompt_to_class"] = torch.tensor(prompt_to_class, dtype=torch.long)
        fields["image_labels"] = torch.tensor(plan.image_labels, dtype=torch.long)[
            torch.from_numpy(image_ok)
        ]
    if text_pairs is not None:
        every = np.ones(len(text_pairs.scores), dtype=bool)
        fields["pair_a_features"] = _gather(shards, jobs, "pair_a", enc.text_width(), every)
        fields["pair_b_features"] = _gather(shards, jobs, "pair_b", enc.text_width(), every)
        fields["pair_scores"] = torch.tensor(text_pairs.scores, dtype=torch.float32)
        fields["pair_a_texts"], fields["pair_b_texts"] = list(text_pairs.a), list(text_pairs.b)
    # token groups: captions follow their image (caption_ok); prompts and pairs are kept whole
    for kind, (group_fields, keep) in {
        "caption": (("text_token_features", "text_token_mask"), caption_ok),
        "prompt": (("prompt_token_features", "prompt_token_mask"), None),
        "pair_a": (("pair_a_token_features", "pair_a_token_mask"), None),
        "pair_b": (("pair_b_token_features", "pair_b_token_mask"), None),
    }.items():
        keys = (token_keys or {}).get(kind)
        if keys and (kind != "prompt" or plan.classes is not None):
            fields[group_fields[0]], fields[group_fields[1]] = _concat_tokens(
                shards, keys, keep, name=kind
            )
    if plan.taxonomy is not None:
        assert plan.class_to_node is not None
        fields["taxonomy_names"] = list(plan.taxonomy.names)
        fields["taxonomy_parents"] = torch.tensor(plan.taxonomy.parents, dtype=torch.long)
        fields["class_to_node"] = torch.tensor(plan.class_to_node, dtype=torch.long)

    skipped = [(f, skipped_files[f]) for f in plan.image_files if f in skipped_files]
    skipped_boxes = [(k, v) for k, v in skipped_files.items() if k.startswith("box ")]
    dropped_captions = int((~caption_ok).sum())
    dropped_boxes = int((~box_ok).sum()) if plan.boxes else 0
    meta = {
        **enc.describe(),
        "source": "curvalign extract",
        **({"images_root": str(images_root)} if images_root is not None else {}),
        # one image-text encoder embeds both sides (a frozen-features cosine baseline applies);
        # IMAGE_SPEC+TEXT_SPEC: two spaces
        "shared_space": enc.shares_space,
        "captions_from_class_prompts": plan.captions_from_prompts,
        # a class folder captioned by its prompts is a classification set, not a retrieval one
        **(
            {"tasks": ["zeroshot_classification", "hierarchical_classification"]}
            if plan.captions_from_prompts
            else {}
        ),
        "extract": {
            "skipped_images": int((~image_ok).sum()),
            "dropped_captions": dropped_captions,
            "dropped_boxes": dropped_boxes,
            "taxonomy_extra_parent_edges": plan.taxonomy.extra_parent_edges if plan.taxonomy else 0,
        },
        **({"protocol": protocol} if protocol else {}),
    }
    if "trained_on" in meta:
        meta["seen_in_training"] = seen_in_training(
            meta["trained_on"], None, fields.get("class_names")
        )
    if int(image_ok.sum()) == 0:
        raise ExtractError(
            f"every image failed to load (see {shards.root / 'manifest.json'}); nothing to store"
        )
    store = FeatureStore.from_fields(meta=meta, **fields)
    store.validate()  # names a non-finite feature (an encoder that overflowed) before anything is written
    store.save(target, overwrite=overwrite)
    _write_skips(target, skipped + skipped_boxes)
    return ExtractSummary(
        store=target,
        images=store.num_images,
        texts=store.num_texts,
        boxes=int(fields["box_to_image"].shape[0]) if plan.boxes else 0,
        classes=len(plan.classes.class_names) if plan.classes else 0,
        skipped_images=skipped,
        skipped_boxes=skipped_boxes,
        dropped_captions=dropped_captions,
        dropped_boxes=dropped_boxes,
    )


# --- shared by every layout -------------------------------------------------------------------


def _progress_bar(progress: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]extract[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        disable=not progress,
        transient=False,
    )


def _encode_batched(
    encode: Callable[[list[Any]], Tensor], items: Sequence[Any], dim: int, batch_size: int
) -> np.ndarray:
    """[len(items), dim] float32: ``encode`` called on batches of ``batch_size`` items."""
    feats = np.zeros((len(items), dim), dtype=np.float32)
    for start in range(0, len(items), batch_size):
        feats[start : start + batch_size] = encode(list(items[start : start + batch_size])).numpy()
    return feats


def _concat_parts(
    shards: _Shards, keys: list[str], name: str, dim: int, label: str | None = None
) -> Tensor:
    """Arrays ``name`` of the parts ``keys``, concatenated into one memory-mapped file
    (``assembled-LABEL.npy``, LABEL defaulting to ``name``)."""
    total = sum(int(shards.load_part(k, name).shape[0]) for k in keys)
    out = np.lib.format.open_memmap(
        shards.root / f"assembled-{label or name}.npy",
        mode="w+",
        dtype=np.float32,
        shape=(total, dim),
    )
    row = 0
    for key in keys:
        part = shards.load_part(key, name)
        out[row : row + part.shape[0]] = part
        row += part.shape[0]
    out.flush()
    return torch.from_numpy(out)


def _save_store(
    shards: _Shards,
    fields: dict[str, Any],
    meta: dict[str, Any],
    target: Path,
    overwrite: bool,
    skipped: list[tuple[str, str]] | None = None,
) -> FeatureStore:
    """Save the assembled store at ``target`` (atomic), list ``skipped`` (file, reason) beside
    it, then remove the partial directory: its shards are in the store now."""
    store = FeatureStore.from_fields(meta=meta, **fields)
    store.save(target, overwrite=overwrite)
    _write_skips(target, skipped or [])
    shutil.rmtree(shards.root, ignore_errors=True)
    return store


def _write_skips(target: Path, skipped: list[tuple[str, str]]) -> None:
    if skipped:
        lines = ["file\treason"] + [f"{f}\t{reason}" for f, reason in skipped]
        (target / SKIPPED_REPORT).write_text("\n".join(lines) + "\n")


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\t", " ").replace("\n", " ")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# --- CLIP_benchmark webdataset layout ---------------------------------------------------------


def extract_webdataset(
    encoder: Encoder | str,
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    splits: Sequence[str] | None = None,
    batch_size: int = 64,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
    protocol: str | None = None,
) -> ExtractSummary:
    """Encode a CLIP_benchmark webdataset root (``curvalign.data.webdataset``) into a store.

    One resumable unit per tar shard, streamed. The store has one split per split folder
    (``split_names``/``image_split``). Classification sets get the classes group (prompts =
    every template for every class) and each image is captioned by its class's first prompt
    (``meta.captions_from_class_prompts``); retrieval sets keep every caption of ``.txt``.
    """
    from curvalign.data.webdataset import WebDatasetError, read_wds_layout

    if batch_size < 1:
        raise ExtractError(f"batch size must be >= 1, got {batch_size}")
    target = Path(out)
    if target.exists() and not overwrite:
        raise ExtractError(f"{target} already exists; pass --overwrite to replace it")
    _check_protocol(protocol)
    try:
        layout = read_wds_layout(root, list(splits) if splits else None)
    except ReaderError as exc:
        raise ExtractError(str(exc)) from None
    enc = _load(encoder, device, images=True)
    prompts, prompt_to_class = [], []
    if layout.class_names is not None:
        assert layout.templates is not None
        prompts = [t.replace("{c}", n) for n in layout.class_names for t in layout.templates]
        prompt_to_class = [c for c in range(len(layout.class_names)) for _ in layout.templates]
    fingerprint = _digest(
        {
            "encoder": enc.spec,
            "layout": "wds",
            "root": str(layout.root.resolve()),
            "shards": [_fingerprint_file(p) for _, _, p in layout.shards()],
            "prompts": prompts,
        }
    )
    shards = _Shards(target.parent / f"{target.name}.partial", fingerprint)

    def shard_job(split: str, n: int, path: Path) -> Callable[[], _Encoded]:
        def encode() -> _Encoded:
            try:
                return _encode_wds_shard(enc, layout, split, n, path, batch_size)
            except WebDatasetError as exc:
                raise ExtractError(str(exc)) from None

        return encode

    units = layout.shards()
    jobs = [
        _Job(f"wds-{split}-{n:05d}", 1, shard_job(split, n, path), f"{split}/{n}.tar", parts=True)
        for split, n, path in units
    ]
    if prompts:
        encode_prompts = lambda: _Encoded(  # noqa: E731
            {"prompts": _encode_batched(enc.encode_texts, prompts, enc.text_width(), batch_size)},
            len(prompts),
        )
        jobs.append(_Job("prompts", 1, encode_prompts, parts=True))
    counts = _run_jobs(shards, jobs, "shards", progress)

    keys = [f"wds-{s}-{n:05d}" for s, n, _ in units]
    infos = [shards.part_info(k) for k in keys]
    split_names = list(layout.splits)
    image_split, labels, owners = _wds_rows(units, infos, split_names)
    skipped = [(f, shards.manifest["skipped"][f]) for f in sorted(shards.manifest["skipped"])]
    _check_wds_rows(layout.root, shards.root, len(units), len(skipped), split_names, image_split)
    fields: dict[str, Any] = {
        "image_features": _concat_parts(shards, keys, "images", enc.image_dim or 0),
        "split_names": split_names,
        "image_split": torch.tensor(image_split, dtype=torch.long),
    }
    if layout.class_names is not None:
        prompt_rows = torch.from_numpy(np.array(shards.load_part("prompts", "prompts")))
        first = torch.tensor(
            [c * len(layout.templates or []) for c in labels], dtype=torch.long
        )  # row of each image's class's first prompt
        fields.update(
            text_features=prompt_rows[first],
            text_to_image=torch.arange(len(labels)),
            class_names=list(layout.class_names),
            prompt_features=prompt_rows,
            prompt_to_class=torch.tensor(prompt_to_class, dtype=torch.long),
            image_labels=torch.tensor(labels, dtype=torch.long),
        )
    else:
        fields.update(
            text_features=_concat_parts(shards, keys, "captions", enc.text_width()),
            text_to_image=torch.tensor(owners, dtype=torch.long),
        )
    meta = {
        **enc.describe(),
        "source": "curvalign extract --wds",
        "dataset": layout.name,
        "dataset_type": layout.dataset_type,
        "tasks": [
            "zeroshot_classification"
            if layout.dataset_type == "classification"
            else "zeroshot_retrieval"
        ],
        "captions_from_class_prompts": layout.class_names is not None,
        "extract": {"skipped_samples": len(skipped), "shards": len(units)},
        **({"protocol": protocol} if protocol else {}),
    }
    store = _save_store(shards, fields, meta, target, overwrite, skipped)
    return ExtractSummary(
        store=target,
        images=store.num_images,
        texts=store.num_texts,
        boxes=0,
        classes=len(layout.class_names or []),
        skipped_images=skipped,
        **counts,
    )


def _encode_wds_shard(
    enc: Encoder, layout: WdsDataset, split: str, n: int, path: Path, batch_size: int
) -> _Encoded:
    """Images and captions of one webdataset tar shard; unreadable samples are skipped."""
    from curvalign.data.webdataset import decode_image, empty_rows, iter_wds_shard, parse_sample

    # Images are encoded as soon as a batch is full: memory holds one batch of decoded
    # images, not a shard (CLIP_benchmark writes up to 10,000 images per tar).
    image_parts: list[np.ndarray] = []
    pending: list[Any] = []
    labels: list[int] = []
    captions: list[str] = []
    owners: list[int] = []
    skipped: dict[str, str] = {}
    keys: list[str] = []

    def flush() -> None:
        if pending:
            image_parts.append(enc.encode_images(pending).numpy().astype(np.float32))
            pending.clear()

    for sample in iter_wds_shard(path):
        name = f"{split}/{n}.tar:{sample.key}"
        try:
            parsed = parse_sample(sample, layout)
            image = decode_image(parsed.image)
        except (OSError, ValueError, SyntaxError) as exc:  # PIL raises all three
            skipped[name] = _reason(exc)
            continue
        for caption in parsed.captions:
            captions.append(caption)
            owners.append(len(labels))
        pending.append(image)
        labels.append(parsed.label)
        keys.append(sample.key)
        if len(pending) == batch_size:
            flush()
    flush()
    image_rows = np.concatenate(image_parts) if image_parts else empty_rows(enc.image_dim or 0)
    caption_rows = _encode_batched(enc.encode_texts, captions, enc.text_width(), batch_size)
    return _Encoded(  # _run_jobs times the whole call: reading, decoding and encoding
        {"images": image_rows, "captions": caption_rows},
        len(labels) + len(captions),
        skipped,
        {
            "labels": labels,
            "caption_to_image": owners,
            "keys": keys,
            "skipped": sorted(skipped),
        },
    )


def _wds_rows(
    units: Sequence[tuple[str, int, Path]], infos: Sequence[dict[str, Any]], split_names: list[str]
) -> tuple[list[int], list[int], list[int]]:
    """Split index and class label per image and owning image per caption, over all shards."""
    image_split: list[int] = []
    labels: list[int] = []
    owners: list[int] = []
    for (split, _, _), info in zip(units, infos, strict=True):
        owners.extend(len(labels) + o for o in info["caption_to_image"])
        labels.extend(info["labels"])
        image_split.extend([split_names.index(split)] * len(info["labels"]))
    return image_split, labels, owners


def _check_wds_rows(
    root: Path,
    partial: Path,
    shard_count: int,
    skipped_count: int,
    split_names: list[str],
    image_split: list[int],
) -> None:
    """Refuse a webdataset with no usable sample, or with a split left without one."""
    if not image_split:
        raise ExtractError(
            f"webdataset {root}: no usable sample in {shard_count} shards "
            f"({skipped_count} skipped, see {partial / 'manifest.json'}); nothing to store"
        )
    empty = [s for s in split_names if s not in {split_names[i] for i in image_split}]
    if empty:
        raise ExtractError(
            f"webdataset {root}: split {empty[0]!r} has no usable sample (every sample "
            f"skipped, see {partial / 'manifest.json'})"
        )


def _encode_images(
    enc: Encoder,
    rows: Sequence[int],
    load: Callable[[int], Any],
    name: Callable[[int], str],
    batch_size: int,
) -> _Encoded:
    """[len(rows), Di] features of the images ``load(i)`` for i in ``rows``; one that cannot be
    read keeps a zero row and is listed in ``skipped`` under ``name(i)``.

    Images are decoded one batch at a time, so memory holds one batch, not a shard.
    """
    feats = np.zeros((len(rows), enc.image_dim or 0), dtype=np.float32)
    skipped: dict[str, str] = {}
    ok_rows: list[int] = []
    images: list[Any] = []

    def flush() -> None:
        if images:
            feats[ok_rows] = enc.encode_images(images).numpy()
            ok_rows.clear()
            images.clear()

    for k, i in enumerate(rows):
        try:
            images.append(load(i))
            ok_rows.append(k)
        except (OSError, ValueError, SyntaxError) as exc:  # PIL raises all three for bad files
            skipped[name(i)] = _reason(exc)
        if len(images) == batch_size:
            flush()
    flush()
    return _Encoded(feats, len(rows), skipped)


# --- SugarCrepe -------------------------------------------------------------------------------


def extract_sugarcrepe(
    encoder: Encoder | str,
    sugarcrepe: str | os.PathLike[str],
    images: str | os.PathLike[str] | None,
    out: str | os.PathLike[str],
    batch_size: int = 64,
    shard_size: int = 1024,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> ExtractSummary:
    """SugarCrepe kind files (``curvalign.data.sugarcrepe``) over COCO val2017 -> a store.

    Images: every file named by an entry, once. Texts: one positive caption per entry.
    Hard negatives: one per entry, ``negative_to_text`` its entry's caption, ``negative_kind``
    its file (kind names in ``negative_kind_names``).

    Entries whose image is not in ``images`` are dropped *before* anything is encoded (a
    listed skip: ``skipped_images.tsv``, the summary, ``meta.extract``); an images folder
    holding none of the named files fails at once, before the encoder is loaded. An image that
    is there but unreadable is dropped after encoding, with its entries.

    ``images=None`` is the text-only mode (:func:`extract_sugarcrepe_texts`).
    """
    from curvalign.data.sugarcrepe import read_sugarcrepe

    if batch_size < 1 or shard_size < 1:
        raise ExtractError(
            f"batch size and shard size must be >= 1, got {batch_size}, {shard_size}"
        )
    if images is None:
        return extract_sugarcrepe_texts(
            encoder, sugarcrepe, out, batch_size, shard_size, device, overwrite, progress
        )
    images_dir = Path(images)
    if not images_dir.is_dir():
        raise ExtractError(f"images folder {images_dir}: no such directory (COCO val2017 images)")
    if next(os.scandir(images_dir), None) is None:
        raise ExtractError(
            f"images folder {images_dir} is empty; give the COCO val2017 folder, or leave "
            "--images out for the text-only mode"
        )
    target = Path(out)
    if target.exists() and not overwrite:
        raise ExtractError(f"{target} already exists; pass --overwrite to replace it")
    try:
        every, kinds = read_sugarcrepe(sugarcrepe)
    except ReaderError as exc:
        raise ExtractError(str(exc)) from None
    named = list(dict.fromkeys(e.image_file for e in every))
    missing = {f for f in named if not (images_dir / f).is_file()}
    entries = [e for e in every if e.image_file not in missing]
    if not entries:
        raise ExtractError(
            f"none of the {len(named)} images named by {sugarcrepe} is in {images_dir} "
            f"(e.g. {named[0]}); is --images the COCO val2017 folder? Without images, leave "
            "--images out for the text-only mode"
        )
    enc = _load(encoder, device, images=True)
    files = list(dict.fromkeys(e.image_file for e in entries))
    fingerprint = _digest(
        {
            "encoder": enc.spec,
            "layout": "sugarcrepe",
            "images": str(images_dir.resolve()),
            "entries": _digest(
                [(e.kind, e.entry_id, e.image_file, e.caption, e.negative) for e in entries]
            ),
            "shard_size": shard_size,
        }
    )
    shards = _Shards(target.parent / f"{target.name}.partial", fingerprint)

    def encode_texts(texts: Sequence[str]) -> _Encoded:
        return _Encoded(
            _encode_batched(enc.encode_texts, texts, enc.text_width(), batch_size), len(texts)
        )

    jobs = [
        *_shard_jobs(
            "images",
            len(files),
            shard_size,
            lambda rows: _encode_images(
                enc,
                rows,
                lambda i: open_image(images_dir / files[i]),
                lambda i: files[i],
                batch_size,
            ),
        ),
        *_shard_jobs(
            "captions",
            len(entries),
            shard_size,
            lambda rows: encode_texts([entries[i].caption for i in rows]),
        ),
        *_shard_jobs(
            "negatives",
            len(entries),
            shard_size,
            lambda rows: encode_texts([entries[i].negative for i in rows]),
        ),
    ]
    counts = _run_jobs(shards, jobs, "rows", progress)

    bad = shards.manifest["skipped"]
    image_ok = np.array([f not in bad for f in files], dtype=bool)
    if not image_ok.any():
        raise ExtractError(
            f"none of the {len(files)} images of {sugarcrepe} found in {images_dir} could be "
            f"read (see {shards.root / 'manifest.json'})"
        )
    new_id = np.cumsum(image_ok) - 1
    index = {f: i for i, f in enumerate(files)}
    owner = np.array([index[e.image_file] for e in entries], dtype=np.int64)
    entry_ok = image_ok[owner]
    kept = int(entry_ok.sum())
    fields: dict[str, Any] = {
        "image_features": _gather(shards, jobs, "images", enc.image_dim or 0, image_ok),
        "text_features": _gather(shards, jobs, "captions", enc.text_dim or 0, entry_ok),
        "text_to_image": torch.from_numpy(new_id[owner[entry_ok]]),
        "negative_features": _gather(shards, jobs, "negatives", enc.text_dim or 0, entry_ok),
        "negative_to_text": torch.arange(kept),
        "negative_kind": torch.tensor(
            [kinds.index(e.kind) for e, ok in zip(entries, entry_ok, strict=True) if ok],
            dtype=torch.long,
        ),
        "negative_kind_names": kinds,
        "image_paths": [f for f, ok in zip(files, image_ok, strict=True) if ok],
        "texts": [e.caption for e, ok in zip(entries, entry_ok, strict=True) if ok],
    }
    dropped = {k: 0 for k in kinds}
    for e in every:
        dropped[e.kind] += int(e.image_file in missing)
    for e, ok in zip(entries, entry_ok, strict=True):
        dropped[e.kind] += int(not ok)
    skipped = [(f, "not in the images folder") for f in named if f in missing]
    skipped += [(f, bad[f]) for f in files if f in bad]
    dropped_entries = len(every) - kept
    meta = {
        **enc.describe(),
        "source": "curvalign extract --sugarcrepe",
        "dataset": "sugar_crepe",
        "images_root": str(images_dir.resolve()),
        "tasks": ["image_caption_selection"],
        "extract": {
            "entries": len(every),
            "images_named": len(named),
            "images_missing": len(missing),
            "skipped_images": len(skipped),
            "dropped_entries": dropped_entries,
            "dropped_entries_per_kind": dropped,
        },
    }
    if "trained_on" in meta:
        meta["seen_in_training"] = seen_in_training(meta["trained_on"], "coco")
    store = _save_store(shards, fields, meta, target, overwrite, skipped)
    return ExtractSummary(
        store=target,
        images=store.num_images,
        texts=store.num_texts,
        boxes=0,
        classes=0,
        skipped_images=skipped,
        dropped_captions=dropped_entries,
        **counts,
    )


def extract_sugarcrepe_texts(
    encoder: Encoder | str,
    sugarcrepe: str | os.PathLike[str],
    out: str | os.PathLike[str],
    batch_size: int = 64,
    shard_size: int = 1024,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> ExtractSummary:
    """SugarCrepe without COCO images: caption vs negative with a text-side score.

    Each entry's "image" row is another caption of the same photo taken from SugarCrepe's own
    files (the first distinct caption of that file in file order that differs from the entry's
    caption): the recipe then scores anchor caption -> caption against anchor caption ->
    negative with its own text-to-text score, and ``eval`` reports ``compositional/<kind>`` as
    for images. An entry whose photo has no second caption in the files is dropped (counted per
    kind in ``meta.extract``). Any text encoder works (``minilm``). ``meta.text_only`` is true.
    """
    from curvalign.data.sugarcrepe import read_sugarcrepe

    target = Path(out)
    if target.exists() and not overwrite:
        raise ExtractError(f"{target} already exists; pass --overwrite to replace it")
    try:
        every, kinds = read_sugarcrepe(sugarcrepe)
    except ReaderError as exc:
        raise ExtractError(str(exc)) from None
    captions_of: dict[str, list[str]] = {}
    for e in every:
        seen = captions_of.setdefault(e.image_file, [])
        if e.caption not in seen:
            seen.append(e.caption)
    anchor_of = [
        next((c for c in captions_of[e.image_file] if c != e.caption), None) for e in every
    ]
    entries = [e for e, a in zip(every, anchor_of, strict=True) if a is not None]
    chosen = [a for a in anchor_of if a is not None]
    if not entries:
        raise ExtractError(
            f"{sugarcrepe}: no photo has two different captions, so no entry has a text anchor"
        )
    anchors = list(dict.fromkeys(chosen))
    anchor_id = {a: i for i, a in enumerate(anchors)}
    enc = _load(encoder, device, images=False)
    sources = {
        "anchors": anchors,
        "captions": [e.caption for e in entries],
        "negatives": [e.negative for e in entries],
    }
    fingerprint = _digest(
        {
            "encoder": enc.spec,
            "layout": "sugarcrepe-text",
            "sources": {k: _digest(v) for k, v in sources.items()},
            "shard_size": shard_size,
        }
    )
    shards = _Shards(target.parent / f"{target.name}.partial", fingerprint)
    dim = enc.text_dim or 0
    jobs: list[_Job] = []

    def encode_rows_of(texts: Sequence[str], rows: range) -> _Encoded:
        return _Encoded(
            _encode_batched(enc.encode_texts, [texts[i] for i in rows], dim, batch_size),
            len(rows),
        )

    for kind, texts in sources.items():
        jobs += _shard_jobs(kind, len(texts), shard_size, functools.partial(encode_rows_of, texts))
    counts = _run_jobs(shards, jobs, "texts", progress)
    every_row = {k: np.ones(len(v), dtype=bool) for k, v in sources.items()}
    fields: dict[str, Any] = {
        "image_features": _gather(shards, jobs, "anchors", dim, every_row["anchors"]),
        "text_features": _gather(shards, jobs, "captions", dim, every_row["captions"]),
        "text_to_image": torch.tensor([anchor_id[a] for a in chosen], dtype=torch.long),
        "negative_features": _gather(shards, jobs, "negatives", dim, every_row["negatives"]),
        "negative_to_text": torch.arange(len(entries)),
        "negative_kind": torch.tensor([kinds.index(e.kind) for e in entries], dtype=torch.long),
        "negative_kind_names": kinds,
        "image_texts": anchors,
        "texts": sources["captions"],
    }
    dropped = {k: 0 for k in kinds}
    for e, a in zip(every, anchor_of, strict=True):
        dropped[e.kind] += int(a is None)
    meta = {
        **enc.describe(),
        "image_dim": dim,
        "source": "curvalign extract --sugarcrepe (text only)",
        "dataset": "sugar_crepe",
        "tasks": ["image_caption_selection"],
        "text_only": True,
        "image_side": "another caption of the entry's photo from SugarCrepe's files: the "
        "caption and its negative are scored against it with the recipe's text-side score",
        "extract": {
            "entries": len(every),
            "dropped_entries": len(every) - len(entries),
            "dropped_entries_per_kind": dropped,
        },
    }
    if "trained_on" in meta:
        meta["seen_in_training"] = seen_in_training(meta["trained_on"], "coco")
    store = _save_store(shards, fields, meta, target, overwrite)
    return ExtractSummary(
        store=target,
        images=store.num_images,
        texts=store.num_texts,
        boxes=0,
        classes=0,
        dropped_captions=len(every) - len(entries),
        **counts,
    )


# --- text-only extraction and token-level features --------------------------------------------


def _check_tokens(enc: Encoder) -> None:
    if type(enc).encode_text_tokens is Encoder.encode_text_tokens:
        raise ExtractError(
            f"encoder {enc.spec!r} gives no token-level features (--tokens); the hf-clip and "
            "sentence-transformers adapters do"
        )


def _encode_text_parts(
    enc: Encoder, texts: Sequence[str], batch_size: int, tokens: bool
) -> dict[str, np.ndarray]:
    """{"features": [n, Dt]} and, with ``tokens``, {"tokens": [n, L, Dk], "mask": [n, L]}
    (L = the longest text of this part; padding rows are zero, mask 0)."""
    out = {"features": _encode_batched(enc.encode_texts, texts, enc.text_width(), batch_size)}
    if tokens:
        out.update(_encode_tokens(enc, texts, batch_size))
    return out


def _encode_tokens(enc: Encoder, texts: Sequence[str], batch_size: int) -> dict[str, np.ndarray]:
    """{"tokens": [n, L, Dk], "mask": [n, L]} (L = the longest text here; padding zero, mask 0)."""
    out: dict[str, np.ndarray] = {}
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for start in range(0, len(texts), batch_size):
        hidden, mask = enc.encode_text_tokens(list(texts[start : start + batch_size]))
        parts.append((hidden.float().numpy(), mask.numpy().astype(np.int64)))
    length = max((h.shape[1] for h, _ in parts), default=1)
    dim = parts[0][0].shape[2] if parts else 1
    out["tokens"] = np.zeros((len(texts), length, dim), dtype=np.float32)
    out["mask"] = np.zeros((len(texts), length), dtype=np.int64)
    row = 0
    for hidden_rows, mask_rows in parts:
        n, width = mask_rows.shape
        out["tokens"][row : row + n, :width] = hidden_rows
        out["mask"][row : row + n, :width] = mask_rows
        row += n
    return out


def _concat_tokens(
    shards: _Shards, keys: list[str], keep: np.ndarray | None = None, name: str = "texts"
) -> tuple[Tensor, Tensor]:
    """Token parts of ``keys`` (rows where ``keep``), right-padded to the longest, memory-mapped
    (``assembled-{name}-tokens.npy`` in the shard folder; ``FeatureStore.save`` copies it)."""
    parts = [(shards.load_part(k, "tokens"), shards.load_part(k, "mask")) for k in keys]
    length = max(int(t.shape[1]) for t, _ in parts)
    dim = int(parts[0][0].shape[2])
    total = sum(t.shape[0] for t, _ in parts) if keep is None else int(keep.sum())
    feats = np.lib.format.open_memmap(
        shards.root / f"assembled-{name}-tokens.npy",
        mode="w+",
        dtype=np.float32,
        shape=(total, length, dim),
    )
    mask = np.zeros((total, length), dtype=np.int64)
    row = start = 0
    for tokens, part_mask in parts:
        rows = (
            np.ones(tokens.shape[0], dtype=bool)
            if keep is None
            else keep[start : start + tokens.shape[0]]
        )
        n, width = int(rows.sum()), tokens.shape[1]
        feats[row : row + n, :width] = tokens[rows]
        mask[row : row + n, :width] = part_mask[rows]
        row, start = row + n, start + tokens.shape[0]
    feats.flush()
    return torch.from_numpy(feats), torch.from_numpy(mask)


def extract_texts(
    encoder: Encoder | str,
    out: str | os.PathLike[str],
    captions: str | os.PathLike[str] | None = None,
    layout: str | None = None,
    pairs: str | os.PathLike[str] | None = None,
    score_max: float = 1.0,
    classes: str | os.PathLike[str] | None = None,
    templates: str | os.PathLike[str] | None = None,
    tokens: bool = False,
    batch_size: int = 64,
    shard_size: int = 1024,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> ExtractSummary:
    """A store from texts alone (no image files); the store's *image* side holds texts too.

    The two views, as in ``--data wordnet`` (docs/real-data.md):

    * ``captions`` (COCO or Karpathy JSON): each image's first caption is its "image" row, its
      other captions are the texts (caption -> paraphrase retrieval); Karpathy splits kept.
    * ``classes`` + ``templates``: each class name is an "image" row labelled with its class,
      prompts are every template for every class, texts the first prompt of each class.
    * ``pairs`` (scored text pairs, DualPath): the pair group; alone, ``a`` is the "image" row
      and ``b`` its text.

    ``tokens`` also stores token-level features and masks of every text part it writes (groups
    ``tokens`` for the texts, ``prompt_tokens``, ``pair_tokens``; a recipe that pools tokens,
    DualPath with ``pool_tokens=true``, embeds all of them). The image side stays pooled.
    ``meta.text_only`` is true and ``meta.image_side`` says what the image rows are.
    """
    target = Path(out)
    _check_text_only_args(
        batch_size, shard_size, captions, classes, templates, pairs, target, overwrite
    )
    text_rows, text_pairs = _read_text_only_rows(
        captions, layout, pairs, score_max, classes, templates
    )
    enc = _load(encoder, device, images=False)
    if tokens:
        _check_tokens(enc)
    names, prompt_templates = text_rows.names, text_rows.prompt_templates
    prompts = [t.replace("{c}", n) for n in names or [] for t in prompt_templates]
    pairs_alone = text_pairs is not None and captions is None and classes is None
    sources: dict[str, list[str]] = {
        "anchors": text_rows.anchors,
        "texts": text_rows.texts,
        "prompts": prompts,
    }
    if text_pairs is not None and not pairs_alone:
        sources.update(pair_a=text_pairs.a, pair_b=text_pairs.b)
    # every text part the store holds gets tokens; the anchors only when they are pair text a
    token_kinds = (
        {"texts", "prompts", "pair_a", "pair_b"} | ({"anchors"} if pairs_alone else set())
        if tokens
        else set()
    )
    fingerprint = _digest(
        {
            "encoder": enc.spec,
            "layout": "texts",
            "sources": {k: _digest(v) for k, v in sources.items()},
            "tokens": sorted(token_kinds),
            "shard_size": shard_size,
        }
    )
    shards = _Shards(target.parent / f"{target.name}.partial", fingerprint)

    def encode_part(kind: str, rows: range) -> _Encoded:
        part = [sources[kind][i] for i in rows]
        return _Encoded(_encode_text_parts(enc, part, batch_size, kind in token_kinds), len(rows))

    keys: dict[str, list[str]] = {}
    jobs: list[_Job] = []
    for kind, source in sources.items():
        kind_jobs = _shard_jobs(
            kind, len(source), shard_size, functools.partial(encode_part, kind), parts=True
        )
        keys[kind] = [job.key for job in kind_jobs]
        jobs.extend(kind_jobs)
    counts = _run_jobs(shards, jobs, "texts", progress)

    dim = enc.text_width()
    fields: dict[str, Any] = {
        "image_features": _concat_parts(shards, keys["anchors"], "features", dim, "anchors"),
        "text_features": _concat_parts(shards, keys["texts"], "features", dim, "texts"),
        "text_to_image": torch.tensor(text_rows.owners, dtype=torch.long),
        # the strings themselves: search results show the matched text, not "(row N)"
        "texts": list(text_rows.texts),
        "image_texts": list(text_rows.anchors),
    }
    if text_rows.splits is not None:
        fields.update(_split_fields(text_rows.splits))
    if names is not None:
        fields.update(
            class_names=list(names),
            prompt_features=_concat_parts(shards, keys["prompts"], "features", dim, "prompts"),
            prompt_to_class=torch.tensor(
                [c for c in range(len(names)) for _ in prompt_templates], dtype=torch.long
            ),
            image_labels=torch.arange(len(names)),
        )
    if text_pairs is not None:
        if pairs_alone:
            a, b = fields["image_features"], fields["text_features"]
        else:
            a = _concat_parts(shards, keys["pair_a"], "features", dim, "pair_a")
            b = _concat_parts(shards, keys["pair_b"], "features", dim, "pair_b")
        fields.update(
            pair_a_features=a, pair_b_features=b, pair_scores=torch.tensor(text_pairs.scores)
        )
    if tokens:
        _add_text_only_tokens(
            fields,
            shards,
            keys,
            prompts=names is not None,
            pairs=text_pairs is not None,
            pairs_alone=pairs_alone,
        )
    meta = {
        **enc.describe(),
        "image_dim": dim,
        "source": "curvalign extract (text only)",
        "text_only": True,
        "image_side": text_rows.side,
        "extract": {"images_without_text": text_rows.dropped},
    }
    store = _save_store(shards, fields, meta, target, overwrite)
    return ExtractSummary(
        store=target,
        images=store.num_images,
        texts=store.num_texts,
        boxes=0,
        classes=len(names or []),
        dropped_captions=0,
        **counts,
    )


@dataclass
class _TextOnlyRows:
    """What a text-only store's rows are: ``anchors`` are the "image" rows, ``texts`` the text
    rows owned by ``owners`` (anchor index per text); ``splits`` per anchor when the source has
    them; ``names``/``prompt_templates`` for zero-shot classes; ``side`` describes the anchors."""

    anchors: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    splits: list[str] | None = None
    names: list[str] | None = None
    prompt_templates: list[str] = field(default_factory=list)
    side: str = ""
    dropped: int = 0


def _check_text_only_args(
    batch_size: int,
    shard_size: int,
    captions: str | os.PathLike[str] | None,
    classes: str | os.PathLike[str] | None,
    templates: str | os.PathLike[str] | None,
    pairs: str | os.PathLike[str] | None,
    target: Path,
    overwrite: bool,
) -> None:
    """The argument checks of ``extract_texts``, before any file is read."""
    if batch_size < 1 or shard_size < 1:
        raise ExtractError(
            f"batch size and shard size must be >= 1, got {batch_size}, {shard_size}"
        )
    if captions is not None and classes is not None:
        raise ExtractError("text-only extraction takes --captions or --classes, not both")
    if (classes is None) != (templates is None):
        raise ExtractError("zero-shot classes need both --classes FILE and --templates FILE")
    if captions is None and classes is None and pairs is None:
        raise ExtractError(
            "nothing to extract: give --captions FILE, --classes FILE --templates FILE, or --pairs FILE"
        )
    if target.exists() and not overwrite:
        raise ExtractError(f"{target} already exists; pass --overwrite to replace it")


def _read_text_only_rows(
    captions: str | os.PathLike[str] | None,
    layout: str | None,
    pairs: str | os.PathLike[str] | None,
    score_max: float,
    classes: str | os.PathLike[str] | None,
    templates: str | os.PathLike[str] | None,
) -> tuple[_TextOnlyRows, TextPairs | None]:
    """The rows of a text-only store from captions, classes + templates or scored pairs (first
    given wins in that order), and the scored pairs when given; reader errors -> ExtractError."""
    try:
        text_pairs = read_text_pairs(pairs, score_max) if pairs is not None else None
        if captions is not None:
            rows = _caption_anchor_rows(captions, layout)
        elif classes is not None:
            assert templates is not None
            rows = _class_name_rows(classes, templates)
        elif text_pairs is not None:
            rows = _text_pair_rows(text_pairs)
        else:
            rows = _TextOnlyRows()
    except ReaderError as exc:
        raise ExtractError(str(exc)) from None
    if not rows.anchors or not rows.texts:
        raise ExtractError(
            f"{captions}: no image has two captions; text-only captions need paraphrases"
            if captions is not None
            else "no texts to extract"
        )
    return rows, text_pairs


def _caption_anchor_rows(captions: str | os.PathLike[str], layout: str | None) -> _TextOnlyRows:
    """Each image's first caption is an anchor, its other captions are the texts."""
    captioned = read_captions(captions, layout)
    rows = _TextOnlyRows(side="the first caption of each image; its other captions are the texts")
    first: dict[int, int] = {}
    for text, image in zip(captioned.captions, captioned.caption_to_image, strict=True):
        if image not in first:
            first[image] = len(rows.anchors)
            rows.anchors.append(text)
        else:
            rows.texts.append(text)
            rows.owners.append(first[image])
    rows.dropped = len(captioned.image_files) - len(first)
    if captioned.image_splits is not None:
        by_anchor = sorted(first, key=first.__getitem__)
        rows.splits = [captioned.image_splits[i] for i in by_anchor]
    return rows


def _class_name_rows(
    classes: str | os.PathLike[str], templates: str | os.PathLike[str]
) -> _TextOnlyRows:
    """Class names are the anchors; each class's first prompt is its text."""
    from curvalign.data.readers import read_string_list

    names = read_string_list(classes, "classnames file", None)
    prompt_templates = read_string_list(templates, "templates file", None)
    bad = [t for t in prompt_templates if "{c}" not in t]
    if bad:
        raise ExtractError(f"templates file {templates}: {bad[0]!r} has no '{{c}}'")
    return _TextOnlyRows(
        anchors=list(names),
        texts=[prompt_templates[0].replace("{c}", n) for n in names],
        owners=list(range(len(names))),
        names=names,
        prompt_templates=prompt_templates,
        side="the class names; texts are each class's first prompt",
    )


def _text_pair_rows(text_pairs: TextPairs) -> _TextOnlyRows:
    """Text a of each scored pair is an anchor, text b its text."""
    return _TextOnlyRows(
        anchors=list(text_pairs.a),
        texts=list(text_pairs.b),
        owners=list(range(len(text_pairs.b))),
        side="text a of each scored pair; texts are text b",
    )


def _split_fields(splits: list[str]) -> dict[str, Any]:
    """``split_names`` (train, val, test first) and ``image_split`` from one split name per row."""
    present = sorted(
        set(splits), key=lambda s: (_SPLIT_ORDER.index(s) if s in _SPLIT_ORDER else 99, s)
    )
    return {
        "split_names": present,
        "image_split": torch.tensor([present.index(s) for s in splits], dtype=torch.long),
    }


def _add_text_only_tokens(
    fields: dict[str, Any],
    shards: _Shards,
    keys: dict[str, list[str]],
    prompts: bool,
    pairs: bool,
    pairs_alone: bool,
) -> None:
    """Token features and masks of every text part of a text-only store into ``fields``."""
    fields["text_token_features"], fields["text_token_mask"] = _concat_tokens(
        shards, keys["texts"], name="texts"
    )
    if prompts:
        fields["prompt_token_features"], fields["prompt_token_mask"] = _concat_tokens(
            shards, keys["prompts"], name="prompts"
        )
    if pairs:
        a_key, b_key = ("anchors", "texts") if pairs_alone else ("pair_a", "pair_b")
        fields["pair_a_token_features"], fields["pair_a_token_mask"] = _concat_tokens(
            shards, keys[a_key], name="pair_a"
        )
        if b_key == "texts":
            b_tokens = (fields["text_token_features"], fields["text_token_mask"])
        else:
            b_tokens = _concat_tokens(shards, keys[b_key], name="pair_b")
        fields["pair_b_token_features"], fields["pair_b_token_mask"] = b_tokens
