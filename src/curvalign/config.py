"""Run configuration: the trainer's settings, the recipe's settings, and how they are resolved.

A run is described by a ``RunConfig``: the recipe name, the data spec, a ``TrainConfig`` and the
recipe's own ``Config`` dataclass (stored as a plain dict so that ``config.json`` needs no
pickling). Values come, in increasing precedence, from the dataclass defaults, a YAML file with
the same structure as ``config.json``, and ``key=value`` overrides::

    recipe: meru
    data: synthetic
    train: {steps: 2000, lr: 1e-3}
    recipe_config: {entailment_weight: 0.2}

An override key is a field of ``TrainConfig`` (``lr=1e-3``) or of the recipe's ``Config``
(``temperature_init=0.05``); prefix it with ``train.`` or ``recipe.`` to be explicit. Values are
parsed to the field's declared type (bool, int, float, str, tuples, Optional, Literal), so
``1e-3`` is a float even where YAML would read a string.

This module sits below ``train/``, ``eval/`` and ``index/``: all of them read run configs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import yaml

from curvalign._io import atomic_write_text
from curvalign.errors import ConfigError

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore
    from curvalign.recipes.base import Recipe


#: the most steps between two validations under the default epoch rule (``val_every`` unset)
VAL_EVERY_MAX = 50
#: the store's default run (``steps`` unset): this many epochs of the train split ...
DEFAULT_EPOCHS = 20
#: ... at least this many steps and at most this many to start with ...
DEFAULT_STEPS_MIN, DEFAULT_STEPS_START_MAX = 100, 1000
#: ... then longer while validation has not converged (the shared rule,
#: ``curvalign.stats.curve_converged``), up to this cap (``max_steps``)
DEFAULT_STEPS_CAP = 3000
#: the sampler's shuffles (``TrainConfig.shuffle``; ``curvalign.data.sampling.SHUFFLES``)
SHUFFLES = ("auto", "rows", "chunks")


@dataclass
class TrainConfig:
    """Trainer settings (the recipe's own settings live in its ``Config``).

    steps            optimizer steps in the run; None (the default) = the store's default run
                     (``default_steps``): ``DEFAULT_EPOCHS`` epochs of the train split, within
                     [``DEFAULT_STEPS_MIN``, ``DEFAULT_STEPS_START_MAX``], trained on while
                     validation has not converged up to ``max_steps`` = ``DEFAULT_STEPS_CAP``;
                     resolved when the run starts and saved in config.json (``--steps`` wins)
    max_steps        a run whose validation has not converged at ``steps`` (the shared rule,
                     ``curvalign.stats.curve_converged``) trains on, half its length at a time,
                     up to this many steps (``train.hooks.TrainUntilConverged``); None = never
    batch_size       images per step (global batch; each with one caption, and a box if needed)
    lr               peak learning rate of AdamW
    weight_decay     AdamW decay, not applied to ``recipe.no_decay_parameter_names()``
    warmup           linear warm-up length: a fraction of ``steps`` if < 1, else a step count
    min_lr_ratio     the cosine decays to ``lr * min_lr_ratio``
    grad_clip        max global gradient norm; 0 turns clipping off
    bf16             run the forward and loss under bfloat16 autocast (parameters stay float32)
    seed             seeds parameter init, sampling and every RNG
    log_every        write a log line every this many steps (and at the last step)
    checkpoint_every write a checkpoint every this many steps; 0 = only at the end
    pair_batch_size  scored text pairs per step, for recipes that require "text_pairs"
    device           torch device, e.g. "cpu", "cuda", "cuda:1"
    num_threads      torch intra-op threads; None leaves torch's default
    tensorboard      also write TensorBoard scalars under ``tb/``
    val_every        validate every this many steps (and at step 0 and the last step): mean of
                     T2I and I2T recall@1 on the validation split with the recipe's own score;
                     the best weights are kept in ``best.safetensors``; 0 = no validation;
                     None (the default) = once per epoch of the train split, at most every
                     ``VAL_EVERY_MAX`` steps (``validation_interval``); the run saves the
                     resolved number
    patience         stop after this many validations without improvement; 0 = never
    val_fraction     share of the train images held out (seeded) for validation when the data
                     has no "val" split of its own; in (0, 1)
    val_max_images   most validation images scored per validation: a larger split is scored on
                     a subsample of this size (seeded by ``seed``, recorded in meta.json), so a
                     validation costs the same at any store size; 0 = every image
    shuffle          the order the sampler draws train images in (``data.sampling``): "rows"
                     a uniform random permutation per epoch; "chunks" runs of 64 neighbouring
                     rows in a seeded order, shuffled together 4,096 rows at a time (each
                     page of memory-mapped shards read once an epoch); "auto" (the default)
                     "chunks" on memory-mapped shards (``clip-retrieval:DIR``), "rows" on
                     stores held in memory. A resumed run keeps the shuffle it was saved with
    """

    steps: int | None = None
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.2
    warmup: float = 0.05
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    bf16: bool = False
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 500
    pair_batch_size: int = 64
    device: str = "cpu"
    num_threads: int | None = None
    tensorboard: bool = True
    val_every: int | None = None
    patience: int = 0
    val_fraction: float = 0.1
    val_max_images: int = 5000
    max_steps: int | None = None
    shuffle: Literal["auto", "rows", "chunks"] = "auto"

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "warmup", "min_lr_ratio", "grad_clip"):
            value = getattr(self, name)
            # inf passes "> 0" and would fail steps later as a non-finite loss
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        checks = [
            (self.steps is None or self.steps >= 1, "steps must be >= 1 (unset: the store's)"),
            (self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1"),
            (
                self.batch_size >= 2,
                "batch_size must be >= 2 (contrastive learning needs negatives)",
            ),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.warmup >= 0, "warmup must be >= 0 (a fraction of steps if < 1, else steps)"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio must lie in [0, 1]"),
            (self.grad_clip >= 0, "grad_clip must be >= 0 (0 = off)"),
            (self.log_every >= 1, "log_every must be >= 1"),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0 = only at the end)"),
            (self.pair_batch_size >= 1, "pair_batch_size must be >= 1"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1"),
            (
                self.val_every is None or self.val_every >= 0,
                "val_every must be >= 0 (0 = no validation; unset = once per epoch)",
            ),
            (self.patience >= 0, "patience must be >= 0 (0 = no early stopping)"),
            (
                0.0 < self.val_fraction < 1.0,
                f"val_fraction must lie in (0, 1) (a share of the train images), got "
                f"{self.val_fraction}",
            ),
            (self.val_max_images >= 0, "val_max_images must be >= 0 (0 = every image)"),
            (
                self.shuffle in SHUFFLES,
                f"shuffle must be one of {list(SHUFFLES)}, got {self.shuffle!r}",
            ),
            (
                self.patience == 0 or self.val_every != 0,
                f"patience={self.patience} needs validation: set val_every > 0 or leave it unset "
                "(early stopping counts validations without improvement)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def validates(self) -> bool:
        """Whether the run validates (``val_every`` unset or > 0)."""
        return self.val_every != 0

    def validation_interval(self, train_images: int) -> int:
        """Steps between validations: ``val_every`` when set, else the epoch rule.

        The epoch rule: one validation per epoch (``ceil(train_images / batch_size)`` steps),
        at most every ``VAL_EVERY_MAX`` steps. Why per epoch: a fixed step count reads as many epochs on a small
        store (50 steps of 256 pairs are 15 epochs of ``wordnet:mammal.n.01``'s 828 train
        pairs), where the best weights can come and go between two checks; one validation per
        epoch costs a fixed share of an epoch's training at any store size, because the
        validation split is a fixed share of the store (and at most ``val_max_images``). No
        floor of validations per run: on a store of 1M pairs a validation took about 2 s
        against 0.05 s a step of ``clip`` (docs/scale.md), so "ten a run" would make a short
        run mostly validation. 0 when the run does not validate."""
        if self.val_every is not None:
            return self.val_every
        epoch = max(1, math.ceil(max(train_images, 1) / self.batch_size))
        return min(VAL_EVERY_MAX, epoch)

    def default_steps(self, train_images: int) -> tuple[int, int]:
        """``(steps, max_steps)`` of the store's default run: ``DEFAULT_EPOCHS`` epochs of
        ``train_images`` at ``batch_size`` (clamped to [``DEFAULT_STEPS_MIN``,
        ``DEFAULT_STEPS_START_MAX``]), continued while validation has not converged up to
        ``DEFAULT_STEPS_CAP`` (a ``max_steps`` set by the user wins). Why epochs: a fixed 1000
        steps is 333 epochs of a 700-pair store and 0.26 of a 1M-pair one (batch 256); why the convergence
        rule: how many epochs a head needs depends on its geometry and rate, and a default row
        cut while its validation still rises measures the optimiser, not the geometry."""
        epoch = max(1, math.ceil(max(train_images, 1) / self.batch_size))
        steps = min(DEFAULT_STEPS_START_MAX, max(DEFAULT_STEPS_MIN, DEFAULT_EPOCHS * epoch))
        cap = self.max_steps if self.max_steps is not None else DEFAULT_STEPS_CAP
        return min(steps, cap), cap

    @property
    def warmup_steps(self) -> int:
        """Warm-up length in steps (``warmup`` read as a fraction of ``steps`` when < 1)."""
        if self.steps is None:
            raise ConfigError(
                "steps is not resolved yet (resolve_steps resolves it from the store)"
            )
        if self.warmup < 1:
            return int(round(self.warmup * self.steps))
        return int(self.warmup)


@dataclass
class RunConfig:
    """Everything needed to rebuild a run: saved as ``config.json`` in the run directory."""

    recipe: str
    data: str
    train: TrainConfig = field(default_factory=TrainConfig)
    recipe_config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "data": self.data,
            "train": _jsonable(dataclasses.asdict(self.train)),
            "recipe_config": _jsonable(dict(self.recipe_config)),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config") -> RunConfig:
        """Inverse of ``to_dict``; validates keys and types (recipe keys against its Config)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{source}: expected a mapping with keys recipe, data, train, recipe_config"
            )
        unknown = set(raw) - {"recipe", "data", "train", "recipe_config"}
        if unknown:
            raise ConfigError(
                f"{source}: unknown top-level key(s) {sorted(unknown)}; "
                "expected recipe, data, train, recipe_config"
            )
        for key in ("recipe", "data"):
            if not isinstance(raw.get(key), str):
                raise ConfigError(f"{source}: {key!r} must be a string")
        saved_train = dict(raw.get("train") or {})
        saved_train.setdefault("val_every", 0)  # a run from before validation existed had none
        saved_train.setdefault("val_max_images", 0)  # ... and before subsampling: every image
        train = _build_dataclass(TrainConfig, saved_train, f"{source}: train")
        recipe_cls = recipe_class(raw["recipe"])
        saved = dict(raw.get("recipe_config") or {})
        for key, value in (getattr(recipe_cls, "saved_config_defaults", None) or {}).items():
            saved.setdefault(key, value)  # a config.json from before the key existed
        recipe_config = _build_dataclass(recipe_cls.Config, saved, f"{source}: recipe_config")
        return cls(raw["recipe"], raw["data"], train, init_values(recipe_config))

    def recipe_config_object(self) -> Any:
        """The recipe's ``Config`` dataclass instance."""
        return _build_dataclass(
            recipe_class(self.recipe).Config, self.recipe_config, "recipe_config"
        )

    def save(self, run_dir: Path) -> None:
        """Write ``config.json`` (read back by ``load_run``) and ``config.yaml`` (for humans)."""
        data = self.to_dict()
        atomic_write_text(Path(run_dir) / "config.json", json.dumps(data, indent=2) + "\n")
        atomic_write_text(Path(run_dir) / "config.yaml", yaml.safe_dump(data, sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """Read a ``config.json``."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist") from None
        except (OSError, ValueError) as err:
            raise ConfigError(f"{path} is not readable JSON ({err})") from None
        return cls.from_dict(raw, source=str(path))


# --- resolution -----------------------------------------------------------------------------


def recipe_class(name: str) -> type[Recipe]:
    """The registered recipe class ``name``; ConfigError listing the known names otherwise."""
    from curvalign.recipes import get_recipe, recipe_names

    try:
        return get_recipe(name)
    except KeyError:
        known = ", ".join(recipe_names()) or "(none registered)"
        raise ConfigError(f"unknown recipe {name!r}; known recipes: {known}") from None


def resolve_config(
    recipe: str | None,
    data: str | None,
    *,
    steps: int | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    config_file: str | Path | None = None,
    base: RunConfig | None = None,
) -> RunConfig:
    """Build the run's config: ``base`` (or defaults) < ``config_file`` < ``steps`` < ``overrides``.

    ``recipe`` / ``data`` given here win over the file's. ``overrides`` are ``"key=value"``
    strings or a mapping of key to value.
    """
    file_values: dict[str, Any] = {}
    file_train: dict[str, Any] = {}
    file_recipe: dict[str, Any] = {}
    loose: dict[str, Any] = {}
    if config_file is not None:
        file_values = read_yaml(config_file)
        file_train = dict(file_values.pop("train", None) or {})
        file_recipe = dict(file_values.pop("recipe_config", None) or {})
        for key in list(file_values):
            if key not in ("recipe", "data"):
                loose[key] = file_values.pop(key)  # top-level keys read like overrides

    recipe = recipe or file_values.get("recipe") or (base.recipe if base else None)
    data = data or file_values.get("data") or (base.data if base else None)
    if not recipe:
        raise ConfigError("no recipe given: pass --recipe NAME or set 'recipe' in the config file")
    if not data:
        raise ConfigError("no data given: pass --data SPEC or set 'data' in the config file")
    recipe_cls = recipe_class(str(recipe))
    _refuse_another_recipes_keys(config_file, file_values.get("recipe"), recipe, file_recipe)

    # the recipe's paper defaults < config file < --steps < key=value (a resumed run keeps its own)
    train_values = dataclasses.asdict(base.train) if base else recipe_train_defaults(recipe_cls)
    recipe_values = dict(base.recipe_config) if base and base.recipe == recipe else {}
    train_values.update(file_train)
    recipe_values.update(file_recipe)

    pairs = (
        list(overrides.items())
        if isinstance(overrides, Mapping)
        else [parse_override(o) for o in overrides]
    )
    pairs = list(loose.items()) + ([("train.steps", steps)] if steps is not None else []) + pairs
    train_fields = _field_names(TrainConfig)
    recipe_fields = _field_names(recipe_cls.Config)
    for key, value in pairs:
        section, name = _route_key(key, train_fields, recipe_fields, recipe)
        (train_values if section == "train" else recipe_values)[name] = value

    train = _build_dataclass(TrainConfig, train_values, "train")
    recipe_config = _build_dataclass(recipe_cls.Config, recipe_values, f"recipe {recipe!r}")
    return RunConfig(str(recipe), str(data), train, init_values(recipe_config))


def _refuse_another_recipes_keys(
    config_file: str | Path | None, file_recipe: Any, recipe: str, keys: Mapping[str, Any]
) -> None:
    """A ConfigError naming the conflict when ``--recipe`` differs from the config file's recipe
    and the file's ``recipe_config`` holds keys the chosen recipe does not have (instead of
    listing them one by one as unknown)."""
    if config_file is None or not file_recipe or str(file_recipe) == str(recipe) or not keys:
        return
    foreign = sorted(set(keys) - set(_field_names(recipe_class(str(recipe)).Config)))
    if foreign:
        raise ConfigError(
            f"config file {config_file} is a config of recipe {file_recipe!r} but --recipe "
            f"{recipe!r} was given: its recipe_config holds {len(foreign)} key(s) of "
            f"{file_recipe!r} that {recipe!r} does not have ({', '.join(foreign[:4])}"
            f"{', ...' if len(foreign) > 4 else ''}); drop --recipe to train {file_recipe!r}, "
            f"or remove the file's recipe_config section to train {recipe!r} with its other "
            "settings"
        )


def describe_config(
    recipe: str | None,
    data: str | None,
    *,
    steps: int | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    config: str | Path | None = None,
) -> str:
    """The resolved config as YAML, with a comment naming the trainer keys that come from the
    recipe's paper (``curvalign train --print-config``). Without data, ``data`` reads "(not given)"."""
    resolved = resolve_config(
        recipe,
        data or (None if config is not None else "(not given)"),
        steps=steps,
        overrides=overrides,
        config_file=config,
    )
    paper = recipe_train_defaults(recipe_class(resolved.recipe))
    kept = [k for k, v in paper.items() if getattr(resolved.train, k) == v]
    # values resolved from the data's feature norms (the run's config.json holds the same)
    from_data = ""
    if resolved.data != "(not given)":
        from curvalign.data import load_store
        from curvalign.data.validation_split import validation_split

        store = load_store(resolved.data)[0]
        train = resolved.train
        if train.validates:  # the store the run trains on: its validation hold-out labelled
            store, _ = validation_split(store, train.val_fraction, train.seed, resolved.data)
        with_data = resolve_data_init(resolved, store)
        changed = [
            k for k, v in with_data.recipe_config.items() if resolved.recipe_config.get(k) != v
        ]
        resolved = with_data
        from_data = (
            "# recipe keys resolved from the train features' norms (docs/methods.md): "
            + (", ".join(changed) or "none")
            + "\n"
        )
        if resolved.train.val_every is None:
            resolved = resolve_val_every(resolved, store)
            from_data += (
                f"# val_every resolved by the epoch rule (docs/training.md): "
                f"{resolved.train.val_every}\n"
            )
        if resolved.train.steps is None:
            resolved = resolve_steps(resolved, store)
            from_data += (
                f"# steps resolved from the store (docs/training.md): {resolved.train.steps}, "
                f"continued while validation has not converged up to {resolved.train.max_steps}\n"
            )
        if recipe_class(resolved.recipe).uses_alignment(resolved.recipe_config_object()):
            from curvalign.data.alignment import fit_alignment

            has_val = "val" in (store.split_names or [])
            alignment = fit_alignment(store, val_split="val" if has_val else None)
            from_data += f"# {alignment.describe()} (docs/methods.md, 'The warm start')\n"
    text = yaml.safe_dump(resolved.to_dict(), sort_keys=False)
    note = (
        f"# trainer keys at the paper defaults of recipe {resolved.recipe} (docs/methods.md): "
        + (", ".join(kept) or "none")
        + "\n"
    )
    return note + from_data + text


def resolve_data_init(config: RunConfig, store: FeatureStore) -> RunConfig:
    """``config`` with the recipe's data-dependent initial values filled in (the keys the
    recipe's ``resolve_init`` resolves from ``store``'s train feature norms, e.g. MERU's
    per-modality scale before ``expmap0``); values the user set are kept. The result is what
    the run saves in ``config.json`` and ``--print-config`` shows (docs/methods.md,
    "Initialisation that fits the data")."""
    from curvalign.data.statistics import feature_norms

    recipe_cls = recipe_class(config.recipe)
    norms = feature_norms(store)
    try:
        resolved = recipe_cls.resolve_init(config.recipe_config_object(), norms)
    except ValueError as err:
        raise ConfigError(
            f"recipe {config.recipe!r} on data {config.data!r}: {err}; set its scale explicitly "
            "(see docs/methods.md, 'Initialisation that fits the data')"
        ) from None
    if not resolved:
        return config
    values = {**config.recipe_config, **resolved}
    recipe_config = _build_dataclass(recipe_cls.Config, values, f"recipe {config.recipe!r}")
    return dataclasses.replace(config, recipe_config=init_values(recipe_config))


def resolve_val_every(config: RunConfig, store: FeatureStore) -> RunConfig:
    """``config`` with an unset ``val_every`` resolved by the epoch rule
    (``TrainConfig.validation_interval``) on ``store``, the store the run trains on with its
    validation images labelled "val" (``data.validation_split``); a set value is kept."""
    from curvalign.data.validation_split import train_image_count

    if config.train.val_every is not None:
        return config
    every = config.train.validation_interval(train_image_count(store))
    return dataclasses.replace(config, train=dataclasses.replace(config.train, val_every=every))


def resolve_steps(config: RunConfig, store: FeatureStore) -> RunConfig:
    """``config`` with an unset ``steps`` resolved to the store's default run
    (``TrainConfig.default_steps`` on ``store``, the store the run trains on with its validation
    images labelled "val"; ``max_steps`` set to the cap when the run validates, since the
    continuation reads validation); a set value is kept."""
    from curvalign.data.validation_split import train_image_count

    if config.train.steps is not None:
        return config
    steps, cap = config.train.default_steps(train_image_count(store))
    train = dataclasses.replace(
        config.train, steps=steps, max_steps=cap if config.train.validates else None
    )
    return dataclasses.replace(config, train=train)


def recipe_train_defaults(recipe_cls: type[Recipe]) -> dict[str, Any]:
    """The ``TrainConfig`` values recipe class ``recipe_cls`` declares (``train_defaults``)."""
    defaults = dict(getattr(recipe_cls, "train_defaults", None) or {})
    unknown = sorted(set(defaults) - set(_field_names(TrainConfig)))
    if unknown:
        raise ConfigError(
            f"recipe {getattr(recipe_cls, 'name', recipe_cls)!r} declares train_defaults for "
            f"unknown trainer key(s) {unknown}; valid keys: {', '.join(_field_names(TrainConfig))}"
        )
    return defaults


def parse_override(text: str) -> tuple[str, str]:
    """``"key=value"`` -> ``("key", "value")``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"override {text!r} is not key=value (e.g. lr=1e-3 or recipe.temperature_init=0.05)"
        )
    return key.strip(), value.strip()


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as err:  # binary garbage, or text in another encoding
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); "
            "a YAML file shaped like a run's config.json expected"
        ) from None
    except (OSError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"config file {path} is not readable YAML ({first})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping at the top level, got {type(raw).__name__}"
        )
    for section in ("train", "recipe_config"):
        if section in raw and raw[section] is not None and not isinstance(raw[section], dict):
            raise ConfigError(f"config file {path}: {section!r} must be a mapping")
    return raw


def _route_key(
    key: str, train_fields: list[str], recipe_fields: list[str], recipe: str
) -> tuple[str, str]:
    prefix, dot, rest = key.partition(".")
    if dot:
        if prefix == "train" and rest in train_fields:
            return "train", rest
        if prefix == "recipe" and rest in recipe_fields:
            return "recipe", rest
        if prefix not in ("train", "recipe"):
            raise ConfigError(
                f"unknown key {key!r}: a prefix must be 'train.' or 'recipe.'; "
                + _valid_keys(train_fields, recipe_fields, recipe)
            )
        raise ConfigError(
            f"unknown key {key!r}; " + _valid_keys(train_fields, recipe_fields, recipe)
        )
    in_train, in_recipe = key in train_fields, key in recipe_fields
    if in_train and in_recipe:
        raise ConfigError(
            f"key {key!r} exists in both the trainer's config and the config of recipe {recipe!r}; "
            f"write train.{key}=... or recipe.{key}=..."
        )
    if in_train:
        return "train", key
    if in_recipe:
        return "recipe", key
    raise ConfigError(f"unknown key {key!r}; " + _valid_keys(train_fields, recipe_fields, recipe))


def canonical_key(key: str, recipe: str) -> str:
    """The one name of a setting of ``recipe``'s runs: ``"train.FIELD"`` or ``"recipe.FIELD"``
    for ``key`` written as ``FIELD``, ``train.FIELD`` or ``recipe.FIELD`` (the routing of
    ``resolve_config``; an unknown key is a ``ConfigError``)."""
    recipe_cls = recipe_class(recipe)
    section, name = _route_key(
        key.strip(), _field_names(TrainConfig), _field_names(recipe_cls.Config), recipe
    )
    return f"{section}.{name}"


def config_file_keys(path: str | Path, recipe: str) -> set[str]:
    """The canonical keys (``canonical_key``) a YAML config file sets for ``recipe``."""
    values = read_yaml(path)
    keys = {f"train.{k}" for k in dict(values.pop("train", None) or {})}
    keys |= {f"recipe.{k}" for k in dict(values.pop("recipe_config", None) or {})}
    keys |= {canonical_key(k, recipe) for k in values if k not in ("recipe", "data")}
    return keys


def _valid_keys(train_fields: list[str], recipe_fields: list[str], recipe: str) -> str:
    recipe_part = ", ".join(recipe_fields) or "(none)"
    return f"valid keys: trainer: {', '.join(train_fields)}; recipe {recipe!r}: {recipe_part}"


# --- typed construction ---------------------------------------------------------------------


def init_values(obj: Any) -> dict[str, Any]:
    """The constructor arguments of dataclass instance ``obj`` (fields with ``init=False`` left out)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def _field_names(cls: type) -> list[str]:
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls!r} is not a dataclass; a recipe's Config must be one")
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _build_dataclass(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """``cls(**values)`` with every value coerced to its field's type; clear errors."""
    names = _field_names(cls)
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(names)}")
    hints = _type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = coerce(
                values[f.name], hints.get(f.name, Any), f"{where}: {f.name}", default=_default_of(f)
            )
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be evaluated: fall back to the defaults' types
        return {}


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~", ""}


