"""Tables a person can read: a headline table of the few metrics that differ between rows (the
constant ones listed underneath, every column with --columns all), each trained row's mean R@1
gain over the alignment and its own step-0 row with an interval over seeds and test items, and
verdict marks only where they mean something."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from curvalign.cli import _print_benchmark, app
from curvalign.eval.retrieval import RetrievalItems
from curvalign.readout import recall_from_ranks
from curvalign.report.benchmark import (
    BenchmarkResult,
    BenchmarkRow,
    baseline_comparisons,
    baseline_table,
    gains_of,
    headline,
    verdicts_of,
)
from curvalign.report.tables import (
    HEADLINE_WIDTH,
    column_verdicts,
    gain_cell,
    mark_chance_columns,
)
from curvalign.stats import mean_interval, paired_difference

runner = CliRunner()
T2I, I2T = "retrieval/t2i@1", "retrieval/i2t@1"


def _stat(values):
    return {**mean_interval(values).as_dict(), "values": list(values)}


def _trained(name, seeds=3):
    return BenchmarkRow(
        kind="trained",
        recipe=name,
        seeds=tuple(range(seeds)),
        best_step=(5,) * seeds,
        last_step=(10,) * seeds,
        converged=(True,) * seeds,
        untrained=f"{name} (step 0)",
    )


def _items(hits_t2i, hits_i2t) -> RetrievalItems:
    """Ranks with the given hits at 1 (rank 0 = hit, 3 = miss), one caption per image."""
    t = torch.tensor([0 if h else 3 for h in hits_t2i])
    i = torch.tensor([0 if h else 3 for h in hits_i2t])
    return RetrievalItems(t, i, torch.arange(len(t)))


def _hand_result(seeds=3) -> BenchmarkResult:
    """Two recipes, their step-0 rows, ridge and chance on 40 test images; Leaf and PredDepth
    the same for every row, TIE different."""
    rng = np.random.default_rng(0)
    n = 40
    rows, stats, items = {}, {}, {}

    def add(name, row, per_seed):
        rows[name] = row
        items[name] = [_items(t, i) for t, i in per_seed]
        evals = [recall_from_ranks(x.t2i_rank, x.i2t_rank, ks=(1,)) for x in items[name]]
        stats[name] = {
            T2I: _stat([e["t2i@1"] for e in evals]),
            I2T: _stat([e["i2t@1"] for e in evals]),
            "hierarchy/TIE": _stat(list(rng.uniform(2, 3, len(evals)))),
            "hierarchy/leaf_rate": _stat([1.0] * len(evals)),
            "hierarchy/pred_depth": _stat([4.0] * len(evals)),
        }

    def draw(p):
        return [(rng.random(n) < p, rng.random(n) < p) for _ in range(seeds)]

    add("clip", _trained("clip", seeds), draw(0.6))
    add("meru", _trained("meru", seeds), draw(0.3))
    add("clip (step 0)", BenchmarkRow(kind="untrained", recipe="clip"), draw(0.3))
    add("meru (step 0)", BenchmarkRow(kind="untrained", recipe="meru"), draw(0.3))
    add("ridge (image→text)", BenchmarkRow(kind="frozen", recipe=None), draw(0.35)[:1])
    rows["chance"] = BenchmarkRow(kind="chance", recipe=None)
    stats["chance"] = {
        T2I: _stat([1 / n]),
        I2T: _stat([1 / n]),
        "hierarchy/TIE": _stat([3.5]),
    }
    result = BenchmarkResult({}, {}, {}, {}, data="hand-made", steps=10, seeds=list(range(seeds)))
    result.rows, result.stats, result.items = rows, stats, items
    return result


def test_gains_count_seeds_and_test_items_and_match_the_table_means():
    result = _hand_result()
    gains = gains_of(result)
    assert set(gains) == {"clip", "meru"}
    clip = gains["clip"]
    assert clip["alignment"]["row"] == "ridge (image→text)"
    assert clip["step 0"]["row"] == "clip (step 0)"
    mean_r1 = {
        r: 0.5 * (result.stats[r][T2I]["mean"] + result.stats[r][I2T]["mean"])
        for r in ("clip", "clip (step 0)", "ridge (image→text)")
    }
    assert clip["alignment"]["mean"] == pytest.approx(
        mean_r1["clip"] - mean_r1["ridge (image→text)"]
    )
    assert clip["step 0"]["mean"] == pytest.approx(mean_r1["clip"] - mean_r1["clip (step 0)"])
    assert clip["alignment"]["how"] == "seeds and test items"
    # against the single ridge evaluation, the interval is wider than the seed-only one: the
    # ridge row's own sampling noise on 40 test images counts
    t2i, i2t = result.stats["clip"][T2I]["values"], result.stats["clip"][I2T]["values"]
    per_seed = [0.5 * (t + i) for t, i in zip(t2i, i2t, strict=True)]
    seed_only = paired_difference(per_seed, [mean_r1["ridge (image→text)"]] * 3)
    width = clip["alignment"]["high"] - clip["alignment"]["low"]
    assert width > seed_only.high - seed_only.low
    # without per-item ranks (a tuned benchmark's merged rows) the gain falls back to the seeds
    result.items = {}
    result.cache.clear()
    assert gains_of(result)["clip"]["alignment"]["how"] == "seeds only"


def test_identical_rows_gain_zero_with_a_zero_width_interval():
    result = _hand_result()
    result.items["clip (step 0)"] = result.items["clip"]
    result.stats["clip (step 0)"] = result.stats["clip"]
    gain = gains_of(result)["clip"]["step 0"]
    assert gain["mean"] == 0.0 and gain["low"] == 0.0 and gain["high"] == 0.0
    assert gain["better"] is None and gain_cell(gain) == "+0.0±0.0 ="


def test_headline_leaves_out_constant_columns_and_lists_them():
    result = _hand_result()
    head = headline(result)
    headers = [c[0] for c in head["columns"]]
    assert headers[:2] == ["T2I R@1", "I2T R@1"] and "TIE↓" in headers
    assert "Leaf" not in headers and "PredDepth" not in headers
    assert "constant for every row: Leaf 100.0, PredDepth 4.00" in head["notes"]
    assert set(head["lead"]) == {"ΔR@1 align", "ΔR@1 step0"}


def test_leaf_rate_and_depth_carry_no_verdict_marks_and_read_beside_lca():
    result = _hand_result()
    result.stats["clip"]["hierarchy/leaf_rate"] = _stat([0.02, 0.03, 0.02])
    result.stats["clip"]["hierarchy/LCA"] = _stat([1.0, 1.1, 1.0])
    result.stats["meru"]["hierarchy/LCA"] = _stat([2.0, 2.1, 2.2])
    table = baseline_table(result, baseline_comparisons(result))
    leaf_column = table.splitlines()[0].split(" | ").index("Leaf")
    for line in table.splitlines()[2:]:
        cell = line.split(" | ")[leaf_column]
        assert not re.search("[▲▼=]", cell), line
    lca = verdicts_of(result)["hierarchy/LCA"]
    assert lca["best"] == "clip"
    assert "leaf rate / predicted depth: clip 2.3% / 4.00" in lca["text"]
    # a headline that shows LCA shows the leaf rate beside it (it differs between rows now)
    head = headline(result)
    headers = [c[0] for c in head["columns"]]
    if "LCA↓" in headers:
        assert headers[headers.index("LCA↓") + 1] == "Leaf"


def test_sibling_recall_below_chance_is_marked_and_never_best():
    stats = {
        "a": {"hierarchy/sibling@5": _stat([0.64, 0.66, 0.65])},
        "b": {"hierarchy/sibling@5": _stat([0.80, 0.81, 0.82])},
        "chance": {"hierarchy/sibling@5": _stat([0.95])},
    }
    verdict = column_verdicts(stats, ["a", "b"], [("Sib@5", "hierarchy/sibling@5", "pct")])
    assert verdict["hierarchy/sibling@5"]["best"] is None
    assert "chance (95.0) is above every trained row" in verdict["hierarchy/sibling@5"]["text"]
    columns, note = mark_chance_columns(
        [("Sib@5", "hierarchy/sibling@5", "pct")], stats, ["a", "b"]
    )
    assert columns[0][0] == "Sib@5†" and note.startswith("† chance is above every trained row")
    # chance below the rows: the ordinary verdict, no mark
    stats["chance"] = {"hierarchy/sibling@5": _stat([0.10])}
    verdict = column_verdicts(stats, ["a", "b"], [("Sib@5", "hierarchy/sibling@5", "pct")])
    assert verdict["hierarchy/sibling@5"]["best"] == "b"
    assert mark_chance_columns([("Sib@5", "hierarchy/sibling@5", "pct")], stats, ["a", "b"]) == (
        [("Sib@5", "hierarchy/sibling@5", "pct")],
        "",
    )


@pytest.mark.parametrize("seeds", [1, 3])
def test_demo_table_fits_120_columns_with_no_constant_column(seeds, capsys, tmp_path):
    # the demo's printer, given a console 2000 wide (as off a terminal): the headline table and
    # its notes still fit 120 columns; --columns all prints every column as wide as it needs
    result = _hand_result(seeds)
    _print_benchmark(result, tmp_path, "curvalign demo", width=2000)
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if not line.startswith(("wrote ", "plots: "))]
    assert max(len(line.rstrip()) for line in lines) <= HEADLINE_WIDTH
    header = next(line for line in lines if line.strip().startswith("row"))
    assert "Leaf" not in header and "PredDepth" not in header and "ΔR@1 align" in header
    assert "constant for every row: Leaf 100.0, PredDepth 4.00" in text
    gain = next(line for line in lines if line.strip().startswith("clip "))
    assert ("±" in gain) == (seeds > 1)  # one seed: the gain without an interval
    _print_benchmark(result, tmp_path, "curvalign demo", width=2000, columns="all")
    every = capsys.readouterr().out
    header = next(line for line in every.splitlines() if line.strip().startswith("row"))
    assert "Leaf" in header and "PredDepth" in header


def test_columns_option_is_refused_unless_headline_or_all(tmp_path):
    for command in (["demo"], ["benchmark", "--recipes", "clip"]):
        out = tmp_path / command[0]
        result = runner.invoke(app, [*command, "--columns", "some", "--out", str(out)])
        assert result.exit_code == 2 and "--columns must be headline or all" in result.output
        assert not (out / "runs").exists()  # refused before any training


def test_per_item_totals_give_the_evaluation_recalls():
    # 30 images, 70 captions (some images with none): the totals over images reproduce the
    # recalls the evaluation reports, per direction and as mean R@k
    g = torch.Generator().manual_seed(0)
    owner = torch.randint(0, 25, (70,), generator=g)  # images 25..29 have no caption
    t_ranks = torch.randint(0, 12, (70,), generator=g)
    i_ranks = torch.randint(0, 12, (30,), generator=g)
    i_ranks[25:] = -1
    items = RetrievalItems(t_ranks, i_ranks, owner)
    recalls = recall_from_ranks(t_ranks, i_ranks, ks=(1, 5))
    for k in (1, 5):
        assert items.totals(f"t2i@{k}").statistic() == pytest.approx(recalls[f"t2i@{k}"])
        assert items.totals(f"i2t@{k}").statistic() == pytest.approx(recalls[f"i2t@{k}"])
        mean = 0.5 * (recalls[f"t2i@{k}"] + recalls[f"i2t@{k}"])
        assert items.totals(f"mean@{k}").statistic() == pytest.approx(mean)
        assert float(items.hits(f"t2i@{k}").mean()) == pytest.approx(recalls[f"t2i@{k}"])
    from curvalign.errors import InputError

    with pytest.raises(InputError, match="t2i@K"):
        items.totals("r@1")


def test_evaluation_exposes_the_items_behind_its_rates():
    # one evaluation of an untrained head on a tiny synthetic world: the per-item results
    # reproduce the reported rates (retrieval, zero-shot top-1, hard negatives), keys unchanged
    from curvalign.config import resolve_config
    from curvalign.data import load_data
    from curvalign.eval import evaluate, run_evaluation
    from curvalign.runs import recipe_input_dims
    from curvalign.train.trainer import build_model

    spec = "synthetic:images=120,text_pairs=60,captions_max=3"
    store = load_data(spec)
    config = resolve_config("clip", spec)
    model = build_model(config, *recipe_input_dims(config, store)).eval()
    done = run_evaluation(model, store, diagnostics=False)
    metrics = done.metrics
    assert metrics.to_json() == evaluate(model, store, diagnostics=False).to_json()
    assert done.items is not None
    for key, value in metrics.retrieval.items():
        assert done.items.totals(key).statistic() == pytest.approx(value, abs=1e-6)
    assert metrics.zeroshot is not None and metrics.compositional is not None
    assert float(done.hits["zeroshot/top1"].mean()) == pytest.approx(metrics.zeroshot.top1)
    won = done.hits["compositional/overall"]
    assert float(won.mean()) == pytest.approx(metrics.compositional["overall"])


def test_zero_shot_and_hard_negative_comparisons_count_the_items_too():
    result = _hand_result()
    rng = np.random.default_rng(5)
    for name in result.stats:
        if name == "chance":
            continue
        hits = [torch.tensor(rng.random(60) < 0.5).float() for _ in result.items[name]]
        result.item_hits[name] = [{"zeroshot/top1": h} for h in hits]
        result.stats[name]["zeroshot/top1"] = _stat([float(h.mean()) for h in hits])
    comparison = baseline_comparisons(result)["clip"]
    ridge = comparison["ridge (image→text)"]["zeroshot/top1"]
    assert ridge["item_se"] > 0 and ridge["n"] == 3
    assert "item_se" not in comparison["ridge (image→text)"]["hierarchy/TIE"]  # seeds only


def test_chance_map_is_what_random_rankings_score():
    # the chance row's mAP against the mean mAP of 400 seeded random rankings of the split's
    # annotated images (within four standard errors of that mean)
    from curvalign.data import load_data
    from curvalign.eval.multilabel import label_matrix, multilabel_map
    from curvalign.report.benchmark import chance_multilabel_map

    store = load_data("synthetic:images=120,text_pairs=60,captions_max=3")
    assert store.has_multilabels
    want = chance_multilabel_map(store, "test")
    ids = store.split_image_ids("test")
    local = torch.full((store.num_images,), -1, dtype=torch.long)
    local[ids] = torch.arange(len(ids))
    owner = local[store.multilabel_to_image.long()]
    keep = owner >= 0
    num_classes = int(store.multilabel_class.max()) + 1
    labels = label_matrix(owner[keep], store.multilabel_class.long()[keep], len(ids), num_classes)
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor(
        [
            multilabel_map(torch.rand(len(ids), num_classes, generator=g), labels)["mAP"]
            for _ in range(400)
        ]
    )
    se = float(draws.std()) / 20
    assert abs(float(draws.mean()) - want) < 4 * se
