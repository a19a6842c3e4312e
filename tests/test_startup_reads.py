"""What a run reads before its first step on memory-mapped shards: the warm start's fit and the
check for held-out images copied from train take the same train rows (read once)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from curvalign.data import alignment, load_data
from curvalign.data.sharded import ShardedRows
from curvalign.data.validation_split import copies_of_train

pytest.importorskip("pyarrow")
from test_clip_retrieval import write_layout  # noqa: E402


def test_spread_runs_takes_evenly_spaced_runs_of_consecutive_ids():
    ids = torch.arange(1000) * 3
    picked = alignment.spread_runs(ids, 200)
    assert len(picked) == 200 and len(set(picked.tolist())) == 200
    runs = np.split(picked.numpy(), np.flatnonzero(np.diff(picked.numpy()) != 3) + 1)
    assert all(len(r) == alignment.SAMPLE_RUN_ROWS for r in runs[:-1])
    assert picked[0] == 0 and picked[-1] >= ids[900]  # spread over the whole split
    assert torch.equal(alignment.spread_runs(ids[:50], 200), ids[:50])


def test_the_copy_check_reads_the_train_rows_the_fit_reads(tmp_path: Path, monkeypatch):
    write_layout(tmp_path, shard_rows=(150, 150, 40))
    store = load_data(f"clip-retrieval:{tmp_path},val=20,test=20")
    read: list[np.ndarray] = []
    real = ShardedRows._gather

    def gather(self, ids):
        if self is store.image_features:
            read.append(np.asarray(ids).copy())
        return real(self, ids)

    monkeypatch.setattr(ShardedRows, "_gather", gather)
    train = set(store.split_image_ids("train").tolist())
    alignment.split_pairs(store, "train", max_rows=100)
    fit = set(np.concatenate(read).tolist())
    read.clear()
    copies = copies_of_train(store, "d", limit=100)
    checked = set(np.concatenate(read).tolist()) & train
    assert copies["train_checked"] == 100 and len(fit) == 100
    assert checked == fit
