"""The structure docs/design.md promises, checked: outside ``recipes/`` nothing names a method.

(The layer rules themselves are import-linter contracts in pyproject.toml, run by CI.)
"""

from __future__ import annotations

import re
from pathlib import Path

import curvalign
from curvalign.plugins import available_recipe_names

SRC = Path(curvalign.__file__).parent


def _method_names() -> list[str]:
    return [n for n in available_recipe_names() if not n.startswith("_")]


def _names_method(line: str, names: list[str]) -> bool:
    """A quoted method name, or a test of some ``.name`` against a string literal."""
    quoted = "|".join(map(re.escape, names))
    return bool(
        re.search(rf"""["']({quoted})["']""", line) or re.search(r"\.name\s*[!=]=\s*[\"']", line)
    )


def _outside_recipes() -> list[Path]:
    return [p for p in SRC.rglob("*.py") if "recipes" not in p.relative_to(SRC).parts]


def test_no_recipe_name_is_written_outside_recipes():
    names = _method_names()
    assert {"clip", "meru", "agr"} <= set(names)
    hits = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in _outside_recipes()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _names_method(line, names)
    ]
    assert hits == [], "method knowledge outside recipes/:\n" + "\n".join(hits)


def test_the_check_can_fail():
    names = _method_names()
    assert _names_method('key = {"meru": "point"}[name]', names)
    assert _names_method("if r.name == 'anything':", names)
    assert not _names_method('geometry = {"point": "lorentz"}', names)


def _shipped_non_python_files() -> set[Path]:
    """The files the ``[tool.setuptools.package-data]`` globs of pyproject.toml put in a wheel."""
    import tomllib

    src = Path(curvalign.__file__).parent.parent
    config = tomllib.loads((src.parent / "pyproject.toml").read_text())
    shipped: set[Path] = set()
    for package, globs in config["tool"]["setuptools"]["package-data"].items():
        folder = src.joinpath(*package.split("."))
        for pattern in globs:
            shipped.update(folder.glob(pattern))
    return shipped


def test_every_native_kernel_source_ships_in_the_wheel():
    """A kernel source (or a header it includes) missing from package-data builds in an
    editable checkout but not in an installed wheel, where the kernel would silently fall back
    to its eager reference."""
    root = Path(curvalign.__file__).parent
    sources = {p for pattern in ("*.cpp", "*.h") for p in root.rglob(pattern)}
    assert sources, "no kernel sources found: the check would pass vacuously"
    missing = sorted(str(p.relative_to(root)) for p in sources - _shipped_non_python_files())
    assert not missing, f"not in pyproject.toml's package-data: {missing}"
