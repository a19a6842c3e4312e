"""Old home of the run configuration; it lives in ``curvalign.config`` now (below ``train/``, so
that ``eval/`` and ``index/`` read configs without importing the trainer). Re-exported here so
that existing imports keep working."""

from curvalign.config import (
    RunConfig,
    TrainConfig,
    coerce,
    init_values,
    parse_override,
    read_yaml,
    recipe_class,
    resolve_config,
)
from curvalign.errors import ConfigError, TrainError

__all__ = [
    "ConfigError",
    "RunConfig",
    "TrainConfig",
    "TrainError",
    "coerce",
    "init_values",
    "parse_override",
    "read_yaml",
    "recipe_class",
    "resolve_config",
]
