"""Typed runs through ``fit``: settings parsed once per recipe, typed values for a trial's
point, a run kept in memory (nothing written), and tuning trials that write no run."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("optuna")

from curvalign.errors import ConfigError, TrainError  # noqa: E402
from curvalign.report import tuning  # noqa: E402
from curvalign.train.fitting import RunSpec, fit, per_recipe_overrides  # noqa: E402

TINY = "synthetic:images=120,text_pairs=60,captions_max=3"
TINY_TRAIN = ["batch_size=16", "pair_batch_size=16", "tensorboard=false", "checkpoint_every=0"]


def test_per_recipe_overrides_route_prefixes_and_keep_the_command_lines_order():
    got = per_recipe_overrides(
        ["lr=1", "meru.lr=2", "train.lr=3", "clip.embed_dim=8"], ["clip", "meru"]
    )
    # for meru, train.lr=3 came after meru.lr=2: the later spelling decides
    assert list(got["meru"].items()) == [("lr", "2"), ("train.lr", "3")]
    assert RunSpec.parse("meru", TINY, overrides=got["meru"]).config.train.lr == 3.0
    assert got["clip"] == {"lr": "1", "train.lr": "3", "embed_dim": "8"}
    with pytest.raises(ConfigError, match="names recipe 'atmg'"):
        per_recipe_overrides(["atmg.lr=1"], ["clip"])
    with pytest.raises(ConfigError, match="not key=value"):
        per_recipe_overrides(["lr"], ["clip"])


def test_typed_values_are_chosen_under_their_canonical_keys():
    spec = RunSpec.parse("clip", TINY, overrides=["lr=0.01"])
    tuned = spec.with_values({"weight_decay": 0.5, "temperature_init": 0.2})
    assert tuned.config.train.weight_decay == 0.5
    assert tuned.config.recipe_config["temperature_init"] == 0.2
    assert tuned.sets("weight_decay") and tuned.sets("recipe.temperature_init")
    assert tuned.chosen_values() == {
        "recipe.temperature_init": 0.2,
        "train.lr": 0.01,
        "train.weight_decay": 0.5,
    }
    with pytest.raises(ConfigError, match="unknown key"):
        spec.with_values({"no_such_knob": 1})


def test_fit_without_out_keeps_the_run_in_memory_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray write would land here
    spec = RunSpec.parse("clip", TINY, overrides=[*TINY_TRAIN, "val_every=2"], steps=4)
    kept = fit(spec, None, show_progress=False)
    assert list(tmp_path.iterdir()) == []
    assert not kept.written and kept.best_val is not None and kept.last_step == 4
    with pytest.raises(TrainError, match="kept in memory"):
        kept.run_dir  # noqa: B018
    # the same run written: the same record and the same weights, bit for bit (same computation)
    written = fit(spec, tmp_path / "run", show_progress=False)
    assert written.val_history == kept.val_history and written.best_step == kept.best_step
    mine, theirs = kept.recipe.state_dict(), written.recipe.state_dict()
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert value.equal(theirs[name]), name


def test_tuning_trials_write_no_run_unless_asked(tmp_path):
    common = dict(trials=1, steps=4, overrides=TINY_TRAIN, seeds=1, lr_range_steps=0)
    result = tuning.run_tuning(["clip"], TINY, tmp_path / "a", **common)
    assert result.counted == {"clip": 1} and result.best["clip"] is not None
    assert not (tmp_path / "a" / "runs").exists()
    tuning.run_tuning(["clip"], TINY, tmp_path / "b", keep_runs=True, **common)
    runs = sorted(p.name for p in (tmp_path / "b" / "runs" / "clip").glob("trial-*/seed-*"))
    assert runs == ["seed-0"]
    row = next(csv.DictReader((tmp_path / "b" / "trials.csv").open()))
    assert row["outcome"] == "ok" and float(row["value"]) == pytest.approx(
        float(next(csv.DictReader((tmp_path / "a" / "trials.csv").open()))["value"]), abs=1e-6
    )
