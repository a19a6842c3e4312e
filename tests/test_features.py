"""Feature store: validation of every kind of bad input, save/load round trips, subsets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvalign.data.features import (
    FLOAT_FIELDS,
    GROUPS,
    LIST_FIELDS,
    TENSOR_FIELDS,
    FeatureStore,
    FeatureStoreError,
    TextPart,
)


def tiny_store(seed: int = 0) -> FeatureStore:
    """A hand-made store with every optional group: 6 images, 3 of them with two captions."""
    g = torch.Generator().manual_seed(seed)
    ni, nt, di, dt = 6, 9, 5, 4
    return FeatureStore(
        image_features=torch.randn(ni, di, generator=g),
        text=TextPart(
            torch.randn(nt, dt, generator=g),
            torch.randn(nt, 3, 2, generator=g),
            (torch.arange(3)[None, :] <= torch.arange(nt)[:, None] % 3).long(),
        ),
        text_to_image=torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5]),
        image_split=torch.tensor([0, 0, 0, 0, 1, 1]),
        split_names=["train", "test"],
        box_image_features=torch.randn(7, di, generator=g),
        box_text_features=torch.randn(7, dt, generator=g),
        box_to_image=torch.tensor([0, 1, 1, 2, 3, 4, 5]),
        pair_a=TextPart(
            torch.randn(3, dt, generator=g),
            torch.randn(3, 2, 2, generator=g),
            torch.tensor([[1, 1], [1, 0], [1, 1]]),
        ),
        pair_b=TextPart(
            torch.randn(3, dt, generator=g),
            torch.randn(3, 4, 2, generator=g),
            torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]),
        ),
        pair_scores=torch.tensor([0.9, 0.5, 0.0]),
        class_names=["cat", "dog", "car"],
        prompt=TextPart(
            torch.randn(6, dt, generator=g),
            torch.randn(6, 2, 2, generator=g),
            torch.ones(6, 2, dtype=torch.long),
        ),
        prompt_to_class=torch.tensor([0, 0, 1, 1, 2, 2]),
        image_labels=torch.tensor([0, 1, 2, -1, 0, 1]),
        taxonomy_names=["thing", "animal", "vehicle", "cat", "dog", "car"],
        taxonomy_parents=torch.tensor([-1, 0, 0, 1, 1, 2]),
        class_to_node=torch.tensor([3, 4, 5]),
        negative=TextPart(
            torch.randn(4, dt, generator=g),
            torch.randn(4, 3, 2, generator=g),
            torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        ),
        negative_to_text=torch.tensor([6, 6, 7, 8]),
        negative_kind=torch.tensor([0, 1, 0, 1]),
        negative_kind_names=["object_replaced", "attribute_replaced"],
        chain_features=torch.randn(2, 3, dt, generator=g),
        multilabel_to_image=torch.tensor([0, 0, 1, 4, 5]),
        multilabel_class=torch.tensor([0, 2, 1, 0, 1]),
        meta={"source": "test", "sizes": [6, 9]},
    )


def assert_same(a: FeatureStore, b: FeatureStore) -> None:
    for name in TENSOR_FIELDS:
        x, y = a.field(name), b.field(name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            assert torch.equal(x, y), name
    for name in LIST_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    assert a.meta == b.meta


def test_tiny_store_is_valid_and_has_every_group():
    store = tiny_store()
    store.validate()
    assert store.groups == list(GROUPS)


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip(tmp_path: Path, mmap: bool):
    store = tiny_store()
    store.save(tmp_path / "s")
    loaded = FeatureStore.load(tmp_path / "s", mmap=mmap)
    assert_same(store, loaded)


def test_round_trip_without_optional_groups_and_float64(tmp_path: Path):
    store = FeatureStore(
        image_features=torch.randn(3, 2, dtype=torch.float64),
        text=TextPart(torch.randn(2, 3, dtype=torch.float64)),
        text_to_image=torch.tensor([2, 0]),
    )
    store.save(tmp_path / "s")
    loaded = FeatureStore.load(tmp_path / "s")
    assert_same(store, loaded)
    assert loaded.groups == []
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "image_features.npy",
        "meta.json",
        "text_features.npy",
        "text_to_image.npy",
    ]


def test_mmap_load_is_memory_mapped_and_leaves_file_unchanged(tmp_path: Path):
    tiny_store().save(tmp_path / "s")
    before = (tmp_path / "s" / "image_features.npy").read_bytes()
    loaded = FeatureStore.load(tmp_path / "s", mmap=True)
    loaded.image_features[0, 0] = 123.0  # copy-on-write: only this process's pages change
    assert (tmp_path / "s" / "image_features.npy").read_bytes() == before
    assert FeatureStore.load(tmp_path / "s").image_features[0, 0] != 123.0


def test_bfloat16_is_saved_as_float32(tmp_path: Path):
    store = tiny_store()
    store.image_features = store.image_features.bfloat16()
    store.save(tmp_path / "s")
    loaded = FeatureStore.load(tmp_path / "s")
    assert loaded.image_features.dtype == torch.float32
    assert torch.equal(loaded.image_features, store.image_features.float())


def test_meta_json_describes_counts_and_groups(tmp_path: Path):
    tiny_store().save(tmp_path / "s")
    header = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert (
        header["counts"]["images"] == 6
        and header["counts"]["texts"] == 9
        and header["counts"]["boxes"] == 7
    )
    assert header["dims"] == {"image": 5, "text": 4, "token": 2}
    assert header["groups"] == list(GROUPS)
    assert header["negative_kind_names"] == ["object_replaced", "attribute_replaced"]
    assert header["arrays"]["chain_features"] == {"shape": [2, 3, 4], "dtype": "float32"}


def test_save_refuses_to_overwrite(tmp_path: Path):
    store = tiny_store()
    store.save(tmp_path / "s")
    with pytest.raises(FeatureStoreError, match="already exists"):
        store.save(tmp_path / "s")
    other = tiny_store(seed=1)
    other.save(tmp_path / "s", overwrite=True)
    assert_same(other, FeatureStore.load(tmp_path / "s"))
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary directories left behind


def test_save_never_replaces_a_directory_that_is_not_a_store(tmp_path: Path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("precious")
    with pytest.raises(FeatureStoreError, match="not a feature store"):
        tiny_store().save(tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "precious"


def test_save_rejects_meta_that_is_not_json(tmp_path: Path):
    store = replace(tiny_store(), meta={"bad": object()})
    with pytest.raises(FeatureStoreError, match="meta"):
        store.save(tmp_path / "s")
    assert not any(tmp_path.iterdir())


# --- bad stores in memory ----------------------------------------------------------------------


def broken(**changes) -> FeatureStore:
    """The tiny store with the fields named by their on-disk names replaced."""
    return tiny_store().with_fields(**changes)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (
            {"text_to_image": torch.tensor([0, 1])},
            r"text_to_image.* 2 entries .*text_features.* 9 rows",
        ),
        (
            {"text_to_image": torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 6])},
            r"text_to_image.*outside \[0, 6\).*row 8: 6",
        ),
        ({"text_to_image": torch.zeros(9)}, r"text_to_image.*integer"),
        ({"image_features": torch.randn(6)}, r"image_features.*2-D"),
        ({"text_features": torch.randn(9, 4).long()}, r"text_features.*floating"),
        (
            {"box_image_features": torch.randn(7, 3)},
            r"box_image_features.*dimension 3 .*image_features has 5",
        ),
        ({"prompt_features": torch.randn(6, 5)}, r"prompt_features.*dimension 5"),
        ({"chain_features": torch.randn(2, 4)}, r"chain_features.*3-D"),
        ({"box_to_image": torch.tensor([0, 1, 1, 2, 3, 4, 9])}, r"box_to_image.*outside"),
        (
            {"prompt_to_class": torch.tensor([0, 0, 1, 1, 2, 3])},
            r"prompt_to_class.*outside \[0, 3\)",
        ),
        ({"image_labels": torch.tensor([0, 1, 2, -2, 0, 1])}, r"image_labels.*outside \[-1, 3\)"),
        ({"negative_to_text": torch.tensor([6, 6, 7, 9])}, r"negative_to_text.*outside \[0, 9\)"),
        ({"negative_kind": torch.tensor([0, 1, 0, 2])}, r"negative_kind.*outside"),
        ({"class_to_node": torch.tensor([3, 4, 6])}, r"class_to_node.*outside \[0, 6\)"),
        (
            {"taxonomy_parents": torch.tensor([-1, 0, 0, 1, 1, 7])},
            r"taxonomy_parents.*outside \[-1, 6\)",
        ),
        (
            {"taxonomy_parents": torch.tensor([-1, 3, 0, 1, 1, 2])},
            r"taxonomy_parents.*cycle.*animal",
        ),
        ({"taxonomy_parents": torch.tensor([-1, 1, 0, 1, 1, 2])}, r"cycle \(animal -> animal\)"),
        ({"image_split": torch.tensor([0, 0, 0, 0, 1, 2])}, r"image_split.*outside \[0, 2\)"),
        ({"class_to_node": torch.tensor([3, 4])}, r"class_to_node.*2 entries.*3 classes"),
        ({"taxonomy_names": ["a", "b"]}, r"taxonomy_parents.*6 entries.*names 2 nodes"),
        ({"pair_scores": torch.tensor([0.9, 1.5, 0.0])}, r"pair_scores.*outside \[0, 1\]"),
        ({"pair_scores": torch.tensor([0.9, 0.5])}, r"pair_scores.*2 entries"),
        ({"box_to_image": None}, r"group 'boxes' is only partly present.*lacks box_to_image"),
        ({"negative_kind_names": None}, r"group 'negatives'.*lacks negative_kind_names"),
        ({"split_names": None}, r"group 'splits'"),
        (
            {
                "class_names": None,
                "prompt_features": None,
                "prompt_token_features": None,
                "prompt_token_mask": None,
                "prompt_to_class": None,
                "image_labels": None,
            },
            r"taxonomy group needs the classes",
        ),
        ({"split_names": "train"}, r"split_names.*list of strings"),
    ],
)
def test_validate_rejects(changes, pattern):
    with pytest.raises(FeatureStoreError, match=pattern):
        broken(**changes).validate()


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_validate_counts_nonfinite_rows(name: str):
    value = tiny_store().field(name).clone()
    value[0] = float("nan")
    value[-1] = float("inf")
    store = broken(**{name: value})
    with pytest.raises(FeatureStoreError, match=rf"{name}.* 2 rows with NaN or inf.*first: row 0"):
        store.validate()
    store.validate(check_values=False)  # the scan can be skipped


def test_nonfinite_scan_is_chunked(monkeypatch):
    import curvalign.data.features as features

    monkeypatch.setattr(features, "_SCAN_ELEMENTS", 7)  # one or two rows per chunk
    store = tiny_store()
    store.image_features[[0, 3, 5], 2] = float("nan")
    with pytest.raises(FeatureStoreError, match=r"image_features.* 3 rows.*first: row 0"):
        store.validate()


def test_images_without_captions_are_legal():
    store = broken(
        text_features=torch.randn(2, 4),
        text_to_image=torch.tensor([0, 0]),
        negative_to_text=torch.tensor([0, 1, 1, 0]),
        text_token_features=None,
        text_token_mask=None,
    )
    store.validate()


# --- bad stores on disk --------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    tiny_store().save(tmp_path / "s")
    return tmp_path / "s"


def edit_meta(path: Path, edit) -> None:
    header = json.loads((path / "meta.json").read_text())
    edit(header)
    (path / "meta.json").write_text(json.dumps(header))


def test_load_missing_directory(tmp_path: Path):
    with pytest.raises(FeatureStoreError, match="no such directory"):
        FeatureStore.load(tmp_path / "nowhere")


def test_load_missing_meta(saved: Path):
    (saved / "meta.json").unlink()
    with pytest.raises(FeatureStoreError, match="meta.json is missing"):
        FeatureStore.load(saved)


def test_load_unreadable_meta(saved: Path):
    (saved / "meta.json").write_text("{not json")
    with pytest.raises(FeatureStoreError, match="meta.json is not readable JSON"):
        FeatureStore.load(saved)


def test_load_unsupported_version(saved: Path):
    edit_meta(saved, lambda h: h.update(version=99))
    with pytest.raises(FeatureStoreError, match="version 99"):
        FeatureStore.load(saved)


def test_load_not_a_store(saved: Path):
    (saved / "meta.json").write_text("[1, 2]")
    with pytest.raises(FeatureStoreError, match="does not describe a curvalign feature store"):
        FeatureStore.load(saved)


def test_load_missing_array(saved: Path):
    (saved / "box_to_image.npy").unlink()
    with pytest.raises(FeatureStoreError, match=r"box_to_image.npy is missing"):
        FeatureStore.load(saved)


def test_load_missing_list_field(saved: Path):
    edit_meta(saved, lambda h: h.pop("class_names"))
    with pytest.raises(FeatureStoreError, match=r"class_names"):
        FeatureStore.load(saved)


def test_load_truncated_array(saved: Path):
    data = (saved / "text_features.npy").read_bytes()
    (saved / "text_features.npy").write_bytes(data[: len(data) - 10])
    with pytest.raises(FeatureStoreError, match=r"text_features.npy is not a readable"):
        FeatureStore.load(saved)


def test_load_replaced_array_with_other_shape(saved: Path):
    np.save(saved / "text_to_image.npy", np.zeros(4, dtype=np.int64))
    with pytest.raises(
        FeatureStoreError, match=r"text_to_image.npy has shape \[4\] but meta.json records \[9\]"
    ):
        FeatureStore.load(saved)


def test_load_names_the_file_of_a_bad_value(saved: Path):
    labels = np.load(saved / "image_labels.npy")
    labels[2] = 7
    np.save(saved / "image_labels.npy", labels)
    with pytest.raises(FeatureStoreError, match=r"image_labels.npy has 1 entries outside"):
        FeatureStore.load(saved)


@pytest.mark.parametrize("mmap", [False, True])
def test_load_finds_nan_in_files(saved: Path, mmap: bool):
    feats = np.load(saved / "negative_features.npy")
    feats[3, 0] = np.nan
    np.save(saved / "negative_features.npy", feats)
    with pytest.raises(
        FeatureStoreError,
        match=r"negative_features.npy has 1 row with NaN or inf values \(first: row 3\)",
    ):
        FeatureStore.load(saved, mmap=mmap, check_values=True)


def _nan_in_place(saved: Path) -> None:
    """A NaN written into image_features.npy without changing the file's size."""
    feats = np.load(saved / "image_features.npy")
    feats[2, 1] = np.nan
    np.save(saved / "image_features.npy", feats)


