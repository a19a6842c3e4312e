"""curvalign.data: the feature store, the synthetic world, and ``load_data`` for data specs.

A data spec is ``PREFIX`` or ``PREFIX:ARGUMENT``:

    synthetic                       the synthetic world with its default knobs
    synthetic:images=500,seed=3     the same with ``SyntheticConfig`` overrides
    features:PATH                   a feature store directory written by ``FeatureStore.save``
    wordnet:SYNSET                  a WordNet sub-tree (``curvalign.data.wordnet``)

New sources register a loader under a new prefix (``register_data_source``); ``load_data``
dispatches on the text before the first ``:``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from curvalign.data.features import FeatureStore, FeatureStoreError

__all__ = [
    "FeatureStore",
    "FeatureStoreError",
    "DataSpecError",
    "load_data",
    "register_data_source",
    "data_spec_forms",
]


class DataSpecError(ValueError):
    """A data spec that names no known source or carries a bad argument."""


@dataclass(frozen=True)
class _Source:
    load: Callable[[str], FeatureStore]
    usage: tuple[str, ...]  # accepted forms, shown in errors and help


_SOURCES: dict[str, _Source] = {}


def register_data_source(
    prefix: str, load: Callable[[str], FeatureStore], usage: tuple[str, ...]
) -> None:
    """Make ``load_data("PREFIX:ARG")`` call ``load(ARG)`` (``ARG`` is "" for a bare ``PREFIX``).

    ``usage`` lists the accepted forms, e.g. ``("wordnet:SYNSET",)``. A loader raises
    ``DataSpecError`` (or ``ValueError``) with a clear message for a bad argument.
    """
    if not prefix.isidentifier():
        raise ValueError(f"data source prefix must be an identifier, got {prefix!r}")
    _SOURCES[prefix] = _Source(load, tuple(usage))


def data_spec_forms() -> list[str]:
    """Every accepted spec form, for help texts."""
    return [form for source in _SOURCES.values() for form in source.usage]


def load_data(spec: str) -> FeatureStore:
    """The feature store that ``spec`` names (see the module docstring); ``meta["spec"]`` records it.

    Raises ``DataSpecError`` for an unknown or malformed spec and ``FeatureStoreError`` for a
    store on disk that breaks the format.
    """
    prefix, _, argument = spec.strip().partition(":")
    source = _SOURCES.get(prefix)
    if source is None:
        raise DataSpecError(
            f"unknown data spec {spec!r}; accepted forms: {', '.join(data_spec_forms())}"
        )
    try:
        store = source.load(argument)
    except (DataSpecError, FeatureStoreError):
        raise
    except ValueError as exc:
        raise DataSpecError(f"data spec {spec!r}: {exc}") from None
    store.meta["spec"] = spec
    return store


def _load_synthetic(argument: str) -> FeatureStore:
    from curvalign.data.synthetic import config_from_spec, make_world

    return make_world(config_from_spec(argument))


def _load_features(argument: str) -> FeatureStore:
    if not argument:
        raise DataSpecError("features: needs a path, e.g. features:runs/coco_clip")
    # Memory-mapped: stores larger than memory stay usable; pages are read as they are touched.
    return FeatureStore.load(argument, mmap=True)


register_data_source("synthetic", _load_synthetic, ("synthetic", "synthetic:key=value,..."))
register_data_source("features", _load_features, ("features:PATH",))


def _load_wordnet(argument: str) -> FeatureStore:
    from curvalign.data.wordnet import load_wordnet_spec

    return load_wordnet_spec(argument)


register_data_source(
    "wordnet", _load_wordnet, ("wordnet:SYNSET", "wordnet:SYNSET,encoder=SPEC,seed=N")
)
