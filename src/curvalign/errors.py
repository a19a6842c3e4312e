"""The one root of curvalign's errors.

Every error curvalign raises on purpose (bad input, a missing or damaged file, a config it cannot
use, a run that cannot continue) derives from ``CurvalignError`` and carries one message for the
user that names the input and what was expected. The command line prints such an error as one
line (``error: ...``); anything else is a bug and shows its traceback.

Classes that callers already catch as ``ValueError`` (data specs, feature stores, index
mismatches, ...) keep ``ValueError`` as a second base; they live next to the code that raises
them. The ones defined here are shared by several layers.
"""

from __future__ import annotations


class CurvalignError(Exception):
    """Root of every deliberate curvalign error: one clear message, printed without a traceback."""


class ConfigError(CurvalignError, ValueError):
    """A configuration value or key that cannot be used (trainer settings, recipe settings,
    overrides, config files, benchmark and study options)."""


class TrainError(CurvalignError):
    """A training run that cannot start or continue (the trainer's own problems)."""


class InputError(CurvalignError, ValueError):
    """An input that does not fit what the called function needs (a split without images,
    scores with NaN, an option outside its range)."""


class NotFoundError(CurvalignError, FileNotFoundError):
    """A path that should hold a curvalign artefact (embeddings, index) does not."""


class OverwriteError(CurvalignError, FileExistsError):
    """An output path holds something curvalign did not write; it is not overwritten."""


class NonFiniteError(CurvalignError, FloatingPointError):
    """A model produced NaN or infinite values (embeddings, scores)."""


class DamagedFileError(CurvalignError, ValueError):
    """A file curvalign wrote whose bytes are not what it wrote (its SHA-256 differs from the
    one recorded next to it) or that cannot be read as what it should hold (truncated)."""


__all__ = [
    "ConfigError",
    "CurvalignError",
    "DamagedFileError",
    "InputError",
    "NonFiniteError",
    "NotFoundError",
    "OverwriteError",
    "TrainError",
]
