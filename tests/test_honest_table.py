"""A benchmark table that tells the truth (issue 21 item 7): trained rows ranked against the frozen
(or ridge) row and the untrained heads too, a row whose best step is 0 marked "= untrained" and
never bold, every trained row compared with its baselines, a ridge baseline where the two sides
share no space, chance for every metric that has one, and ties that name what the seeds resolve."""

from __future__ import annotations

import math

import pytest
import torch

from curvalign.data.features import FeatureStore, TextPart
from curvalign.eval.chance import chance_evaluation
from curvalign.eval.ridge import RidgeMap, fit_ridge
from curvalign.report.benchmark import (
    BenchmarkResult,
    BenchmarkRow,
    baseline_comparisons,
    baseline_table,
    best_step_cells,
    verdicts_of,
)
from curvalign.report.tables import column_verdicts
from curvalign.stats import mean_interval

T2I = "retrieval/t2i@1"


def _stat(values):
    return {**mean_interval(values).as_dict(), "values": list(values)}


def _result(rows: dict, stats: dict) -> BenchmarkResult:
    result = BenchmarkResult({}, {}, {}, {}, data="hand-made", steps=10, seeds=[0, 1, 2])
    result.rows, result.stats = rows, stats
    return result


def _trained(name, best_steps):
    return BenchmarkRow(
        kind="trained",
        recipe=name,
        seeds=tuple(range(len(best_steps))),
        best_step=tuple(best_steps),
        converged=(True,) * len(best_steps),
        untrained=f"{name} (step 0)",
    )


def _untrained(name):
    return BenchmarkRow(kind="untrained", recipe=name)


FROZEN = BenchmarkRow(kind="frozen", recipe=None)


def test_frozen_row_that_beats_every_head_is_the_best_and_heads_are_not():
    stats = {
        "clip": {T2I: _stat([0.30, 0.31, 0.32])},
        "meru": {T2I: _stat([0.20, 0.21, 0.22])},
        "clip (step 0)": {T2I: _stat([0.10, 0.10, 0.10])},
        "meru (step 0)": {T2I: _stat([0.10, 0.11, 0.10])},
        "frozen features": {T2I: _stat([0.45])},
    }
    rows = {
        "clip": _trained("clip", [5, 6, 7]),
        "meru": _trained("meru", [5, 6, 7]),
        "clip (step 0)": _untrained("clip"),
        "meru (step 0)": _untrained("meru"),
        "frozen features": FROZEN,
    }
    verdict = verdicts_of(_result(rows, stats))[T2I]
    assert verdict["best"] == "frozen features"
    assert (
        "frozen features best" in verdict["text"] and "against the single value" in verdict["text"]
    )
    # ranked among trained rows only, clip would have been called best
    assert column_verdicts(stats, ["clip", "meru"], [("T2I", T2I, "pct")])[T2I]["best"] == "clip"


def test_a_row_whose_best_step_is_zero_is_marked_and_never_bold():
    stats = {
        "meru": {T2I: _stat([0.50, 0.52, 0.51])},
        "clip": {T2I: _stat([0.30, 0.31, 0.29])},
        "meru (step 0)": {T2I: _stat([0.50, 0.52, 0.51])},
        "clip (step 0)": {T2I: _stat([0.10, 0.11, 0.12])},
    }
    rows = {
        "meru": _trained("meru", [0, 0, 0]),
        "clip": _trained("clip", [4, 8, 8]),
        "meru (step 0)": _untrained("meru"),
        "clip (step 0)": _untrained("clip"),
    }
    result = _result(rows, stats)
    cells = dict(best_step_cells(result))
    assert cells["meru"] == "0, 0, 0 = untrained" and cells["clip"] == "4, 8, 8"
    verdict = verdicts_of(result)[T2I]
    assert verdict["best"] is None  # meru leads by far, but it is its untrained head
    assert "meru" in verdict["text"]
    # one seed at step 0 of three: marked, and never bold either, even where it leads every
    # other row (its step-0 row included) by more than the noise
    stats["meru (step 0)"] = {T2I: _stat([0.10, 0.12, 0.11])}
    rows["meru"] = _trained("meru", [0, 6, 7])
    assert dict(best_step_cells(result))["meru"] == "0, 6, 7 (= untrained in 1/3)"
    verdict = verdicts_of(result)[T2I]
    assert verdict["best"] is None and "untrained head" in verdict["text"]
    # without any step-0 seed the same numbers make meru best (the rule is what blocks it)
    rows["meru"] = _trained("meru", [5, 6, 7])
    assert verdicts_of(result)[T2I]["best"] == "meru"