def test_load_trusts_the_recorded_value_scan(saved: Path, monkeypatch):
    # save() scanned every float and recorded it: a plain open reads no float again, so a file
    # edited in place after the save (same size) is only caught when the scan is forced
    header = json.loads((saved / "meta.json").read_text())
    record = header["values_checked"]
    assert record["nonfinite_rows"] == 0
    assert set(record["file_bytes"]) == {f"{n}.npy" for n in FLOAT_FIELDS}
    _nan_in_place(saved)
    FeatureStore.load(saved, mmap=True)  # O(1): no scan
    with pytest.raises(FeatureStoreError, match=r"image_features.npy has 1 row with NaN"):
        FeatureStore.load(saved, mmap=True, check_values=True)
    monkeypatch.setenv("CURVALIGN_CHECK_VALUES", "1")  # what `curvalign --check` sets
    with pytest.raises(FeatureStoreError, match=r"image_features.npy has 1 row with NaN"):
        FeatureStore.load(saved, mmap=True)


def test_load_scans_when_the_record_is_stale_or_absent(saved: Path):
    _nan_in_place(saved)
    header = json.loads((saved / "meta.json").read_text())
    # a file of another size than recorded: the record no longer covers it
    header["values_checked"]["file_bytes"]["image_features.npy"] += 8
    (saved / "meta.json").write_text(json.dumps(header))
    with pytest.raises(FeatureStoreError, match=r"image_features.npy has 1 row with NaN"):
        FeatureStore.load(saved, mmap=True)
    # a store written before the record existed is scanned on every open, as before
    del header["values_checked"]
    (saved / "meta.json").write_text(json.dumps(header))
    with pytest.raises(FeatureStoreError, match=r"image_features.npy has 1 row with NaN"):
        FeatureStore.load(saved, mmap=True)
    FeatureStore.load(saved, mmap=True, check_values=False)  # unless told to skip it


