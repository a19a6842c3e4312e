"""Benchmark comparisons a researcher can trust: seeds with intervals, baselines, verdicts only
where intervals separate, requirements checked before training, failed recipes reported, a
terminal table that fits 80 and 120 columns, and readable plots."""

from __future__ import annotations

import io
import json

import pytest
import torch
from typer.testing import CliRunner

from curvalign.cli import app
from curvalign.data import load_data
from curvalign.report import plots
from curvalign.report.tables import column_verdicts, stat_cell, terminal_stats_table
from curvalign.stats import mean_interval

# a small taxonomy (16 classes, 2 templates; the default world has 108 x 4): each run's test
# evaluation scores zero-shot per class and per template
TINY = "synthetic:images=120,text_pairs=60,captions_max=3,depth=2,branching=2,templates=2"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16", "tensorboard=false", "checkpoint_every=0"]
runner = CliRunner()


def _stat(values):
    return {**mean_interval(values).as_dict(), "values": list(values)}


def test_interval_cell_against_a_hand_computed_case():
    # values 0.40, 0.50, 0.60: mean 0.5, sd 0.1, t(0.975, 2) = 4.303 -> half 4.303 * 0.1 / sqrt(3)
    stat = _stat([0.40, 0.50, 0.60])
    assert stat["mean"] == pytest.approx(0.5)
    assert (stat["high"] - stat["low"]) / 2 == pytest.approx(4.302653 * 0.1 / 3**0.5, rel=1e-4)
    assert stat_cell(stat, "pct") == "50.0±24.8"
    assert stat_cell(_stat([2.0]), "num") == "2.00"  # one seed: no interval
    assert stat_cell(None, "pct") == "n/a"


def test_best_only_where_the_paired_interval_separates_else_tied():
    cols = [("T2I R@1", "retrieval/t2i@1", "pct"), ("TIE", "hierarchy/TIE", "num")]
    stats = {
        "a": {
            "retrieval/t2i@1": _stat([0.50, 0.52, 0.51]),
            "hierarchy/TIE": _stat([3.0, 3.5, 2.0]),
        },
        "b": {
            "retrieval/t2i@1": _stat([0.30, 0.31, 0.29]),
            "hierarchy/TIE": _stat([3.1, 3.4, 2.2]),
        },
        "c": {
            "retrieval/t2i@1": _stat([0.10, 0.12, 0.11]),
            "hierarchy/TIE": _stat([6.0, 6.1, 6.2]),
        },
    }
    verdicts = column_verdicts(stats, ["a", "b", "c"], cols)
    assert verdicts["retrieval/t2i@1"]["best"] == "a"
    tie = verdicts["hierarchy/TIE"]  # lower is better; a and b overlap, c is clearly worse
    assert tie["best"] is None and tie["tied"] == ["a", "b"] and "tied" in tie["text"]
    single = {n: {"retrieval/t2i@1": _stat([v])} for n, v in (("a", 0.9), ("b", 0.1))}
    one = column_verdicts(single, ["a", "b"], cols[:1])["retrieval/t2i@1"]
    assert one["best"] is None and "one seed, no verdict" in one["text"]  # no verdict from one seed


def _wide_stats():
    names = ["clip", "meru", "hycoclip", "atmg", "phyclip", "proclip", "agr", "dualpath"]
    names += [f"{n} (step 0)" for n in names] + ["frozen features", "chance"]
    paths = [
        "retrieval/t2i@1", "retrieval/t2i@5", "retrieval/i2t@1", "retrieval/i2t@5",
        "zeroshot/top1", "zeroshot/top5", "hierarchy/TIE", "hierarchy/LCA", "hierarchy/J",
        "hierarchy/PH", "hierarchy/RH", "compositional/overall",
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    return {
        n: {
            p: _stat((torch.rand(3, generator=gen) * (9 if "TIE" in p else 1)).tolist())
            for p in paths
        }
        for n in names
    }


@pytest.mark.parametrize("width", [80, 120])
def test_terminal_table_fits_the_terminal_without_cutting_names(width):
    from rich.console import Console

    stats = _wide_stats()
    conv = [(n, "3/3") for n in list(stats)[:8]]
    table, shown, left_out = terminal_stats_table(stats, width, None, {"conv": conv}, title="t")
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False).print(table)
    text = buffer.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    for name in stats:
        assert name in text  # every row name whole
    assert len(shown) >= (4 if width == 80 else 6) and "T2I R@1" in [c[0] for c in shown]
    assert len(shown) + len(left_out) == 12  # the rest is named, and in results.md


