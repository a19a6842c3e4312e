"""clip-retrieval's embedding layout (and any sharded embeddings) as a feature store, in place.

The layout that ``clip-retrieval inference`` writes (and img2dataset + clip-retrieval dumps of
LAION and the like)::

    DIR/
      img_emb/img_emb_0.npy  img_emb_1.npy  ...        float16 or float32 [n_k, Di], L2-normalised
      text_emb/text_emb_0.npy text_emb_1.npy ...        [n_k, Dt], row r of shard k pairs with
                                                        row r of img_emb_k
      metadata/metadata_0.parquet ...                   optional: n_k rows; "caption", and
                                                        "image_path" or "url"

Shards are matched by the number in their names (``_0``, ``_1``, ..., ``_10``: numeric order)
and must agree in row count. ``--data clip-retrieval:DIR`` (``read_clip_retrieval``) memory-maps
every shard read-only where it lies (``ShardedRows``: no copy, no concatenation; a training
batch gathers its rows from the maps), keeps float16 as float16, pairs row i with row i (one
caption per image, ``text_to_image = arange(N)``), and reads the metadata lazily
(``ParquetColumn``: ``texts`` from "caption", ``image_paths`` from "image_path" or else "url",
which is what ``curvalign search`` shows for a hit). pyarrow is needed only when there is
metadata (``pip install 'curvalign[parquet]'``).

The split is drawn here, seeded: ``val`` and ``test`` images (default ``min(10000, N // 20)``
each, so that validation and evaluation cost does not grow with N), the rest "train". The spec
records the seed and the counts (``clip-retrieval:DIR,val=5000,test=5000,seed=1``), so the run's
recorded data spec reproduces the split; ``meta["split"]`` holds the same.

Opening reads the ``.npy`` headers, the parquet footers and a strided sample of rows (the norm
note below): O(number of shards), not O(N).
The NaN/inf scan is not run on open (the sampler checks every row it draws; ``check=True`` or
``curvalign --check`` scans every shard once); ``FeatureStore.save`` imports the data into a
native store (chunk by chunk) and records the scan there.

What opening finds that is not an error goes to ``meta["notes"]`` (one line each; training shows
them as notes and keeps them in the run): metadata without a "caption" column (search then shows
item ids), and image or text rows that are not unit-norm (checked on a strided sample of at most
``NORM_SAMPLE`` rows per side, not on every row).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvalign.data.features import FeatureStore, TextPart, forced_value_check, validate_store
from curvalign.data.sharded import ParquetColumn, ShardedRows, ShardError, require_pyarrow

#: at most this many images in each of the drawn "val" and "test" splits (by default)
MAX_SPLIT_IMAGES = 10_000
#: by default each of "val" and "test" takes N // SPLIT_DIVISOR images (up to MAX_SPLIT_IMAGES)
SPLIT_DIVISOR = 20
CAPTION_COLUMN = "caption"
#: rows (evenly strided over the whole store) whose norms are checked on open
NORM_SAMPLE = 256
#: a sampled row whose L2 norm differs from 1 by more than this is "not unit-norm" (float16
#: rounding of a normalised row stays far below it)
NORM_TOLERANCE = 1e-2
PATH_COLUMNS = ("image_path", "url")

_SHARD_NUMBER = re.compile(r"_(\d+)\.[^.]+$")


def _numbered(folder: Path, prefix: str, suffix: str) -> dict[int, Path]:
    """``{k: folder/PREFIX_k.SUFFIX}`` for every numbered shard in ``folder``."""
    out: dict[int, Path] = {}
    for path in folder.glob(f"{prefix}_*{suffix}"):
        match = _SHARD_NUMBER.search(path.name)
        if match and path.name == f"{prefix}_{match.group(1)}{suffix}":
            out[int(match.group(1))] = path
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _sample_norms(rows: ShardedRows) -> np.ndarray:
    """L2 norms of an evenly strided sample of ``rows`` (at most ``NORM_SAMPLE``), read straight
    from the maps (no NaN check: a NaN row is the value check's to report; no copy of the rest)."""
    n = len(rows)
    if n == 0:  # an empty store is the split check's to refuse
        return np.zeros(0, dtype=np.float32)
    ids = np.unique(np.linspace(0, n - 1, min(n, NORM_SAMPLE)).astype(np.int64))
    shard = np.searchsorted(rows.offsets, ids, side="right") - 1
    # the pages of the sampled rows only: with the kernel's default read-around (megabytes a
    # fault) 256 rows strided over a layout read all of it from a cold cache
    advice = rows.advice
    rows.advise("random")
    try:
        sample = np.stack(
            [
                np.asarray(rows.shards[k][i - rows.offsets[k]])
                for i, k in zip(ids, shard, strict=True)
            ]
        ).astype(np.float32)
    finally:
        rows.advise(advice)
    norms = np.linalg.norm(sample, axis=1)
    return norms[np.isfinite(norms)]


def _norm_note(images: ShardedRows, texts: ShardedRows) -> str | None:
    """One note when the sampled image or text rows are not unit-norm; None when they are."""
    found = []
    for side, rows in (("image", images), ("text", texts)):
        norms = _sample_norms(rows)
        if norms.size and np.abs(norms - 1.0).max() > NORM_TOLERANCE:
            found.append(
                (
                    side,
                    f"{side}: mean norm {norms.mean():.3g}, range "
                    f"{norms.min():.3g}..{norms.max():.3g} over {norms.size} sampled rows",
                )
            )
    if not found:
        return None
    return (
        f"{' and '.join(side for side, _ in found)} rows are not unit-norm "
        f"({'; '.join(text for _, text in found)}): clip-retrieval writes L2-normalised "
        "embeddings, so these may come from another tool; the heads read them as they are "
        "(not normalised)"
    )


def default_split_size(n: int) -> int:
    """Images in each of "val" and "test" when the spec does not say: ``min(10000, n // 20)``."""
    return min(MAX_SPLIT_IMAGES, n // SPLIT_DIVISOR)


def read_sharded_embeddings(
    image_files: Sequence[str | os.PathLike[str]],
    text_files: Sequence[str | os.PathLike[str]],
    metadata_files: Sequence[str | os.PathLike[str]] | None = None,
    *,
    val: int | None = None,
    test: int | None = None,
    seed: int = 0,
    check: bool | None = None,
    meta: dict[str, Any] | None = None,
) -> FeatureStore:
    """A feature store over paired embedding shards (see the module docstring).

    ``image_files[k]`` and ``text_files[k]`` (and ``metadata_files[k]``) hold the same pairs, in
    order. ``val``/``test``: images drawn (seeded by ``seed``) into those splits, by default
    ``default_split_size(N)`` each. ``check=True`` scans every float for NaN/inf (reads every
    shard once); ``None`` scans only when ``CURVALIGN_CHECK_VALUES`` asks.
    """
    if not image_files or len(image_files) != len(text_files):
        raise ShardError(
            f"{len(image_files)} image shards and {len(text_files)} text shards; "
            "one text shard per image shard expected (and at least one)"
        )
    images = ShardedRows.open(image_files)
    texts = ShardedRows.open(text_files)
    for k, (a, b) in enumerate(zip(images.shards, texts.shards, strict=True)):
        if len(a) != len(b):
            raise ShardError(
                f"{text_files[k]} has {len(b)} rows but {image_files[k]} has {len(a)}; "
                "row r of a text shard is the caption of row r of its image shard"
            )
    n = len(images)
    norm_note = _norm_note(images, texts)
    notes = [norm_note] if norm_note else []
    items: dict[str, ParquetColumn] = {}
    if metadata_files:
        if len(metadata_files) != len(image_files):
            raise ShardError(
                f"{len(metadata_files)} metadata shards for {len(image_files)} embedding shards"
            )
        pq = require_pyarrow("the embeddings' metadata")
        try:
            names = set(pq.ParquetFile(metadata_files[0]).schema_arrow.names)
        except Exception as exc:  # pyarrow raises its own error types for a bad file
            raise ShardError(
                f"{metadata_files[0]}: not a readable parquet file ({_first_line(exc)})"
            ) from None
        if CAPTION_COLUMN in names:
            items["texts"] = ParquetColumn(metadata_files, CAPTION_COLUMN)
        else:
            notes.insert(
                0,
                f"metadata ({metadata_files[0]}) has no {CAPTION_COLUMN!r} column (it has "
                f"{', '.join(sorted(names)[:8]) or 'none'}{', ...' if len(names) > 8 else ''}): "
                "search shows item ids, not captions",
            )
        path_column = next((c for c in PATH_COLUMNS if c in names), None)
        if path_column is not None:
            items["image_paths"] = ParquetColumn(metadata_files, path_column)
        for column in items.values():
            counts = column.offsets[1:] - column.offsets[:-1]
            for k, (rows, shard) in enumerate(zip(counts.tolist(), images.shards, strict=True)):
                if rows != len(shard):
                    raise ShardError(
                        f"{metadata_files[k]} has {rows} rows but {image_files[k]} has "
                        f"{len(shard)}; one metadata row per embedding row expected"
                    )
    n_val = default_split_size(n) if val is None else int(val)
    n_test = default_split_size(n) if test is None else int(test)
    if n_val < 0 or n_test < 0 or n_val + n_test >= n:
        raise ShardError(
            f"val={n_val} and test={n_test} images leave no train image out of {n}; "
            "choose smaller val= and test="
        )
    # Seeded split: n_val + n_test distinct images drawn (O(n_val + n_test) for a small share,
    # not a permutation of all N), the first n_val "val", the rest "test".
    drawn = torch.from_numpy(
        np.random.default_rng(int(seed)).choice(n, size=n_val + n_test, replace=False)
    )
    image_split = torch.zeros(n, dtype=torch.long)
    image_split[drawn[:n_val]] = 1
    image_split[drawn[n_val:]] = 2
    store = FeatureStore(
        image_features=images,  # type: ignore[arg-type]  # rows gathered from the maps
        text=TextPart(texts),  # type: ignore[arg-type]
        text_to_image=torch.arange(n),
        image_split=image_split,
        split_names=["train", "val", "test"],
        **items,  # type: ignore[arg-type]
        meta={
            **(meta or {}),
            "shards": len(image_files),
            "pairs": n,
            "dtype": str(images.dtype).removeprefix("torch."),
            "split": {"seed": int(seed), "val": n_val, "test": n_test},
            **({"notes": notes} if notes else {}),
        },
    )
    where = f"sharded embeddings ({image_files[0]}, ...)"
    scanned = forced_value_check() if check is None else check
    validate_store(store, lambda name: f"field {name!r}", where, scanned)
    # not scanned: every row read (a batch, a validation split, a sample) is checked instead
    images.check_values = texts.check_values = not scanned
    return store


def read_clip_retrieval(
    root: str | os.PathLike[str],
    *,
    val: int | None = None,
    test: int | None = None,
    seed: int = 0,
    check: bool | None = None,
) -> FeatureStore:
    """The store of clip-retrieval's layout under ``root`` (see the module docstring)."""
    base = Path(root).expanduser()
    if not base.is_dir():
        raise ShardError(f"clip-retrieval directory {base}: no such directory")
    image = _numbered(base / "img_emb", "img_emb", ".npy")
    text = _numbered(base / "text_emb", "text_emb", ".npy")
    metadata = _numbered(base / "metadata", "metadata", ".parquet")
    if not image:
        raise ShardError(f"{base}/img_emb holds no img_emb_<k>.npy shard (clip-retrieval layout)")
    if set(text) != set(image):
        missing = sorted(set(image) ^ set(text))[:5]
        raise ShardError(
            f"{base}: img_emb and text_emb shards do not match (shard numbers {missing} are in "
            "one folder only); every img_emb_<k>.npy needs its text_emb_<k>.npy"
        )
    if metadata and set(metadata) != set(image):
        missing = sorted(set(image) ^ set(metadata))[:5]
        raise ShardError(
            f"{base}: metadata shards do not match the embedding shards (shard numbers {missing})"
        )
    order = sorted(image)
    return read_sharded_embeddings(
        [image[k] for k in order],
        [text[k] for k in order],
        [metadata[k] for k in order] if metadata else None,
        val=val,
        test=test,
        seed=seed,
        check=check,
        meta={"source": "clip-retrieval", "root": str(base.resolve())},
    )


def clip_retrieval_from_spec(argument: str) -> FeatureStore:
    """``DIR[,val=N,test=N,seed=S,check=1]`` -> ``read_clip_retrieval``; errors name the key."""
    path, *options = argument.split(",")
    if not path:
        raise ShardError(
            "clip-retrieval: needs a directory, e.g. clip-retrieval:embeddings/laion-1m"
        )
    values: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key not in ("val", "test", "seed", "check") or not sep:
            raise ShardError(
                f"clip-retrieval option {option!r}: expected val=N, test=N, seed=N or check=1"
            )
        try:
            number = int(value)
        except ValueError:
            raise ShardError(f"clip-retrieval option {option!r}: an integer expected") from None
        values[key] = bool(number) if key == "check" else number
    return read_clip_retrieval(path, **values)