def test_load_rejects_float_indices(saved: Path):
    np.save(saved / "text_to_image.npy", np.zeros(9, dtype=np.float32))
    with pytest.raises(
        FeatureStoreError, match=r"text_to_image.npy holds float32 values; integer indices expected"
    ):
        FeatureStore.load(saved)


def test_load_converts_int32_indices(saved: Path):
    np.save(saved / "text_to_image.npy", np.load(saved / "text_to_image.npy").astype(np.int32))
    assert FeatureStore.load(saved).text_to_image.dtype == torch.int64


# --- subsets and accessors --------------------------------------------------------------------


def test_subset_reindexes_captions_boxes_labels_and_negatives():
    store = tiny_store()
    sub = store.subset([5, 2])
    sub.validate()
    assert torch.equal(sub.image_features, store.image_features[[5, 2]])
    # captions keep their original order; their image ids are the new positions
    assert torch.equal(sub.text_features, store.text_features[[3, 4, 7, 8]])
    assert sub.text_to_image.tolist() == [1, 1, 0, 0]
    assert torch.equal(sub.box_image_features, store.box_image_features[[3, 6]])
    assert sub.box_to_image.tolist() == [1, 0]
    assert sub.image_labels.tolist() == [1, 2] and sub.image_split.tolist() == [1, 0]
    # negatives 2, 3 compete with old texts 7, 8 (now 2, 3); negatives of old text 6 are dropped
    assert torch.equal(sub.negative_features, store.negative_features[[2, 3]])
    assert sub.negative_to_text.tolist() == [2, 3]
    assert torch.equal(sub.prompt_features, store.prompt_features)
    assert sub.meta == store.meta


