"""Method registry: ``register`` a Recipe subclass by its ``name``; ``get_recipe`` finds it.

Each method lives in one file of this package; importing the package registers all of them.
"""

from __future__ import annotations

import importlib

from curvalign.errors import ConfigError
from curvalign.recipes.base import Batch, Embedding, Gather, LossOutput, Progress, Recipe


class UnknownRecipeError(ConfigError, KeyError):
    """A recipe name that is not registered (a KeyError too, for lookups that expect one)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


_REGISTRY: dict[str, type[Recipe]] = {}
_MODULES = ("clip", "meru", "hycoclip", "atmg", "phyclip", "proclip", "agr", "dualpath")


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: make ``cls`` available as ``get_recipe(cls.name)``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"recipe name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for module in _MODULES:
        try:
            importlib.import_module(f"curvalign.recipes.{module}")
        except ModuleNotFoundError as err:  # a method not written yet must not hide the others
            if err.name != f"curvalign.recipes.{module}":
                raise


def recipe_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_recipe(name: str) -> type[Recipe]:
    _load_all()
    if name not in _REGISTRY:
        raise UnknownRecipeError(
            f"unknown recipe {name!r}; known recipes: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


__all__ = [
    "Batch",
    "Embedding",
    "Gather",
    "LossOutput",
    "Progress",
    "Recipe",
    "UnknownRecipeError",
    "get_recipe",
    "recipe_names",
    "register",
]
