"""A COCO-layout folder (captions + instances) -> one feature store with everything in it.

``extract_coco(encoder, ROOT, OUT)`` reads COCO's own layout::

    ROOT/annotations/captions_SPLIT.json    {"images": [{id, file_name}], "annotations": [{image_id, caption}]}
    ROOT/annotations/instances_SPLIT.json   {"annotations": [{image_id, bbox [x, y, w, h], category_id,
                                              iscrowd, area}], "categories": [{id, name, supercategory}]}
    ROOT/SPLIT/FILE.jpg                     SPLIT in train2017, val2017 (either may be absent)

and writes a store (through :func:`curvalign.data.extract.extract_features`, so resumable,
with listed skips) holding:

* images and their captions (5 a photo in COCO); images without a caption (COCO-MINI's
  distractor photos) are left out;
* splits: ``train2017`` is ``train``; the captioned ``val2017`` images are cut, seeded, into
  ``val`` (``val_fraction`` of them) and ``test``;
* box-level pairs (HyCoCLIP, PHyCLIP): every non-crowd instance whose box is at least
  ``min_box`` pixels on each side: the crop as an image, its category name as the phrase;
* zero-shot classes: the 80 categories, prompts ``templates`` (default "a photo of a {c}." and
  "a {c}."); an image's label is the category of its largest instance (-1: none), and every
  category it holds is in ``meta["image_categories"]`` (multi-label evaluations);
* a taxonomy: ``object`` -> supercategory -> category (a supercategory that shares its name
  with a category, COCO's "person", is named ``"person (supercategory)"``);
* scored text pairs (DualPath), from ``train`` images only: two captions of one photo (score
  1) and the first captions of two photos (score: the Jaccard overlap of their category sets);
* ``meta["dataset"] = "coco"`` and what the encoders saw of it (``meta["seen_in_training"]``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.data.encoders import Encoder, load_encoder, seen_in_training
from curvalign.data.extract import ExtractError, ExtractSummary, extract_features
from curvalign.data.features import FeatureStore
from curvalign.data.readers import read_json

COCO_SPLITS = ("train2017", "val2017")
DEFAULT_TEMPLATES = ("a photo of a {c}.", "a {c}.")
ROOT_NODE = "object"


def _load_split(root: Path, split: str) -> dict[str, Any] | None:
    captions = root / "annotations" / f"captions_{split}.json"
    instances = root / "annotations" / f"instances_{split}.json"
    if not captions.is_file():
        return None
    out = {"captions": read_json(captions, "COCO captions file")}
    out["instances"] = read_json(instances, "COCO instances file") if instances.is_file() else None
    return out


def _write_if_changed(path: Path, text: str) -> None:
    """Keep the file (and its mtime, which the resumable extraction fingerprints) when unchanged."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def _coco_categories(splits: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The categories of the first split with an instances file, by id (empty: none has one)."""
    for data in splits.values():
        if data and data["instances"]:
            return sorted(data["instances"]["categories"], key=lambda c: c["id"])
    return []


