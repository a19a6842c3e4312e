"""The API reference (docs/api/, built by mkdocs + mkdocstrings in CI) covers every public module.

A module added without a ``::: curvalign.x.y`` line would silently have no reference page; CI's
``mkdocs build --strict`` catches a broken one, this catches a missing one.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
API = ROOT / "docs" / "api"
DEPRECATED_ALIASES = {
    "curvalign.report.results",
    "curvalign.report.studies",
    "curvalign.report.studykit",
}


def _public_modules() -> set[str]:
    out = set()
    for path in (SRC / "curvalign").rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        if any(part.startswith("_") for part in rel.parts):
            continue  # private modules and __init__/__main__
        out.add(".".join(rel.parts))
    # the command line is documented in README and --help; the deprecated aliases of modules
    # that moved to curvalign_lab (docs/api/lab.md) only warn and forward
    return out - {"curvalign.cli", *DEPRECATED_ALIASES}


def _referenced() -> set[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in API.glob("*.md"))
    return set(re.findall(r"^::: (curvalign(?:\.\w+)*)\s*$", text, flags=re.M))


def test_every_public_module_has_a_reference_entry() -> None:
    missing = sorted(_public_modules() - _referenced())
    assert not missing, f"add these to a page in docs/api/: {missing}"


def test_the_deprecated_aliases_still_warn() -> None:
    # an alias that stops warning is a module again, and needs its reference entry back
    import importlib
    import sys
    import warnings

    for name in sorted(DEPRECATED_ALIASES):
        sys.modules.pop(name, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.import_module(name)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), name


def test_reference_entries_name_existing_modules() -> None:
    stale = sorted(_referenced() - _public_modules())
    assert not stale, f"docs/api names modules that no longer exist: {stale}"


def test_every_api_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {f"api/{p.name}" for p in API.glob("*.md")}
    assert pages and all(page in nav for page in pages), sorted(p for p in pages if p not in nav)
