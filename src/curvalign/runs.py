"""Reading a run directory: its config, meta, weights and log. Below ``train/``: ``eval/``,
``index/``, ``report/`` and ``train/`` (resume) all read runs through this module.

A run directory holds::

    config.json        the resolved RunConfig (read back by load_run); config.yaml: the same, for humans
    model.safetensors  the recipe's state dict at the last step
    best.safetensors   the state dict at the best validation step (when validation ran); what
                       evaluation and search load by default (``load_run(weights="best")``)
    state.pt           everything resume needs: model, optimizer, scheduler, sampler, RNG states, step
    meta.json          step, feature dimensions, recipe name, versions, data summary, and the
                       SHA-256 of every other file of the checkpoint (``sha256``)
    log.jsonl, tb/     training logs (one JSON object per logged step; TensorBoard scalars;
                       appended to, so not checksummed)

Writing them is the trainer's business (``train/checkpoint.py``, ``train/logging.py``).
Loading recomputes the checksums (``verify_checksum``): a file changed or damaged after the run
wrote it is named in an error instead of being evaluated; a run written before checksums
existed still loads, with a note (``LoadedRun.notes``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from curvalign._io import sha256_file
from curvalign.config import RunConfig, recipe_class
from curvalign.errors import ConfigError, CurvalignError, InputError
from curvalign.recipes.base import Recipe

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore

CONFIG_FILE = "config.json"
CONFIG_YAML = "config.yaml"
MODEL_FILE = "model.safetensors"
BEST_FILE = "best.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LOG_FILE = "log.jsonl"
TB_DIR = "tb"
#: files (and the tb/ folder) that make a directory a run directory
RUN_FILES = (CONFIG_FILE, CONFIG_YAML, MODEL_FILE, BEST_FILE, STATE_FILE, META_FILE, LOG_FILE)
#: what ``load_run`` may load
WEIGHTS = ("best", "last")
#: meta.json key holding ``{file name: hex SHA-256}`` of the checkpoint's other files
CHECKSUMS_KEY = "sha256"
#: files of a run directory that change after a checkpoint (appended logs) or hold the checksums
NOT_CHECKSUMMED = (META_FILE, LOG_FILE)


class CheckpointError(CurvalignError):
    """A run directory that is missing, incomplete or unreadable."""


@dataclass
class LoadedRun:
    """A trained run, ready for evaluation or search.

    recipe   the Recipe instance, weights loaded, in eval mode, on ``map_location``
    config   the RunConfig it was trained with
    step     optimizer steps behind these weights
    run_dir  where it was loaded from
    meta     meta.json (dims, versions, data summary, checksums, validation)
    weights_sha256  SHA-256 of the weights file loaded (what an index records to stay tied to
             exactly these weights)
    notes    one-line remarks for the user (a run written before checksums existed, or before
             best weights were kept)
    weights  "best" (the best validation step) or "last" (the last step): what was loaded
    last_step     the run's last step (``step`` is the loaded weights' step)
    best_step     step of the best validation, None when the run did not validate
    val_history   [(step, mean R@1 on the validation split)], empty without validation
    note     the line for the user when "best" was asked for but only the last weights exist
    """

    recipe: Recipe
    config: RunConfig
    step: int
    run_dir: Path
    meta: dict[str, Any]
    weights_sha256: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    weights: str = "last"
    last_step: int = 0
    best_step: int | None = None
    val_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    note: str | None = None

    def describe(self) -> str:
        """ "best weights (step 120 of 200)" / "last weights (step 200)"."""
        if self.weights == "best":
            return f"best weights (step {self.step} of {self.last_step})"
        return f"last weights (step {self.step})"

    def data_spec(self, data: str | None = None) -> str:
        """The data spec to read for this run: ``data`` if given, else the run's own. A run
        trained on an in-memory store (its spec ``<...>``) has nothing to read again."""
        spec = data or self.config.data
        if not data and spec.startswith("<"):
            raise ConfigError(
                f"{self.run_dir} was trained on an in-memory store ({spec}); pass --data SPEC"
            )
        return spec


def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and any(
        (path / name).exists() for name in (CONFIG_FILE, MODEL_FILE, STATE_FILE)
    )


def read_meta(run_dir: Path) -> dict[str, Any]:
    """``meta.json`` of ``run_dir``; CheckpointError when it is missing or lacks a key."""
    path = Path(run_dir) / META_FILE
    if not path.exists():
        raise CheckpointError(
            f"{run_dir} has no {META_FILE}: no checkpoint was written yet "
            "(the run stopped before its first checkpoint, or this is not a run directory)"
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is corrupt ({err})") from None
    for key in ("step", "image_dim", "text_dim", "recipe"):
        if key not in meta:
            raise CheckpointError(f"{path} is corrupt: it lacks {key!r}")
    return meta


def read_config(run_dir: Path) -> RunConfig:
    """``config.json`` of ``run_dir`` as a RunConfig; CheckpointError when missing or unusable."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).exists():
        raise CheckpointError(f"{run_dir} is not a run directory: no {CONFIG_FILE}")
    try:
        return RunConfig.load(run_dir / CONFIG_FILE)
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


