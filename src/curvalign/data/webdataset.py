"""CLIP_benchmark's webdataset layout -> a feature store (``curvalign extract --wds ROOT``).

The layout that ``clip_benchmark`` reads for ``--dataset wds/NAME`` (and that its
``clip_benchmark_export_wds`` script writes)::

    ROOT/
      dataset_type.txt                         "classification" (default when absent) or "retrieval"
      classnames.txt                           one class name per line (classification)
      zeroshot_classification_templates.txt    one template with {c} per line (classification)
      test/ nshards.txt  0.tar 1.tar ...       ``nshards.txt`` holds N; shards are 0.tar .. N-1.tar
      train/ ...                               any other split, same shape

A shard is a tar whose members are grouped into samples by key (the member's path up to the
first dot of its file name): ``s0000001.webp`` + ``s0000001.cls`` is one sample. A sample holds
one image (``webp``, ``png``, ``jpg`` or ``jpeg``) and, for classification, ``cls`` (the class
index as decimal text) or, for retrieval, ``txt`` (its captions, one per line).

Shards are read as tar *streams* (``tarfile`` mode ``r|*``), one sample at a time: nothing is
unpacked to disk and memory holds one encoder batch. Each finished shard is one unit of the
resumable extraction (``STORE.partial/``, as in ``curvalign.data.extract``).

A sample that cannot be used (no image, an image that does not decode, no ``cls`` or a ``cls``
outside ``[0, C)`` for a classification set, no caption for a retrieval set) is a *listed
skip*: it is named with the reason in ``STORE/skipped_images.tsv`` (``split/N.tar:KEY``) and
counted in the summary and in ``meta["extract"]``; every other sample is kept. A layout error
(no ``nshards.txt``, a missing shard, an empty split, a missing class-names file for a
classification set) is one :class:`~curvalign.data.extract.ExtractError` before any encoding.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from curvalign.data.readers import ReaderError, open_image

#: image extensions read from a sample, in CLIP_benchmark's order of preference
IMAGE_EXTENSIONS = ("webp", "png", "jpg", "jpeg")
DATASET_TYPES = ("classification", "retrieval")


class WebDatasetError(ReaderError):
    """A CLIP_benchmark webdataset root that does not have the expected layout."""


@dataclass
class WdsSample:
    """One sample of a shard: the raw bytes of each member, by extension (lower case)."""

    key: str
    members: dict[str, bytes] = field(default_factory=dict)


@dataclass
class WdsDataset:
    """The layout of a webdataset root (nothing read from the shards yet)."""

    root: Path
    name: str
    dataset_type: str
    splits: dict[str, list[Path]]  # split -> shard paths 0.tar .. N-1.tar
    class_names: list[str] | None
    templates: list[str] | None

    def shards(self) -> list[tuple[str, int, Path]]:
        return [(s, n, p) for s, paths in self.splits.items() for n, p in enumerate(paths)]


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_wds_layout(root: str | os.PathLike[str], splits: list[str] | None = None) -> WdsDataset:
    """Check a webdataset root and list its shards; see the module docstring for the layout.

    ``splits`` picks split folders (default: every folder holding ``nshards.txt``, sorted).
    """
    base = Path(root)
    if not base.is_dir():
        raise WebDatasetError(f"webdataset root {base}: no such directory")
    type_file = base / "dataset_type.txt"
    kind = type_file.read_text().strip().lower() if type_file.is_file() else "classification"
    if kind not in DATASET_TYPES:
        raise WebDatasetError(
            f"{type_file}: dataset type {kind!r}; curvalign reads {' or '.join(DATASET_TYPES)}"
        )
    found = sorted(p.name for p in base.iterdir() if (p / "nshards.txt").is_file())
    wanted = list(splits) if splits else found
    if not wanted:
        raise WebDatasetError(
            f"webdataset root {base}: no split folder with an nshards.txt (expected e.g. {base}/test/nshards.txt)"
        )
    shard_lists: dict[str, list[Path]] = {}
    for split in wanted:
        nshards_file = base / split / "nshards.txt"
        if not nshards_file.is_file():
            raise WebDatasetError(
                f"webdataset root {base}: split {split!r} has no {split}/nshards.txt "
                f"(splits present: {', '.join(found) or 'none'})"
            )
        text = nshards_file.read_text().strip()
        if not text.isdigit():
            raise WebDatasetError(f"{nshards_file}: expected a number of shards, got {text!r}")
        count = int(text)
        if count == 0:
            raise WebDatasetError(f"{nshards_file}: split {split!r} is empty (0 shards)")
        paths = [base / split / f"{n}.tar" for n in range(count)]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise WebDatasetError(
                f"webdataset split {base / split}: nshards.txt says {count} shards but "
                f"{len(missing)} are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            )
        shard_lists[split] = paths
    names = templates = None
    if kind == "classification":
        names_file = base / "classnames.txt"
        templates_file = base / "zeroshot_classification_templates.txt"
        for f in (names_file, templates_file):
            if not f.is_file():
                raise WebDatasetError(
                    f"webdataset root {base} is a classification set but has no {f.name} "
                    "(zero-shot classification needs the class names and the prompt templates)"
                )
        names = _lines(names_file)
        templates = _lines(templates_file)
        if not names or not templates:
            raise WebDatasetError(
                f"webdataset root {base}: {'classnames.txt' if not names else templates_file.name} is empty"
            )
        bad = [t for t in templates if "{c}" not in t]
        if bad:
            raise WebDatasetError(
                f"{templates_file}: template {bad[0]!r} has no '{{c}}' for the class name"
            )
    return WdsDataset(base, base.name, kind, shard_lists, names, templates)


def _split_key(name: str) -> tuple[str, str]:
    """``dir/s0001.seg.webp`` -> (``dir/s0001``, ``seg.webp``): webdataset's key rule."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext.lower() if dot else "")