def test_subset_rejects_bad_ids():
    with pytest.raises(ValueError, match="duplicates"):
        tiny_store().subset([1, 1])
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        tiny_store().subset([6])


def test_split_accessors():
    store = tiny_store()
    assert store.split_image_ids("test").tolist() == [4, 5]
    assert store.texts_of_split("test").tolist() == [6, 7, 8]
    assert store.texts_of_split("train").tolist() == list(range(6))
    assert store.select_split("test").num_texts == 3
    assert store.prompt_ids_of_class(1).tolist() == [2, 3]
    with pytest.raises(ValueError, match="split 'val' not in this store"):
        store.texts_of_split("val")


def test_repr_is_a_summary():
    text = repr(tiny_store())
    assert text.startswith("FeatureStore(images=6x5, texts=9x4") and "tensor" not in text


def test_overwrite_a_store_that_is_memory_mapped_from_the_same_path(tmp_path: Path):
    tiny_store().save(tmp_path / "s")
    mapped = FeatureStore.load(tmp_path / "s", mmap=True)
    changed = replace(mapped, meta={"source": "changed"})
    changed.save(tmp_path / "s", overwrite=True)  # reads the old files while replacing them
    assert_same(
        replace(tiny_store(), meta={"source": "changed"}), FeatureStore.load(tmp_path / "s")
    )


