"""``curvalign train`` end to end (in-process CliRunner): files, config, logs, errors, resume;
and a smoke run of every registered recipe on a tiny synthetic world."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from _train_toy import toy_recipes, toy_store  # noqa: F401  (fixture)
from curvalign.cli import app
from curvalign.runs import load_run, read_log

METHODS = ("clip", "meru", "hycoclip", "atmg", "phyclip", "proclip", "agr", "dualpath")
TINY_WORLD = (
    "synthetic:images=120,text_pairs=80,families=2,max_objects=2,depth=2,branching=2,latent_dim=16,"
    "image_dim=24,text_dim=20,hidden_dim=32"
)

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, ["train", *map(str, args)])


@pytest.fixture
def toy_features(tmp_path):
    path = tmp_path / "features"
    toy_store(num_images=40, captions=2, test_images=5).save(path)
    return f"features:{path}"


@pytest.mark.usefixtures("toy_recipes")
def test_cli_writes_checkpoint_config_and_logs(tmp_path, toy_features):
    out = tmp_path / "run"
    result = _run(
        "--recipe",
        "_toy",
        "--data",
        toy_features,
        "--steps",
        4,
        "--out",
        out,
        "--quiet",
        "batch_size=8",
        "log_every=2",
        "temperature_init=0.2",
    )
    assert result.exit_code == 0, result.output
    assert "trained to step 4" in result.output and str(out) in result.output
    for name in (
        "config.json",
        "config.yaml",
        "model.safetensors",
        "state.pt",
        "meta.json",
        "log.jsonl",
    ):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["recipe"] == "_toy" and config["data"] == toy_features
    assert config["train"]["steps"] == 4 and config["recipe_config"]["temperature_init"] == 0.2
    assert [r["step"] for r in read_log(out)] == [2, 4]
    assert load_run(out, weights="last").step == 4


@pytest.mark.usefixtures("toy_recipes")
def test_cli_config_file_resume_and_overwrite(tmp_path, toy_features):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"recipe: _toy\ndata: '{toy_features}'\ntrain:\n  batch_size: 8\n  steps: 3\n"
        "  tensorboard: false\n"
    )
    out = tmp_path / "run"
    assert _run("--config", config, "--out", out, "-q").exit_code == 0
    assert load_run(out, weights="last").step == 3

    refused = _run("--config", config, "--out", out, "-q")
    assert (
        refused.exit_code == 2
        and "already holds a run of recipe '_toy' at step 3" in refused.output
    )

    resumed = _run("--out", out, "--resume", "--steps", 5)
    assert resumed.exit_code == 0, resumed.output
    assert "resuming" in resumed.output and load_run(out, weights="last").step == 5

    replaced = _run("--config", config, "--out", out, "--overwrite", "-q", "seed=4")
    assert (
        replaced.exit_code == 0
        and load_run(out).config.train.seed == 4
        and load_run(out, weights="last").step == 3
    )


@pytest.mark.usefixtures("toy_recipes")
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--recipe", "nope"], "unknown recipe 'nope'; known recipes: _toy, _toy_boxes"),
        (["--recipe", "_toy", "bogus=1"], "unknown key 'bogus'"),
        (["--recipe", "_toy", "lr"], "is not key=value"),
        (
            ["--recipe", "_toy_boxes"],
            "recipe '_toy_boxes' trains on box-level pairs; data 'features:",
        ),
        (
            ["--recipe", "_toy", "batch_size=500"],
            "batch_size 500 is larger than the 36 usable train images",
        ),
    ],
)
def test_cli_errors_are_one_line_without_traceback(tmp_path, toy_features, args, fragment):
    result = _run("--data", toy_features, "--steps", 2, "--out", tmp_path / "run", *args)
    assert result.exit_code == 2
    assert fragment in result.output and "Traceback" not in result.output
    assert result.output.strip().startswith("error:")


@pytest.mark.usefixtures("toy_recipes")
def test_cli_bad_data_spec(tmp_path):
    result = _run(
        "--recipe", "_toy", "--data", "nosuchsource:x", "--steps", 2, "--out", tmp_path / "run"
    )
    assert (
        result.exit_code == 2
        and "nosuchsource" in result.output
        and "Traceback" not in result.output
    )


@pytest.mark.parametrize("recipe", METHODS)
def test_every_recipe_trains_a_few_steps_from_the_cli(tmp_path, recipe):
    from curvalign.recipes import recipe_names

    assert recipe in recipe_names(), f"method {recipe!r} is not registered"
    out = tmp_path / recipe
    result = _run(
        "--recipe",
        recipe,
        "--data",
        TINY_WORLD,
        "--steps",
        3,
        "--out",
        out,
        "--quiet",
        "batch_size=16",
        "pair_batch_size=8",
        "log_every=1",
        "tensorboard=false",
    )
    assert result.exit_code == 0, result.output
    records = read_log(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) and r["loss"] == r["loss"] for r in records)
    run = load_run(out, weights="last")
    assert run.step == 3 and run.config.recipe == recipe and not run.recipe.training
    features = torch.randn(5, 24)
    with torch.no_grad():
        emb = run.recipe.embed_images(features)
    assert all(torch.isfinite(v).all() for v in emb.values())


@pytest.mark.parametrize(
    "recipe, small",
    [
        ("dualpath", ["model_dim=32", "hidden_dim=32", "embed_dim=16"]),  # path copy at the switch
        (
            "agr",
            ["embed_dim=32", "lora_rank=4"],
        ),  # curriculum phases, score jitter from the global RNG
    ],
)
def test_curriculum_recipes_resume_bit_for_bit(tmp_path, recipe, small):
    from curvalign.train.trainer import train

    overrides = [
        "batch_size=16",
        "pair_batch_size=8",
        "tensorboard=false",
        "checkpoint_every=3",
        *small,
    ]
    train(recipe, TINY_WORLD, tmp_path / "full", steps=8, overrides=overrides, show_progress=False)
    train(
        recipe,
        TINY_WORLD,
        tmp_path / "part",
        steps=8,
        overrides=overrides,
        show_progress=False,
        stop_at=3,
    )  # as if killed after the checkpoint at step 3
    resumed = _run("--out", tmp_path / "part", "--resume", "--quiet")
    assert resumed.exit_code == 0, resumed.output
    full = load_run(tmp_path / "full", weights="last")
    part = load_run(tmp_path / "part", weights="last")
    assert part.step == 8
    for (name, a), (_, b) in zip(
        full.recipe.state_dict().items(), part.recipe.state_dict().items(), strict=False
    ):
        assert torch.equal(a, b), name
