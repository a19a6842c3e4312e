"""curvalign.report: tables print n/a for what does not apply, JSON has no NaN, plots write PNGs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from curvalign.report import plots
from curvalign.report.tables import (
    lookup,
    markdown_table,
    metrics_lines,
    present_columns,
    to_jsonable,
    write_json,
)

RESULTS = {
    "clip": {
        "retrieval": {"t2i@1": 0.5, "i2t@1": 0.25},
        "ordering": {"text": None, "image": None, "note": "n/a"},
    },
    "meru": {
        "retrieval": {"t2i@1": 0.125, "i2t@1": 1.0},
        "ordering": {"text": {"chain": 0.75, "pairs": 0.8}},
    },
}


def test_markdown_table_shows_percentages_and_na():
    md = markdown_table(RESULTS)
    lines = md.strip().splitlines()
    assert lines[0] == "| recipe | T2I R@1 | I2T R@1 | Order txt |"
    assert lines[2] == "| clip | 50.0 | 25.0 | n/a |"
    assert lines[3] == "| meru | 12.5 | 100.0 | 75.0 |"


def test_columns_without_any_number_are_dropped():
    headers = [c[0] for c in present_columns(RESULTS)]
    assert "ZS top1" not in headers and "T2I R@1" in headers


def test_lookup_and_metric_lines():
    assert lookup(RESULTS["meru"], "ordering/text/chain") == 0.75
    assert lookup(RESULTS["clip"], "ordering/text/chain") is None
    lines = dict(metrics_lines(RESULTS["clip"]))
    # one unit convention (issue 16, item 9): rates in %, as in the benchmark tables
    assert lines["retrieval/t2i@1"] == "50.0" and lines["ordering/text/chain"] == "n/a"
    tie = dict(metrics_lines({"hierarchy": {"TIE": 2.5, "J": 0.25}}))
    assert tie["hierarchy/TIE"] == "2.500" and tie["hierarchy/J"] == "25.0"


def test_json_has_no_nan(tmp_path):
    path = write_json(
        tmp_path / "r.json", {"a": float("nan"), "b": [1.0, float("inf")], "c": np.float64(2.0)}
    )
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": 2.0}
    assert to_jsonable({"x": (1, 2)}) == {"x": [1, 2]}


def test_overrides_split_per_recipe():
    from curvalign.train.fitting import per_recipe_overrides

    got = per_recipe_overrides(
        ["lr=1e-3", "phyclip.num_factors=4", "train.seed=1"], ["clip", "phyclip"]
    )
    assert got == {
        "clip": {"lr": "1e-3", "train.seed": "1"},
        "phyclip": {"lr": "1e-3", "num_factors": "4", "train.seed": "1"},
    }
    with pytest.raises(ValueError, match="not in this run"):
        per_recipe_overrides(["meru.lr=1"], ["clip"])
    with pytest.raises(ValueError, match="key=value"):
        per_recipe_overrides(["lr"], ["clip"])


def test_plots_write_png_files(tmp_path):
    rng = np.random.default_rng(0)
    files = [
        plots.retrieval_bars(RESULTS, tmp_path / "r.png"),
        plots.hierarchy_bars({"m": {"hierarchy": {"TIE": 2.0, "J": 0.5}}}, tmp_path / "h.png"),
        plots.distance_histograms(
            {"clip": None, "meru": {"image": rng.random(50), "text": rng.random(50)}},
            tmp_path / "d.png",
        ),
        plots.spectra(
            {"meru": {"image": np.array([3.0, 1.0, 0.0]), "text": np.array([2.0, 0.5, 0.1])}},
            tmp_path / "s.png",
        ),
        plots.log_curves(
            {"agr": [{"step": 1, "routing_weight": 0.5}, {"step": 2, "routing_weight": 0.4}]},
            ["routing_weight"],
            tmp_path / "c.png",
            marks={"T_w": 1},
        ),
        plots.line_plot(
            [0.1, 1.0], {"a": [0.5, None]}, tmp_path / "l.png", "c", "acc", "t", logx=True
        ),
        plots.heatmap(np.eye(3), tmp_path / "m.png", ["a", "b", "c"], "factor", "t"),
    ]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
