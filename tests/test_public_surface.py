"""The public surface keeps its promise: moved names and old constructor forms still work for
one release with a DeprecationWarning naming the new place; the package ships its licence,
version and type marker; the documentation cites only files the repository holds."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import curvalign
from curvalign.data.features import FeatureStore, TextPart

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- moved names --------------------------------------------------------------------------------


def test_load_run_from_the_trainer_package_warns_and_is_the_runs_one():
    import curvalign.train as train_package
    from curvalign import runs

    with pytest.warns(DeprecationWarning, match=r"curvalign\.runs"):
        from curvalign.train import load_run
    assert load_run is runs.load_run
    assert "load_run" not in train_package.__all__  # the alias is not part of the API


def test_an_unknown_name_of_the_trainer_package_is_still_an_attribute_error():
    import curvalign.train as train_package

    with pytest.raises(AttributeError, match="no_such_name"):
        train_package.no_such_name  # noqa: B018


# --- FeatureStore's old keywords ------------------------------------------------------------------


def _parts(n_images: int = 3, n_texts: int = 4):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(n_images, 5, generator=g),
        torch.randn(n_texts, 4, generator=g),
        torch.randn(n_texts, 3, 2, generator=g),
        torch.ones(n_texts, 3, dtype=torch.long),
        torch.tensor([0, 0, 1, 2]),
    )


def _same(a: FeatureStore, b: FeatureStore) -> None:
    for name, value in a.fields().items():
        other = b.field(name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), name
        else:
            assert value == other, name


def test_old_text_keywords_build_the_store_from_fields_builds_with_a_warning():
    images, texts, tokens, mask, t2i = _parts()
    with pytest.warns(DeprecationWarning, match=r"TextPart.*from_fields"):
        old = FeatureStore(
            image_features=images,
            text_features=texts,
            text_token_features=tokens,
            text_token_mask=mask,
            text_to_image=t2i,
        )
    new = FeatureStore.from_fields(
        image_features=images,
        text_features=texts,
        text_token_features=tokens,
        text_token_mask=mask,
        text_to_image=t2i,
    )
    assert isinstance(old.text, TextPart) and old.text.token_mask is mask
    _same(old, new)
    old.validate()


def test_old_optional_part_keywords_become_text_parts():
    images, texts, _, _, t2i = _parts()
    prompts = torch.randn(2, 4)
    with pytest.warns(DeprecationWarning, match="prompt_features"):
        old = FeatureStore(
            image_features=images,
            text_features=texts,
            text_to_image=t2i,
            prompt_features=prompts,
        )
    assert isinstance(old.prompt, TextPart) and old.prompt_features is prompts
    assert old.pair_a is None and old.negative is None


def test_a_caption_tensor_given_positionally_becomes_a_text_part():
    images, texts, _, _, t2i = _parts()
    with pytest.warns(DeprecationWarning, match="TextPart"):
        old = FeatureStore(images, texts, t2i)
    _same(old, FeatureStore(images, TextPart(texts), t2i))


def test_the_current_constructor_does_not_warn():
    images, texts, _, _, t2i = _parts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = FeatureStore(image_features=images, text=TextPart(texts), text_to_image=t2i)
        FeatureStore.from_fields(image_features=images, text_features=texts, text_to_image=t2i)
    store.validate()


def test_a_text_part_given_twice_is_refused():
    images, texts, _, _, t2i = _parts()
    with pytest.raises(TypeError, match="text_features.*text"):
        FeatureStore(
            image_features=images, text=TextPart(texts), text_features=texts, text_to_image=t2i
        )


# --- what the package ships -----------------------------------------------------------------------


def test_version_licence_and_type_marker_are_shipped():
    project = _pyproject()
    assert curvalign.__version__ == project["project"]["version"]
    assert project["project"]["license"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "src" / "curvalign" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["curvalign"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{curvalign.__version__}]" in changelog and "## [0.1.0]" in changelog


def test_the_documentation_cites_only_files_the_repository_holds():
    """The design document lives in the repository as docs/design.md; nothing cites it by a
    name the repository does not hold."""
    assert (ROOT / "docs" / "design.md").is_file()
    bare = re.compile(r"(?<![\w/])DESIGN\.md")
    offenders = []
    for folder in ("src", "docs", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".yml", ".yaml", ".toml") and path.is_file():
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if bare.search(line):
                        offenders.append(f"{path.relative_to(ROOT)}:{n}")
    readme = (ROOT / "README.md").read_text()
    offenders += [f"README.md: {m}" for m in bare.findall(readme)]
    assert not offenders, offenders