def _instances_by_image(data: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """The non-crowd instance annotations of one split, per image id."""
    instances: dict[int, list[dict[str, Any]]] = {}
    for ann in (data["instances"] or {}).get("annotations", []):
        if not ann.get("iscrowd"):
            instances.setdefault(ann["image_id"], []).append(ann)
    return instances


def _assign_splits(
    split: str, captioned: list[int], val_fraction: float, rng: random.Random
) -> dict[int, str]:
    """``train2017`` images are ``train``; the others are shuffled by ``rng`` and cut into
    ``val`` (``val_fraction`` of them) and ``test``."""
    if split == "train2017":
        return dict.fromkeys(captioned, "train")
    order = list(captioned)
    rng.shuffle(order)
    n_val = round(val_fraction * len(order))
    return {i: ("val" if k < n_val else "test") for k, i in enumerate(order)}


def _box_records(
    file: str,
    objects: list[dict[str, Any]],
    categories: list[dict[str, Any]],
    cat_index: dict[int, int],
    min_box: float,
) -> list[dict[str, Any]]:
    """One boxes-file record (corners, category name as phrase) per instance of ``file`` whose
    box is at least ``min_box`` pixels on each side."""
    boxes = []
    for a in objects:
        x, y, w, h = a["bbox"]
        if w >= min_box and h >= min_box:
            boxes.append(
                {
                    "image": file,
                    "box": [x, y, x + w, y + h],
                    "phrase": categories[cat_index[a["category_id"]]]["name"],
                }
            )
    return boxes


def _scored_caption_pairs(
    records: list[dict[str, Any]], image_categories: list[list[int]], rng: random.Random
) -> list[dict[str, Any]]:
    """Scored text pairs from the train images: two captions of one photo (score 1), and the
    first captions of it and a photo drawn by ``rng`` (score: Jaccard of their category sets)."""
    train = [k for k, r in enumerate(records) if r["split"] == "train"]
    pairs: list[dict[str, Any]] = []
    for k in train:
        caps = [s["raw"] for s in records[k]["sentences"]]
        if len(caps) >= 2:
            pairs.append({"a": caps[0], "b": caps[1], "score": 1.0})
        others = [j for j in train if j != k]
        if others:
            j = rng.choice(others)
            a, b = set(image_categories[k]), set(image_categories[j])
            score = len(a & b) / len(a | b) if a | b else 0.0
            pairs.append({"a": caps[0], "b": records[j]["sentences"][0]["raw"], "score": score})
    return pairs


def _write_coco_files(
    work: Path,
    records: list[dict[str, Any]],
    boxes: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
) -> dict[str, Path]:
    """Write the Karpathy captions, boxes and (when any) pairs files; their paths by name."""
    work.mkdir(parents=True, exist_ok=True)
    paths = {"captions": work / "captions.json", "boxes": work / "boxes.jsonl"}
    _write_if_changed(paths["captions"], json.dumps({"images": records}))
    _write_if_changed(paths["boxes"], "".join(json.dumps(b) + "\n" for b in boxes))
    if pairs:
        paths["pairs"] = work / "pairs.jsonl"
        _write_if_changed(paths["pairs"], "".join(json.dumps(p) + "\n" for p in pairs))
    return paths


def coco_inputs(
    root: str | os.PathLike[str],
    work: str | os.PathLike[str],
    val_fraction: float = 0.5,
    seed: int = 0,
    min_box: float = 16.0,
) -> dict[str, Any]:
    """Write the Karpathy captions, boxes and pairs files of a COCO folder into ``work``.

    Returns {"captions", "boxes", "pairs": paths; "files": image files in store order;
    "categories": [{id, name, supercategory}]; "image_categories": [[category index]],
    "labels": [largest instance's category index or -1]}.
    """
    root, work = Path(root), Path(work)
    splits = {s: _load_split(root, s) for s in COCO_SPLITS}
    if not any(splits.values()):
        raise ExtractError(
            f"COCO folder {root}: no annotations/captions_train2017.json or "
            "annotations/captions_val2017.json"
        )
    if not 0 < val_fraction < 1:
        raise ExtractError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    categories = _coco_categories(splits)
    cat_index = {c["id"]: i for i, c in enumerate(categories)}
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    boxes: list[dict[str, Any]] = []
    image_categories: list[list[int]] = []
    labels: list[int] = []
    for split, data in splits.items():
        if data is None:
            continue
        images = {im["id"]: im for im in data["captions"]["images"]}
        sentences: dict[int, list[str]] = {}
        for ann in data["captions"]["annotations"]:
            sentences.setdefault(ann["image_id"], []).append(ann["caption"].strip())
        instances = _instances_by_image(data)
        captioned = sorted(i for i in images if i in sentences)
        split_of = _assign_splits(split, captioned, val_fraction, rng)
        for image_id in captioned:
            file = f"{split}/{images[image_id]['file_name']}"
            records.append(
                {
                    "filepath": split,
                    "filename": images[image_id]["file_name"],
                    "split": split_of[image_id],
                    "sentences": [{"raw": s} for s in sentences[image_id]],
                }
            )
            objects = instances.get(image_id, [])
            image_categories.append(sorted({cat_index[a["category_id"]] for a in objects}))
            largest = max(objects, key=lambda a: a.get("area", 0), default=None)
            labels.append(cat_index[largest["category_id"]] if largest else -1)
            boxes.extend(_box_records(file, objects, categories, cat_index, min_box))
    if not records:
        raise ExtractError(f"COCO folder {root}: no image has a caption")
    pairs = _scored_caption_pairs(records, image_categories, rng)
    paths = _write_coco_files(work, records, boxes, pairs)
    return {
        **paths,
        "files": [f"{r['filepath']}/{r['filename']}" for r in records],
        "categories": categories,
        "image_categories": image_categories,
        "labels": labels,
        "boxes_kept": len(boxes),
    }


def _taxonomy(categories: Sequence[dict[str, Any]]) -> tuple[list[str], list[int], list[int]]:
    """(node names, parents, class -> node): object -> supercategory -> category."""
    category_names = {c["name"] for c in categories}
    names, parents = [ROOT_NODE], [-1]
    group: dict[str, int] = {}
    for c in categories:
        sup = c.get("supercategory") or ROOT_NODE
        if sup not in group:
            group[sup] = len(names)
            names.append(f"{sup} (supercategory)" if sup in category_names else sup)
            parents.append(0)
    class_to_node = []
    for c in categories:
        class_to_node.append(len(names))
        names.append(c["name"])
        parents.append(group[c.get("supercategory") or ROOT_NODE])
    return names, parents, class_to_node


def extract_coco(
    encoder: Encoder | str,
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    val_fraction: float = 0.5,
    seed: int = 0,
    min_box: float = 16.0,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    batch_size: int = 64,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
) -> ExtractSummary:
    """Encode a COCO-layout folder into one store (module docstring). ``encoder``: an Encoder
    or a spec, e.g. ``efficientnet-lite0+minilm``."""
    bad = [t for t in templates if "{c}" not in t]
    if bad:
        raise ExtractError(f"template {bad[0]!r} has no '{{c}}'")
    target = Path(out)
    work = target.parent / f"{target.name}.coco-inputs"
    inputs = coco_inputs(root, work, val_fraction, seed, min_box)
    enc = load_encoder(encoder, device=device) if isinstance(encoder, str) else encoder
    summary = extract_features(
        enc,
        root,
        target,
        captions=inputs["captions"],
        layout="karpathy",
        boxes=inputs["boxes"],
        pairs=inputs.get("pairs"),
        batch_size=batch_size,
        device=device,
        overwrite=overwrite,
        progress=progress,
    )
    store = FeatureStore.load(target)
    kept = {f: k for k, f in enumerate(inputs["files"])}
    rows = [kept[f] for f in store.image_paths or []]
    categories = inputs["categories"]
    names = [c["name"] for c in categories]
    fields: dict[str, Any] = {}
    if names:
        prompts = [t.replace("{c}", n) for n in names for t in templates]
        feats = [
            enc.encode_texts(prompts[i : i + batch_size])
            for i in range(0, len(prompts), batch_size)
        ]
        tax_names, parents, class_to_node = _taxonomy(categories)
        # every category an image holds, one row per (image, category): multi-label mAP
        pairs = [(i, c) for i, r in enumerate(rows) for c in inputs["image_categories"][r]]
        fields = {
            "multilabel_to_image": torch.tensor([i for i, _ in pairs], dtype=torch.long),
            "multilabel_class": torch.tensor([c for _, c in pairs], dtype=torch.long),
            "class_names": names,
            "prompt_features": torch.cat(feats).float(),
            "prompt_to_class": torch.tensor(
                [c for c in range(len(names)) for _ in templates], dtype=torch.long
            ),
            "image_labels": torch.tensor([inputs["labels"][r] for r in rows], dtype=torch.long),
            "taxonomy_names": tax_names,
            "taxonomy_parents": torch.tensor(parents, dtype=torch.long),
            "class_to_node": torch.tensor(class_to_node, dtype=torch.long),
        }
    meta = {
        **store.meta,
        "source": "curvalign.data.coco.extract_coco",
        "dataset": "coco",
        "coco_root": str(Path(root).resolve()),
        "splits_from": f"train2017 = train; captioned val2017 images cut (seed {seed}) into "
        f"val ({val_fraction:g}) and test",
        "image_labels_from": "the category of the image's largest non-crowd instance",
        "image_categories": [inputs["image_categories"][r] for r in rows],
        "boxes_from": f"non-crowd instances with both sides >= {min_box:g} px; phrase = category",
        "prompt_templates": list(templates),
        "pairs_from": "train captions: two of one photo (1.0); first captions of two photos "
        "(Jaccard overlap of their category sets)",
    }
    if "trained_on" in meta:
        meta["seen_in_training"] = seen_in_training(meta["trained_on"], "coco", names or None)
    final = store.with_fields(**fields, meta=meta)
    final.validate()
    final.save(target, overwrite=True)
    return dataclasses.replace(summary, classes=len(names))


__all__ = ["DEFAULT_TEMPLATES", "coco_inputs", "extract_coco"]
