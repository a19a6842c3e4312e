"""Trainer events (``curvalign.train.hooks``): the built-in hooks keep today's model selection,
observing hooks leave training bit-exact, and STOP / EXTEND / marks / a data swap / a hook's own
score act in memory exactly as the stop-and-resume cycle through the disk did."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from _train_toy import toy_recipes, toy_store  # noqa: F401  (fixture)
from curvalign.errors import TrainError
from curvalign.train.hooks import (
    Decision,
    EarlyStopping,
    KeepBestWeights,
    TrainerHook,
    TrainUntilConverged,
    ValidationEvent,
    best_of,
    combine,
    validations_since_best,
    with_builtin_hooks,
)
from curvalign.train.trainer import train
from curvalign.train.validation import ValidationSet

pytestmark = pytest.mark.usefixtures("toy_recipes")

FAST = ["batch_size=16", "log_every=1", "tensorboard=false", "train.warmup=2"]


def _files(run_dir, name="model.safetensors"):
    return load_file(str(run_dir / name))


def _same(a, b):
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def _scripted(monkeypatch, values):
    calls = {"n": 0}

    def score(self, recipe):
        value = values[min(calls["n"], len(values) - 1)]
        calls["n"] += 1
        return value

    monkeypatch.setattr(ValidationSet, "score", score)


def test_best_of_keeps_the_first_of_tied_maxima_and_counts_validations_after_it():
    history = [(0, 0.1), (5, 0.6), (10, 0.6), (15, 0.2)]
    assert best_of(history) == (5, 0.6)
    assert validations_since_best(history) == 2
    assert best_of([]) is None and validations_since_best([]) == 0


def test_decisions_combine_stop_first_then_the_longest_extension():
    assert combine([None, Decision.CONTINUE]) == (Decision.CONTINUE, 0)
    assert combine([(Decision.EXTEND, 3), (Decision.EXTEND, 7)]) == (Decision.EXTEND, 7)
    assert combine([(Decision.EXTEND, 3), Decision.STOP]) == (Decision.STOP, 0)
    with pytest.raises(TrainError, match="extend the run by 0 steps"):
        combine([(Decision.EXTEND, 0)])
    with pytest.raises(TrainError, match="not a Decision"):
        combine(["stop"])


def test_builtin_hooks_come_first_and_a_callers_instance_replaces_one():
    class Watch(TrainerHook):
        pass

    watch, patient = Watch(), EarlyStopping(patience=7)
    hooks = with_builtin_hooks([watch, patient])
    assert [type(h) for h in hooks] == [KeepBestWeights, EarlyStopping, TrainUntilConverged, Watch]
    assert hooks[1] is patient and hooks[3] is watch


@pytest.mark.parametrize("explicit", [False, True])
def test_builtin_hooks_select_and_stop_as_the_rule_says(tmp_path, monkeypatch, explicit):
    """Regression for the built-in hooks: the best step is the first maximum of the history, the
    run stops at the first validation ``patience`` evaluations past it, best.safetensors holds
    the weights of that step (those of a run stopped there), and passing the built-in hooks
    explicitly writes the same files as leaving them out."""
    store = toy_store(num_images=40)
    values = [0.1, 0.5, 0.5, 0.3, 0.2, 0.9]
    args = dict(steps=30, overrides=FAST + ["val_every=5", "patience=3"], show_progress=False)
    hooks = [KeepBestWeights(), EarlyStopping()] if explicit else []
    _scripted(monkeypatch, values)
    run = train("_toy", store, tmp_path / "run", hooks=hooks, **args)
    steps = [0, 5, 10, 15, 20, 25]
    history = list(zip(steps, values, strict=True))
    stop = next(
        i for i in range(len(history)) if validations_since_best(history[: i + 1]) >= 3
    )  # reference: the rule written out on the scripted values
    assert run.stopped_early and run.last_step == steps[stop] == 20
    assert run.best_step == best_of(history[: stop + 1])[0] == 5
    _scripted(monkeypatch, values)
    at_best = train("_toy", store, tmp_path / "at_best", stop_at=5, **args)
    assert _same(_files(run, "best.safetensors"), _files(at_best))
    meta = json.loads((run / "meta.json").read_text())
    assert meta["val_history"] == [list(h) for h in history[: stop + 1]]
    state = torch.load(run / "state.pt", weights_only=False)
    assert state["validation"]["since_best"] == 3


class _Observer(TrainerHook):
    """Looks at everything and disturbs every random state it can."""

    def __init__(self, marks=()):
        self._marks = marks
        self.events: list[tuple] = []

    def marks(self):
        return self._marks

    def _disturb(self):
        import random

        import numpy as np

        torch.rand(100), np.random.rand(3), random.random()

    def on_fit_start(self, trainer):
        self.events.append(("start", trainer.step))

    def on_step_end(self, trainer, step, record):
        self._disturb()
        assert record["step"] == step and "loss" in record and "lr" in record
        self.events.append(("step", step))

    def on_validation(self, trainer, event):
        self._disturb()
        assert isinstance(event, ValidationEvent) and event.history[-1] == (
            event.step,
            event.score,
        )
        self.events.append(("val", event.step))

    def on_mark(self, trainer, step):
        self._disturb()
        assert not trainer.recipe.training and not torch.is_grad_enabled()
        self.events.append(("mark", step))

    def on_fit_end(self, trainer, run):
        self.events.append(("end", run.last_step))


def test_observing_hooks_leave_training_bit_exact_and_see_every_event(tmp_path):
    store = toy_store(num_images=40)
    args = dict(steps=8, overrides=FAST + ["val_every=4"], show_progress=False)
    plain = train("_toy", store, tmp_path / "plain", **args)
    observer = _Observer(marks=(3, 6))
    watched = train("_toy", store, tmp_path / "watched", hooks=[observer], **args)
    assert _same(_files(plain), _files(watched))
    assert _same(_files(plain, "best.safetensors"), _files(watched, "best.safetensors"))
    assert watched.val_history == plain.val_history
    assert observer.events[0] == ("start", 0) and observer.events[-1] == ("end", 8)
    assert [e for e in observer.events if e[0] == "val"] == [("val", 0), ("val", 4), ("val", 8)]
    assert [e for e in observer.events if e[0] == "mark"] == [("mark", 3), ("mark", 6)]
    assert [e[1] for e in observer.events if e[0] == "step"] == list(range(1, 9))


def test_a_hook_that_stops_ends_the_run_with_a_checkpoint(tmp_path):
    class StopAtSix(TrainerHook):
        def validation_steps(self):
            return (6,)

        def on_validation(self, trainer, event):
            return Decision.STOP if event.step == 6 else None

    store = toy_store(num_images=40)
    run = train(
        "_toy",
        store,
        tmp_path / "run",
        steps=20,
        overrides=FAST + ["val_every=4"],
        show_progress=False,
        hooks=[StopAtSix()],
    )
    assert run.stopped_early and run.last_step == 6
    assert [s for s, _ in run.val_history] == [0, 4, 6]
    assert json.loads((run / "meta.json").read_text())["step"] == 6


class _Extend(TrainerHook):
    """Scores with a fixed value at given steps and extends the run once at ``at`` by ``by``."""

    def __init__(self, at, by, steps=()):
        self.at, self.by, self.steps = at, by, steps

    def validation_steps(self):
        return self.steps

    def score(self, trainer):
        return 0.5 + 0.01 * trainer.step

    def on_validation(self, trainer, event):
        return (Decision.EXTEND, self.by) if event.step == self.at else None


def test_extending_in_memory_equals_resuming_with_more_steps(tmp_path):
    """The study's old cycle (train to the budget, read the run, resume with steps + n) and
    one fit that a hook extends end with the same weights, schedule and config."""
    store = toy_store(num_images=40)
    args = dict(overrides=FAST + ["val_every=0"], show_progress=False)
    train("_toy", store, tmp_path / "disk", steps=10, **args)
    by_disk = train("_toy", store, tmp_path / "disk", steps=14, resume=True, show_progress=False)
    extended = train("_toy", store, tmp_path / "mem", steps=10, hooks=[_Extend(10, 4)], **args)
    assert extended.last_step == by_disk.last_step == 14
    assert _same(_files(by_disk), _files(extended))
    assert json.loads((extended / "config.json").read_text())["train"]["steps"] == 14
    # the hook's score drove model selection (val_every=0: no validation split of its own)
    assert [s for s, _ in extended.val_history] == [10, 14] and extended.best_step == 14
    assert (extended / "best.safetensors").exists()


def test_a_store_swapped_at_a_mark_equals_resuming_on_that_store(tmp_path):
    store = toy_store(num_images=40, captions=3)
    other = store.with_fields(text_features=store.text_features.flip(0))

    class Swap(TrainerHook):
        def marks(self):
            return (5,)

        def on_mark(self, trainer, step):
            trainer.use_store(other)

    args = dict(overrides=FAST + ["val_every=0"], show_progress=False)
    train("_toy", store, tmp_path / "disk", steps=12, stop_at=5, **args)
    by_disk = train("_toy", other, tmp_path / "disk", resume=True, show_progress=False)
    swapped = train("_toy", store, tmp_path / "mem", steps=12, hooks=[Swap()], **args)
    unswapped = train("_toy", store, tmp_path / "none", steps=12, **args)
    assert _same(_files(by_disk), _files(swapped))
    assert not _same(_files(unswapped), _files(swapped))  # the swap changed the training


def test_a_resumed_run_keeps_its_history_for_the_hooks(tmp_path, monkeypatch):
    store = toy_store(num_images=40)
    seen = []

    class Watch(TrainerHook):
        def on_validation(self, trainer, event):
            seen.append(event.history)

    args = dict(steps=12, overrides=FAST + ["val_every=4"], show_progress=False)
    train("_toy", store, tmp_path / "run", stop_at=6, **args)
    train("_toy", store, tmp_path / "run", resume=True, show_progress=False, hooks=[Watch()])
    assert [[s for s, _ in h] for h in seen] == [[0, 4, 8], [0, 4, 8, 12]]


def test_a_hook_that_is_not_a_trainer_hook_is_one_clear_error(tmp_path):
    from curvalign.errors import ConfigError

    with pytest.raises(ConfigError, match="is not a curvalign.train.hooks.TrainerHook"):
        train("_toy", toy_store(), tmp_path / "r", steps=2, overrides=FAST, hooks=[object()])
