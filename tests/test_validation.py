"""Validation and model selection: the split, the metric, best and last weights, early stopping,
old run directories, and one clear error per bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from _train_toy import toy_recipes, toy_store  # noqa: F401  (fixture)
from curvalign.config import TrainConfig
from curvalign.errors import ConfigError
from curvalign.runs import load_run
from curvalign.train.trainer import train
from curvalign.train.validation import (
    ValidationSet,
    recall_at_1_image_query,
    recall_at_1_text_query,
    validation_store,
)

pytestmark = pytest.mark.usefixtures("toy_recipes")

FAST = ["batch_size=16", "log_every=1", "tensorboard=false", "train.warmup=2"]


def test_recall_at_1_against_a_hand_computed_case():
    # 3 texts, 2 images; texts 0, 1 belong to image 0, text 2 to image 1
    t2i = torch.tensor([0, 0, 1])
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.2], [0.3, 0.8]])
    # text 0 right; text 1 tied (a tie counts against the model); text 2 right -> 2/3
    assert recall_at_1_text_query(scores, t2i) == pytest.approx(2 / 3)
    # image 0: own best 0.9 > other 0.3 -> hit; image 1: own 0.8 > others' best 0.2 -> hit
    assert recall_at_1_image_query(scores, t2i) == pytest.approx(1.0)
    scores[1, 1] = 0.85  # now a caption of image 0 outranks image 1's own caption
    assert recall_at_1_image_query(scores, t2i) == pytest.approx(0.5)


def _scripted(monkeypatch, values):
    """ValidationSet.score returns ``values`` in order (then the last one again)."""
    calls = {"n": 0}

    def score(self, recipe):
        value = values[min(calls["n"], len(values) - 1)]
        calls["n"] += 1
        return value

    monkeypatch.setattr(ValidationSet, "score", score)
    return calls


def test_a_run_whose_validation_peaks_early_keeps_the_early_weights(tmp_path, monkeypatch):
    store = toy_store(num_images=40)
    args = dict(steps=20, overrides=FAST + ["val_every=5"], show_progress=False)
    # validations at steps 0, 5, 10, 15, 20: the peak is at step 5
    _scripted(monkeypatch, [0.1, 0.6, 0.4, 0.3, 0.2])
    run = train("_toy", store, tmp_path / "run", **args)
    assert run.best_step == 5 and run.best_val == pytest.approx(0.6)
    assert [s for s, _ in run.val_history] == [0, 5, 10, 15, 20]
    _scripted(monkeypatch, [0.1, 0.6])
    early = train("_toy", store, tmp_path / "early", stop_at=5, **args)  # the weights at step 5
    best, at_five = (
        load_file(str(run / "best.safetensors")),
        load_file(str(early / "model.safetensors")),
    )
    last = load_file(str(run / "model.safetensors"))
    assert all(torch.equal(best[k], at_five[k]) for k in best)
    assert not all(torch.equal(best[k], last[k]) for k in best)  # training went on after step 5
    loaded = load_run(run)
    assert loaded.weights == "best" and loaded.step == 5 and loaded.last_step == 20
    assert "step 5 of 20" in loaded.describe() and loaded.note is None
    assert load_run(run, weights="last").step == 20
    meta = json.loads((run / "meta.json").read_text())
    assert meta["best_step"] == 5 and len(meta["val_history"]) == 5


def test_patience_stops_early_and_resume_says_nothing_to_do(tmp_path, monkeypatch):
    store = toy_store(num_images=40)
    _scripted(monkeypatch, [0.1, 0.5, 0.4, 0.3, 0.2, 0.1])
    run = train(
        "_toy",
        store,
        tmp_path / "run",
        steps=30,
        overrides=FAST + ["val_every=5", "patience=2"],
        show_progress=False,
    )
    # best at 5, no improvement at 10 and 15: stopped at 15 of 30
    assert run.stopped_early and run.last_step == 15 and run.best_step == 5
    assert load_run(run).step == 5 and load_run(run, weights="last").step == 15
    notes: list[str] = []
    again = train("_toy", store, run, resume=True, show_progress=False, notify=notes.append)
    assert again.last_step == 15 and any("stopped early" in n for n in notes)


def test_store_val_split_is_used_and_holdout_is_recorded(tmp_path):
    store = toy_store(num_images=40, test_images=10)
    held, info = validation_store(store, 0.25, seed=3)
    assert info == {"source": "holdout", "images": 10, "fraction": 0.25, "seed": 3}
    assert held.split_names == ["train", "test", "val"]
    val = set(held.split_image_ids("val").tolist())
    assert len(val) == 10 and not val & set(store.split_image_ids("test").tolist())
    assert val == set(validation_store(store, 0.25, seed=3)[0].split_image_ids("val").tolist())
    own, info = validation_store(held, 0.5, seed=0)  # a store with its own split keeps it
    assert own is held and info == {"source": "store", "images": 10}


def test_synthetic_world_has_a_val_split_disjoint_from_test():
    from curvalign.data import load_data

    store = load_data("synthetic:images=200")
    sizes = {n: len(store.split_image_ids(n)) for n in store.split_names}
    assert sizes == {"train": 140, "test": 40, "val": 20}
    test_of_default = load_data("synthetic:images=200,val_fraction=0")
    assert torch.equal(test_of_default.split_image_ids("test"), store.split_image_ids("test"))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"val_fraction": 0.0}, "val_fraction must lie in (0, 1)"),
        ({"val_fraction": 1.5}, "val_fraction must lie in (0, 1)"),
        ({"patience": 3, "val_every": 0}, "patience=3 needs validation: set val_every > 0"),
        ({"val_every": -1}, "val_every must be >= 0"),
    ],
)
def test_bad_validation_settings_are_one_clear_error(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "settings, train_images, expected",
    [
        ({}, 828, 4),  # wordnet:mammal.n.01's train pairs at batch 256: an epoch is 4 steps
        ({}, 100_000, 50),  # a large store: never more than 50 steps between two checks
        ({"steps": 100}, 100_000, 50),  # no floor per run: a short run on a big store
        ({"batch_size": 8}, 0, 1),  # never below one step
        ({"batch_size": 8}, 8, 1),  # an epoch of one batch
        ({"batch_size": 16}, 40, 3),  # ceil(40 / 16): a partial last batch counts as a step
        ({"val_every": 7}, 828, 7),  # a value the user set is kept
        ({"val_every": 0}, 828, 0),  # ... and so is "no validation"
    ],
)
def test_the_default_validation_interval_is_one_epoch(settings, train_images, expected):
    assert TrainConfig(**settings).validation_interval(train_images) == expected


def test_an_unset_val_every_is_resolved_per_epoch_and_saved(tmp_path):
    store = toy_store(num_images=40)
    run = train(
        "_toy",
        store,
        tmp_path / "run",
        steps=60,
        overrides=["batch_size=8", "tensorboard=false", "patience=0"],
        show_progress=False,
    )
    # 40 images, 10% held out: 36 train images, batch 8 -> an epoch is 5 steps (ceil 4.5)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["train"]["val_every"] == 5
    history = json.loads((tmp_path / "run" / "meta.json").read_text())["val_history"]
    assert [step for step, _ in history] == list(range(0, 61, 5))
    assert load_run(tmp_path / "run").config.train.val_every == 5
    assert run.best_step in range(0, 61, 5)


def test_print_config_shows_the_resolved_validation_interval(tmp_path):
    from curvalign.config import describe_config

    store = toy_store(num_images=40)
    store.save(tmp_path / "store")
    text = describe_config("_toy", f"features:{tmp_path / 'store'}", overrides=["batch_size=8"])
    # 36 train images after the 10% hold-out, batch 8: an epoch is 5 steps, as the run saves
    assert "val_every resolved by the epoch rule (docs/training.md): 5" in text
    assert "  val_every: 5\n" in text
    set_by_user = describe_config(
        "_toy", f"features:{tmp_path / 'store'}", overrides=["batch_size=8", "val_every=9"]
    )
    assert "  val_every: 9\n" in set_by_user and "epoch rule" not in set_by_user


def test_patience_with_the_default_interval_is_accepted():
    assert TrainConfig(patience=3).val_every is None  # validates once per epoch: patience counts


def test_empty_or_test_overlapping_val_split_is_refused(tmp_path):
    store = toy_store(num_images=40, test_images=10)
    empty = store.subset(torch.arange(50))
    empty.split_names = ["train", "test", "val"]  # a "val" split with no image
    with pytest.raises(ConfigError, match="'val' split is empty"):
        train("_toy", empty, tmp_path / "a", steps=2, overrides=FAST, show_progress=False)
    leaky = store.subset(torch.arange(50))
    leaky.split_names = ["train", "test", "val"]
    leaky.image_split = leaky.image_split.clone()
    leaky.image_split[:5] = 2
    leaky.image_features = leaky.image_features.clone()
    leaky.image_features[:3] = leaky.image_features[40:43]  # 3 of 5 val images are test images
    with pytest.raises(ConfigError, match="3 of the 5 images of its 'val' split are identical"):
        train("_toy", leaky, tmp_path / "b", steps=2, overrides=FAST, show_progress=False)
    leaky.image_features[1:3] = torch.randn(2, 6)  # one duplicate: the data's own, a note
    notes: list[str] = []
    train("_toy", leaky, tmp_path / "c", steps=2, overrides=FAST, show_progress=False,
          notify=notes.append)  # fmt: skip
    assert any("identical to a test image" in n for n in notes)


def test_run_from_before_validation_loads_last_weights_as_best_with_a_note(tmp_path):
    store = toy_store(num_images=40)
    run = train(
        "_toy",
        store,
        tmp_path / "run",
        steps=3,
        overrides=FAST + ["val_every=0"],
        show_progress=False,
    )
    assert not (run / "best.safetensors").exists()
    meta = json.loads((run / "meta.json").read_text())
    for key in ("validation", "val_history", "best_step", "best_val", "stopped_early", "sha256"):
        meta.pop(key)  # as meta.json was written before this change (and before checksums)
    (run / "meta.json").write_text(json.dumps(meta))
    config = json.loads((run / "config.json").read_text())
    for key in ("val_every", "patience", "val_fraction"):
        config["train"].pop(key)
    (run / "config.json").write_text(json.dumps(config))
    loaded = load_run(run)
    assert loaded.weights == "last" and loaded.step == 3 and loaded.config.train.val_every == 0
    assert "written before curvalign kept best weights" in loaded.note
    assert loaded.note in loaded.notes  # the CLI prints every note


def test_a_store_too_small_for_a_holdout_trains_without_validation_with_a_note(tmp_path):
    store = toy_store(num_images=6)
    same, info = validation_store(store, 0.1, seed=0)
    assert same is store and info["source"] == "none" and "too few" in info["reason"]
    notes: list[str] = []
    run = train(
        "_toy", store, tmp_path / "run", steps=2, overrides=["batch_size=4", "tensorboard=false"],
        show_progress=False, notify=notes.append,
    )  # fmt: skip
    assert run.best_step is None and any("no validation" in n for n in notes)
    assert load_run(run).weights == "last"
