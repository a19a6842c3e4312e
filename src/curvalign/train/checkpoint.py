"""Writing checkpoints into a run directory, and reading back what resume needs.

Reading a run for evaluation or search (``load_run``, ``read_config``, ``read_meta``) lives in
``curvalign.runs``, below the trainer; the names this module uses are re-exported here for old
imports, except ``load_run`` (one import path: ``curvalign.runs``).

Every file is written to a temporary name in the same directory and moved into place with
``os.replace`` (``curvalign._io.atomic_write``), so a reader never sees a partial file.
``state.pt`` is written first and carries its own copy of the weights, so resume always finds
weights, optimizer and sampler from the same step, even if the process dies between two files
of one checkpoint. ``meta.json`` is written last and records the SHA-256 of the files written
before it (``curvalign.runs.verify_checksum`` checks them on load).
"""

from __future__ import annotations

import io
import json
import platform
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from curvalign._io import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    sha256_bytes,
    sha256_file,
)
from curvalign.runs import (
    BEST_FILE,
    CHECKSUMS_KEY,
    CONFIG_FILE,
    CONFIG_YAML,
    LOG_FILE,
    META_FILE,
    MODEL_FILE,
    NOT_CHECKSUMMED,
    RUN_FILES,
    STATE_FILE,
    TB_DIR,
    CheckpointError,
    LoadedRun,
    build_recipe,
    is_run_dir,
    read_config,
    read_meta,
    verify_checksum,
)


def atomic_torch_save(path: Path, obj: object) -> None:
    """``torch.save(obj, path)``, atomically."""
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
    best_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write one checkpoint: ``state.pt`` (with the weights, and the best weights so far), then
    ``model.safetensors``, ``best.safetensors`` (when ``best_state`` is given; ``meta`` then holds
    ``best_step``), then ``meta.json`` with the SHA-256 of every other file in ``run_dir``
    (``meta["sha256"]``). ``train_state`` must hold ``step``; ``meta`` too."""
    run_dir = Path(run_dir)
    tensors = model_tensors(model_state)
    best = model_tensors(best_state) if best_state is not None else None
    buffer = io.BytesIO()
    torch.save({**train_state, "model": tensors, "best_model": best}, buffer)
    state_bytes = buffer.getvalue()
    atomic_write_bytes(run_dir / STATE_FILE, state_bytes)
    atomic_write(
        run_dir / MODEL_FILE,
        lambda tmp: save_file(tensors, str(tmp), metadata={"step": str(meta["step"])}),
    )
    if best is not None:
        atomic_write(
            run_dir / BEST_FILE,
            lambda tmp: save_file(best, str(tmp), metadata={"step": str(meta["best_step"])}),
        )
    checksums = run_checksums(run_dir, known={STATE_FILE: sha256_bytes(state_bytes)})
    atomic_write_text(
        run_dir / META_FILE, json.dumps({**meta, CHECKSUMS_KEY: checksums}, indent=2) + "\n"
    )


def run_checksums(run_dir: Path, known: dict[str, str] | None = None) -> dict[str, str]:
    """``{name: SHA-256}`` of every plain file of ``run_dir`` but meta.json and the logs (hidden
    temporaries and folders such as tb/ skipped); ``known`` supplies digests already computed."""
    known = known or {}
    return {
        path.name: known.get(path.name) or sha256_file(path)
        for path in sorted(Path(run_dir).iterdir())
        if path.is_file() and not path.name.startswith(".") and path.name not in NOT_CHECKSUMMED
    }


# --- resume ---------------------------------------------------------------------------------


def _numpy_array_globals() -> list[Any]:
    """What a ``state.pt`` written before the RNG state was stored as tensors needs to unpickle
    numpy's RNG key array: numpy's array reconstruction and its uint32 dtype, nothing that runs
    code of the file's choosing."""
    import numpy

    core = getattr(numpy, "_core", None) or numpy.core
    return [
        core.multiarray._reconstruct,
        numpy.ndarray,
        numpy.dtype,
        type(numpy.dtype(numpy.uint32)),
    ]


def read_state_file(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and containers only (an
    arbitrary pickle in a run folder from someone else is refused, never executed)."""
    with torch.serialization.safe_globals(_numpy_array_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)


def _load_failure(err: Exception) -> str:
    """One line on why ``torch.load(weights_only=True)`` refused a file: for a pickle that asks
    for a function or class, which one; never torch's advice to load it with
    ``weights_only=False`` (running a planted pickle is what the refusal prevents)."""
    import pickle

    if isinstance(err, pickle.UnpicklingError):
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        asks = f" (it asks for {found.group(1)})" if found else ""
        return (
            f"a pickle that holds more than tensors and numbers{asks}, refused unread: a "
            "curvalign training state never holds one; restore the file from a copy you trust, "
            "or train again into a new directory"
        )
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    lines = [line for line in lines if "weights_only" not in line]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def load_train_state(
    run_dir: Path,
    map_location: str | torch.device = "cpu",
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """``state.pt`` (what resume needs), checked against the SHA-256 in ``meta.json``.

    A ``state.pt`` newer than ``meta.json`` is the first file of a checkpoint whose writing was
    interrupted (it is written first and atomically): it is used, and the caller should write the
    checkpoint again. Remarks for the user are appended to ``notes``."""
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"{run_dir} has no {STATE_FILE}: nothing to resume from")
    notes = notes if notes is not None else []
    try:
        meta = read_meta(run_dir)
    except CheckpointError:
        meta = None  # a state.pt without meta.json: the first checkpoint was interrupted
    mismatch = None
    if meta is not None:
        try:
            _, note = verify_checksum(run_dir, STATE_FILE, meta)
            notes += [note] if note else []
        except CheckpointError as err:
            mismatch = err
            # only a state.pt written after meta.json (an interrupted checkpoint) may differ
            # from it; anything else is refused before a byte of it is deserialised
            if path.stat().st_mtime_ns <= (Path(run_dir) / META_FILE).stat().st_mtime_ns:
                raise
    try:
        state = read_state_file(path, map_location)
    except Exception as err:  # torch.load raises many types for a damaged file
        if mismatch is not None:
            raise mismatch from None
        raise CheckpointError(f"{path} is corrupt ({_load_failure(err)})") from None
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise CheckpointError(f"{path} is corrupt: not a curvalign training state")
    if mismatch is not None and meta is not None:  # a mismatch is only found against meta
        if int(state["step"]) <= int(meta["step"]):
            raise mismatch
        notes.append(
            f"{path} (step {state['step']}) is newer than {META_FILE} (step {meta['step']}): the "
            "process stopped while writing that checkpoint; resuming from it"
        )
    return state


__all__ = [
    "BEST_FILE",
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
    "atomic_torch_save",
    "atomic_write",
    "atomic_write_text",
    "build_recipe",
    "is_run_dir",
    "load_train_state",
    "model_tensors",
    "read_state_file",
    "read_config",
    "read_meta",
    "run_checksums",
    "save_checkpoint",
    "versions",
]
