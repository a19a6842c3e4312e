"""Searcher: free text and image files through the run's own encoder (issue 14, part 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _search_world import build_world, needs_open_clip
from curvalign.index import load_index
from curvalign.index.searcher import Searcher, SearchError, poincare_disk_2d

pytestmark = needs_open_clip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    return build_world(tmp_path_factory.mktemp("search_world"))


def test_text_query_matches_the_manual_pipeline_and_names_items(world) -> None:
    searcher = Searcher.open(world.runs["meru"], world.indexes["meru"])
    assert searcher.encoder_spec == world.encoder  # recorded by extract, copied by training
    result = searcher.search_text("caption 0 about picture dog/img0.jpg", k=3)
    assert result.ranked_by == "distance" and [h.rank for h in result.hits] == [1, 2, 3]
    # The same query by hand: encoder -> head -> exact index.
    enc = searcher.encoder()
    feats = enc.encode_texts(["caption 0 about picture dog/img0.jpg"])
    with torch.no_grad():
        point = searcher.recipe.embed_texts(feats)["point"].numpy()
    dist, ids = load_index(world.indexes["meru"]).search(point, 3)
    assert [h.id for h in result.hits] == ids[0].tolist()
    np.testing.assert_allclose([h.distance for h in result.hits], dist[0])
    assert all(h.score == -h.distance for h in result.hits)
    # Items: the image's path under the images root and its first caption.
    for hit in result.hits:
        assert hit.item.path == world.files[hit.id]
        assert hit.item.caption == f"caption 0 about picture {world.files[hit.id]}"
        assert (world.images / hit.item.path).is_file()
    assert searcher.images_root == str(world.images.resolve())
    assert result.disk is not None and len(result.disk["hits"]) == 3
    assert searcher.info()["hyperbolic"] is True


def test_batch_forms_and_image_queries_on_a_text_index(world, tmp_path: Path) -> None:
    from curvalign.index.embed import build_from_embeddings, load_embeddings

    searcher = Searcher.open(world.runs["meru"], world.indexes["meru"])
    batch = searcher.search_texts(["a dog", "two cats"], k=2)
    single = searcher.search_text("two cats", k=2)
    assert [h.id for h in batch[1].hits] == [h.id for h in single.hits]
    with pytest.raises(SearchError, match="holds images, ranked for text queries; an image query"):
        searcher.search_image(world.images / world.files[0])
    texts = build_from_embeddings(
        load_embeddings(world.embeddings["meru"]), tmp_path / "idx-texts", side="texts"
    )
    by_image = Searcher.open(world.runs["meru"], texts)
    path = world.images / world.files[2]
    a = by_image.search_image(path, k=4)
    b = by_image.search_images([path.read_bytes()], k=4)[0]
    assert [h.id for h in a.hits] == [h.id for h in b.hits] and len(a.hits) == 4
    assert all(h.item.side == "text" and h.item.caption.startswith("caption") for h in a.hits)
    with pytest.raises(SearchError, match="a text query does not fit"):
        by_image.search_text("a dog")
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(SearchError, match=f"image {broken}: cannot read it as an image"):
        by_image.search_image(broken)


def test_rerank_recipe_and_ann_index(world) -> None:
    atmg = Searcher.open(world.runs["atmg"], world.indexes["atmg"], candidates=3)
    result = atmg.search_text("a photo of a cat", k=3)
    assert result.ranked_by == "score" and result.hits[0].distance is None
    scores = [h.score for h in result.hits]
    assert scores == sorted(scores, reverse=True)
    assert result.disk is not None  # AtMG points are Lorentz points too
    exact = Searcher.open(world.runs["meru"], world.indexes["meru"], items=False)
    ann = Searcher.open(world.runs["meru"], world.indexes["meru-hnsw"], items=False)
    q = ["caption 1 about picture cat/img1.png"]
    assert [h.id for h in ann.search_texts(q, 6)[0].hits] == [
        h.id for h in exact.search_texts(q, 6)[0].hits
    ]
    assert exact.search_text(q[0]).hits[0].item.caption is None  # items=False: ids only


def test_clear_errors_before_heavy_work(world, tmp_path: Path) -> None:
    missing = tmp_path / "gone.pt"
    with pytest.raises(SearchError, match=f"{missing}.*never downloads"):
        Searcher.open(
            world.runs["meru"], world.indexes["meru"], encoder=f"open_clip:ViT-B-32:{missing}"
        )
    with pytest.raises(SearchError, match="holds 'atmg' embeddings but the run .* is a 'meru' run"):
        Searcher.open(world.runs["meru"], world.indexes["atmg"])
    # an encoder of another width: 16-dimensional text features against a run trained on 8
    import json

    import open_clip

    from _search_world import TINY

    wide = json.loads(json.dumps(TINY))
    wide["embed_dim"] = 16
    cfg = tmp_path / "tiny-search-wide.json"
    cfg.write_text(json.dumps(wide))
    open_clip.add_model_config(cfg)
    ckpt = tmp_path / "wide.pt"
    torch.save(open_clip.create_model("tiny-search-wide").state_dict(), ckpt)
    searcher = Searcher.open(
        world.runs["meru"], world.indexes["meru"], encoder=f"open_clip:{cfg}:{ckpt}"
    )
    with pytest.raises(
        SearchError, match="text features of dimension 16 but the run .* 8-dimensional"
    ):
        searcher.search_text("a dog")
    with pytest.raises(SearchError, match=r"must have shape \[n, 8\]"):
        searcher.search_features(np.zeros((2, 5)), "text")


def test_poincare_disk_radius_is_exact() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 5)) * np.array([0.1, 1, 3, 10, 0.5])[:, None][[0, 1, 2, 3, 4, 0, 1]]
    c = 0.7
    xy = poincare_disk_2d(x, c)
    t = np.sqrt(1 / c + (x**2).sum(1))
    d0 = np.arccosh(np.sqrt(c) * t) / np.sqrt(c)
    np.testing.assert_allclose(np.linalg.norm(xy, axis=1), np.tanh(np.sqrt(c) * d0 / 2), rtol=1e-5)
    assert (np.linalg.norm(xy, axis=1) < 1).all()


def test_search_example_runs(world) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "search.py"
    result = subprocess.run(
        [
            sys.executable,
            str(example),
            str(world.runs["meru"]),
            str(world.indexes["meru"]),
            "a photo of a dog",
            "--k",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'a photo of a dog' (distance):" in result.stdout
    assert "  1. " in result.stdout and "  2. " in result.stdout and "  3. " not in result.stdout
    assert any(f in result.stdout for f in world.files)
