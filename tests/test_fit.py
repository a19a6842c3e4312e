"""One typed run: ``RunSpec`` parses once, ``fit`` returns the model, and every untrained row is
the trained run's own step 0 (``train.trainer.start_of_run``)."""

from __future__ import annotations

import pytest
import torch

from curvalign.data import load_store
from curvalign.errors import ConfigError
from curvalign.runs import load_run, read_config
from curvalign.train import FitResult, RunSpec, fit
from curvalign.train.trainer import Trainer, start_of_run

TINY = "synthetic:images=160,text_pairs=0,captions_max=3"
TINY_TRAIN = ["batch_size=16", "num_threads=1", "embed_dim=16"]


@pytest.fixture(scope="module")
def raw_store():
    return load_store(TINY)[0]


def _unit(store):
    unit = torch.nn.functional.normalize
    return store.with_fields(
        image_features=unit(store.image_features, dim=-1),
        text_features=unit(store.text_features, dim=-1),
        box_image_features=unit(store.box_image_features, dim=-1),
        box_text_features=unit(store.box_text_features, dim=-1),
    )


def test_spec_parses_once_and_knows_what_was_chosen():
    spec = RunSpec.parse("meru", TINY, overrides=["train.lr=0.01", "embed_dim=16"], steps=7)
    assert spec.config.train.lr == 0.01 and spec.config.train.steps == 7
    assert spec.sets("lr") and spec.sets("train.lr") and spec.sets("recipe.embed_dim")
    assert spec.sets("steps") and not spec.sets("weight_decay")
    later = spec.with_train(seed=3).with_recipe(curvature_init=2.0)
    assert later.seed == 3 and later.config.recipe_config["curvature_init"] == 2.0
    assert later.sets("seed") and later.sets("curvature_init") and spec.seed == 0
    with pytest.raises(ConfigError, match="unknown key"):
        spec.with_train(not_a_setting=1)
    with pytest.raises(ConfigError):
        spec.with_train(lr="fast")  # validated by the same parser as the command line


def test_fit_returns_the_best_weights_in_memory(tmp_path, raw_store):
    spec = RunSpec.parse("clip", TINY, overrides=TINY_TRAIN, steps=12).with_train(val_every=3)
    result = fit(spec, tmp_path / "run", data=raw_store, show_progress=False)
    assert isinstance(result, FitResult) and not result.recipe.training
    assert result.val_history[0][0] == 0 and result.step0_val == result.val_history[0][1]
    assert result.warm_start is not None and result.warm_start["kind"] in ("identity", "ridge")
    loaded = load_run(result.run_dir)  # the same weights the disk holds as best
    assert loaded.step == result.best_step and result.last_step == 12
    for key, value in loaded.recipe.state_dict().items():
        assert torch.equal(value, result.recipe.state_dict()[key]), key
    assert result.config == read_config(result.run_dir)


@pytest.mark.parametrize("features", ["unit-norm", "unnormalised"])
@pytest.mark.parametrize("recipe", ["meru", "atmg", "phyclip"])
def test_the_untrained_row_is_the_trained_runs_step_0(tmp_path, raw_store, recipe, features):
    store = _unit(raw_store) if features == "unit-norm" else raw_store
    overrides = [o for o in TINY_TRAIN if recipe != "phyclip" or not o.startswith("embed_dim")]
    if recipe == "phyclip":
        overrides += ["num_factors=2", "factor_dim=4"]
    spec = RunSpec.parse(recipe, TINY, overrides=overrides, steps=2)
    trainer = Trainer(spec.config, store, tmp_path, show_progress=False)
    step0 = {k: v.clone() for k, v in trainer.recipe.state_dict().items()}
    trainer.fit()
    untrained = start_of_run(read_config(tmp_path), store).state_dict()  # from the saved config
    assert step0.keys() == untrained.keys()
    for key, value in step0.items():
        assert torch.equal(value, untrained[key]), key


@pytest.mark.parametrize("features", ["unit-norm", "unnormalised"])
def test_a_studys_untrained_arm_is_its_trained_arms_step_0(tmp_path, raw_store, features):
    from curvalign_lab import kit

    store = _unit(raw_store) if features == "unit-norm" else raw_store
    bench = kit.Bench(tmp_path, store, TINY, 2, TINY_TRAIN, val_every=1)
    untrained = bench.untrained("meru", [], seed=1).state_dict()
    config = RunSpec.parse("meru", TINY, overrides=[*bench.overrides, "seed=1"], steps=2).config
    trainer = Trainer(config, bench.store, tmp_path / "arm", show_progress=False)
    for key, value in trainer.recipe.state_dict().items():
        assert torch.equal(value, untrained[key]), key
