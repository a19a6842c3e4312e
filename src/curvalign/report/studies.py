"""Deprecated alias of the claim studies, which moved out of the importable library into the
sibling package ``curvalign_lab`` (installed by the same distribution): ``run_study``,
``run_all``, ``STUDIES`` and ``parse_study_options`` in ``curvalign_lab.runner``, each study
in ``curvalign_lab.studies.<name>``, their shared helpers in ``curvalign_lab.common``.
Importing this name warns; it goes in the next release."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

warnings.warn(
    "curvalign.report.studies moved to curvalign_lab (run_study, run_all, STUDIES: "
    "curvalign_lab.runner; each study: curvalign_lab.studies.<name>); this alias will be "
    "removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)


def _modules() -> list[ModuleType]:
    from curvalign_lab import common, runner, studies

    return [runner, common, *studies.modules()]


def __getattr__(name: str) -> Any:
    for module in _modules():
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