@settings(max_examples=30, deadline=None)
@given(st.permutations(range(6)), st.integers(0, 6))
def test_subset_keeps_each_caption_with_its_image(order: list[int], size: int):
    store = tiny_store()
    ids = order[:size]
    sub = store.subset(ids)
    sub.validate()
    for new, old in enumerate(ids):
        mine = sub.text_features[sub.text_to_image == new]
        assert torch.equal(mine, store.text_features[store.text_to_image == old])
        assert torch.equal(
            sub.box_image_features[sub.box_to_image == new],
            store.box_image_features[store.box_to_image == old],
        )
    # texts keep their original order, so new text j is the j-th old text whose image is kept
    old_text = torch.nonzero(
        torch.isin(store.text_to_image, torch.tensor(ids, dtype=torch.long))
    ).flatten()
    expected = torch.isin(store.negative_to_text, old_text)
    assert torch.equal(sub.negative_features, store.negative_features[expected])
    assert torch.equal(old_text[sub.negative_to_text], store.negative_to_text[expected])


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_with_empty_groups(tmp_path: Path, mmap: bool):
    store = tiny_store().with_fields(
        pair_a_features=torch.zeros(0, 4),
        pair_b_features=torch.zeros(0, 4),
        pair_scores=torch.zeros(0),
        pair_a_token_features=torch.zeros(0, 2, 2),
        pair_a_token_mask=torch.zeros(0, 2, dtype=torch.long),
        pair_b_token_features=torch.zeros(0, 4, 2),
        pair_b_token_mask=torch.zeros(0, 4, dtype=torch.long),
        chain_features=torch.zeros(0, 3, 4),
    )
    store.save(tmp_path / "s")
    assert_same(store, FeatureStore.load(tmp_path / "s", mmap=mmap))


def test_save_refuses_an_invalid_store(tmp_path: Path):
    store = tiny_store()
    store.text_features[2, 1] = float("nan")
    with pytest.raises(FeatureStoreError, match=r"text_features.* 1 row with NaN"):
        store.save(tmp_path / "s")
    assert not any(tmp_path.iterdir())


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([f for f in TENSOR_FIELDS if f not in FLOAT_FIELDS]),
    st.integers(0, 20),
    st.integers(-3, 12),
)
def test_any_corrupted_index_gives_a_store_error_or_a_valid_store(name: str, row: int, value: int):
    column = tiny_store().field(name).clone()
    column[row % len(column)] = value
    store = broken(**{name: column})
    try:
        store.validate()
    except FeatureStoreError as err:
        assert name in str(err)
    else:  # still valid: every accessor works on it
        store.subset(torch.arange(store.num_images).flip(0)).validate()


