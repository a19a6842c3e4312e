"""TrainConfig / RunConfig: key=value overrides, YAML files, typed parsing and their errors."""

from __future__ import annotations

import json

import pytest

from _train_toy import toy_recipes  # noqa: F401  (fixture)
from curvalign.config import RunConfig, TrainConfig, coerce, parse_override, resolve_config
from curvalign.errors import ConfigError, CurvalignError

pytestmark = pytest.mark.usefixtures("toy_recipes")


def test_defaults_and_warmup_steps():
    cfg = TrainConfig(steps=200, warmup=0.1)
    assert cfg.batch_size == 256 and cfg.device == "cpu" and cfg.num_threads is None
    assert cfg.warmup_steps == 20
    assert TrainConfig(steps=200, warmup=30).warmup_steps == 30
    assert TrainConfig(steps=200, warmup=0).warmup_steps == 0


def test_overrides_route_to_train_and_recipe_with_types():
    cfg = resolve_config(
        "_toy",
        "synthetic",
        steps=7,
        overrides=[
            "lr=1e-3",
            "bf16=true",
            "batch_size=32",
            "num_threads=none",
            "temperature_init=0.05",
            "recipe.dim=4",
            "train.seed=3",
            "widths=(4, 5)",
            "mode=nan_grad",
            "scale=2",
        ],
    )
    assert cfg.train.steps == 7
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.train.bf16 is True and cfg.train.batch_size == 32 and cfg.train.seed == 3
    assert cfg.train.num_threads is None
    assert cfg.recipe_config["temperature_init"] == pytest.approx(0.05)
    assert cfg.recipe_config["dim"] == 4
    assert cfg.recipe_config["widths"] == (4, 5)
    assert cfg.recipe_config["mode"] == "nan_grad"
    assert cfg.recipe_config["scale"] == 2.0


def test_recipe_config_is_complete_with_defaults():
    cfg = resolve_config("_toy", "synthetic")
    assert cfg.recipe_config["temperature_init"] == pytest.approx(0.1)
    assert cfg.recipe_config["widths"] == (8,)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("lrr=3", "unknown key 'lrr'"),
        ("train.dim=3", "unknown key 'train.dim'"),
        ("model.lr=3", "prefix must be 'train.' or 'recipe.'"),
        ("lr=fast", "expected a number"),
        ("steps=1.5", "expected an integer"),
        ("bf16=maybe", "expected true or false"),
        ("mode=other", "is not one of"),
        ("widths=(a,b)", "expected an integer"),
        ("warmup=3", "train.warmup=... or recipe.warmup=..."),
        ("steps=0", "steps must be >= 1"),
        ("lr", "is not key=value"),
    ],
)
def test_override_errors_are_clear(override, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        resolve_config("_toy", "synthetic", overrides=[override])
    assert fragment in str(info.value)


def test_unknown_key_lists_valid_keys_of_both_sides():
    with pytest.raises(ConfigError) as info:
        resolve_config("_toy", "synthetic", overrides=["temprature=0.1"])
    message = str(info.value)
    assert "batch_size" in message and "temperature_init" in message and "'_toy'" in message


def test_ambiguous_key_resolved_by_prefix():
    cfg = resolve_config("_toy", "synthetic", overrides=["train.warmup=5", "recipe.warmup=2"])
    assert cfg.train.warmup == 5 and cfg.recipe_config["warmup"] == 2


def test_unknown_recipe_lists_known():
    with pytest.raises(ConfigError) as info:
        resolve_config("nope", "synthetic")
    assert "unknown recipe 'nope'" in str(info.value) and "_toy" in str(info.value)


def test_missing_recipe_or_data():
    with pytest.raises(ConfigError, match="no recipe given"):
        resolve_config(None, "synthetic")
    with pytest.raises(ConfigError, match="no data given"):
        resolve_config("_toy", None)


def test_yaml_file_then_steps_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "recipe: _toy\n"
        "data: synthetic:images=50\n"
        "train:\n  lr: 1e-3\n  steps: 100\n  batch_size: 16\n"
        "recipe_config:\n  dim: 4\n  widths: [2, 3]\n"
        "seed: 9\n"  # a top-level key reads like an override
    )
    cfg = resolve_config(None, None, config_file=path, steps=50, overrides=["batch_size=8"])
    assert cfg.recipe == "_toy" and cfg.data == "synthetic:images=50"
    assert cfg.train.lr == pytest.approx(1e-3)  # YAML reads 1e-3 as a string; the field type wins
    assert cfg.train.steps == 50 and cfg.train.batch_size == 8 and cfg.train.seed == 9
    assert cfg.recipe_config["dim"] == 4 and cfg.recipe_config["widths"] == (2, 3)
    assert resolve_config("_toy", "other", config_file=path).data == "other"


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config("_toy", "synthetic", config_file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not readable YAML"):
        resolve_config("_toy", "synthetic", config_file=bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        resolve_config("_toy", "synthetic", config_file=listy)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        resolve_config("_toy", "synthetic", config_file=wrong)


def test_json_round_trip(tmp_path):
    cfg = resolve_config("_toy", "synthetic", overrides=["widths=(1,2,3)", "lr=0.5"])
    cfg.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["recipe_config"]["widths"] == [
        1,
        2,
        3,
    ]
    assert (tmp_path / "config.yaml").read_text().startswith("recipe: _toy")
    again = RunConfig.load(tmp_path / "config.json")
    assert again == cfg


def test_from_dict_rejects_unknown_sections():
    with pytest.raises(ConfigError, match="unknown top-level"):
        RunConfig.from_dict({"recipe": "_toy", "data": "x", "trian": {}})


@pytest.mark.parametrize(
    "value, annotation, expected",
    [
        ("3", int, 3),
        ("3.0", int, 3),
        (3, float, 3.0),
        ("1e-4", float, 1e-4),
        ("off", bool, False),
        ("[1, 2]", tuple[int, ...], (1, 2)),
        ("1,2", list[float], [1.0, 2.0]),
        ("null", int | None, None),
        ("7", int | None, 7),
        ("abc", str, "abc"),
        (5, str, "5"),
    ],
)
def test_coerce(value, annotation, expected):
    assert coerce(value, annotation, "x") == expected


def test_parse_override_keeps_equals_in_value():
    assert parse_override("data=features:/a=b") == ("data", "features:/a=b")


def test_config_lives_below_the_trainer_and_old_imports_still_work():
    import curvalign.train as train_package
    import curvalign.train.checkpoint as old_checkpoint
    import curvalign.train.config as old_config
    from curvalign import runs

    assert old_config.RunConfig is RunConfig and old_config.ConfigError is ConfigError
    assert old_checkpoint.read_meta is runs.read_meta
    # one import path for load_run: curvalign.runs (curvalign.train's is a deprecated alias)
    assert not hasattr(old_checkpoint, "load_run") and "load_run" not in train_package.__all__
    assert callable(runs.load_run) and callable(train_package.train)
    assert issubclass(ConfigError, CurvalignError) and issubclass(ConfigError, ValueError)
