"""clip-retrieval's sharded layout read in place: ShardedRows, ParquetColumn, the data spec, training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from curvalign.data import DataSpecError, FeatureStore, FeatureStoreError, load_data
from curvalign.data.sampling import BatchSampler
from curvalign.data.sharded import ShardedRows

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: rows per shard: uneven on purpose (a short last shard, as clip-retrieval writes)
SHARD_ROWS = (70, 70, 23)


def unit_rows(rng: np.random.Generator, n: int, d: int, dtype=np.float16) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(dtype)


def write_layout(
    root: Path, shard_rows=SHARD_ROWS, di: int = 12, dt: int = 8, seed: int = 0, dtype=np.float16
):
    """clip-retrieval's layout written with numpy and pyarrow alone; returns the whole arrays.
    Shard numbers 0, 1, 10 (not 2): numeric order, not the names' string order, pairs them."""
    rng = np.random.default_rng(seed)
    numbers = [0, 1, 10][: len(shard_rows)]
    for folder in ("img_emb", "text_emb", "metadata"):
        (root / folder).mkdir(parents=True)
    images, texts, captions, urls = [], [], [], []
    start = 0
    for k, rows in zip(numbers, shard_rows, strict=True):
        img, txt = unit_rows(rng, rows, di, dtype), unit_rows(rng, rows, dt, dtype)
        np.save(root / "img_emb" / f"img_emb_{k}.npy", img)
        np.save(root / "text_emb" / f"text_emb_{k}.npy", txt)
        cap = [f"caption {start + r}" for r in range(rows)]
        url = [f"https://example.org/{start + r}.jpg" for r in range(rows)]
        table = pa.table({"caption": cap, "url": url, "key": [str(start + r) for r in range(rows)]})
        pq.write_table(table, root / "metadata" / f"metadata_{k}.parquet")
        images.append(img)
        texts.append(txt)
        captions += cap
        urls += url
        start += rows
    return np.concatenate(images), np.concatenate(texts), captions, urls


def test_sharded_rows_index_like_the_concatenation(tmp_path: Path):
    images, _, _, _ = write_layout(tmp_path)
    rows = ShardedRows.open(
        sorted((tmp_path / "img_emb").glob("*.npy"), key=lambda p: int(p.stem.split("_")[-1]))
    )
    whole = torch.from_numpy(images)
    assert rows.shape == whole.shape and rows.dtype == torch.float16 and len(rows) == 163
    ids = torch.tensor([162, 0, 69, 70, 140, 139, 5, 70, 141, -1])  # shard edges, repeats, -1
    assert torch.equal(rows[ids], whole[ids])
    assert torch.equal(rows[60:150], whole[60:150])  # a slice across three shards
    assert torch.equal(rows[::7], whole[::7])
    assert torch.equal(rows[71], whole[71])
    assert torch.equal(rows[ids, 3], whole[ids, 3])
    mask = torch.zeros(163, dtype=torch.bool)
    mask[[3, 90, 150]] = True
    assert torch.equal(rows[mask], whole[mask])
    assert rows[torch.tensor([], dtype=torch.long)].shape == (0, 12)
    with pytest.raises(IndexError):
        rows[torch.tensor([163])]
    # the maps are the files themselves, not copies in memory
    assert all(isinstance(s, np.memmap) for s in rows.shards)


def test_clip_retrieval_spec_reads_the_layout_in_place(tmp_path: Path):
    images, texts, captions, urls = write_layout(tmp_path)
    store = load_data(f"clip-retrieval:{tmp_path},val=10,test=20,seed=3")
    assert isinstance(store.image_features, ShardedRows)
    assert store.image_features.dtype == torch.float16  # float16 kept
    assert store.num_images == store.num_texts == 163
    assert torch.equal(store.text_to_image, torch.arange(163))  # one-to-one pairs
    ids = torch.tensor([0, 70, 100, 162])
    assert torch.equal(store.image_features[ids], torch.from_numpy(images)[ids])
    assert torch.equal(store.text_features[ids], torch.from_numpy(texts)[ids])
    assert [store.texts[i] for i in ids.tolist()] == [captions[i] for i in ids.tolist()]
    assert store.image_paths[162] == urls[162]
    # the seeded split: counts as asked, recorded, reproducible, different for another seed
    assert [len(store.split_image_ids(s)) for s in ("train", "val", "test")] == [133, 10, 20]
    assert store.meta["split"] == {"seed": 3, "val": 10, "test": 20}
    assert store.meta["spec"] == f"clip-retrieval:{tmp_path},val=10,test=20,seed=3"
    again = load_data(f"clip-retrieval:{tmp_path},val=10,test=20,seed=3")
    assert torch.equal(again.image_split, store.image_split)
    other = load_data(f"clip-retrieval:{tmp_path},val=10,test=20,seed=4")
    assert not torch.equal(other.image_split, store.image_split)
    # a split of the store holds its own rows, captions and paths
    test = store.select_split("test")
    test_ids = store.split_image_ids("test")
    assert torch.equal(test.image_features, torch.from_numpy(images)[test_ids])
    assert test.texts == [captions[i] for i in test_ids.tolist()]


