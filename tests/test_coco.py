"""A COCO-layout folder -> one store (curvalign.data.coco): captions, splits, boxes, classes,
taxonomy, scored pairs and the training-data disclosure; the real COCO-MINI annotations when
../shared is there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from curvalign.data.coco import coco_inputs, extract_coco
from curvalign.data.extract import ExtractError
from curvalign.data.features import FeatureStore
from test_extract import PixelEncoder

SHARED_COCO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "coco-mini"


def make_coco(root: Path) -> None:
    """train2017: 3 photos; val2017: 4 captioned photos and 1 distractor; 3 categories."""
    rng = np.random.default_rng(0)
    (root / "annotations").mkdir(parents=True)
    categories = [
        {"id": 1, "name": "person", "supercategory": "person"},
        {"id": 18, "name": "dog", "supercategory": "animal"},
        {"id": 17, "name": "cat", "supercategory": "animal"},
    ]
    for split, n in (("train2017", 3), ("val2017", 5)):
        (root / split).mkdir()
        images, caps, inst = [], [], []
        for i in range(n):
            image_id = 100 * (split == "val2017") + i
            name = f"{image_id:012d}.jpg"
            Image.fromarray((rng.random((60, 80, 3)) * 255).astype("uint8")).save(
                root / split / name
            )
            images.append({"id": image_id, "file_name": name})
            if split == "val2017" and i == 4:
                continue  # a distractor: no caption, no box
            caps += [
                {"image_id": image_id, "caption": f"photo {image_id} view {k}"} for k in range(2)
            ]
            inst += [
                {
                    "image_id": image_id,
                    "bbox": [0, 0, 40, 30],
                    "category_id": 18 if i % 2 else 17,
                    "iscrowd": 0,
                    "area": 1200,
                },
                {
                    "image_id": image_id,
                    "bbox": [10, 10, 20, 50],
                    "category_id": 1,
                    "iscrowd": 0,
                    "area": 1000,
                },
                {
                    "image_id": image_id,
                    "bbox": [5, 5, 8, 8],
                    "category_id": 1,
                    "iscrowd": 0,
                    "area": 64,
                },  # smaller than min_box: no box pair, still a category of the photo
                {
                    "image_id": image_id,
                    "bbox": [0, 0, 60, 60],
                    "category_id": 18,
                    "iscrowd": 1,
                    "area": 3600,
                },  # a crowd region: ignored
            ]
        (root / "annotations" / f"captions_{split}.json").write_text(
            json.dumps({"images": images, "annotations": caps})
        )
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": inst, "categories": categories})
        )


def test_extract_coco_builds_every_group(tmp_path: Path) -> None:
    make_coco(tmp_path / "coco")
    summary = extract_coco(PixelEncoder(), tmp_path / "coco", tmp_path / "s", progress=False)
    store = FeatureStore.load(tmp_path / "s")
    assert summary.classes == 3 and store.num_images == 7 and store.num_texts == 14
    splits = [store.split_names[i] for i in store.image_split.tolist()]
    assert splits[:3] == ["train"] * 3 and sorted(splits[3:]) == ["test", "test", "val", "val"]
    assert store.box_to_image.shape[0] == 2 * 7  # two boxes >= 16 px per photo, no crowd
    assert store.class_names == ["person", "cat", "dog"]  # by category id
    # label = the largest instance (cat for even photos, dog for odd)
    files = store.image_paths
    want = [1 if int(Path(f).stem) % 2 == 0 else 2 for f in files]
    assert store.image_labels.tolist() == want
    assert store.meta["image_categories"][0] == [0, 1]
    # the multilabels group holds the same sets, one row per (image, category)
    assert store.has_multilabels
    held = [set() for _ in range(store.num_images)]
    for i, c in zip(
        store.multilabel_to_image.tolist(), store.multilabel_class.tolist(), strict=True
    ):
        held[i].add(c)
    assert [sorted(h) for h in held] == store.meta["image_categories"]
    names = store.taxonomy_names
    assert names[0] == "object" and "person (supercategory)" in names
    dog = names.index("dog")
    assert names[store.taxonomy_parents[dog]] == "animal"
    assert store.prompt_features.shape[0] == 3 * 2
    torch.testing.assert_close(
        store.prompt_features[:2],
        PixelEncoder().encode_texts(["a photo of a person.", "a person."]),
    )
    # pairs from train photos only: one same-photo pair (1.0) and one across photos each
    assert store.pair_scores.shape[0] == 6 and store.pair_scores.tolist().count(1.0) >= 3
    assert store.meta["dataset"] == "coco"


def test_extract_coco_errors(tmp_path: Path) -> None:
    with pytest.raises(ExtractError, match="no annotations/captions_train2017.json"):
        coco_inputs(tmp_path, tmp_path / "w")
    make_coco(tmp_path / "coco")
    with pytest.raises(ExtractError, match="val_fraction"):
        coco_inputs(tmp_path / "coco", tmp_path / "w", val_fraction=1.0)


@pytest.mark.skipif(
    not (SHARED_COCO / "annotations").is_dir(),
    reason=f"COCO-MINI is not at {SHARED_COCO} (the project's shared data folder)",
)
def test_real_coco_mini_inputs(tmp_path: Path) -> None:
    inputs = coco_inputs(SHARED_COCO, tmp_path)
    records = json.loads(inputs["captions"].read_text())["images"]
    splits = [r["split"] for r in records]
    assert (splits.count("train"), splits.count("val"), splits.count("test")) == (80, 40, 39)
    assert sum(len(r["sentences"]) for r in records) == 400 + 395
    assert len(inputs["categories"]) == 80
    # every box file is one of the captioned photos; each phrase a category name
    names = {c["name"] for c in inputs["categories"]}
    boxes = [json.loads(line) for line in inputs["boxes"].read_text().splitlines()]
    assert boxes and {b["phrase"] for b in boxes} <= names
    assert {b["image"] for b in boxes} <= set(inputs["files"])
