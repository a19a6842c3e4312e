"""curvalign.train: run any recipe (trainer), write its checkpoints and logs.

The config dataclasses (``curvalign.config``) and reading a run (``curvalign.runs``) live below
this package; the config names, ``LoadedRun`` and ``read_log`` are re-exported here for
convenience. ``load_run`` has one import path, ``curvalign.runs``
(``curvalign.train.load_run``, its place before 0.2.0, still works for one release with a
``DeprecationWarning``). Names are imported lazily so that ``import curvalign.train`` stays
light.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "TrainConfig": "curvalign.config",
    "RunConfig": "curvalign.config",
    "TrainError": "curvalign.errors",
    "ConfigError": "curvalign.errors",
    "resolve_config": "curvalign.config",
    "LoadedRun": "curvalign.runs",
    "CheckpointError": "curvalign.runs",
    "Trainer": "curvalign.train.trainer",
    "NonFiniteLossError": "curvalign.train.trainer",
    # the one entry point; towers=... trains encoders in front of the recipe
    "train": "curvalign.train.trainer",
    "TowerTrainer": "curvalign.train.towers",
    "TowerFeatures": "curvalign.train.towers",
    "FeatureSource": "curvalign.train.sources",
    "export_towers": "curvalign.train.towers",
    "load_towers": "curvalign.train.towers",
    "read_log": "curvalign.runs",
    "TrainerHook": "curvalign.train.hooks",
    "Decision": "curvalign.train.hooks",
    "ValidationEvent": "curvalign.train.hooks",
    "KeepBestWeights": "curvalign.train.hooks",
    "EarlyStopping": "curvalign.train.hooks",
    "RunSpec": "curvalign.train.fitting",
    "FitResult": "curvalign.train.fitting",
    "fit": "curvalign.train.fitting",
}
#: public names that moved, kept for one release with a DeprecationWarning: name -> new module
_MOVED = {"load_run": "curvalign.runs"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(
            f"curvalign.train.{name} is deprecated and will be removed in 0.3.0: "
            f"import it from {_MOVED[name]} (from {_MOVED[name]} import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'curvalign.train' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
