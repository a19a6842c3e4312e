"""curvalign embed / index build / index search, end to end on tiny trained runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from curvalign.cli import app
from curvalign.index import lorentz_distance
from curvalign.index.embed import load_embeddings
from curvalign.runs import load_run
from curvalign.train.trainer import train

DATA = "synthetic:images=120,text_pairs=20,seed=5"
runner = CliRunner()


def _run(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout + (
        result.stderr if result.stderr_bytes is not None else ""
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("index_cli")
    out = {}
    for recipe in ("meru", "atmg"):
        out[recipe] = train(
            recipe,
            DATA,
            root / recipe,
            steps=2,
            overrides=["embed_dim=8", "batch_size=32"],
            show_progress=False,
        )
    return root, out


@pytest.fixture(scope="module")
def embedded(runs):
    root, run_dirs = runs
    paths = {}
    for recipe, run_dir in run_dirs.items():
        code, text = _run(
            "embed", run_dir, "--out", root / f"emb_{recipe}", "--batch-size", "33", "-q"
        )
        assert code == 0, text
        paths[recipe] = root / f"emb_{recipe}"
    return root, run_dirs, paths


def test_embed_files_match_the_run_in_memory(embedded):
    _, run_dirs, paths = embedded
    emb = load_embeddings(paths["meru"])
    run = load_run(run_dirs["meru"])
    from curvalign.data import load_data

    store = load_data(DATA)
    assert emb.meta["recipe"] == "meru" and emb.meta["step"] == run.step
    assert emb.meta["counts"] == {"images": store.num_images, "texts": store.num_texts}
    with torch.no_grad():
        want = run.recipe.embed_texts(store.text_features.float())["point"].numpy()
    got = emb.side("texts")["point"]
    assert isinstance(got, np.memmap)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_build_and_search_exact_lorentz_index(embedded):
    root, _, paths = embedded
    code, text = _run("index", "build", paths["meru"], "--out", root / "idx_meru", "--exact")
    assert code == 0, text
    code, text = _run(
        "index", "search", root / "idx_meru", "--query-text-ids", "0,5,9", "--k", "4", "--json"
    )
    assert code == 0, text
    result = json.loads(text)
    emb = load_embeddings(paths["meru"])
    images, texts = emb.side("images")["point"], emb.side("texts")["point"]
    c = emb.curvature[0]
    truth = emb.text_to_image()
    for row, q in zip(result["results"], (0, 5, 9), strict=False):
        d = lorentz_distance(images, texts[q][None], c)
        order = np.lexsort((np.arange(len(d)), d))[:4]
        assert row["query"] == q and row["true_image"] == int(truth[q])
        assert row["ids"] == order.tolist()
        np.testing.assert_allclose(row["distances"], d[order], rtol=1e-9)
    code, text = _run("index", "search", root / "idx_meru", "--query-text-ids", "2", "--k", "3")
    assert code == 0 and "rank" in text and "true image" in text


def test_ann_index_and_rerank_index(embedded):
    root, _, paths = embedded
    code, text = _run(
        "index",
        "build",
        paths["meru"],
        "--out",
        root / "idx_meru_ivf",
        "--ann",
        "ivf",
        "--nlist",
        "4",
        "--nprobe",
        "4",
    )
    assert code == 0, text
    code, text = _run(
        "index", "search", root / "idx_meru_ivf", "--query-text-ids", "1", "--k", "5", "--json"
    )
    assert code == 0, text
    if not (root / "idx_meru").exists():
        assert _run("index", "build", paths["meru"], "--out", root / "idx_meru")[0] == 0
    exact_code, exact = _run(
        "index", "search", root / "idx_meru", "--query-text-ids", "1", "--k", "5", "--json"
    )
    assert exact_code == 0, exact
    # nprobe = nlist visits every cell: the same answer as exact search
    assert json.loads(text)["results"][0]["ids"] == json.loads(exact)["results"][0]["ids"]
    # AtMG ranks by an angle: a rerank index, which reloads the run to score candidates.
    code, text = _run("index", "build", paths["atmg"], "--out", root / "idx_atmg")
    assert code == 0, text
    n_images = load_embeddings(paths["atmg"]).meta["counts"]["images"]
    code, text = _run(
        "index",
        "search",
        root / "idx_atmg",
        "--query-text-ids",
        "0,1",
        "--k",
        "5",
        "--candidates",
        str(n_images),
        "--json",
    )
    assert code == 0, text
    got = json.loads(text)["results"]
    run = load_run(load_embeddings(paths["atmg"]).meta["run_dir"])
    emb = load_embeddings(paths["atmg"])
    with torch.no_grad():
        scores = run.recipe.scores(
            {"point": torch.from_numpy(np.array(emb.side("texts")["point"][:2]))},
            {"point": torch.from_numpy(np.array(emb.side("images")["point"]))},
        ).numpy()
    for i in range(2):
        want = np.lexsort((np.arange(scores.shape[1]), -scores[i]))[:5]
        assert got[i]["ids"] == want.tolist()


def test_bad_queries_are_refused_with_one_line(embedded, tmp_path):
    root, _, paths = embedded
    if not (root / "idx_meru").exists():
        assert _run("index", "build", paths["meru"], "--out", root / "idx_meru")[0] == 0
    wrong_dim = tmp_path / "q.npy"
    np.save(wrong_dim, np.zeros((2, 64), np.float32))
    code, text = _run("index", "search", root / "idx_meru", "--query-npy", wrong_dim)
    assert (
        code == 2
        and "query has dimension 64 but the index holds Lorentz points of dimension 8" in text
    )
    assert "Traceback" not in text
    code, text = _run(
        "index", "search", root / "idx_meru", "--queries", paths["atmg"], "--query-text-ids", "0"
    )
    assert code == 2 and "'atmg'" in text and "'meru'" in text
    code, text = _run("index", "search", root / "idx_meru", "--query-image-ids", "0")
    assert code == 2 and "query it with texts" in text
    code, text = _run("index", "search", root / "idx_meru", "--query-text-ids", "0,100000")
    assert code == 2 and "out of range" in text
    code, text = _run("index", "build", paths["atmg"], "--out", tmp_path / "x", "--ann", "ivf")
    assert code == 2 and "its approximate candidate index is HNSW" in text
    code, text = _run("index", "build", paths["atmg"], "--out", tmp_path / "y", "--ann", "hnsw")
    assert code == 0 and '"candidate_index": "hnsw"' in (tmp_path / "y" / "index.json").read_text()
    code, text = _run("index", "search", tmp_path, "--query-text-ids", "0")
    assert code == 2 and "not an index" in text