def coerce(value: Any, annotation: Any, where: str, default: Any = dataclasses.MISSING) -> Any:
    """Convert ``value`` (a string from the command line, or a YAML/JSON value) to ``annotation``.

    An unannotated field (``Any``) takes its default's type; with no default a string is read as a
    YAML scalar. Otherwise the annotation's form (union, literal, sequence, mapping) or its scalar
    type picks the rule; a value already of a plain class annotation passes through.
    """
    if annotation is Any or annotation is None:
        if default is dataclasses.MISSING or default is None:
            return _yaml_scalar(value) if isinstance(value, str) else value
        annotation = type(default)
    origin = typing.get_origin(annotation)
    form_rule = _FORM_RULES.get(origin) or _FORM_RULES.get(annotation)
    if form_rule is not None:
        return form_rule(value, annotation, where)
    scalar_rule = _SCALAR_RULES.get(annotation)
    if scalar_rule is not None:
        return scalar_rule(value, where)
    if isinstance(annotation, type) and isinstance(value, annotation):
        return value
    raise ConfigError(f"{where}: cannot read {value!r} as {_type_name(annotation)}")


def _coerce_union(value: Any, annotation: Any, where: str) -> Any:
    """``X | None`` takes the none words; otherwise the first member that reads the value."""
    args = typing.get_args(annotation)
    if type(None) in args and (
        value is None or (isinstance(value, str) and value.strip().lower() in _NONE)
    ):
        return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:  # ``X | None``: X's own error ("expected an integer")
        return coerce(value, members[0], where)
    for arg in members:
        try:
            return coerce(value, arg, where)
        except ConfigError:
            continue
    raise ConfigError(f"{where}: cannot read {value!r} as {_type_name(annotation)}")


