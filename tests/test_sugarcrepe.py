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
    result = evaluate(recipe, store, diagnostics=False)["compositional"]
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
