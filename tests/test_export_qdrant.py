"""`curvalign index export --to qdrant`: Qdrant's embedded local mode ranks like the exact
Lorentz search (issue 14, part 6)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from curvalign.index import build_index

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("qdrant_client") is None,
    reason="optional extra not installed: pip install 'curvalign[qdrant]'",
)


def test_qdrant_top_k_equals_exact_search(tmp_path) -> None:
    from qdrant_client import QdrantClient

    from curvalign.index.export import distance_from_score, export_points, qdrant_query_vector

    rng = np.random.default_rng(0)
    c = 0.8
    x = (rng.normal(size=(1500, 8)) * rng.uniform(0.05, 2.0, size=(1500, 1))).astype(np.float32)
    q = (rng.normal(size=(40, 8)) * 0.7).astype(np.float32)
    ids = np.arange(1000, 2500)
    done = export_points(
        x, c, "pts", path=tmp_path / "qd", ids=ids, payloads=[{"row": i} for i in range(1500)]
    )
    assert done.count == 1500 and done.dim == 8
    want_d, want_ids = build_index(x, c, ids=ids).search(q, 10)
    client = QdrantClient(path=str(tmp_path / "qd"))
    for row in range(len(q)):
        hits = client.query_points(
            "pts", query=qdrant_query_vector(q[row], c)[0].tolist(), limit=10, with_payload=True
        ).points
        assert [h.id for h in hits] == want_ids[row].tolist()
        assert [h.payload["row"] for h in hits] == (want_ids[row] - 1000).tolist()
        # the score is <x,y>_L: turned back into the distance
        np.testing.assert_allclose(
            distance_from_score([h.score for h in hits], c), want_d[row], rtol=2e-3, atol=2e-3
        )
    client.close()


def test_cli_export_of_a_run_index_with_payloads(tmp_path) -> None:
    import json

    import torch
    from qdrant_client import QdrantClient
    from typer.testing import CliRunner

    from _search_world import build_world, needs_open_clip
    from curvalign.cli import app
    from curvalign.index.searcher import Searcher

    if needs_open_clip.args[0]:
        pytest.skip(needs_open_clip.kwargs["reason"])
    torch.set_num_threads(1)
    world = build_world(tmp_path / "w")
    runner = CliRunner()
    out = tmp_path / "qdrant"
    result = runner.invoke(
        app, ["index", "export", str(world.indexes["meru"]), "--to", "qdrant", "--path", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "exported 6 points" in result.output and "acosh" in result.output
    info = json.loads((out / "curvalign-export.json").read_text())
    searcher = Searcher.open(world.runs["meru"], world.indexes["meru"])
    want = searcher.search_text("a dog on grass", 6)
    point = searcher.embed(searcher.encoder().encode_texts(["a dog on grass"]), "text")["point"]
    from curvalign.index.export import distance_from_score, qdrant_query_vector

    client = QdrantClient(path=str(out))
    hits = client.query_points(
        info["collection"],
        query=qdrant_query_vector(point.numpy(), info["curvature"])[0].tolist(),
        limit=6,
    ).points
    assert [h.id for h in hits] == [h.id for h in want.hits]
    assert [h.payload["path"] for h in hits] == [h.item.path for h in want.hits]
    np.testing.assert_allclose(
        distance_from_score([h.score for h in hits], info["curvature"]),
        [h.distance for h in want.hits],
        rtol=1e-3,
        atol=1e-3,
    )
    client.close()
    refused = runner.invoke(
        app,
        [
            "index",
            "export",
            str(world.indexes["atmg"]),
            "--to",
            "qdrant",
            "--path",
            str(tmp_path / "q2"),
        ],
    )
    assert refused.exit_code == 2 and "only Lorentz-distance indexes export" in refused.output
    again = runner.invoke(
        app, ["index", "export", str(world.indexes["meru"]), "--to", "qdrant", "--path", str(out)]
    )
    assert again.exit_code == 2 and "exists already" in again.output
