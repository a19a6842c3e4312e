"""curvalign.train: run any recipe (trainer), its config, checkpoints and logs.

``load_run`` (checkpoint.py) is what evaluation and search use; it never imports the trainer.
Names are imported lazily so that ``import curvalign.train.checkpoint`` stays light.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "TrainConfig": "curvalign.train.config",
    "RunConfig": "curvalign.train.config",
    "TrainError": "curvalign.train.config",
    "ConfigError": "curvalign.train.config",
    "resolve_config": "curvalign.train.config",
    "LoadedRun": "curvalign.train.checkpoint",
    "CheckpointError": "curvalign.train.checkpoint",
    "load_run": "curvalign.train.checkpoint",
    "Trainer": "curvalign.train.trainer",
    "NonFiniteLossError": "curvalign.train.trainer",
    "train": "curvalign.train.trainer",
    "read_log": "curvalign.train.logging",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'curvalign.train' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