def verify_checksum(run_dir: Path, name: str, meta: dict[str, Any]) -> tuple[str, str | None]:
    """Recompute the SHA-256 of ``run_dir/name`` and compare it with the one ``meta.json``
    recorded. Returns ``(digest, note)``: ``note`` is a remark when nothing was recorded (a run
    written before checksums existed). Raises ``CheckpointError`` naming the file on a mismatch."""
    path = Path(run_dir) / name
    try:
        digest = sha256_file(path)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror or err})") from None
    recorded = meta.get(CHECKSUMS_KEY)
    if not isinstance(recorded, dict) or name not in recorded:
        return digest, (
            f"{run_dir} was written without a checksum for {name} (by an older curvalign): "
            "its integrity is not verified"
        )
    if recorded[name] != digest:
        raise CheckpointError(
            f"{path} is damaged or was changed after the run wrote it: its SHA-256 "
            f"{digest[:12]}... differs from the {recorded[name][:12]}... recorded in "
            f"{META_FILE} at step {meta.get('step')}; restore the file or retrain"
        )
    return digest, None


def _weights_step(path: Path) -> int | None:
    """The step a safetensors file says it holds (its metadata), or None."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return int((handle.metadata() or {})["step"])
    except Exception:  # any unreadable header: the checksum check names the file
        return None


def reads_text_tokens(config: RunConfig) -> bool:
    """Whether the recipe of ``config``, so configured, embeds texts from token features
    (``Recipe.reads_text_tokens``), asked before it is built."""
    return bool(recipe_class(config.recipe).reads_text_tokens(config.recipe_config_object()))


def recipe_input_dims(config: RunConfig, store: FeatureStore) -> tuple[int, int]:
    """(image, text) input widths of ``config``'s recipe on ``store`` (a FeatureStore): the
    pooled feature widths, or the token width ``Dk`` as the text width when the recipe reads
    text tokens (a store without tokens is one clear error, ``FeatureStoreError``)."""
    return store.input_dims(text_tokens=reads_text_tokens(config))


def build_recipe(config: RunConfig, image_dim: int, text_dim: int) -> Recipe:
    """The recipe of ``config`` with fresh parameters (seed the RNG first for a reproducible init).
    No data-aware start: for loading saved weights into; a new run starts with
    ``build_started_recipe``."""
    cls = recipe_class(config.recipe)
    return cls(config.recipe_config_object(), image_dim, text_dim)


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and ``random`` (every rank and every resume builds the same model)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@dataclass(frozen=True)
class StartedRecipe:
    """A new run's recipe at step 0, as ``build_started_recipe`` made it.

    recipe      the recipe with its step-0 parameters
    config      the run's config with the values resolved from the data (saved in config.json)
    warm_start  the alignment the heads start from (``LinearAlignment.to_json()`` plus "start",
                the recipe's one line on how close its start is), or None
    note        one line for the user about the start, or None
    """

    recipe: Recipe
    config: RunConfig
    warm_start: dict[str, Any] | None
    note: str | None


def build_started_recipe(
    config: RunConfig,
    store: FeatureStore,
    input_dims: tuple[int, int] | None = None,
    device: str | torch.device = "cpu",
) -> StartedRecipe:
    """The one builder of a new run's step-0 recipe: the config's data-dependent values resolved
    from ``store``'s train rows (``config.resolve_data_init``), parameters drawn with the RNG
    seeded by ``config.train.seed``, and, where the recipe asks for it (``uses_alignment``:
    ``head_init=align``), its heads started at the data's linear alignment (fit on the "train"
    split, chosen on the "val" split when ``store`` has one: pass the store the run trains on,
    with its validation hold-out labelled). ``input_dims``: the heads' (image, text) widths,
    default the store's features'. The trainer, the benchmark's untrained rows, tuning and the
    studies all start a recipe here, so an untrained row is the trained arm's step 0."""
    from curvalign.config import resolve_data_init
    from curvalign.data.alignment import fit_alignment

    dims = input_dims if input_dims is not None else recipe_input_dims(config, store)
    config = resolve_data_init(config, store)
    seed_everything(config.train.seed)
    recipe = build_recipe(config, *dims)
    info: dict[str, Any] | None = None
    note: str | None = None
    if type(recipe).uses_alignment(recipe.config):
        if (store.image_dim, store.text_dim) != tuple(dims):
            note = (
                f"no warm start: the heads take other inputs than the store's features "
                f"({dims[0]}/{dims[1]}-d vs {store.image_dim}/{store.text_dim}-d); they start at "
                "random projections"
            )
        else:
            val_split = "val" if "val" in (store.split_names or []) else None
            try:
                alignment = fit_alignment(store, val_split=val_split)
            except InputError as err:
                raise ConfigError(f"recipe {config.recipe!r}: {err}") from None
            how = recipe.warm_start(alignment)
            info = {**alignment.to_json(), "start": how}
            note = f"{alignment.describe()}; {how}"
    return StartedRecipe(recipe.to(device), config, info, note)


