"""A store and a run know their encoder and their items (issue 14, part 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from curvalign.data.extract import extract_features
from curvalign.data.features import ITEMS_FILE, FeatureStore, FeatureStoreError, TextPart
from test_extract import PixelEncoder, make_collection


def _store(**items) -> FeatureStore:
    return FeatureStore(
        image_features=torch.randn(3, 4),
        text=TextPart(torch.randn(5, 2)),
        text_to_image=torch.tensor([0, 0, 1, 2, 2]),
        meta={"encoder": "test:pixels"},
        **items,
    )


def test_items_round_trip_and_subset(tmp_path: Path) -> None:
    store = _store(
        image_paths=["a.png", "b/b.jpg", "c.png"], texts=[f"caption {i}" for i in range(5)]
    )
    store.save(tmp_path / "s")
    assert json.loads((tmp_path / "s" / ITEMS_FILE).read_text())["image_paths"][1] == "b/b.jpg"
    back = FeatureStore.load(tmp_path / "s")
    assert back.image_paths == store.image_paths and back.texts == store.texts
    assert back.image_texts is None
    sub = back.subset([2, 0])
    assert sub.image_paths == ["c.png", "a.png"]
    # texts follow their image: captions 0, 1 (image 0) and 3, 4 (image 2), in store order
    assert sub.texts == ["caption 0", "caption 1", "caption 3", "caption 4"]
    assert sub.text_to_image.tolist() == [1, 1, 0, 0]


def test_old_store_without_items_loads_and_bad_items_are_refused(tmp_path: Path) -> None:
    _store().save(tmp_path / "old")
    assert not (tmp_path / "old" / ITEMS_FILE).exists()
    assert FeatureStore.load(tmp_path / "old").texts is None
    with pytest.raises(FeatureStoreError, match="'texts' has 2 entries but the store has 5 texts"):
        _store(texts=["x", "y"]).validate()
    _store(texts=[str(i) for i in range(5)]).save(tmp_path / "bad")
    (tmp_path / "bad" / ITEMS_FILE).write_text(json.dumps({"texts": ["only one"]}))
    with pytest.raises(FeatureStoreError, match=f"{ITEMS_FILE} 'texts' has 1 entries"):
        FeatureStore.load(tmp_path / "bad")


def test_extract_records_paths_captions_and_root(tmp_path: Path) -> None:
    c = make_collection(tmp_path)
    extract_features(
        PixelEncoder(), c["images"], tmp_path / "s", captions=c["captions"], progress=False
    )
    store = FeatureStore.load(tmp_path / "s")
    kept = [f for f in c["files"] if f not in ("dog/truncated.jpg", "cat/missing.png")]
    assert store.image_paths == kept
    assert store.meta["images_root"] == str(c["images"].resolve())
    assert store.meta["encoder"] == "test:pixels"
    for row, owner in enumerate(store.text_to_image.tolist()):
        assert store.texts[row].endswith(f"about picture {kept[owner]}")


def test_training_copies_the_encoder_spec_into_the_run(tmp_path: Path, one_thread) -> None:
    from curvalign.runs import read_meta
    from curvalign.train.trainer import train

    store = _store()
    store.meta["encoder"] = "open_clip:/models/tiny.json:/models/tiny.pt"
    run_dir = train(
        "clip", store, tmp_path / "run", steps=1, overrides=["batch_size=2"], show_progress=False
    )
    assert read_meta(run_dir)["encoder"] == "open_clip:/models/tiny.json:/models/tiny.pt"


def test_wordnet_store_keeps_both_views_and_items_name_synsets(monkeypatch, tmp_path) -> None:
    import importlib.util

    from curvalign.data import encoders

    try:
        from curvalign.data.wordnet import build_tree, wordnet_dir

        wordnet_dir()
    except ValueError:
        pytest.skip("needs the WordNet database (apt-get install wordnet-base)")
    if importlib.util.find_spec("nltk") is None:
        pytest.skip("needs nltk (pip install 'curvalign[wordnet]')")
    from curvalign.data import load_data
    from curvalign.index.searcher import _StoreItems
    from test_wordnet import LetterEncoder

    monkeypatch.setattr(encoders, "load_encoder", lambda spec, device="cpu": LetterEncoder())
    monkeypatch.setenv("CURVALIGN_CACHE", str(tmp_path / "cache"))
    store = load_data("wordnet:big_cat.n.01")
    tree = build_tree("big_cat.n.01")
    assert store.image_texts == tree.names_text and store.texts == tree.texts
    again = load_data("wordnet:big_cat.n.01")  # from the cache: the items travel in items.json
    assert again.image_texts == tree.names_text and again.texts == tree.texts
    lion = tree.synsets.index("lion.n.01")
    item = _StoreItems(store, "image")(lion, lion)
    assert item.synset == item.class_name == "lion.n.01" and item.caption.startswith("lion")
    gloss = tree.text_to_node.index(lion)
    text_item = _StoreItems(store, "text")(gloss, gloss)
    assert text_item.caption == tree.texts[gloss] and text_item.synset == "lion.n.01"
