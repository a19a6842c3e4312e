"""Trainer events: what a caller of ``Trainer.fit`` (benchmark, studies, tuning trials, tower
training) plugs in instead of stopping and resuming a run through the disk.

``Trainer.fit`` calls, on every hook in order (every method is optional)::

    on_fit_start(trainer)                      before the first step of this call
    on_step_end(trainer, step, record)         after every optimizer step (step counts from 1)
    on_validation(trainer, event)              after each validation -> a Decision
    on_mark(trainer, step)                     after step ``step`` for each step in marks()
    on_fit_end(trainer, run)                   after the last checkpoint of this call

A validation happens every ``train.val_every`` steps, at step 0 (the untrained weights, when
``val_every > 0``), at the last step, and at the steps a hook lists in ``validation_steps()``.
Its score is the trainer's own (mean R@1 on the validation split) unless a hook's ``score``
returns one (a study's custom validation value); higher is better.

Decisions: ``STOP`` ends the run after this step (with a checkpoint); ``(EXTEND, n)`` lengthens
the run by ``n`` steps (its learning-rate schedule stretched over the new total, exactly as a
resume with more ``steps`` would); any STOP wins over EXTEND, the largest EXTEND wins over the
others. Decisions at the step-0 validation are ignored (nothing has been trained yet).

Hooks run with the recipe in eval mode and gradients off, and the torch/numpy/python random
states are restored after them, so a hook that measures the model cannot change the training
that follows (a run with hooks that only observe equals one without, bit for bit).

The two built-in hooks, installed by ``Trainer`` unless the caller passes its own instance of
the same class: ``KeepBestWeights`` (the best validation weights, written as
``best.safetensors``), ``EarlyStopping`` (``train.patience``) and ``TrainUntilConverged``
(``train.max_steps``: a run not converged at its last step trains on).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from curvalign.errors import ConfigError, TrainError

if TYPE_CHECKING:
    # the trainer imports this module: its types are read by the type checker only
    from curvalign.train.trainer import TrainedRun, Trainer


class Decision(enum.Enum):
    """What a hook asks of the trainer after a validation."""

    CONTINUE = "continue"
    STOP = "stop"
    EXTEND = "extend"  # lengthen the run; the hook says by how many steps: (EXTEND, n)


@dataclass(frozen=True)
class ValidationEvent:
    """One validation: ``score`` at ``step`` (higher is better) and every (step, score) of the
    run so far, this one included (a resumed run's earlier validations too)."""

    step: int
    score: float
    history: tuple[tuple[int, float], ...]


class TrainerHook:
    """Base class of trainer hooks: every method is a no-op; override the ones you need."""

    def marks(self) -> Iterable[int]:
        """Steps after which ``on_mark`` fires (read once, when ``fit`` starts)."""
        return ()

    def validation_steps(self) -> Iterable[int]:
        """Steps at which the trainer validates in addition to its own schedule (read once,
        when ``fit`` starts)."""
        return ()

    def score(self, trainer: Trainer) -> float | None:
        """This hook's validation value for ``trainer.recipe`` (None: not this hook's business).
        The first hook that returns a value replaces the trainer's own validation score."""
        return None

    def on_fit_start(self, trainer: Trainer) -> None:
        return None

    def on_step_end(self, trainer: Trainer, step: int, record: Mapping[str, float]) -> None:
        """``record``: ``step``, ``loss`` and ``lr`` of this step; on a logging step also the
        logged window means (``loss/TERM``, ``grad_norm``, ``pairs_per_s``, the recipe's
        log values)."""
        return None

    def on_validation(
        self, trainer: Trainer, event: ValidationEvent
    ) -> Decision | tuple[Decision, int] | None:
        return None

    def on_mark(self, trainer: Trainer, step: int) -> None:
        return None

    def on_fit_end(self, trainer: Trainer, run: TrainedRun) -> None:
        return None


def best_of(history: Sequence[tuple[int, float]]) -> tuple[int, float] | None:
    """The first (step, score) with the highest score (a later tie does not replace it)."""
    best: tuple[int, float] | None = None
    for step, score in history:
        if best is None or score > best[1]:
            best = (step, score)
    return best


def validations_since_best(history: Sequence[tuple[int, float]]) -> int:
    """How many validations came after the (first) best one."""
    best = best_of(history)
    if best is None:
        return 0
    index = next(i for i, item in enumerate(history) if item[0] == best[0])
    return len(history) - 1 - index


class KeepBestWeights(TrainerHook):
    """Keeps a copy of the weights at the best validation so far in ``trainer`` (``best_step``,
    ``best_val``), which the checkpoint writes as ``best.safetensors``: a later validation
    replaces them only when strictly better."""

    def on_validation(self, trainer: Trainer, event: ValidationEvent) -> None:
        if trainer.best_val is None or event.score > trainer.best_val:
            trainer.keep_best(event.step, event.score)


class EarlyStopping(TrainerHook):
    """Stops the run after ``patience`` validations without improving on the best one
    (``patience`` None: the run's ``train.patience``; 0: never)."""

    def __init__(self, patience: int | None = None) -> None:
        self.patience = patience

    def on_validation(self, trainer: Trainer, event: ValidationEvent) -> Decision | None:
        patience = trainer.train_config.patience if self.patience is None else self.patience
        if not patience or validations_since_best(event.history) < patience:
            return None
        best = best_of(event.history)
        assert best is not None
        trainer.notify_user(
            f"stopped early at step {event.step}: validation has not improved on step "
            f"{best[0]} ({100 * best[1]:.1f}%) in {patience} evaluations"
        )
        return Decision.STOP


class TrainUntilConverged(TrainerHook):
    """Lengthens a run whose validation has not converged at its last step (the shared rule,
    ``curvalign.stats.curve_converged``; None, too few validations, counts as not converged)
    by half its length (at least one validation interval), up to ``train.max_steps``; a run
    without ``max_steps`` (``--steps`` given) is never lengthened. The store's default run
    (``TrainConfig.default_steps``) sets ``max_steps``, so default rows are not cut while
    validation still rises."""

    def on_validation(
        self, trainer: Trainer, event: ValidationEvent
    ) -> tuple[Decision, int] | None:
        from curvalign.stats import curve_converged

        cfg = trainer.train_config
        cap, total = cfg.max_steps, cfg.steps
        if not cap or event.step != total or total >= cap:
            return None
        if curve_converged(event.history):
            return None
        more = min(cap - total, max(int(cfg.val_every or 1), total // 2))
        trainer.notify_user(
            f"validation has not converged at step {total}: training on to step "
            f"{total + more} (max_steps {cap})"
        )
        return Decision.EXTEND, more


BUILTIN_HOOKS: tuple[type[TrainerHook], ...] = (KeepBestWeights, EarlyStopping, TrainUntilConverged)


def with_builtin_hooks(hooks: Iterable[TrainerHook]) -> list[TrainerHook]:
    """The built-in hooks (first, in ``BUILTIN_HOOKS`` order) that ``hooks`` does not replace
    with an instance of the same class, then ``hooks`` in their order."""
    hooks = list(hooks)
    for hook in hooks:
        if not isinstance(hook, TrainerHook):
            raise ConfigError(f"trainer hook {hook!r} is not a curvalign.train.hooks.TrainerHook")
    builtin = [cls() for cls in BUILTIN_HOOKS if not any(type(h) is cls for h in hooks)]
    replaced = [h for h in hooks if type(h) in BUILTIN_HOOKS]
    others = [h for h in hooks if type(h) not in BUILTIN_HOOKS]
    # built-in behaviour first (the best weights are kept before anyone decides to stop)
    ordered: list[TrainerHook] = []
    for cls in BUILTIN_HOOKS:
        ordered += [h for h in [*builtin, *replaced] if type(h) is cls]
    return ordered + others


def combine(decisions: Iterable[Decision | tuple[Decision, int] | None]) -> tuple[Decision, int]:
    """One decision from several: STOP wins; else the largest EXTEND; else CONTINUE."""
    extend = 0
    for item in decisions:
        if item is None:
            continue
        decision, steps = item if isinstance(item, tuple) else (item, 0)
        if not isinstance(decision, Decision):
            raise TrainError(f"a trainer hook returned {item!r}, not a Decision")
        if decision is Decision.STOP:
            return Decision.STOP, 0
        if decision is Decision.EXTEND:
            if int(steps) < 1:
                raise TrainError(f"a trainer hook asked to extend the run by {steps} steps")
            extend = max(extend, int(steps))
    return (Decision.EXTEND, extend) if extend else (Decision.CONTINUE, 0)


__all__ = [
    "BUILTIN_HOOKS",
    "Decision",
    "EarlyStopping",
    "KeepBestWeights",
    "TrainerHook",
    "TrainUntilConverged",
    "ValidationEvent",
    "best_of",
    "combine",
    "validations_since_best",
    "with_builtin_hooks",
]
