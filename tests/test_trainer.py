"""The trainer: exact resume, atomic writes, non-finite handling, run-directory rules, logs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from _train_toy import ToyRecipe, toy_recipes, toy_store  # noqa: F401  (fixture)
from curvalign._io import atomic_write
from curvalign.config import TrainConfig
from curvalign.errors import ConfigError, TrainError
from curvalign.runs import CheckpointError, load_run, read_log
from curvalign.train import checkpoint as ckpt
from curvalign.train.trainer import NonFiniteLossError, build_optimizer, lr_multiplier, train

pytestmark = pytest.mark.usefixtures("toy_recipes")

FAST = ["batch_size=16", "log_every=1", "tensorboard=false", "train.warmup=2"]


def _weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert (a / "best.safetensors").exists() == (b / "best.safetensors").exists()
    if (a / "best.safetensors").exists():  # model selection resumes exactly too
        ba, bb = load_file(str(a / "best.safetensors")), load_file(str(b / "best.safetensors"))
        for key in ba:
            assert torch.equal(ba[key], bb[key]), key
        ma, mb = (json.loads((d / "meta.json").read_text()) for d in (a, b))
        assert ma["val_history"] == mb["val_history"] and ma["best_step"] == mb["best_step"]


def test_killed_run_resumed_equals_uninterrupted_run_bit_for_bit(tmp_path):
    """40 images, batches of 16 (epochs straddle batches), dropout on: a run stopped at step 6
    and resumed by a fresh Trainer to 12 ends with the same weights as one never stopped."""
    store = toy_store(num_images=40, captions=3, boxes=True, pairs=20)
    args = dict(
        steps=12,
        overrides=FAST + ["checkpoint_every=4", "pair_batch_size=4", "val_every=5"],
        show_progress=False,
    )
    full = train("_toy_boxes", store, tmp_path / "full", **args)
    part = train("_toy_boxes", store, tmp_path / "part", stop_at=6, **args)
    assert load_run(part, weights="last").step == 6
    torch.rand(1000)  # disturb every global RNG between the two processes' worth of work
    import random

    import numpy as np

    random.random(), np.random.rand(5)
    resumed = train("_toy_boxes", store, tmp_path / "part", resume=True, show_progress=False)
    assert resumed == tmp_path / "part"
    _assert_same_weights(full, resumed)
    state_full = torch.load(full / "state.pt", weights_only=False)
    state_res = torch.load(resumed / "state.pt", weights_only=False)
    for a, b in zip(
        state_full["optimizer"]["state"].values(),
        state_res["optimizer"]["state"].values(),
        strict=False,
    ):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    log_full, log_res = read_log(full), read_log(resumed)
    assert [r["step"] for r in log_res] == list(range(1, 13))
    assert log_full[-1]["loss"] == log_res[-1]["loss"] and log_full[-1]["lr"] == log_res[-1]["lr"]


def test_kill_after_the_last_checkpoint_resumes_from_it_and_trims_the_log(tmp_path, monkeypatch):
    store = toy_store(num_images=40)
    args = dict(steps=10, overrides=FAST + ["checkpoint_every=3"], show_progress=False)
    full = train("_toy", store, tmp_path / "full", **args)

    original = ToyRecipe.loss

    def dies_at_step_8(self, batch, progress, gather=None):
        if progress.step + 1 == 8:
            raise KeyboardInterrupt  # as if the process were killed: no checkpoint is written
        return original(self, batch, progress, gather)

    monkeypatch.setattr(ToyRecipe, "loss", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        train("_toy", store, tmp_path / "killed", **args)
    monkeypatch.setattr(ToyRecipe, "loss", original)
    assert load_run(tmp_path / "killed", weights="last").step == 6
    assert [r["step"] for r in read_log(tmp_path / "killed")] == list(range(1, 8))

    train("_toy", store, tmp_path / "killed", resume=True, show_progress=False)
    _assert_same_weights(full, tmp_path / "killed")
    assert [r["step"] for r in read_log(tmp_path / "killed")] == list(range(1, 11))


def test_resume_can_extend_steps_but_not_change_the_run(tmp_path):
    store = toy_store(num_images=40)
    run = train("_toy", store, tmp_path / "run", steps=3, overrides=FAST, show_progress=False)
    with pytest.raises(ConfigError, match="cannot change lr"):
        train("_toy", store, run, resume=True, overrides=["lr=0.5"], show_progress=False)
    with pytest.raises(ConfigError, match="holds a run of recipe '_toy', not '_toy_boxes'"):
        train("_toy_boxes", store, run, resume=True, show_progress=False)
    train("_toy", store, run, resume=True, steps=5, show_progress=False)
    assert load_run(run, weights="last").step == 5 and load_run(run).config.train.steps == 5


def test_resume_with_other_feature_dims_is_refused(tmp_path):
    run = train(
        "_toy",
        toy_store(num_images=40),
        tmp_path / "run",
        steps=3,
        overrides=FAST,
        show_progress=False,
        stop_at=2,
    )
    with pytest.raises(
        CheckpointError, match="feature dimensions differ.*dims 7/5.*trained on 6/5"
    ):
        train("_toy", toy_store(num_images=40, image_dim=7), run, resume=True, show_progress=False)


def test_resume_on_empty_directory_starts_fresh(tmp_path):
    notes = []
    run = train(
        "_toy",
        toy_store(num_images=40),
        tmp_path / "new",
        steps=2,
        overrides=FAST,
        resume=True,
        show_progress=False,
        notify=notes.append,
    )
    assert load_run(run, weights="last").step == 2 and any("starting a new one" in n for n in notes)


@pytest.mark.parametrize(
    "mode, fragment",
    [
        ("nan_loss", "the loss became non-finite at step 7: term bad = nan"),
        ("nan_grad", "the gradient became non-finite at step 7"),
    ],
)
def test_non_finite_loss_stops_names_the_term_and_keeps_the_last_good_checkpoint(
    tmp_path, mode, fragment
):
    store = toy_store(num_images=40)
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteLossError) as info:
        train(
            "_toy",
            store,
            run_dir,
            steps=10,
            show_progress=False,
            overrides=FAST + ["checkpoint_every=5", "nan_at_step=7", f"mode={mode}"],
        )
    message = str(info.value)
    assert fragment in message and "last good checkpoint (step 5)" in message
    loaded = load_run(run_dir, weights="last")
    assert loaded.step == 5
    assert all(torch.isfinite(p).all() for p in loaded.recipe.parameters())
    assert [r["step"] for r in read_log(run_dir)] == list(range(1, 7))


def test_non_finite_before_any_checkpoint_says_so(tmp_path):
    with pytest.raises(NonFiniteLossError, match="no checkpoint had been written yet"):
        train(
            "_toy",
            toy_store(num_images=40),
            tmp_path / "run",
            steps=10,
            show_progress=False,
            overrides=FAST + ["checkpoint_every=5", "nan_at_step=2"],
        )


def test_existing_run_is_refused_unless_resume_or_overwrite(tmp_path):
    store = toy_store(num_images=40)
    run = train("_toy", store, tmp_path / "run", steps=2, overrides=FAST, show_progress=False)
    with pytest.raises(
        ConfigError, match="already holds a run of recipe '_toy' at step 2; pass --resume"
    ):
        train("_toy", store, run, steps=2, overrides=FAST, show_progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        train("_toy", store, tmp_path / "other", steps=2, show_progress=False)
    with pytest.raises(ConfigError, match="holds files but no curvalign run"):
        train("_toy", store, tmp_path / "other", steps=2, resume=True, show_progress=False)
    train(
        "_toy",
        store,
        run,
        steps=3,
        overrides=FAST + ["seed=1"],
        overwrite=True,
        show_progress=False,
    )
    assert load_run(run, weights="last").step == 3 and load_run(run).config.train.seed == 1
    assert [r["step"] for r in read_log(run)] == [1, 2, 3]


def test_unknown_recipe_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown recipe 'nope'; known recipes: _toy, _toy_boxes"):
        train("nope", toy_store(), tmp_path / "run", steps=2, show_progress=False)
    assert not (tmp_path / "run").exists()


def test_run_directory_layout_logs_and_tensorboard(tmp_path):
    run = train(
        "_toy",
        toy_store(num_images=40),
        tmp_path / "run",
        steps=4,
        show_progress=False,
        overrides=["batch_size=8", "log_every=2", "checkpoint_every=0"],
    )
    names = {p.name for p in run.iterdir()}
    assert {
        "config.json",
        "config.yaml",
        "model.safetensors",
        "best.safetensors",
        "state.pt",
        "meta.json",
        "log.jsonl",
        "tb",
    } <= names
    assert not [n for n in names if n.endswith(".tmp")]
    assert any((run / "tb").iterdir())
    meta = json.loads((run / "meta.json").read_text())
    assert (
        meta["step"] == 4
        and meta["image_dim"] == 6
        and meta["text_dim"] == 5
        and meta["recipe"] == "_toy"
    )
    # 4 of the 40 images are the seeded validation hold-out (the store has no "val" split)
    assert meta["sampler"]["train_images"] == 36 and "torch" in meta["versions"]
    assert meta["validation"] == {"source": "holdout", "images": 4, "fraction": 0.1, "seed": 0}
    records = read_log(run)
    assert [r["step"] for r in records] == [2, 4]
    assert {
        "loss",
        "loss/contrastive",
        "lr",
        "grad_norm",
        "pairs_per_s",
        "temperature",
        "batch_rows",
    } <= set(records[0])
    assert records[0]["pairs_per_s"] > 0
    assert json.loads((run / "config.json").read_text())["train"]["batch_size"] == 8


def test_load_run_builds_the_trained_recipe_in_eval_mode(tmp_path):
    store = toy_store(num_images=40)
    run = train(
        "_toy", store, tmp_path / "run", steps=3, overrides=FAST + ["dim=4"], show_progress=False
    )
    loaded = load_run(run)
    assert isinstance(loaded.recipe, ToyRecipe) and not loaded.recipe.training
    assert loaded.recipe.image_head.out_features == 4 and loaded.config.recipe_config["dim"] == 4
    emb = loaded.recipe.embed_images(store.image_features[:3])
    assert emb["point"].shape == (3, 4)


def test_load_run_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_run(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a run directory"):
        load_run(tmp_path)
    run = train(
        "_toy",
        toy_store(num_images=40),
        tmp_path / "run",
        steps=2,
        overrides=FAST,
        show_progress=False,
    )
    (run / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors is damaged"):
        load_run(run, weights="last")
    (run / "best.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="best.safetensors is damaged"):
        load_run(run)
    with pytest.raises(CheckpointError, match="weights must be one of best, last"):
        load_run(run, weights="newest")
    (run / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        load_run(run)


def test_atomic_write_leaves_old_file_and_no_partial_file_on_failure(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_text("old")

    def writes_half_then_dies(tmp):
        tmp.write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(target, writes_half_then_dies)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_checkpoint_failure_keeps_previous_checkpoint_whole(tmp_path, monkeypatch):
    store = toy_store(num_images=40)
    run_dir = tmp_path / "run"
    calls = {"n": 0}
    real = ckpt.save_file

    def fails_on_second_checkpoint(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", fails_on_second_checkpoint)
    with pytest.raises(OSError):
        train(
            "_toy",
            store,
            run_dir,
            steps=6,
            overrides=FAST
            + ["checkpoint_every=3", "val_every=0"],  # one safetensors per checkpoint
            show_progress=False,
        )
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    assert (
        load_run(run_dir, weights="last").step == 3
    )  # model.safetensors and meta.json still from step 3


def test_optimizer_groups_and_schedule():
    recipe = ToyRecipe(ToyRecipe.Config(), 6, 5)
    cfg = TrainConfig(steps=10, warmup=2, weight_decay=0.3)
    opt = build_optimizer(recipe, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in recipe.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == recipe.no_decay_parameter_names()
    assert lr_multiplier(0, cfg) == pytest.approx(0.5) and lr_multiplier(1, cfg) == pytest.approx(
        1.0
    )
    assert lr_multiplier(9, cfg) == pytest.approx(0.0, abs=1e-12)


def test_bf16_autocast_trains_finite(tmp_path):
    run = train(
        "_toy",
        toy_store(num_images=40),
        tmp_path / "run",
        steps=3,
        show_progress=False,
        overrides=FAST + ["bf16=true"],
    )
    weights = _weights(run)
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())


def test_ctrl_c_stops_between_steps_with_an_exact_checkpoint(tmp_path, monkeypatch):
    import os
    import signal

    store = toy_store(num_images=40)
    args = dict(steps=6, overrides=FAST + ["checkpoint_every=0"], show_progress=False)
    full = train("_toy", store, tmp_path / "full", **args)
    original = ToyRecipe.loss

    def ctrl_c_during_step_3(self, batch, progress, gather=None):
        if progress.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only records the request
        return original(self, batch, progress, gather)

    monkeypatch.setattr(ToyRecipe, "loss", ctrl_c_during_step_3)
    with pytest.raises(TrainError, match=r"interrupted \(SIGINT\): stopped at step 3 .*--resume"):
        train("_toy", store, tmp_path / "run", **args)
    monkeypatch.setattr(ToyRecipe, "loss", original)
    assert load_run(tmp_path / "run", weights="last").step == 3
    train("_toy", store, tmp_path / "run", resume=True, show_progress=False)
    _assert_same_weights(full, tmp_path / "run")


def test_a_term_present_on_some_steps_is_averaged_over_those_steps(tmp_path, monkeypatch):
    original = ToyRecipe.loss

    def odd_steps_add_a_term(self, batch, progress, gather=None):
        out = original(self, batch, progress, gather)
        if progress.step % 2 == 0:
            out.terms["phase"] = torch.tensor(1.0)
        return out

    monkeypatch.setattr(ToyRecipe, "loss", odd_steps_add_a_term)
    run = train(
        "_toy",
        toy_store(num_images=40),
        tmp_path / "run",
        steps=4,
        show_progress=False,
        overrides=["batch_size=8", "log_every=2", "tensorboard=false"],
    )
    assert [r["loss/phase"] for r in read_log(run)] == [1.0, 1.0]


def test_non_finite_features_stop_training_with_field_and_row(tmp_path):
    store = toy_store(num_images=40, captions=1)
    store.image_features[11, 0] = float("inf")
    with pytest.raises(
        TrainError,
        match="step [12]: feature store field 'image_features' has non-finite values \\(row 11\\)",
    ):
        train(
            "_toy",
            store,
            tmp_path / "run",
            steps=5,
            overrides=["batch_size=20", "tensorboard=false"],
            show_progress=False,
        )


def test_read_log_skips_a_torn_last_line_and_names_a_corrupt_one(tmp_path):
    assert read_log(tmp_path) == []  # no log yet
    (tmp_path / "log.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2]
    (tmp_path / "log.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(CheckpointError, match="log.jsonl:2 is not valid JSON"):
        read_log(tmp_path)