def test_sampler_gathers_batches_across_shards(tmp_path: Path):
    images, texts, _, _ = write_layout(tmp_path)
    store = load_data(f"clip-retrieval:{tmp_path},val=10,test=10")
    sampler = BatchSampler(store, batch_size=50, seed=0)
    shards_seen = set()
    train = set(store.split_image_ids("train").tolist())
    for _ in range(4):
        idx = sampler.next_indices()
        assert set(idx["image"].tolist()) <= train
        assert torch.equal(idx["text"], idx["image"])  # caption i is image i's
        shards_seen |= set(np.searchsorted([70, 140], idx["image"].numpy(), side="right").tolist())
    assert shards_seen == {0, 1, 2}
    batch = BatchSampler(store, batch_size=50, seed=1).next_batch()
    ref = BatchSampler(store, batch_size=50, seed=1).next_indices()
    assert batch.image.dtype == torch.float32
    assert torch.equal(batch.image, torch.from_numpy(images)[ref["image"]].float())
    assert torch.equal(batch.text, torch.from_numpy(texts)[ref["text"]].float())


def test_import_into_a_native_store(tmp_path: Path):
    images, _, captions, _ = write_layout(tmp_path / "cr")
    store = load_data(f"clip-retrieval:{tmp_path / 'cr'},val=10,test=10")
    store.save(tmp_path / "native")  # chunk by chunk; validated and recorded
    native = FeatureStore.load(tmp_path / "native", mmap=True)
    assert native.image_features.dtype == torch.float16
    assert torch.equal(native.image_features, torch.from_numpy(images))
    assert native.texts == captions
    assert torch.equal(native.image_split, store.image_split)


def test_layout_errors_name_the_problem(tmp_path: Path):
    write_layout(tmp_path / "a")
    (tmp_path / "a" / "text_emb" / "text_emb_10.npy").unlink()
    with pytest.raises(DataSpecError, match=r"img_emb and text_emb shards do not match.*\[10\]"):
        load_data(f"clip-retrieval:{tmp_path / 'a'}")
    write_layout(tmp_path / "b")
    np.save(tmp_path / "b" / "text_emb" / "text_emb_1.npy", np.zeros((5, 8), np.float16))
    with pytest.raises(
        DataSpecError, match=r"text_emb_1.npy has 5 rows but .*img_emb_1.npy has 70"
    ):
        load_data(f"clip-retrieval:{tmp_path / 'b'}")
    write_layout(tmp_path / "c")
    with pytest.raises(DataSpecError, match=r"val=100 and test=100 images leave no train image"):
        load_data(f"clip-retrieval:{tmp_path / 'c'},val=100,test=100")
    with pytest.raises(DataSpecError, match=r"option 'shards=2'"):
        load_data(f"clip-retrieval:{tmp_path / 'c'},shards=2")
    with pytest.raises(DataSpecError, match=r"no such directory"):
        load_data(f"clip-retrieval:{tmp_path / 'nowhere'}")


def test_check_scans_every_shard(tmp_path: Path):
    write_layout(tmp_path)
    bad = np.load(tmp_path / "img_emb" / "img_emb_10.npy")
    bad[4, 0] = np.nan
    np.save(tmp_path / "img_emb" / "img_emb_10.npy", bad)
    load_data(f"clip-retrieval:{tmp_path}")  # opening reads no float
    with pytest.raises(FeatureStoreError, match=r"image_features.* 1 row with NaN or inf.*row 144"):
        load_data(f"clip-retrieval:{tmp_path}", check=True)
    with pytest.raises(FeatureStoreError, match=r"row 144"):
        load_data(f"clip-retrieval:{tmp_path},check=1")


def test_train_on_the_layout(tmp_path: Path):
    # the issue's route end to end on a tiny layout: train with the defaults' validation (the
    # layout's own seeded "val" split), embed, and the searcher shows the parquet captions
    from curvalign.train import train

    # float32 shards: validation on float16 features is issue 26 item 1 (another branch)
    write_layout(tmp_path / "cr", shard_rows=(150, 150, 40), dtype=np.float32)
    spec = f"clip-retrieval:{tmp_path / 'cr'},val=30,test=30"
    train(
        "clip",
        spec,
        tmp_path / "run",
        steps=3,
        overrides=["embed_dim=8", "batch_size=32", "val_every=2"],
        show_progress=False,
    )
    saved = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert saved["data"] == spec  # the seeded split is reproduced from the recorded spec
    assert saved["validation"]["source"] == "store" and saved["validation"]["images"] == 30
    assert saved["sampler"]["train_images"] == 340 - 60
