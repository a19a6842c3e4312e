"""Long item lists of a native store (a million captions imported from clip-retrieval) are kept
as indexed strings: the store opens without reading a caption, and reads one when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import curvalign.data.features as features
import curvalign.data.sharded as sharded
from curvalign.data import FeatureStore, load_data
from curvalign.data.sharded import IndexedStrings, ShardError

pytest.importorskip("pyarrow")
from test_clip_retrieval import write_layout  # noqa: E402


def test_an_imported_store_opens_without_reading_its_captions(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(features, "INDEXED_ITEMS_MIN", 50)  # the tiny layout's lists count as long
    _, _, captions, urls = write_layout(tmp_path / "cr")
    load_data(f"clip-retrieval:{tmp_path / 'cr'},val=10,test=10").save(tmp_path / "native")
    items_json = tmp_path / "native" / "items.json"
    assert not items_json.exists() or "texts" not in json.loads(items_json.read_text())
    reads: list[int] = []
    real = IndexedStrings._read
    monkeypatch.setattr(
        IndexedStrings, "_read", lambda self, fh, i: reads.append(i) or real(self, fh, i)
    )
    native = FeatureStore.load(tmp_path / "native", mmap=True)
    assert isinstance(native.texts, IndexedStrings) and reads == []
    assert native.texts[7] == captions[7] and native.texts[-1] == captions[-1]
    assert list(native.image_paths) == urls and native.texts[3:6] == captions[3:6]
    assert torch.equal(native.text_to_image, torch.arange(len(captions)))


def test_indexed_strings_round_trip_and_refuse_damage(tmp_path: Path):
    values = ["", "caption é", "x" * 300, "last"]
    IndexedStrings.write(values, tmp_path / "s.txt", tmp_path / "s.offsets.npy")
    strings = IndexedStrings(tmp_path / "s.txt", tmp_path / "s.offsets.npy")
    assert list(strings) == values and strings.take([3, 1, 3]) == ["last", "caption é", "last"]
    with open(tmp_path / "s.txt", "ab") as fh:
        fh.write(b"more")
    with pytest.raises(ShardError, match="does not index"):
        IndexedStrings(tmp_path / "s.txt", tmp_path / "s.offsets.npy")
    assert issubclass(sharded.ParquetColumn, sharded.LazyStrings)
