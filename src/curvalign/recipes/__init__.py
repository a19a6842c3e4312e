"""Method registry: ``register`` a Recipe subclass by its ``name``; ``get_recipe`` finds it.

Recipes are found by discovery, not by a list (``curvalign.plugins``): every module of this
package (except ``base`` and private ``_*`` modules) is imported, and so is every entry point of
the ``curvalign.recipes`` group, so a user's own package adds a method without forking::

    # the user's pyproject.toml
    [project.entry-points."curvalign.recipes"]
    myrecipe = "mypackage.myrecipe"          # a module that applies @register, or the class

A module that fails to import raises ``RecipeImportError`` naming it (with its cause), never
hides its recipe.
"""

from __future__ import annotations

import importlib

from curvalign.data.batch import Batch
from curvalign.errors import ConfigError
from curvalign.plugins import (
    RECIPE_ENTRY_POINT_GROUP,
    available_recipe_names,
    recipe_entry_points,
    recipe_module_names,
)
from curvalign.recipes.base import Embedding, Gather, LossOutput, Progress, Recipe


class UnknownRecipeError(ConfigError, KeyError):
    """A recipe name that is not registered (a KeyError too, for lookups that expect one)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RecipeImportError(ImportError):
    """A recipe module or entry point that failed to import (a bug to fix, so not a one-line
    CurvalignError: the traceback of the cause is kept)."""


_REGISTRY: dict[str, type[Recipe]] = {}
_loaded = False


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: make ``cls`` available as ``get_recipe(cls.name)``."""
    if not isinstance(cls, type) or not issubclass(cls, Recipe):
        raise TypeError(f"register expects a Recipe subclass, got {cls!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"recipe name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _import_recipe_module(module: str) -> None:
    """Import the package's recipe module ``module`` (RecipeImportError naming it on failure)."""
    name = f"{__name__}.{module}"
    try:
        importlib.import_module(name)
    except Exception as err:
        raise RecipeImportError(f"recipe module {name} failed to import: {err}") from err


def _load_all() -> None:
    """Import every recipe module of the package and every entry point, once."""
    global _loaded
    if _loaded:
        return
    for module in recipe_module_names():
        _import_recipe_module(module)
    for point in recipe_entry_points():
        try:
            obj = point.load()
        except Exception as err:
            raise RecipeImportError(
                f"entry point {point.name!r} = {point.value!r} of group {RECIPE_ENTRY_POINT_GROUP!r} "
                f"failed to import: {err}"
            ) from err
        if isinstance(obj, type) and issubclass(obj, Recipe) and obj.name not in _REGISTRY:
            register(obj)
    _loaded = True


def recipe_names() -> list[str]:
    """Every registered recipe name, sorted (imports the recipe modules)."""
    _load_all()
    return sorted(_REGISTRY)


def get_recipe(name: str) -> type[Recipe]:
    """The Recipe class registered as ``name``; UnknownRecipeError listing the known names.

    A built-in recipe's module carries the recipe's name, so that module alone is imported
    first: a command that runs one recipe (``index search`` reading its run) does not import
    the other recipes and every entry point. Any other name discovers them all."""
    if name not in _REGISTRY and not _loaded and name in recipe_module_names():
        _import_recipe_module(name)
    if name not in _REGISTRY:
        _load_all()
    if name not in _REGISTRY:
        raise UnknownRecipeError(
            f"unknown recipe {name!r}; known recipes: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


__all__ = [
    "RECIPE_ENTRY_POINT_GROUP",
    "Batch",
    "Embedding",
    "Gather",
    "LossOutput",
    "Progress",
    "Recipe",
    "RecipeImportError",
    "UnknownRecipeError",
    "available_recipe_names",
    "get_recipe",
    "recipe_names",
    "register",
]
