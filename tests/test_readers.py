"""Readers on small files in each layout, and one clear error for each kind of malformed file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from curvalign.data.readers import (
    ReaderError,
    read_boxes,
    read_captions,
    read_class_folder,
    read_coco_captions,
    read_edge_list,
    read_karpathy,
    taxonomy_with_ancestors,
)


def write(path: Path, content) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_coco_captions_keeps_order_and_uncaptioned_images(tmp_path: Path) -> None:
    file = write(
        tmp_path / "coco.json",
        {
            "images": [
                {"id": 7, "file_name": "a.jpg"},
                {"id": 3, "file_name": "b.jpg"},
                {"id": 9, "file_name": "c.jpg"},
            ],
            "annotations": [
                {"image_id": 3, "caption": " two "},
                {"image_id": 7, "caption": "one"},
                {"image_id": 3, "caption": "three"},
            ],
        },
    )
    got = read_coco_captions(file)
    assert got.image_files == ["a.jpg", "b.jpg", "c.jpg"]
    assert got.captions == ["two", "one", "three"]
    assert got.caption_to_image == [1, 0, 1]
    assert got.image_splits is None
    assert read_captions(file).caption_to_image == got.caption_to_image  # layout told by keys


def test_karpathy_split_with_filepath_and_restval(tmp_path: Path) -> None:
    file = write(
        tmp_path / "dataset_coco.json",
        {
            "images": [
                {
                    "filepath": "val2014",
                    "filename": "x.jpg",
                    "split": "test",
                    "sentences": [{"raw": "a"}, {"raw": "b"}],
                },
                {"filename": "y.jpg", "split": "restval", "sentences": [{"raw": "c"}]},
            ]
        },
    )
    got = read_karpathy(file)
    assert got.image_files == ["val2014/x.jpg", "y.jpg"]
    assert got.captions == ["a", "b", "c"]
    assert got.caption_to_image == [0, 0, 1]
    assert got.image_splits == ["test", "train"]
    assert read_captions(file).image_files == got.image_files


@pytest.mark.parametrize(
    "content, reader, expected",
    [
        ("{not json", read_coco_captions, "not valid JSON (line 1"),
        ({"images": []}, read_coco_captions, "missing key 'annotations'"),
        (
            {"images": [{"id": 1}], "annotations": []},
            read_coco_captions,
            "images[0]: missing key 'file_name'",
        ),
        (
            {
                "images": [{"id": 1, "file_name": "a"}],
                "annotations": [{"image_id": 2, "caption": "x"}],
            },
            read_coco_captions,
            "annotations[0]: image_id 2 is not listed",
        ),
        (
            {
                "images": [{"id": 1, "file_name": "a"}],
                "annotations": [{"image_id": 1, "caption": 5}],
            },
            read_coco_captions,
            "annotations[0].caption: expected str, got int",
        ),
        (
            {
                "images": [{"id": 1, "file_name": "a"}, {"id": 1, "file_name": "b"}],
                "annotations": [],
            },
            read_coco_captions,
            "image id 1 appears twice",
        ),
        (
            {"images": [{"filename": "a", "split": "train", "sentences": [{"tokens": []}]}]},
            read_karpathy,
            "images[0].sentences[0]: missing key 'raw'",
        ),
        (
            {"images": [{"filename": "a", "sentences": []}]},
            read_karpathy,
            "images[0]: missing key 'split'",
        ),
        ([1, 2], read_captions, "neither COCO"),
    ],
)
def test_malformed_caption_files_name_file_and_key(
    tmp_path: Path, content, reader, expected: str
) -> None:
    file = write(tmp_path / "bad.json", content)
    with pytest.raises(ReaderError) as info:
        reader(file)
    assert str(file) in str(info.value)
    assert expected in str(info.value)


def test_missing_captions_file(tmp_path: Path) -> None:
    with pytest.raises(ReaderError, match="no such file"):
        read_captions(tmp_path / "nope.json")


def make_class_folder(tmp_path: Path) -> Path:
    root = tmp_path / "pets"
    for folder, files in {"n02": ["b.png", "a.jpg", "notes.txt"], "n01": ["c.jpeg"]}.items():
        (root / folder).mkdir(parents=True)
        for f in files:
            (root / folder / f).write_bytes(b"x")
    return root


def test_class_folder_with_clip_benchmark_files(tmp_path: Path) -> None:
    root = make_class_folder(tmp_path)
    classnames = write(
        tmp_path / "en_classnames.json", {"pets": ["cat", "dog"], "other": ["x", "y", "z"]}
    )
    templates = write(tmp_path / "templates.json", {"pets": ["a photo of a {c}.", "a {c}"]})
    got = read_class_folder(root, classnames, templates)
    assert got.class_folders == ["n01", "n02"]  # sorted, names follow this order
    assert got.class_names == ["cat", "dog"]
    assert got.image_files == ["n01/c.jpeg", "n02/a.jpg", "n02/b.png"]  # notes.txt is not an image
    assert got.image_labels == [0, 1, 1]
    texts, owners = got.prompts()
    assert texts == ["a photo of a cat.", "a cat", "a photo of a dog.", "a dog"]
    assert owners == [0, 0, 1, 1]


def test_class_folder_text_lists_and_errors(tmp_path: Path) -> None:
    root = make_class_folder(tmp_path)
    names_txt = write(tmp_path / "names.txt", "cat\n\ndog\n")
    got = read_class_folder(root, names_txt, write(tmp_path / "t.json", ["{c}"]))
    assert got.class_names == ["cat", "dog"]
    with pytest.raises(ReaderError, match="3 names for 2 class folders"):
        read_class_folder(root, write(tmp_path / "n3.json", ["a", "b", "c"]), tmp_path / "t.json")
    with pytest.raises(ReaderError, match=r"has no '\{c\}'"):
        read_class_folder(root, names_txt, write(tmp_path / "t2.json", ["a photo"]))
    with pytest.raises(ReaderError, match="none named 'pets'"):
        read_class_folder(
            root,
            write(tmp_path / "multi.json", {"a": ["x", "y"], "b": ["x", "y"]}),
            tmp_path / "t.json",
        )
    with pytest.raises(ReaderError, match="expected a JSON list of strings"):
        read_class_folder(root, write(tmp_path / "num.json", [1, 2]), tmp_path / "t.json")


def test_edge_list_is_a_format(tmp_path: Path) -> None:
    file = write(
        tmp_path / "is_a.txt",
        "# ImageNet style\nn0 n1\nn0 n2\nn1 n3\n\nn2 n3  # second parent\nn9 n8\n",
    )
    tax = read_edge_list(file)
    idx = tax.index()
    assert tax.parents[idx["n0"]] == -1 and tax.parents[idx["n9"]] == -1
    assert tax.parents[idx["n3"]] == idx["n1"]  # first parent kept
    assert tax.extra_parent_edges == 1
    sub, nodes = taxonomy_with_ancestors(tax, ["n3", "missing"])
    assert sorted(sub.names) == ["n0", "n1", "n3"]
    assert sub.parents[nodes["n3"]] == nodes["n1"] and sub.parents[nodes["n1"]] == nodes["n0"]


@pytest.mark.parametrize(
    "content, expected",
    [
        ("a b c\n", "line 1: expected 'parent child'"),
        ("a a\n", "line 1: 'a' is its own parent"),
        ("a b\nb c\nc a\n", "cycle"),
        ("# nothing\n", "no 'parent child' lines"),
    ],
)
def test_edge_list_errors(tmp_path: Path, content: str, expected: str) -> None:
    file = write(tmp_path / "tax.txt", content)
    with pytest.raises(ReaderError, match=expected) as info:
        read_edge_list(file)
    assert str(file) in str(info.value)


def test_boxes_jsonl_and_json_list(tmp_path: Path) -> None:
    rows = [
        {"image": "a.jpg", "box": [0, 1, 5, 6.5], "phrase": " a dog "},
        {"image": "b.jpg", "box": [2, 2, 3, 3], "phrase": "x"},
    ]
    jsonl = write(tmp_path / "b.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    listed = write(tmp_path / "b.json", rows)
    for file in (jsonl, listed):
        boxes = read_boxes(file)
        assert [(b.image_file, b.box, b.phrase) for b in boxes] == [
            ("a.jpg", (0.0, 1.0, 5.0, 6.5), "a dog"),
            ("b.jpg", (2.0, 2.0, 3.0, 3.0), "x"),
        ]


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"image": "a", "box": [0, 0, 1], "phrase": "p"}', "line 2: 'box' must be four numbers"),
        ('{"image": "a", "box": [3, 0, 1, 1], "phrase": "p"}', "line 2: 'box' needs x0 < x1"),
        ('{"image": "a", "box": [0, 0, 1, 1]}', "line 2: missing key 'phrase'"),
        ('{"image": "a", "box": [0, 0, 1, 1], "phrase": "  "}', "line 2: 'phrase' is empty"),
        ("not json", "line 2: not a JSON object"),
    ],
)
def test_boxes_errors_name_the_line(tmp_path: Path, line: str, expected: str) -> None:
    good = '{"image": "a", "box": [0, 0, 1, 1], "phrase": "p"}'
    file = write(tmp_path / "boxes.jsonl", good + "\n" + line + "\n")
    with pytest.raises(ReaderError, match=expected) as info:
        read_boxes(file)
    assert str(file) in str(info.value)