def iter_wds_shard(path: str | os.PathLike[str]) -> Iterator[WdsSample]:
    """Samples of one tar shard, streamed member by member (consecutive members with one key)."""
    current: WdsSample | None = None
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _split_key(member.name)
                if current is not None and (key != current.key or ext in current.members):
                    yield current
                    current = None
                if current is None:
                    current = WdsSample(key)
                handle = tar.extractfile(member)
                current.members[ext] = handle.read() if handle is not None else b""
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise WebDatasetError(f"shard {path}: not a readable tar file ({exc})") from None
    if current is not None:
        yield current


@dataclass
class ParsedSample:
    image: bytes
    label: int  # -1 for retrieval sets
    captions: list[str]


def parse_sample(sample: WdsSample, dataset: WdsDataset) -> ParsedSample:
    """The image bytes, class and captions of a sample; ``ValueError`` names what is wrong."""
    image = next((sample.members[e] for e in IMAGE_EXTENSIONS if e in sample.members), None)
    if image is None:
        raise ValueError(
            f"no image member (.{', .'.join(IMAGE_EXTENSIONS)}); members: {sorted(sample.members)}"
        )
    if dataset.dataset_type == "retrieval":
        if "txt" not in sample.members:
            raise ValueError("retrieval sample without a .txt member (its captions)")
        captions = [
            c.strip() for c in sample.members["txt"].decode("utf-8", "replace").splitlines()
        ]
        captions = [c for c in captions if c]
        if not captions:
            raise ValueError(".txt member holds no caption")
        return ParsedSample(image, -1, captions)
    if "cls" not in sample.members:
        raise ValueError("classification sample without a .cls member (its class index)")
    text = sample.members["cls"].decode("utf-8", "replace").strip()
    try:
        label = int(text)
    except ValueError:
        raise ValueError(f".cls member {text[:20]!r} is not an integer class index") from None
    assert dataset.class_names is not None
    if not 0 <= label < len(dataset.class_names):
        raise ValueError(
            f"class index {label} outside [0, {len(dataset.class_names)}) (classnames.txt has "
            f"{len(dataset.class_names)} names)"
        )
    return ParsedSample(image, label, [])


def decode_image(data: bytes) -> Any:
    """A PIL RGB image, fully decoded now (raises OSError/ValueError for a bad one)."""
    return open_image(io.BytesIO(data))


def empty_rows(dim: int) -> np.ndarray:
    return np.zeros((0, dim), dtype=np.float32)


__all__ = [
    "WebDatasetError",
    "WdsDataset",
    "WdsSample",
    "decode_image",
    "iter_wds_shard",
    "parse_sample",
    "read_wds_layout",
]
