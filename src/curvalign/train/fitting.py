"""One typed run: a ``RunSpec`` says what to train, ``fit`` trains it, a ``FitResult`` holds the
trained model in memory with its record (docs/design.md, "One typed run").

    spec = RunSpec.parse(name, "synthetic", overrides=["lr=1e-3"], steps=300)  # a recipe
    spec = spec.with_train(seed=3)                 # typed, validated: no "key=value" strings
    result = fit(spec, "runs/meru-s3")
    result.recipe                                  # the best-validation weights, eval mode
    result.best_step, result.val_history, result.warm_start
    fit(spec, None)                                # the same run kept in memory: no file written

Key=value strings and YAML are parsed once, in ``RunSpec.parse`` (``config.resolve_config``,
the one parser); everything above ``train/`` changes a spec with ``with_train`` /
``with_recipe``, which validate through the same dataclasses. ``fit`` writes the run directory
as ``curvalign train`` does (checkpoints, best weights, logs, meta) and returns the model, so no
caller re-reads it from disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from curvalign.config import (
    RunConfig,
    TrainConfig,
    canonical_key,
    config_file_keys,
    parse_override,
    resolve_config,
)
from curvalign.errors import ConfigError, TrainError
from curvalign.train.hooks import TrainerHook

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore
    from curvalign.recipes.base import Recipe
    from curvalign.recipes.health import Step0Health
    from curvalign.towers.base import Towers, TowersConfig
    from curvalign.train.trainer import TrainedRun, Trainer


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

    def with_values(self, values: Mapping[str, Any]) -> RunSpec:
        """A copy with settings replaced, keys written as on the command line (``"lr"``,
        ``"train.lr"``, ``"recipe.temperature_init"``) and typed values (a tuning trial's point,
        ``Recipe.search_overrides``), validated by the same parser and recorded as chosen."""
        return self._with(values)

    def _with(self, values: Mapping[str, Any]) -> RunSpec:
        config = resolve_config(self.recipe, self.data, overrides=values, base=self.config)
        keys = frozenset(canonical_key(k, self.recipe) for k in values)
        return dataclasses.replace(self, config=config, chosen=self.chosen | keys)

    def chosen_values(self) -> dict[str, Any]:
        """The chosen settings (``chosen``) with their typed values, by canonical key
        (``{"train.lr": 0.01, "recipe.embed_dim": 64}``), in key order."""
        train = {f.name for f in dataclasses.fields(TrainConfig)}
        out: dict[str, Any] = {}
        for key in sorted(self.chosen):
            section, _, name = key.partition(".")
            if section == "train" and name in train:
                out[key] = getattr(self.config.train, name)
            elif name in self.config.recipe_config:
                out[key] = self.config.recipe_config[name]
        return out

    def sets(self, key: str) -> bool:
        """Whether ``key`` ("lr", "train.lr", "recipe.embed_dim") was chosen (on the command
        line, in a config file or by ``with_train``/``with_recipe``) rather than defaulted."""
        return canonical_key(key, self.recipe) in self.chosen

    def as_overrides(self) -> dict[str, Any]:
        """Every setting as a ``{"train.KEY" | "recipe.KEY": value}`` mapping (typed values):
        what ``train.trainer.train`` rebuilds exactly this config from."""
        train = {f"train.{k}": v for k, v in dataclasses.asdict(self.config.train).items()}
        return train | {f"recipe.{k}": v for k, v in self.config.recipe_config.items()}


def per_recipe_overrides(
    overrides: Iterable[str], recipes: Sequence[str]
) -> dict[str, dict[str, str]]:
    """The ``key=value`` strings of a command that trains several recipes (benchmark, tuning),
    parsed once (``config.parse_override``) into one mapping per recipe: ``key=value`` for every
    recipe, ``NAME.key=value`` for recipe NAME only (a NAME not in ``recipes`` is a
    ``ConfigError``). A later value of a key replaces an earlier one and moves to the end, so
    that the order of the command line decides between two spellings of one setting."""
    out: dict[str, dict[str, str]] = {name: {} for name in recipes}
    for item in overrides:
        key, value = parse_override(item)
        head, _, rest = key.partition(".")
        if rest and head in out:
            targets, key = [head], rest
        elif rest and head not in ("train", "recipe"):
            raise ConfigError(
                f"override {item!r} names recipe {head!r}, which is not in this run "
                f"({', '.join(recipes)})"
            )
        else:
            targets = list(recipes)
        for name in targets:
            out[name].pop(key, None)
            out[name][key] = value
    return out


@dataclass(frozen=True)
class FitResult:
    """A finished ``fit``: the trained model and its record.

    run_dir        where the run was written (``runs.load_run`` reads it back); a
                   ``TrainError`` for a run kept in memory (``fit(spec, None)``: ``written``
                   is False, ``out`` None)
    recipe         the model with its best-validation weights (its last ones without
                   validation), eval mode, on the training device
    towers         the towers trained in front of it (``spec.towers``) with the same step's
                   weights, eval mode; None for a run on the store's features
    config         the run's config as saved (values resolved from the data included)
    best_step, best_val   the step and mean R@1 (in [0, 1]) of the kept weights (None without
                   validation); ``best_step == 0``: the start was never beaten
    last_step      the step training ended at; ``stopped_early``: early stopping ended it
    val_history    ((step, mean R@1), ...) of every validation, step 0 first
    step0          the step-0 health check's record (``recipes.health``), or None
    warm_start     the alignment the heads started from (``data.alignment``), or None
    """

    out: Path | None
    recipe: Recipe
    config: RunConfig
    best_step: int | None
    best_val: float | None
    last_step: int
    stopped_early: bool
    val_history: tuple[tuple[int, float], ...]
    step0: Step0Health | None
    warm_start: Mapping[str, Any] | None
    towers: Towers | None = None

    @property
    def written(self) -> bool:
        """Whether the run was written to a directory (``run_dir``)."""
        return self.out is not None

    @property
    def run_dir(self) -> Path:
        """The run directory (``fit``'s ``out``)."""
        if self.out is None:
            raise TrainError("this run was kept in memory (fit without out): it has no run_dir")
        return self.out

    @property
    def step0_val(self) -> float | None:
        """The untrained (step-0) validation value, or None without validation."""
        return next((v for s, v in self.val_history if s == 0), None)


class _KeepTrainer(TrainerHook):
    """Holds the trainer at the end of ``fit`` so the model leaves in memory."""

    trainer: Trainer | None = None

    def on_fit_end(self, trainer: Trainer, run: TrainedRun) -> None:
        self.trainer = trainer


def fit(
    spec: RunSpec,
    out: str | Path | None,
    *,
    data: FeatureStore | None = None,
    hooks: Iterable[TrainerHook] = (),
    overwrite: bool = False,
    show_progress: bool = True,
    notify: Callable[[str], None] | None = None,
) -> FitResult:
    """Train ``spec`` into ``out`` and return the model with its record. ``out`` None: the run
    is kept in memory and nothing is written (no folder, checkpoint or log: a tuning trial).
    ``data``: the store itself when the caller holds it (else ``spec.data`` is loaded);
    ``hooks``: trainer events (``train.hooks``: pruning, marks, extra validations). A directory
    holding files is refused unless ``overwrite``. Errors are ``TrainError``/``ConfigError``
    with one clear message."""
    keep = _KeepTrainer()
    if out is None:
        _fit_in_memory(spec, data, [*hooks, keep], show_progress, notify)
    else:
        from curvalign.train.trainer import train

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
        out=None if out is None else Path(out),
        recipe=recipe,
        config=trainer.config,
        best_step=trainer.best_step,
        best_val=trainer.best_val,
        last_step=int(trainer.step),
        stopped_early=bool(trainer.stopped_early),
        val_history=tuple((int(s), float(v)) for s, v in trainer.val_history),
        step0=trainer.step0_health,
        warm_start=trainer.warm_start_info,
        towers=_best_towers(trainer),
    )