def test_benchmark_json_has_intervals_per_seed_values_and_baselines(tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        ["benchmark", "--recipes", "clip,meru", "--data", TINY, "--out", str(out), "--steps", "4",
         "--seeds", "2", "--json", *TINY_TRAIN],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)  # --json: stdout is exactly the JSON object
    assert payload["seeds"] == [0, 1] and "fractions" in payload["units"]
    for row in ("clip", "meru", "clip (step 0)", "meru (step 0)", "chance"):
        assert row in payload["stats"], row
    t2i = payload["stats"]["clip"]["retrieval/t2i@1"]
    assert len(t2i["values"]) == 2 and t2i["low"] <= t2i["mean"] <= t2i["high"]
    assert t2i["mean"] == pytest.approx(sum(t2i["values"]) / 2)
    assert "frozen features" in payload["absent"]  # synthetic images/texts share no space
    assert payload["stats"]["chance"]["retrieval/t2i@1"]["mean"] == pytest.approx(1 / 24)
    rows = payload["rows"]["meru"]
    assert rows["seeds"] == [0, 1] and len(rows["best_step"]) == 2 and len(rows["converged"]) == 2
    for seed in (0, 1):
        assert (out / "runs" / "meru" / f"seed-{seed}" / "best.safetensors").exists()
    md = (out / "results.md").read_text()
    assert "mean ± 95% interval" in md and "| chance |" in md and "converged" in md
    assert "Row 'frozen features' is absent" in md
    # issue 24's metrics reach the benchmark: mean per-class recall, prediction depths,
    # hierarchy-local recall, entailment (n/a for the cosine recipe: no path), their columns
    meru, clip = payload["stats"]["meru"], payload["stats"]["clip"]
    for path in ("zeroshot/mean_per_class", "hierarchy/depth_match", "hierarchy/sibling@5"):
        assert path in meru and path in clip, path
    assert "entailment/chains/AP" in meru and "entailment/chains/AP" not in clip
    n_class = len(load_data(TINY).class_names)
    chance = payload["stats"]["chance"]
    assert chance["zeroshot/mean_per_class"]["mean"] == pytest.approx(1 / n_class)
    assert "ZS mpc" in md and "Sib@5" in md and "Chain AP" in md
    # two templates in this synthetic world: the prompt-sensitivity table, one column each
    assert "Prompt sensitivity" in md and "| row | template 0 |" in md and "ensemble |" in md
    # each trained row's mean R@1 gain over the ridge row and its own step-0 row, over seeds
    # and test items; the same difference as the table's means
    stats = payload["stats"]
    for name in ("clip", "meru"):
        gains = payload["gains"][name]
        assert gains["alignment"]["row"] == "ridge (image→text)"
        assert gains["step 0"]["row"] == f"{name} (step 0)"
        for gain in gains.values():
            assert gain["how"] == "seeds and test items"
            base = stats[gain["row"]]
            want = 0.5 * (
                stats[name]["retrieval/t2i@1"]["mean"]
                + stats[name]["retrieval/i2t@1"]["mean"]
                - base["retrieval/t2i@1"]["mean"]
                - base["retrieval/i2t@1"]["mean"]
            )
            assert gain["mean"] == pytest.approx(want, abs=1e-6)  # recalls are float32 means
            assert gain["low"] <= gain["mean"] <= gain["high"]
    assert "ΔR@1 align" in md and "Every column:" in md


def test_frozen_features_row_where_the_two_sides_share_a_space(tmp_path):
    from _train_toy import toy_store
    from curvalign.report.benchmark import run_benchmark

    store = toy_store(num_images=60, test_images=20, image_dim=6, text_dim=6)
    store.meta["shared_space"] = True
    result = run_benchmark(
        ["clip"], store, tmp_path, steps=2, overrides=TINY_TRAIN, seeds=2, show_progress=False,
        plots=False,
    )  # fmt: skip
    assert "frozen features" in result.stats and not result.absent
    assert result.stats["frozen features"]["retrieval/t2i@1"]["n"] == 1  # deterministic: one value


