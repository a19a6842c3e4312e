"""The store's default run (``steps`` unset): a number of epochs of the train split, continued
while validation has not converged (the shared rule) up to a cap; ``--steps`` wins and is
never lengthened."""

from __future__ import annotations

import json

import pytest

from _train_toy import toy_recipes, toy_store  # noqa: F401  (fixture)
from curvalign.config import (
    DEFAULT_EPOCHS,
    DEFAULT_STEPS_CAP,
    DEFAULT_STEPS_MIN,
    DEFAULT_STEPS_START_MAX,
    TrainConfig,
)
from curvalign.data.validation_split import train_image_count, validation_split
from curvalign.train.trainer import train
from curvalign.train.validation import ValidationSet

pytestmark = pytest.mark.usefixtures("toy_recipes")

FAST = ["batch_size=16", "log_every=50", "tensorboard=false", "checkpoint_every=0"]


def _scripted(monkeypatch, values):
    calls = {"n": 0}

    def score(self, recipe):
        value = values(calls["n"])
        calls["n"] += 1
        return value

    monkeypatch.setattr(ValidationSet, "score", score)


def test_the_default_steps_follow_the_store_within_their_bounds():
    cfg = TrainConfig(batch_size=256)
    assert cfg.steps is None
    # 700 pairs: 3 steps an epoch, 20 epochs = 60 steps, raised to the floor
    assert cfg.default_steps(700) == (DEFAULT_STEPS_MIN, DEFAULT_STEPS_CAP)
    # 20k pairs: 79 steps an epoch -> 20 epochs, capped at the start's most
    assert cfg.default_steps(20_000) == (DEFAULT_STEPS_START_MAX, DEFAULT_STEPS_CAP)
    middle = 256 * 30  # 30 steps an epoch
    assert cfg.default_steps(middle) == (DEFAULT_EPOCHS * 30, DEFAULT_STEPS_CAP)
    assert TrainConfig(max_steps=40).default_steps(700) == (40, 40)  # a user's cap wins


def test_an_unset_steps_runs_the_store_default_and_trains_on_while_rising(tmp_path, monkeypatch):
    store = toy_store(num_images=48)
    _scripted(monkeypatch, lambda n: 0.01 * n)  # validation rises at every check
    run = train(
        "_toy", store, tmp_path / "run", overrides=[*FAST, "val_every=20", "max_steps=160"],
        show_progress=False,
    )  # fmt: skip
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    split, _ = validation_split(store, 0.1, 0, "toy")
    start, cap = TrainConfig(batch_size=16, max_steps=160).default_steps(train_image_count(split))
    assert start == DEFAULT_STEPS_MIN and cap == 160
    # never converged: lengthened (by half its length at a time) up to the cap, not beyond
    assert run.last_step == saved["steps"] == 160 > start and saved["max_steps"] == 160


def test_a_converged_default_run_stops_at_its_start_and_steps_wins(tmp_path, monkeypatch):
    store = toy_store(num_images=48)
    flat = [0.1, 0.5] + [0.5, 0.49] * 20  # the best early, flat after it: converged
    _scripted(monkeypatch, lambda n: flat[min(n, len(flat) - 1)])
    run = train("_toy", store, tmp_path / "flat", overrides=[*FAST, "val_every=10"],
                show_progress=False)  # fmt: skip
    assert run.last_step == DEFAULT_STEPS_MIN
    _scripted(monkeypatch, lambda n: 0.01 * n)  # rising, but --steps was given
    run = train("_toy", store, tmp_path / "given", steps=30, overrides=[*FAST, "val_every=10"],
                show_progress=False)  # fmt: skip
    saved = json.loads((tmp_path / "given" / "config.json").read_text())["train"]
    assert run.last_step == saved["steps"] == 30 and saved["max_steps"] is None