def _fit_in_memory(
    spec: RunSpec,
    data: FeatureStore | None,
    hooks: list[TrainerHook],
    show_progress: bool,
    notify: Callable[[str], None] | None,
) -> None:
    """``spec`` trained by a trainer that writes nothing (``Trainer(write=False)``)."""
    from curvalign.data import load_store
    from curvalign.train.trainer import Trainer, trainer_factory_for

    store, data_spec = load_store(data if data is not None else spec.data)
    config = spec.config
    if data is not None:  # the store's own name, as a written run records it
        config = dataclasses.replace(config, data=data_spec)
    factory = trainer_factory_for(Trainer, spec.towers)
    trainer = factory(
        config,
        store,
        Path(f"<{config.recipe} in memory>"),  # names the run in notes; nothing is written
        show_progress=show_progress,
        notify=notify,
        hooks=hooks,
        write=False,
    )
    trainer.fit()


def _best_towers(trainer: Trainer) -> Towers | None:
    """The trainer's towers with the weights of its best validation (eval mode), or None."""
    from curvalign.train.towers import TowerFeatures

    source = trainer.features
    if not isinstance(source, TowerFeatures):
        return None
    towers = source.towers
    best = source.best_tower_state()
    if best is not None:
        towers.load_trainable_state(best)
    return towers.eval()


__all__ = ["FitResult", "RunSpec", "fit", "per_recipe_overrides"]