def test_every_trained_row_is_compared_with_frozen_and_its_own_step_zero():
    stats = {
        "clip": {T2I: _stat([0.30, 0.31, 0.32]), "hierarchy/TIE": _stat([2.0, 2.1, 2.2])},
        "clip (step 0)": {T2I: _stat([0.10, 0.11, 0.10]), "hierarchy/TIE": _stat([2.0, 2.3, 2.0])},
        "frozen features": {T2I: _stat([0.45]), "hierarchy/TIE": _stat([3.0])},
    }
    rows = {
        "clip": _trained("clip", [5, 6, 7]),
        "clip (step 0)": _untrained("clip"),
        "frozen features": FROZEN,
    }
    result = _result(rows, stats)
    comp = baseline_comparisons(result)["clip"]
    assert set(comp) == {"frozen features", "clip (step 0)"}
    assert comp["frozen features"][T2I]["better"] is False  # 0.31 < 0.45, interval excludes 0
    assert comp["frozen features"][T2I]["mean"] == pytest.approx(0.31 - 0.45)
    assert comp["clip (step 0)"][T2I]["better"] is True  # paired, +0.21
    assert comp["frozen features"]["hierarchy/TIE"]["better"] is True  # lower TIE is better
    assert comp["clip (step 0)"]["hierarchy/TIE"]["better"] is None  # within noise
    table = baseline_table(result, baseline_comparisons(result))
    assert "| clip − frozen features | -14.0 ▼ |" in table
    assert "| clip − clip (step 0) | +20.7 ▲ |" in table


def test_a_tie_says_when_the_difference_is_below_what_the_seeds_resolve():
    stats = {
        "a": {T2I: _stat([0.50, 0.40, 0.60, 0.45, 0.55])},
        "b": {T2I: _stat([0.49, 0.42, 0.57, 0.47, 0.52])},
    }
    verdict = column_verdicts(stats, ["a", "b"], [("T2I R@1", T2I, "pct")])[T2I]
    assert verdict["best"] is None and "5 seeds resolve" in verdict["text"]
    assert verdict["mde"] > abs(stats["a"][T2I]["mean"] - stats["b"][T2I]["mean"])


def _linear_store(n=120, di=8, dt=6, noise=0.05, seed=0) -> FeatureStore:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, di, generator=g)
    mix = torch.randn(di, dt, generator=g)
    texts = images @ mix + noise * torch.randn(n, dt, generator=g)
    split = torch.zeros(n, dtype=torch.long)
    split[80:100], split[100:] = 1, 2
    return FeatureStore(
        image_features=images,
        text=TextPart(texts),
        text_to_image=torch.arange(n),
        image_split=split,
        split_names=["train", "val", "test"],
    )


def test_ridge_map_recovers_a_linear_relation_and_picks_its_strength_on_validation():
    from curvalign.eval import evaluate

    store = _linear_store()
    ridge = fit_ridge(store)
    assert isinstance(ridge, RidgeMap) and ridge.alpha is not None
    r = evaluate(ridge, store, split="test", diagnostics=False).retrieval
    assert r["t2i@1"] > 0.9  # chance: 1/20
    # the test split is not used to fit: the fit is identical when test features change
    changed = _linear_store()
    changed.image_features[100:] = torch.randn(20, 8)
    assert torch.equal(fit_ridge(changed).weight, ridge.weight)
    # a relation that is not there gives no such result
    noise = _linear_store(noise=100.0)
    r = evaluate(fit_ridge(noise), noise, split="test", diagnostics=False).retrieval
    assert r["t2i@1"] < 0.5


def test_benchmark_adds_the_ridge_row_where_the_sides_share_no_space(tmp_path):
    from _train_toy import toy_store
    from curvalign.eval.ridge import ROW_NAME
    from curvalign.report.benchmark import run_benchmark

    store = toy_store(num_images=60, test_images=20, image_dim=6, text_dim=5)
    result = run_benchmark(
        ["clip"],
        store,
        tmp_path,
        steps=3,
        seeds=2,
        overrides=["batch_size=8", "tensorboard=false", "checkpoint_every=0"],
        show_progress=False,
        plots=False,
    )
    assert ROW_NAME in result.stats and result.rows[ROW_NAME].kind == "frozen"
    assert "alpha" in result.rows[ROW_NAME].note
    assert "frozen features" in result.absent
    md = (tmp_path / "results.md").read_text()
    assert f"| clip − {ROW_NAME} |" in md and "| clip − clip (step 0) |" in md


def test_chance_covers_ordering():
    from curvalign.data import load_store

    store, _ = load_store("synthetic:images=120,text_pairs=60,captions_max=3")
    chance = chance_evaluation(store, split="test")
    length = store.chain_features.shape[1]
    assert chance["ordering"]["text"]["chain"] == pytest.approx(1 / math.factorial(length))
    assert chance["ordering"]["text"]["pairs"] == 0.5
    assert chance["ordering"]["image"]["chain"] == 0.5
    # Monte Carlo: random distances order a chain with probability 1/L!
    d = torch.rand(20000, length, generator=torch.Generator().manual_seed(0))
    mc = float((d[:, 1:] > d[:, :-1]).all(dim=1).float().mean())
    assert mc == pytest.approx(chance["ordering"]["text"]["chain"], abs=0.01)
