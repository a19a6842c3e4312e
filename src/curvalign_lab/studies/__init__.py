"""One module per study, each defining ``STUDY`` (a ``declare.Study``):
``registry()`` finds them, so adding a study is adding a file."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any


def modules() -> list[ModuleType]:
    """Every study module of this package, in name order."""
    return [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)
        if not info.name.startswith("_")
    ]


def registry() -> dict[str, Any]:
    """{name: STUDY} of every study module, in name order."""
    found: dict[str, Any] = {}
    for module in modules():
        study = getattr(module, "STUDY", None)
        if study is not None:
            found[study.name] = study
    return found
