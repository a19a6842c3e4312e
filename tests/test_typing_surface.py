"""Module boundaries stay typed: no module imports another module's private name (a name
starting with "_"); a helper shared across modules has a public, documented name in the module
that owns it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "curvalign"

#: (importing file, name) pairs still allowed: none
ALLOWED: set[tuple[str, str]] = set()


def _private_imports(root: Path) -> list[tuple[str, str]]:
    """(file relative to ``root``, name) of every ``from curvalign... import _name`` whose
    ``_name`` is not itself a module (a private module of a package is its own business)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("curvalign")
            ):
                continue
            package = root.parent.joinpath(*str(node.module).split("."))
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if (package / f"{name}.py").exists() or (package / name).is_dir():
                    continue  # a private submodule, not a private name of another module
                found.append((path.relative_to(root).as_posix(), name))
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    found = _private_imports(SRC)
    assert set(found) <= ALLOWED, sorted(set(found) - ALLOWED)


def test_the_scan_finds_a_private_import(tmp_path: Path) -> None:
    pkg = tmp_path / "curvalign"
    (pkg / "a").mkdir(parents=True)
    (pkg / "a" / "_private_module.py").write_text("")
    (pkg / "b.py").write_text(
        "from curvalign.a.c import _helper\nfrom curvalign.a import _private_module\n"
    )
    assert _private_imports(pkg) == [("b.py", "_helper")]
