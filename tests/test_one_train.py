"""One training entry point: ``curvalign.train.train`` is ``trainer.train``, which takes
``towers=``; the old tower entry point still works for one release with a DeprecationWarning."""

from __future__ import annotations

import inspect

import pytest

from curvalign.errors import ConfigError


def test_the_package_train_is_the_trainer_one_and_takes_towers():
    import curvalign.train as train_package
    from curvalign.train import trainer

    assert train_package.train is trainer.train
    assert "towers" in inspect.signature(trainer.train).parameters


def test_the_old_tower_train_warns_naming_the_new_place_and_runs_the_one_train(tmp_path):
    from curvalign.train import towers

    with pytest.warns(DeprecationWarning, match=r"curvalign\.train\.train"):
        # the one train's own first check answers: the alias reached it
        with pytest.raises(ConfigError, match="exclude each other"):
            towers.train("clip", "synthetic", tmp_path / "r", resume=True, overwrite=True)
