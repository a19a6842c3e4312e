"""One typed run: a ``RunSpec`` says what to train, ``fit`` trains it, a ``FitResult`` holds the
trained model in memory with its record (docs/design.md, "One typed run").

    spec = RunSpec.parse(name, "synthetic", overrides=["lr=1e-3"], steps=300)  # a recipe
    spec = spec.with_train(seed=3)                 # typed, validated: no "key=value" strings
    result = fit(spec, "runs/meru-s3")
    result.recipe                                  # the best-validation weights, eval mode
    result.best_step, result.val_history, result.warm_start

Key=value strings and YAML are parsed once, in ``RunSpec.parse`` (``config.resolve_config``,
the one parser); everything above ``train/`` changes a spec with ``with_train`` /
``with_recipe``, which validate through the same dataclasses. ``fit`` writes the run directory
as ``curvalign train`` does (checkpoints, best weights, logs, meta) and returns the model, so no
caller re-reads it from disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from curvalign.config import (
    RunConfig,
    canonical_key,
    config_file_keys,
    parse_override,
    resolve_config,
)
from curvalign.train.hooks import TrainerHook

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore
    from curvalign.recipes.base import Recipe
    from curvalign.towers.base import TowersConfig
    from curvalign.train.trainer import Trainer


@dataclass(frozen=True)
class RunSpec:
    """What one run trains: the resolved ``RunConfig`` (recipe, data, trainer and recipe
    settings, seed), the encoders trained in front of the recipe (``towers``; None: the
    store's frozen features) and which settings were chosen rather than defaulted
    (``chosen``: canonical keys such as ``"train.lr"``, ``"recipe.embed_dim"``)."""

    config: RunConfig
    towers: TowersConfig | None = None
    chosen: frozenset[str] = frozenset()

    @classmethod
    def parse(
        cls,
        recipe: str | None,
        data: str | None,
        *,
        overrides: Iterable[str] | Mapping[str, Any] = (),
        config_file: str | Path | None = None,
        steps: int | None = None,
        towers: TowersConfig | str | None = None,
    ) -> RunSpec:
        """The spec from command-line values: ``"key=value"`` strings (or a mapping), a YAML
        ``config_file`` and ``steps``, with the precedence of ``config.resolve_config`` (the one
        parser); ``towers`` as a ``TowersConfig`` or its ``"SPEC;key=value"`` string."""
        if not isinstance(overrides, Mapping):
            overrides = list(overrides)  # read twice: resolved, then recorded as chosen
        config = resolve_config(
            recipe, data, steps=steps, overrides=overrides, config_file=config_file
        )
        if isinstance(towers, str):
            from curvalign.towers.base import TowersConfig

            towers = TowersConfig.parse(towers)
        keys = (
            list(overrides)
            if isinstance(overrides, Mapping)
            else [parse_override(o)[0] for o in overrides]
        )
        chosen = {canonical_key(k, config.recipe) for k in keys}
        if config_file is not None:
            chosen |= config_file_keys(config_file, config.recipe)
        if steps is not None:
            chosen.add("train.steps")
        return cls(config, towers, frozenset(chosen))

    @property
    def recipe(self) -> str:
        return self.config.recipe

    @property
    def data(self) -> str:
        return self.config.data

    @property
    def seed(self) -> int:
        return int(self.config.train.seed)

    def with_train(self, **fields: Any) -> RunSpec:
        """A copy with trainer settings replaced (``TrainConfig`` fields, typed values,
        validated by the same parser), recorded as chosen."""
        return self._with({f"train.{k}": v for k, v in fields.items()})

    def with_recipe(self, **fields: Any) -> RunSpec:
        """A copy with recipe settings replaced (fields of the recipe's ``Config``)."""
        return self._with({f"recipe.{k}": v for k, v in fields.items()})

    def _with(self, values: Mapping[str, Any]) -> RunSpec:
        config = resolve_config(self.recipe, self.data, overrides=values, base=self.config)
        return dataclasses.replace(self, config=config, chosen=self.chosen | frozenset(values))

    def sets(self, key: str) -> bool:
        """Whether ``key`` ("lr", "train.lr", "recipe.embed_dim") was chosen (on the command
        line, in a config file or by ``with_train``/``with_recipe``) rather than defaulted."""
        return canonical_key(key, self.recipe) in self.chosen

    def as_overrides(self) -> dict[str, Any]:
        """Every setting as a ``{"train.KEY" | "recipe.KEY": value}`` mapping (typed values):
        what ``train.trainer.train`` rebuilds exactly this config from."""
        train = {f"train.{k}": v for k, v in dataclasses.asdict(self.config.train).items()}
        return train | {f"recipe.{k}": v for k, v in self.config.recipe_config.items()}


@dataclass(frozen=True)
class FitResult:
    """A finished ``fit``: the trained model and its record.

    run_dir        where the run was written (``runs.load_run`` reads it back)
    recipe         the model with its best-validation weights (its last ones without
                   validation), eval mode, on the training device
    config         the run's config as saved (values resolved from the data included)
    best_step, best_val   the step and mean R@1 (in [0, 1]) of the kept weights (None without
                   validation); ``best_step == 0``: the start was never beaten
    last_step      the step training ended at; ``stopped_early``: early stopping ended it
    val_history    ((step, mean R@1), ...) of every validation, step 0 first
    step0          the step-0 health check's record (``recipes.health``), or None
    warm_start     the alignment the heads started from (``data.alignment``), or None
    """

    run_dir: Path
    recipe: Recipe
    config: RunConfig
    best_step: int | None
    best_val: float | None
    last_step: int
    stopped_early: bool
    val_history: tuple[tuple[int, float], ...]
    step0: Mapping[str, Any] | None
    warm_start: Mapping[str, Any] | None

    @property
    def step0_val(self) -> float | None:
        """The untrained (step-0) validation value, or None without validation."""
        return next((v for s, v in self.val_history if s == 0), None)


class _KeepTrainer(TrainerHook):
    """Holds the trainer at the end of ``fit`` so the model leaves in memory."""

    trainer: Trainer | None = None

    def on_fit_end(self, trainer: Trainer, run: Any) -> None:
        self.trainer = trainer


def fit(
    spec: RunSpec,
    out: str | Path,
    *,
    data: FeatureStore | None = None,
    hooks: Iterable[TrainerHook] = (),
    overwrite: bool = False,
    show_progress: bool = True,
    notify: Callable[[str], None] | None = None,
) -> FitResult:
    """Train ``spec`` into ``out`` and return the model with its record. ``data``: the store
    itself when the caller holds it (else ``spec.data`` is loaded); ``hooks``: trainer events
    (``train.hooks``: pruning, marks, extra validations). A directory holding files is refused
    unless ``overwrite``. Errors are ``TrainError``/``ConfigError`` with one clear message."""
    from curvalign.train.trainer import train

    keep = _KeepTrainer()
    train(
        spec.recipe,
        data if data is not None else spec.data,
        out,
        overrides=spec.as_overrides(),
        towers=spec.towers,
        overwrite=overwrite,
        show_progress=show_progress,
        notify=notify,
        hooks=[*hooks, keep],
    )
    trainer = keep.trainer
    assert trainer is not None  # on_fit_end runs whenever fit returns
    recipe = trainer.recipe
    best = trainer.best_weights()
    if best is not None:
        recipe.load_state_dict(best)
    recipe.eval()
    return FitResult(
        run_dir=Path(out),
        recipe=recipe,
        config=trainer.config,
        best_step=trainer.best_step,
        best_val=trainer.best_val,
        last_step=int(trainer.step),
        stopped_early=bool(trainer.stopped_early),
        val_history=tuple((int(s), float(v)) for s, v in trainer.val_history),
        step0=getattr(trainer, "step0_health", None),
        warm_start=trainer.warm_start_info,
    )


__all__ = ["FitResult", "RunSpec", "fit"]