def test_cli_check_forces_the_scan(saved: Path, tmp_path: Path, monkeypatch):
    # `curvalign --check COMMAND` scans a store whose record would have let it open unscanned
    from typer.testing import CliRunner

    from curvalign.cli import app

    monkeypatch.setenv("CURVALIGN_CHECK_VALUES", "0")  # restored after the test
    _nan_in_place(saved)
    args = ["train", "--recipe", "clip", "--data", f"features:{saved}", "--steps", "1"]
    result = CliRunner().invoke(app, ["--check", *args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "image_features.npy has 1 row with NaN" in result.output


# --- text parts as records ---------------------------------------------------------------------


def test_a_store_written_in_the_on_disk_layout_loads_into_text_part_records(tmp_path: Path):
    """The on-disk format did not change when the text parts became ``TextPart`` records: a
    directory written by hand in the documented layout (meta.json + one .npy per field under its
    flat name) loads, each part's files in one record, and saving it again writes the same bytes."""
    g = np.random.default_rng(0)
    arrays = {
        "image_features": g.standard_normal((3, 4)).astype(np.float32),
        "text_features": g.standard_normal((4, 2)).astype(np.float32),
        "text_to_image": np.array([0, 0, 1, 2], dtype=np.int64),
        "pair_a_features": g.standard_normal((2, 2)).astype(np.float32),
        "pair_b_features": g.standard_normal((2, 2)).astype(np.float32),
        "pair_scores": np.array([0.5, 1.0], dtype=np.float32),
        "text_token_features": g.standard_normal((4, 3, 5)).astype(np.float32),
        "text_token_mask": np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=np.int64),
    }
    old = tmp_path / "old"
    old.mkdir()
    for name, value in arrays.items():
        np.save(old / f"{name}.npy", value, allow_pickle=False)
    header = {
        "format": "curvalign.feature_store",
        "version": 1,
        "groups": ["text_pairs", "tokens"],
        "arrays": {n: {"shape": list(v.shape), "dtype": str(v.dtype)} for n, v in arrays.items()},
        "meta": {"source": "written by hand"},
    }
    (old / "meta.json").write_text(json.dumps(header))

    store = FeatureStore.load(old)
    assert isinstance(store.text, TextPart) and store.text.has_tokens
    np.testing.assert_array_equal(store.text.token_mask.numpy(), arrays["text_token_mask"])
    np.testing.assert_array_equal(store.pair_b.features.numpy(), arrays["pair_b_features"])
    assert store.pair_a is not None and not store.pair_a.has_tokens
    assert store.prompt is None and store.negative is None
    assert store.groups == ["text_pairs", "tokens"] and store.token_dim == 5

    store.save(tmp_path / "again")
    for name in arrays:
        assert (tmp_path / "again" / f"{name}.npy").read_bytes() == (
            old / f"{name}.npy"
        ).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "again").glob("*.npy")) == sorted(
        f"{n}.npy" for n in arrays
    )


def test_text_part_fields_speak_the_on_disk_names():
    store = tiny_store()
    assert store.field("prompt_token_mask") is store.prompt.token_mask
    assert store.fields()["negative_features"] is store.negative.features
    changed = store.with_fields(pair_b_token_features=torch.zeros(3, 4, 2))
    assert torch.equal(changed.pair_b.token_features, torch.zeros(3, 4, 2))
    assert changed.pair_b.features is store.pair_b.features
    assert changed.text.token_mask is store.text.token_mask
    # tokens cannot exist without the part's pooled features, in memory or on disk
    with pytest.raises(FeatureStoreError, match="prompt_tokens group needs the classes group"):
        store.with_fields(prompt_features=None, prompt_to_class=None, class_names=None)
    with pytest.raises(FeatureStoreError, match="must be a TextPart"):
        replace(store, negative=store.negative.features).validate()


def test_subset_takes_every_attribute_of_a_text_part():
    store = tiny_store()
    sub = store.subset(torch.tensor([2, 0]))
    rows = torch.tensor([0, 1, 3, 4])  # the captions of images 0 and 2, in caption order
    torch.testing.assert_close(sub.text.token_features, store.text.token_features[rows])
    torch.testing.assert_close(sub.text.token_mask, store.text.token_mask[rows])
    assert sub.pair_a is store.pair_a  # parts not tied to images are kept whole