def load_run(
    run_dir: str | os.PathLike[str],
    map_location: str | torch.device = "cpu",
    weights: str = "best",
) -> LoadedRun:
    """Load the recipe a run directory holds, in eval mode: its best-validation weights
    (``weights="best"``, the default) or its last ones (``"last"``). A run without
    ``best.safetensors`` (validation off, or written before validation existed) loads its last
    weights as the best, and ``LoadedRun.note`` says so.

    Raises CheckpointError with one clear message for a missing, incomplete or corrupt run.
    """
    if weights not in WEIGHTS:
        raise CheckpointError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise CheckpointError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a directory (expected a run directory)")
    config = read_config(run_dir)
    meta = read_meta(run_dir)
    if meta["recipe"] != config.recipe:
        raise CheckpointError(
            f"{run_dir}: meta.json says recipe {meta['recipe']!r}, config.json {config.recipe!r}"
        )
    model_path = run_dir / MODEL_FILE
    if not model_path.exists():
        raise CheckpointError(f"{run_dir} has no {MODEL_FILE}")
    _, note = verify_checksum(run_dir, CONFIG_FILE, meta)
    notes = [note] if note else []
    weights_step = _weights_step(model_path)
    if weights_step is not None and weights_step != int(meta["step"]):
        raise CheckpointError(
            f"{model_path} holds step {weights_step} but {META_FILE} step {meta['step']}: the "
            "process stopped while writing that checkpoint; finish it with "
            f"`curvalign train --out {run_dir} --resume`"
        )
    last_step = int(meta["step"])
    step, loaded, best_note = last_step, "last", None
    best_step = meta.get("best_step")
    if weights == "best":
        if best_step is not None and (run_dir / BEST_FILE).exists():
            model_path, step, loaded = run_dir / BEST_FILE, int(best_step), "best"
        else:
            why = (
                "it was trained without validation (val_every=0)"
                if "val_history" in meta
                else "it was written before curvalign kept best weights"
            )
            best_note = (
                f"{run_dir} has no {BEST_FILE} ({why}): using its last weights (step "
                f"{last_step}) as the best"
            )
    weights_sha256, note = verify_checksum(run_dir, model_path.name, meta)
    if note and not notes:
        notes.append(note)
    if best_note:
        notes.append(best_note)
    try:
        tensors = load_file(str(model_path), device=str(map_location))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{model_path} is corrupt ({err})") from None
    recipe = build_recipe(config, int(meta["image_dim"]), int(meta["text_dim"]))
    try:
        recipe.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0:3]
        raise CheckpointError(
            f"{model_path} does not match recipe {config.recipe!r} as configured "
            f"({' '.join(first)})"
        ) from None
    recipe.to(map_location)
    recipe.eval()
    return LoadedRun(
        recipe=recipe,
        config=config,
        step=step,
        run_dir=run_dir,
        meta=meta,
        weights_sha256=weights_sha256,
        notes=notes,
        weights=loaded,
        last_step=last_step,
        best_step=None if best_step is None else int(best_step),
        val_history=[(int(a), float(b)) for a, b in meta.get("val_history", [])],
        note=best_note,
    )


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/log.jsonl``, one dict per logged step, in order.

    A run that has not logged yet has no file: ``[]``. A last line cut short (a process killed
    while writing) is skipped; any other line that is not JSON raises CheckpointError naming it.
    """
    path = Path(run_dir) / LOG_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # torn by a kill mid-write
                break
            raise CheckpointError(f"{path}:{number} is not valid JSON ({err.msg})") from None
    return records


__all__ = [
    "CHECKSUMS_KEY",
    "BEST_FILE",
    "CONFIG_FILE",
    "CONFIG_YAML",
    "CheckpointError",
    "LOG_FILE",
    "LoadedRun",
    "META_FILE",
    "MODEL_FILE",
    "NOT_CHECKSUMMED",
    "RUN_FILES",
    "StartedRecipe",
    "STATE_FILE",
    "TB_DIR",
    "WEIGHTS",
    "build_recipe",
    "build_started_recipe",
    "is_run_dir",
    "load_run",
    "read_config",
    "read_log",
    "read_meta",
    "reads_text_tokens",
    "recipe_input_dims",
    "seed_everything",
    "verify_checksum",
]