def test_seeds_zero_is_one_clear_error(tmp_path):
    result = runner.invoke(
        app,
        ["benchmark", "--recipes", "clip", "--data", TINY, "--out", str(tmp_path), "--seeds", "0"],
    )
    assert result.exit_code == 2 and "--seeds must be >= 1" in result.output
    assert "Traceback" not in result.output


def test_every_recipe_is_checked_against_the_data_before_any_training(tmp_path):
    from _train_toy import toy_store
    from curvalign.report.benchmark import run_benchmark

    store = toy_store(num_images=40, test_images=10)  # no boxes, no text pairs
    with pytest.raises(ValueError) as info:
        run_benchmark(["clip", "hycoclip", "dualpath"], store, tmp_path / "b", steps=2,
                      show_progress=False)  # fmt: skip
    message = str(info.value)
    assert "nothing was trained" in message and "hycoclip" in message and "dualpath" in message
    assert not (tmp_path / "b" / "runs").exists()


def test_a_recipe_failing_mid_run_is_reported_and_the_others_are_written(tmp_path, monkeypatch):
    import curvalign.train.trainer as trainer
    from curvalign.report.benchmark import run_benchmark

    real = trainer.train

    def meru_diverges(recipe, *args, **kwargs):
        if recipe == "meru":
            raise trainer.NonFiniteLossError("the loss became non-finite at step 3")
        return real(recipe, *args, **kwargs)

    monkeypatch.setattr(trainer, "train", meru_diverges)
    result = run_benchmark(
        ["meru", "clip"], TINY, tmp_path, steps=3, overrides=TINY_TRAIN, seeds=1,
        show_progress=False, plots=False,
    )  # fmt: skip
    assert (
        result.rows["meru"]["status"] == "failed" and "non-finite" in result.rows["meru"]["reason"]
    )
    assert "clip" in result.stats
    payload = json.loads((tmp_path / "results.json").read_text())
    assert "meru" in payload["failed"] and "clip" in payload["stats"]
    assert "**meru failed**" in (tmp_path / "results.md").read_text()


def _capture(monkeypatch):
    figures = []
    real = plots.save_figure  # the real PNG (conftest draws the others only)

    def keep(fig, path, layout=True):
        figures.append(fig)
        fig.canvas.draw()
        return real(fig, path, layout)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_plots_are_readable(tmp_path, monkeypatch):
    import numpy as np

    figures = _capture(monkeypatch)
    names = [f"recipe{i}" for i in range(8)]
    results = {
        n: {"retrieval": {"t2i@1": 0.9, "i2t@1": 0.95}, "hierarchy": {"J": 0.5}} for n in names
    }
    plots.retrieval_bars(results, tmp_path / "r.png")
    fig = figures[-1]
    ax = fig.axes[0]
    legend_box = ax.get_legend().get_window_extent()
    assert legend_box.x0 >= ax.get_window_extent().x1  # outside the axes: covers no bar
    plots.log_curves(
        {"a": [{"step": 1, "loss": 1.0, "curvature": 1.0}], "b": [{"step": 1, "loss": 2.0, "curvature": 0.5}]},
        ["loss", "curvature"],
        tmp_path / "c.png",
        marks={"T_w": 1},
    )  # fmt: skip
    fig = figures[-1]
    assert all(a.get_legend() is not None for a in fig.axes if a.lines)
    label = [t for t in fig.axes[0].texts if t.get_text() == "T_w"][0]
    inside = fig.axes[0].get_window_extent()
    box = label.get_window_extent()
    assert inside.y0 <= box.y0 and box.y1 <= inside.y1 + 1  # the T_w label is not clipped
    rng = np.random.default_rng(0)
    plots.distance_histograms(
        {n: {"image": rng.random(20), "text": rng.random(20)} for n in names}, tmp_path / "d.png"
    )
    width, height = figures[-1].get_size_inches() * figures[-1].dpi
    assert width / height < 3  # a grid, not a 2640 x 308 strip
    plots.hierarchy_bars(results, tmp_path / "h.png")
    captions = " ".join(t.get_text() for t in figures[-1].texts)
    assert "Jaccard" in captions and "precision" in captions and "recall" in captions