def _coerce_literal(value: Any, annotation: Any, where: str) -> Any:
    args = typing.get_args(annotation)
    for choice in args:
        if value == choice or (isinstance(value, str) and str(choice) == value.strip()):
            return choice
    raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")


def _coerce_sequence(value: Any, annotation: Any, where: str) -> Any:
    """A list or tuple from a sequence or from ``"a,b"`` / ``"[a, b]"``; fixed tuples check length."""
    args = typing.get_args(annotation)
    items = _sequence_items(value, where)
    container = tuple if (typing.get_origin(annotation) or annotation) is tuple else list
    if not args:
        return container(_yaml_scalar(i) if isinstance(i, str) else i for i in items)
    if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(items) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {len(items)} ({value!r})")
        return tuple(coerce(i, a, where) for i, a in zip(items, args, strict=False))
    return container(coerce(i, args[0], where) for i in items)


def _coerce_dict(value: Any, annotation: Any, where: str) -> dict:
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"{where}: expected a mapping, got {value!r}")


def _coerce_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    number = _as_float(value, where, "an integer")
    if not number.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return int(number)


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    return _as_float(value, where, "a number")


def _coerce_str(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where}: expected a string, got {value!r}")


# The annotation's form (its typing origin, or the bare class for ``list``/``tuple``/``dict``)
# picks a rule that reads the whole value; otherwise a scalar type does.
_FORM_RULES: dict[Any, Callable[[Any, Any, str], Any]] = {
    Union: _coerce_union,
    types.UnionType: _coerce_union,
    Literal: _coerce_literal,
    tuple: _coerce_sequence,
    list: _coerce_sequence,
    dict: _coerce_dict,
}
_SCALAR_RULES: dict[Any, Callable[[Any, str], Any]] = {
    bool: _coerce_bool,
    int: _coerce_int,
    float: _coerce_float,
    str: _coerce_str,
}


def _as_float(value: Any, where: str, expected: str) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected {expected}, got {value!r}")


def _sequence_items(value: Any, where: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "([" and text[-1:] in ")]":
            text = text[1:-1]
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    raise ConfigError(f"{where}: expected a list of values, got {value!r}")


def _yaml_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
