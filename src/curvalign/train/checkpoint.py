"""Run directories: atomic writes, checkpoints, and ``load_run`` for evaluation and search.

A run directory holds::

    config.json        the resolved RunConfig (read back by load_run); config.yaml: the same, for humans
    model.safetensors  the recipe's state dict (what evaluation and search load)
    state.pt           everything resume needs: model, optimizer, scheduler, sampler, RNG states, step
    meta.json          step, feature dimensions, recipe name, versions, data summary
    log.jsonl, tb/     training logs (see train/logging.py)

Every file is written to a temporary name in the same directory and moved into place with
``os.replace``, so a reader never sees a partial file. ``state.pt`` is written first and carries
its own copy of the weights, so resume always finds weights, optimizer and sampler from the
same step, even if the process dies between two files of one checkpoint.

This module must not import the trainer: ``eval/`` and ``index/`` import it.
"""

from __future__ import annotations

import io
import json
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from curvalign.train.config import RunConfig, TrainError

CONFIG_FILE = "config.json"
CONFIG_YAML = "config.yaml"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LOG_FILE = "log.jsonl"
TB_DIR = "tb"
#: files (and the tb/ folder) that make a directory a run directory
RUN_FILES = (CONFIG_FILE, CONFIG_YAML, MODEL_FILE, STATE_FILE, META_FILE, LOG_FILE)


class CheckpointError(TrainError):
    """A run directory that is missing, incomplete or unreadable."""


# --- atomic writes --------------------------------------------------------------------------


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file next to ``path``, fsync it, then move it onto
    ``path``. On any error the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_torch_save(path: Path, obj: Any) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


# --- saving ---------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    import numpy

    from curvalign import __version__

    return {
        "curvalign": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def model_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as safetensors accepts it: CPU, contiguous, no shared storage."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}


def save_checkpoint(
    run_dir: Path,
    *,
    model_state: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    """Write one checkpoint: ``state.pt`` (with the weights), then ``model.safetensors``, then
    ``meta.json``. ``train_state`` must hold ``step``; ``meta`` too."""
    run_dir = Path(run_dir)
    tensors = model_tensors(model_state)
    atomic_torch_save(run_dir / STATE_FILE, {**train_state, "model": tensors})
    atomic_write(
        run_dir / MODEL_FILE,
        lambda tmp: save_file(tensors, str(tmp), metadata={"step": str(meta["step"])}),
    )
    atomic_write_text(run_dir / META_FILE, json.dumps(meta, indent=2) + "\n")


# --- loading --------------------------------------------------------------------------------


@dataclass
class LoadedRun:
    """A trained run, ready for evaluation or search.

    recipe   the Recipe instance, weights loaded, in eval mode, on ``map_location``
    config   the RunConfig it was trained with
    step     optimizer steps behind these weights
    run_dir  where it was loaded from
    meta     meta.json (dims, versions, data summary)
    """

    recipe: Any
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
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).exists():
        raise CheckpointError(f"{run_dir} is not a run directory: no {CONFIG_FILE}")
    try:
        return RunConfig.load(run_dir / CONFIG_FILE)
    except CheckpointError:
        raise
    except TrainError as err:
        raise CheckpointError(str(err)) from None


def build_recipe(config: RunConfig, image_dim: int, text_dim: int):
    """The recipe of ``config`` with fresh parameters (seed the RNG first for a reproducible init)."""
    from curvalign.train.config import recipe_class

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


def load_train_state(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """``state.pt`` (what resume needs)."""
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"{run_dir} has no {STATE_FILE}: nothing to resume from")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # torch.load raises many types for a damaged file
        raise CheckpointError(f"{path} is corrupt ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise CheckpointError(f"{path} is corrupt: not a curvalign training state")
    return state
