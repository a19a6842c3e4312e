"""`curvalign index export --to poincare`: Poincare-ball coordinates of an index's Lorentz points
(NumPy .npz, Parquet with pyarrow) that map back onto the points within float tolerance."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from curvalign.geometry import lorentz
from curvalign.index.export import geodesic_dist0, lorentz_from_poincare, poincare_coordinates


@pytest.mark.parametrize("c", [0.1, 1.0, 4.0])
def test_poincare_round_trip_and_geodesic_units(c: float) -> None:
    rng = np.random.default_rng(0)
    # radii from 1e-6 to 1e3: the origin, the middle and far against the ball's edge
    x = rng.normal(size=(300, 6)) * np.logspace(-6, 3, 300)[:, None]
    p = poincare_coordinates(x, c)
    assert (np.linalg.norm(p, axis=-1) < 1 / math.sqrt(c)).all()  # inside the ball
    np.testing.assert_allclose(lorentz_from_poincare(p, c), x, rtol=1e-9, atol=1e-12)
    # distances in the ball equal the Lorentz distances of the package's geometry (float64)
    i, j = rng.integers(0, 300, 200), rng.integers(0, 300, 200)
    sq = ((p[i] - p[j]) ** 2).sum(-1)
    den = (1 - c * (p[i] ** 2).sum(-1)) * (1 - c * (p[j] ** 2).sum(-1))
    ball = np.arccosh(1 + 2 * c * sq / den) / math.sqrt(c)
    xt = torch.from_numpy(x)
    want = lorentz.dist(xt[i], xt[j], c).numpy()
    near = want > 1e-3  # acosh loses digits next to 0 in both formulas
    np.testing.assert_allclose(ball[near], want[near], rtol=1e-6)
    np.testing.assert_allclose(geodesic_dist0(x, c), lorentz.dist0(xt, c).numpy(), rtol=1e-9)


def _world(tmp_path):
    from _search_world import build_world, needs_open_clip

    if needs_open_clip.args[0]:
        pytest.skip(needs_open_clip.kwargs["reason"])
    torch.set_num_threads(1)
    return build_world(tmp_path / "w")


def test_cli_export_poincare_npz_round_trips_to_the_indexed_points(tmp_path) -> None:
    from typer.testing import CliRunner

    from curvalign.cli import app
    from curvalign.index.embed import open_index

    world = _world(tmp_path)
    out = tmp_path / "ball.npz"
    runner = CliRunner()
    args = ["index", "export", str(world.indexes["meru"]), "--to", "poincare", "--path", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "exported 6 points" in result.output
    data = np.load(out)
    _, index = open_index(world.indexes["meru"])
    c = float(data["curvature"])
    assert c == pytest.approx(index.curvature)
    points = lorentz_from_poincare(data["poincare"], c)
    from curvalign.index.export import _index_points

    _, want, ids, _ = _index_points(world.indexes["meru"])
    np.testing.assert_allclose(points, want.astype(np.float64), rtol=1e-6, atol=1e-7)
    assert data["ids"].tolist() == ids.tolist()
    assert len(data["item_caption"]) == 6 and all(data["item_caption"])
    # an existing file is not overwritten; an unknown suffix and a rerank index are refused
    assert runner.invoke(app, args).exit_code != 0
    bad = runner.invoke(app, [*args[:-1], str(tmp_path / "ball.csv")])
    assert bad.exit_code != 0 and ".npz or .parquet" in bad.output
    rerank = runner.invoke(
        app,
        [
            "index",
            "export",
            str(world.indexes["atmg"]),
            "--to",
            "poincare",
            "--path",
            str(tmp_path / "a.npz"),
        ],
    )
    # AtMG ranks by an angle (a rerank index): its proxies are not the points to draw
    assert rerank.exit_code != 0 and "Poincare coordinates" in rerank.output


@pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed (Parquet output)"
)
def test_export_poincare_parquet(tmp_path) -> None:
    import json

    import pyarrow.parquet as pq

    from curvalign.index.export import _index_points, export_poincare

    world = _world(tmp_path)
    done = export_poincare(world.indexes["meru"], tmp_path / "ball.parquet")
    table = pq.read_table(done.path)
    info = json.loads(table.schema.metadata[b"curvalign"])
    ball = np.array(table.column("poincare").to_pylist())
    _, want, _, c = _index_points(world.indexes["meru"])
    assert info["curvature"] == pytest.approx(c)
    np.testing.assert_allclose(lorentz_from_poincare(ball, c), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(table.column("dist0").to_numpy(), geodesic_dist0(want, c))
