"""CLIP_benchmark webdataset roots (tar shards written here with ``tarfile``) -> feature stores.

The encoder is the deterministic pixel/letter stand-in of test_extract, so every stored row can
be checked against a direct encoding of the sample it came from.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from curvalign.data.extract import SKIPPED_REPORT, ExtractError, extract_webdataset
from curvalign.data.features import TENSOR_FIELDS, FeatureStore
from curvalign.data.webdataset import WebDatasetError, iter_wds_shard, read_wds_layout
from test_extract import PixelEncoder


def image_bytes(seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((16 + seed % 5, 20, 3)) * 255).astype("uint8")).save(buf, fmt)
    return buf.getvalue()


def write_shard(path: Path, samples: list[dict[str, bytes]]) -> None:
    """Each sample: {"__key__": key, ext: bytes, ...}; members in sample order, as ShardWriter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            key = sample["__key__"]
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def make_classification(root: Path, bad: bool = False) -> dict:
    """2 splits; test has 2 shards of 3 samples; with ``bad`` one sample lacks .cls, one has
    class 7 (out of range), one has a truncated image."""
    (root).mkdir(parents=True)
    (root / "classnames.txt").write_text("cat\ndog\nbird\n")
    (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n{c}\n")
    expected = []  # (split, seed, label) of every kept sample in order
    skipped = []
    seed = 0
    for split, nshards in (("test", 2), ("train", 1)):
        for n in range(nshards):
            samples = []
            for k in range(3):
                key = f"s{seed:07d}"
                sample = {"__key__": key, "webp" if seed % 2 else "png": image_bytes(seed)}
                label = seed % 3
                sample["cls"] = str(label).encode()
                if bad and split == "test" and n == 1 and k == 0:
                    del sample["cls"]
                    skipped.append(f"test/1.tar:{key}")
                elif bad and split == "test" and n == 1 and k == 1:
                    sample["cls"] = b"7"
                    skipped.append(f"test/1.tar:{key}")
                elif bad and split == "train" and k == 2:
                    img_key = "webp" if seed % 2 else "png"
                    sample[img_key] = sample[img_key][:30]
                    skipped.append(f"train/0.tar:{key}")
                else:
                    expected.append((split, seed, label))
                samples.append(sample)
                seed += 1
            write_shard(root / split / f"{n}.tar", samples)
        (root / split / "nshards.txt").write_text(f"{nshards}\n")
    return {"expected": expected, "skipped": skipped}


def make_retrieval(root: Path) -> list[tuple[int, list[str]]]:
    root.mkdir(parents=True)
    (root / "dataset_type.txt").write_text("retrieval\n")
    samples, expected = [], []
    for i in range(4):
        captions = [f"caption {j} of image {i}" for j in range(1 + i % 3)]
        samples.append(
            {
                "__key__": f"{i:04d}",
                "jpg": image_bytes(i, "JPEG"),
                "txt": "\n".join(captions).encode(),
            }
        )
        expected.append((i, captions))
    write_shard(root / "test" / "0.tar", samples)
    (root / "test" / "nshards.txt").write_text("1")
    return expected


def test_shard_is_streamed_into_samples(tmp_path: Path) -> None:
    make_classification(tmp_path / "ds")
    samples = list(iter_wds_shard(tmp_path / "ds" / "test" / "0.tar"))
    assert [s.key for s in samples] == ["s0000000", "s0000001", "s0000002"]
    assert set(samples[1].members) == {"webp", "cls"} and samples[1].members["cls"] == b"1"


def test_classification_root_becomes_a_store(tmp_path: Path) -> None:
    info = make_classification(tmp_path / "ds")
    summary = extract_webdataset(PixelEncoder(), tmp_path / "ds", tmp_path / "s", progress=False)
    store = FeatureStore.load(tmp_path / "s")
    assert summary.images == store.num_images == 9 and summary.skipped_images == []
    assert store.split_names == ["test", "train"] and store.class_names == ["cat", "dog", "bird"]
    assert store.image_split.tolist() == [0] * 6 + [1] * 3
    assert store.image_labels.tolist() == [label for _, _, label in info["expected"]]
    enc = PixelEncoder()
    for row, (_, seed, label) in enumerate(info["expected"]):
        with Image.open(io.BytesIO(image_bytes(seed))) as im:
            torch.testing.assert_close(store.image_features[row], enc.encode_images([im])[0])
        name = store.class_names[label]
        torch.testing.assert_close(
            store.text_features[row], enc.encode_texts([f"a photo of a {name}."])[0]
        )
    assert store.prompt_to_class.tolist() == [0, 0, 1, 1, 2, 2]
    assert (
        store.meta["captions_from_class_prompts"] and store.meta["dataset_type"] == "classification"
    )
    assert summary.items_encoded == 9 + 6 and summary.throughput is not None


def test_malformed_samples_are_listed_skips(tmp_path: Path) -> None:
    info = make_classification(tmp_path / "ds", bad=True)
    summary = extract_webdataset(PixelEncoder(), tmp_path / "ds", tmp_path / "s", progress=False)
    store = FeatureStore.load(tmp_path / "s")
    assert sorted(f for f, _ in summary.skipped_images) == sorted(info["skipped"])
    reasons = dict(summary.skipped_images)
    assert "without a .cls" in reasons["test/1.tar:s0000003"]
    assert "class index 7 outside [0, 3)" in reasons["test/1.tar:s0000004"]
    assert store.num_images == len(info["expected"]) == 6
    assert store.image_labels.tolist() == [label for _, _, label in info["expected"]]
    report = (tmp_path / "s" / SKIPPED_REPORT).read_text()
    assert all(name in report for name in info["skipped"])
    assert store.meta["extract"]["skipped_samples"] == 3


def test_retrieval_root_keeps_every_caption(tmp_path: Path) -> None:
    expected = make_retrieval(tmp_path / "coco")
    extract_webdataset(PixelEncoder(), tmp_path / "coco", tmp_path / "s", progress=False)
    store = FeatureStore.load(tmp_path / "s")
    owners = [i for i, caps in expected for _ in caps]
    assert store.text_to_image.tolist() == owners and not store.has_classes
    enc = PixelEncoder()
    texts = [c for _, caps in expected for c in caps]
    torch.testing.assert_close(store.text_features, enc.encode_texts(texts))


def test_resume_reuses_finished_shards(tmp_path: Path) -> None:
    make_classification(tmp_path / "ds")
    clean = extract_webdataset(PixelEncoder(), tmp_path / "ds", tmp_path / "a", progress=False)
    with pytest.raises(KeyboardInterrupt):  # one encoder call per shard: dies in the third
        extract_webdataset(
            PixelEncoder(fail_after=2), tmp_path / "ds", tmp_path / "b", progress=False
        )
    manifest = json.loads((tmp_path / "b.partial" / "manifest.json").read_text())
    assert sorted(manifest["parts"]) == ["wds-test-00000", "wds-test-00001"]
    again = extract_webdataset(PixelEncoder(), tmp_path / "ds", tmp_path / "b", progress=False)
    assert again.shards_reused == 2 and again.shards_computed == clean.shards_computed - 2
    a, b = FeatureStore.load(tmp_path / "a"), FeatureStore.load(tmp_path / "b")
    for name in TENSOR_FIELDS:
        x, y = a.field(name), b.field(name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name


def test_layout_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(WebDatasetError, match="no such directory"):
        read_wds_layout(tmp_path / "nope")
    make_classification(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "nshards.txt").write_text("2")
    with pytest.raises(WebDatasetError, match="says 2 shards but 1 are missing"):
        read_wds_layout(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "nshards.txt").write_text("0")
    with pytest.raises(WebDatasetError, match="'train' is empty"):
        read_wds_layout(tmp_path / "ds")
    with pytest.raises(WebDatasetError, match="split 'val' has no val/nshards.txt"):
        read_wds_layout(tmp_path / "ds", ["val"])
    (tmp_path / "ds" / "classnames.txt").unlink()
    with pytest.raises(ExtractError, match="no classnames.txt"):
        extract_webdataset(PixelEncoder(), tmp_path / "ds", tmp_path / "s", splits=["test"])
    # a split whose every sample is unusable is an error, not an empty split in the store
    root = tmp_path / "allbad"
    (root / "test").mkdir(parents=True)
    (root / "dataset_type.txt").write_text("retrieval")
    write_shard(root / "test" / "0.tar", [{"__key__": "a", "jpg": image_bytes(0, "JPEG")}])
    (root / "test" / "nshards.txt").write_text("1")
    with pytest.raises(ExtractError, match="no usable sample"):
        extract_webdataset(PixelEncoder(), root, tmp_path / "t", progress=False)


def test_images_are_encoded_batch_by_batch_and_a_broken_tar_is_named(tmp_path: Path) -> None:
    make_classification(tmp_path / "ds")

    class Counting(PixelEncoder):
        largest = 0

        def encode_images(self, images):
            Counting.largest = max(Counting.largest, len(images))
            return super().encode_images(images)

    extract_webdataset(Counting(), tmp_path / "ds", tmp_path / "s", batch_size=2, progress=False)
    assert Counting.largest == 2  # 3 samples per shard: never more than a batch held at once
    (tmp_path / "ds" / "train" / "0.tar").write_bytes(b"not a tar at all" * 40)
    with pytest.raises(ExtractError, match=r"train/0.tar: not a readable tar file"):
        extract_webdataset(PixelEncoder(), tmp_path / "ds", tmp_path / "t", progress=False)
