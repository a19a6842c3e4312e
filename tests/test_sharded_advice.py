"""Kernel advice on memory-mapped shards: random for the sampler's gathers (same batches as
without it), sequential for contiguous passes (import, value scans, embedding)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

import curvalign.data.sampling as sampling
import curvalign.data.sharded as sharded
from curvalign.data import load_data
from curvalign.data.sampling import BatchSampler

pytest.importorskip("pyarrow")
from test_clip_retrieval import write_layout  # noqa: E402


@pytest.fixture
def advice(monkeypatch) -> list[tuple[int, int]]:
    """Every ``madvise`` given to a shard map: ``(id of the map, flag)``."""
    seen: list[tuple[int, int]] = []
    real = sharded._madvise

    def spy(mapping, flag):
        seen.append((id(mapping), flag))
        real(mapping, flag)

    monkeypatch.setattr(sharded, "_madvise", spy)
    return seen


def test_the_sampler_advises_random_reads_and_draws_the_same_batches(tmp_path: Path, advice):
    images, texts, _, _ = write_layout(tmp_path)
    spec = f"clip-retrieval:{tmp_path},val=10,test=10"
    store = load_data(spec)
    sampler = BatchSampler(store, batch_size=40, seed=7)
    maps = {id(sharded._file_map(s)) for s in store.image_features.shards}
    maps |= {id(sharded._file_map(s)) for s in store.text_features.shards}
    assert len(maps) == 6
    assert {m for m, flag in advice if flag == mmap.MADV_RANDOM} == maps
    assert store.image_features.advice == "random"

    # the same seeded batches as a sampler that gives no advice, and as the rows themselves
    plain_store = load_data(spec)
    original = sampling.advise_rows
    sampling.advise_rows = lambda value, pattern: False
    try:
        plain = BatchSampler(plain_store, batch_size=40, seed=7)
    finally:
        sampling.advise_rows = original
    assert plain_store.image_features.advice == "normal"
    for _ in range(6):  # more than an epoch of 143 - 20 train images
        a, b = sampler.next_batch(), plain.next_batch()
        assert torch.equal(a.image, b.image) and torch.equal(a.text, b.text)
    # and a resumed sampler continues with them
    resumed = BatchSampler(load_data(spec), batch_size=40, seed=0)
    resumed.load_state_dict(sampler.state_dict())
    ref = sampler.next_indices()
    got = resumed.next_indices()
    assert torch.equal(got["image"], ref["image"]) and torch.equal(got["text"], ref["text"])
    assert torch.equal(
        resumed.next_batch().image,
        torch.from_numpy(images)[sampler.next_indices()["image"]].float(),
    )


def test_contiguous_passes_read_ahead_then_restore_the_advice(tmp_path: Path, advice, monkeypatch):
    images, _, _, _ = write_layout(tmp_path / "cr")
    store = load_data(f"clip-retrieval:{tmp_path / 'cr'},val=10,test=10")
    rows = store.image_features
    assert rows.advise("random") is True
    advice.clear()
    monkeypatch.setattr(sharded, "SEQUENTIAL_MIN_BYTES", 64)  # the tiny shards count as long
    assert torch.equal(rows[5:150], torch.from_numpy(images[5:150]))
    # each of the three shards read: sequential for the copy, then random again
    flags = [flag for _, flag in advice]
    assert flags == [mmap.MADV_SEQUENTIAL, mmap.MADV_RANDOM] * 3
    advice.clear()
    store.save(tmp_path / "native")  # the import: every field copied in long runs
    assert mmap.MADV_SEQUENTIAL in [flag for _, flag in advice]
    advice.clear()
    rows[0:2]  # a short read is left to the advice the shard has
    assert advice == []


def test_arrays_in_memory_take_no_advice(advice):
    assert sharded.advise_rows(torch.zeros(3, 2), "random") is False
    assert sharded.advise_array(np.zeros((3, 2)), "sequential") is False
    assert advice == []
    with pytest.raises(ValueError, match="access pattern"):
        sharded.advise_array(np.zeros(2), "sideways")


def test_a_sparse_gather_reads_only_its_pages(tmp_path: Path, advice):
    images, _, _, _ = write_layout(tmp_path)
    rows = load_data(f"clip-retrieval:{tmp_path},val=10,test=10").image_features
    advice.clear()
    strided = np.arange(0, 70, 30)  # 3 rows over 61: a strided sample of one shard
    assert torch.equal(rows[strided], torch.from_numpy(images[strided]))
    assert [flag for _, flag in advice] == [mmap.MADV_RANDOM, mmap.MADV_NORMAL]
    advice.clear()
    dense = np.array([3, 4, 6, 8, 9])  # neighbours: the read-ahead is worth keeping
    assert torch.equal(rows[dense], torch.from_numpy(images[dense]))
    assert advice == []


def test_the_sampler_reads_runs_of_neighbouring_rows_from_shards(tmp_path: Path):
    # rows from the disk: the chunk shuffle by default (a page read once an epoch, not once a
    # row); the uniform row shuffle stays available and draws what it always drew
    write_layout(tmp_path)
    store = load_data(f"clip-retrieval:{tmp_path},val=10,test=10")
    auto = BatchSampler(store, batch_size=40, seed=7, chunk_rows=8, window_chunks=2)
    assert auto.shuffle == "chunks" and auto.summary()["shuffle"]["chunk_rows"] == 8
    order = auto._images.order
    assert len(set((order[:16] // 8).tolist())) == 2  # one window: two whole runs of 8
    rows = BatchSampler(store, batch_size=40, seed=7, shuffle="rows")
    first = torch.randperm(len(rows.image_ids), generator=torch.Generator().manual_seed(7))[:40]
    assert torch.equal(rows.next_indices()["image"], rows.image_ids[first])
