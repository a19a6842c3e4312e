"""End to end: `curvalign eval --json`, benchmark, demo and every study, on tiny synthetic worlds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from curvalign.cli import app

TINY = "synthetic:images=120,text_pairs=60,captions_max=3"
TINY_TRAIN = [
    "batch_size=16",
    "pair_batch_size=16",
    "tensorboard=false",
    "log_every=1",
    "checkpoint_every=0",
]
runner = CliRunner()

EVAL_KEYS = {
    "meta",
    "retrieval",
    "zeroshot",
    "hierarchy",
    "compositional",
    "ordering",
    "diagnostics",
}


@pytest.fixture(scope="module")
def meru_run(tmp_path_factory) -> Path:
    from curvalign.train.trainer import train

    out = tmp_path_factory.mktemp("runs") / "meru"
    return train("meru", TINY, out, steps=4, overrides=TINY_TRAIN, show_progress=False)


def test_eval_json_prints_one_object_with_the_documented_keys(meru_run):
    result = runner.invoke(app, ["eval", str(meru_run), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)  # the whole of stdout is one JSON object
    assert EVAL_KEYS <= set(payload)
    assert set(payload["retrieval"]) == {f"{d}@{k}" for d in ("t2i", "i2t") for k in (1, 5, 10)}
    assert set(payload["hierarchy"]) == {"TIE", "LCA", "J", "PH", "RH"} | {
        "depth_match",
        "leaf_rate",
        "pred_depth",
        "true_depth",
        "sibling@5",
        "cousin@5",
    }
    assert {"top1", "top5", "mean_per_class"} == set(payload["zeroshot"])
    entailment = payload["entailment"]
    assert entailment["measure"].startswith("cone margin")
    assert {"AP", "AUROC", "distinct_scores", "modal_fraction"} <= set(entailment["taxonomy"])
    assert set(payload["prompt_sensitivity"]["templates"]) == {f"template {j}" for j in range(4)}
    assert "overall" in payload["compositional"]
    assert set(payload["ordering"]["text"]) == {"chain", "pairs"}
    meta = payload["meta"]
    assert meta["recipe"] == "meru" and meta["last_step"] == 4 and meta["weights"] == "best"
    # a 4-step run validates at step 0, at the last step, and once per epoch between
    assert meta["step"] == meta["best_step"] and meta["step"] in range(5)
    assert set(payload["health"]) == {"converged", "warnings", "step0"}
    assert payload["health"]["step0"]["batch_size"] >= 2  # the step-0 check's report
    assert all(0.0 <= v <= 1.0 for v in payload["retrieval"].values())


def test_eval_text_output_and_split_choice(meru_run):
    result = runner.invoke(app, ["eval", str(meru_run), "--split", "train"])
    assert result.exit_code == 0, result.output
    assert "retrieval/t2i@1" in result.stdout and "meru, best weights (step" in result.stdout
    assert "zeroshot/mean_per_class" in result.stdout and "entailment/chains/AP" in result.stdout
    last = runner.invoke(app, ["eval", str(meru_run), "--weights", "last"])
    assert last.exit_code == 0 and "meru, last weights (step 4)" in last.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "/nonexistent/run"], "does not exist"),
        (["eval", "RUN", "--split", "validation"], "split 'validation'"),
        (["eval", "RUN", "--data", "nosuchsource"], "nosuchsource"),
    ],
)
def test_eval_errors_are_one_line(meru_run, args, message):
    args = [str(meru_run) if a == "RUN" else a for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_benchmark_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "benchmark",
            "--recipes",
            "clip,meru",
            "--data",
            TINY,
            "--out",
            str(out),
            "--steps",
            "3",
            "--quiet",
            *TINY_TRAIN,
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads((out / "results.json").read_text())
    assert payload["recipes"] == ["clip", "meru"] and payload["steps"] == 3
    assert payload["results"]["clip"]["ordering"]["text"] is None  # no origin on the sphere: n/a
    assert payload["results"]["meru"]["ordering"]["text"] is not None
    md = (out / "results.md").read_text()
    assert "| clip |" in md and "| meru |" in md and "n/a" in md
    for png in ("retrieval.png", "hierarchy.png", "distances.png", "spectra.png", "curves.png"):
        assert (out / png).stat().st_size > 0


def test_benchmark_rejects_unknown_recipe(tmp_path):
    result = runner.invoke(
        app, ["benchmark", "--recipes", "clip,nope", "--data", TINY, "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "nope" in result.output


def test_demo_runs_small(tmp_path):
    out = tmp_path / "demo"
    result = runner.invoke(
        app,
        [
            "demo",
            "--out",
            str(out),
            "--recipes",
            "clip",
            "--steps",
            "2",
            "--data",
            TINY,
            "--quiet",
            "batch_size=16",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "demo finished" in result.stdout and (out / "results.md").exists()


def test_study_command_rejects_unknown_name():
    result = runner.invoke(app, ["study", "nope"])
    assert result.exit_code == 2 and "unknown study" in result.output


def test_study_options_are_parsed_and_checked():
    from curvalign_lab.runner import parse_study_options

    assert parse_study_options("atmg-curvature", ["curvatures=0.1,1,3"]) == {
        "curvatures": (0.1, 1, 3)
    }
    with pytest.raises(ValueError, match="no option 'bogus'"):
        parse_study_options("atmg-curvature", ["bogus=1"])
    with pytest.raises(ValueError, match="Python literal"):
        parse_study_options("proclip-product", ["lr_grid=abc"])
    result = runner.invoke(app, ["study", "proclip-product", "--set", "part_dim"])
    assert result.exit_code == 2 and "NAME=VALUE" in result.output


def test_a_run_of_an_in_memory_store_needs_data_to_be_evaluated_or_embedded(tmp_path):
    """eval and embed read the run's data through ``LoadedRun.data_spec``: a run trained on an
    in-memory store has no spec to read again, which is one error naming --data."""
    import dataclasses

    from curvalign.config import resolve_config
    from curvalign.errors import ConfigError
    from curvalign.runs import LoadedRun

    config = resolve_config("clip", "synthetic")
    run = LoadedRun(None, dataclasses.replace(config, data="<FeatureStore>"), 0, tmp_path, {})
    with pytest.raises(ConfigError, match=r"in-memory store \(<FeatureStore>\); pass --data SPEC"):
        run.data_spec()
    assert run.data_spec("features:/elsewhere") == "features:/elsewhere"
    own = LoadedRun(None, config, 0, tmp_path, {})
    assert (
        own.data_spec() == config.data and own.data_spec("synthetic:seed=3") == "synthetic:seed=3"
    )
