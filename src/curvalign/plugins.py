"""Where recipes come from, without importing them (light: no torch).

Recipes are discovered, not listed: the modules of the ``curvalign.recipes`` package (except
``base`` and private ``_*`` modules) and the entry points of the group ``curvalign.recipes``
(a user's package adds a method without forking). By convention a module ``recipes/NAME.py`` and
an entry point ``NAME`` register the recipe ``NAME``; ``available_recipe_names`` relies on that
so that the command line can list names in its help without importing torch.
``curvalign.recipes`` imports what is found here and registers it.
"""

from __future__ import annotations

import pkgutil
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

RECIPE_ENTRY_POINT_GROUP = "curvalign.recipes"
_RECIPES_DIR = Path(__file__).parent / "recipes"
_NOT_RECIPES = {"base", "health"}


def recipe_module_names() -> list[str]:
    """Module names of the ``curvalign.recipes`` package that hold recipes, sorted."""
    return sorted(
        info.name
        for info in pkgutil.iter_modules([str(_RECIPES_DIR)])
        if not info.name.startswith("_") and info.name not in _NOT_RECIPES
    )


def recipe_entry_points() -> list[EntryPoint]:
    """Installed entry points of the ``curvalign.recipes`` group."""
    return list(entry_points(group=RECIPE_ENTRY_POINT_GROUP))


def available_recipe_names() -> list[str]:
    """Recipe names by convention (package modules and entry point names), sorted."""
    return sorted(set(recipe_module_names()) | {p.name for p in recipe_entry_points()})


__all__ = [
    "RECIPE_ENTRY_POINT_GROUP",
    "available_recipe_names",
    "recipe_entry_points",
    "recipe_module_names",
]
