"""Reading a run directory: its config, meta, weights and log. Below ``train/``: ``eval/``,
``index/``, ``report/`` and ``train/`` (resume) all read runs through this module.

A run directory holds::

    config.json        the resolved RunConfig (read back by load_run); config.yaml: the same, for humans
    model.safetensors  the recipe's state dict (what evaluation and search load)
    state.pt           everything resume needs: model, optimizer, scheduler, sampler, RNG states, step
    meta.json          step, feature dimensions, recipe name, versions, data summary
    log.jsonl, tb/     training logs (one JSON object per logged step; TensorBoard scalars)

Writing them is the trainer's business (``train/checkpoint.py``, ``train/logging.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from curvalign.config import RunConfig, recipe_class
from curvalign.errors import ConfigError, CurvalignError
from curvalign.recipes.base import Recipe

CONFIG_FILE = "config.json"
CONFIG_YAML = "config.yaml"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LOG_FILE = "log.jsonl"
TB_DIR = "tb"
#: files (and the tb/ folder) that make a directory a run directory
RUN_FILES = (CONFIG_FILE, CONFIG_YAML, MODEL_FILE, STATE_FILE, META_FILE, LOG_FILE)


class CheckpointError(CurvalignError):
    """A run directory that is missing, incomplete or unreadable."""


@dataclass
class LoadedRun:
    """A trained run, ready for evaluation or search.

    recipe   the Recipe instance, weights loaded, in eval mode, on ``map_location``
    config   the RunConfig it was trained with
    step     optimizer steps behind these weights
    run_dir  where it was loaded from
    meta     meta.json (dims, versions, data summary)
    """

    recipe: Recipe
    config: RunConfig
    step: int
    run_dir: Path
    meta: dict[str, Any]


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


def build_recipe(config: RunConfig, image_dim: int, text_dim: int) -> Recipe:
    """The recipe of ``config`` with fresh parameters (seed the RNG first for a reproducible init)."""
    cls = recipe_class(config.recipe)
    return cls(config.recipe_config_object(), image_dim, text_dim)


def load_run(run_dir: str | Path, map_location: str | torch.device = "cpu") -> LoadedRun:
    """Load the recipe a run directory holds (latest checkpoint), in eval mode.

    Raises CheckpointError with one clear message for a missing, incomplete or corrupt run.
    """
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
        recipe=recipe, config=config, step=int(meta["step"]), run_dir=run_dir, meta=meta
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
    "CONFIG_FILE",
    "CONFIG_YAML",
    "CheckpointError",
    "LOG_FILE",
    "LoadedRun",
    "META_FILE",
    "MODEL_FILE",
    "RUN_FILES",
    "STATE_FILE",
    "TB_DIR",
    "build_recipe",
    "is_run_dir",
    "load_run",
    "read_config",
    "read_log",
    "read_meta",
]
