"""curvalign.data: the feature store, the synthetic world, and ``load_data`` for data specs.

A data spec is ``PREFIX`` or ``PREFIX:ARGUMENT``:

    synthetic                       the synthetic world with its default knobs
    synthetic:images=500,seed=3     the same with ``SyntheticConfig`` overrides
    features:PATH                   a feature store directory written by ``FeatureStore.save``
    wordnet:SYNSET                  a WordNet sub-tree (``curvalign.data.wordnet``)
    clip-retrieval:DIR[,val=N,...]  clip-retrieval's sharded embeddings, memory-mapped in place
                                    (``curvalign.data.clip_retrieval``)

New sources register a loader under a new prefix (``register_data_source``); ``load_data``
dispatches on the text before the first ``:``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from curvalign.data.features import FORCE_VALUE_CHECK, FeatureStore, FeatureStoreError, TextPart

if TYPE_CHECKING:
    from curvalign.data.synthetic import SyntheticWorld
from curvalign.errors import CurvalignError

__all__ = [
    "FeatureStore",
    "FeatureStoreError",
    "TextPart",
    "DataSpecError",
    "load_data",
    "load_store",
    "load_synthetic_world",
    "register_data_source",
    "data_spec_forms",
]


class DataSpecError(CurvalignError, ValueError):
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
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", prefix):
        raise ValueError(
            f"data source prefix must be an identifier (hyphens allowed), got {prefix!r}"
        )
    _SOURCES[prefix] = _Source(load, tuple(usage))


def data_spec_forms() -> list[str]:
    """Every accepted spec form, for help texts."""
    return [form for source in _SOURCES.values() for form in source.usage]


def _parse(spec: str) -> tuple[str, str, _Source]:
    """``(prefix, argument, source)`` of ``spec``; DataSpecError for an unknown prefix."""
    prefix, _, argument = spec.strip().partition(":")
    source = _SOURCES.get(prefix)
    if source is None:
        raise DataSpecError(
            f"unknown data spec {spec!r}; accepted forms: {', '.join(data_spec_forms())}"
        )
    return prefix, argument, source


@contextmanager
def _spec_errors(spec: str) -> Iterator[None]:
    """A loader's plain ValueError becomes a DataSpecError naming the spec."""
    try:
        yield
    except (DataSpecError, FeatureStoreError):
        raise
    except ValueError as exc:
        raise DataSpecError(f"data spec {spec!r}: {exc}") from None


def load_data(spec: str, check: bool = False) -> FeatureStore:
    """The feature store that ``spec`` names (see the module docstring); ``meta["spec"]`` records it.

    ``check=True`` forces the NaN/inf scan of every float, which stores on disk otherwise skip
    when their scan is on record (docs/data.md, "The value scan").
    Raises ``DataSpecError`` for an unknown or malformed spec and ``FeatureStoreError`` for a
    store on disk that breaks the format.
    """
    _, argument, source = _parse(spec)
    token = FORCE_VALUE_CHECK.set(True) if check else None
    try:
        with _spec_errors(spec):
            store = source.load(argument)
    finally:
        if token is not None:
            FORCE_VALUE_CHECK.reset(token)
    store.meta["spec"] = spec
    return store


def load_store(data: str | FeatureStore) -> tuple[FeatureStore, str]:
    """``(store, spec)`` for a data spec or an in-memory store (whose spec is its
    ``meta["spec"]``, or ``"<in-memory FeatureStore>"``). The one entry point of the trainer,
    the evaluation commands, the benchmark and the studies."""
    if isinstance(data, FeatureStore):
        return data, str(data.meta.get("spec", "<in-memory FeatureStore>"))
    return load_data(data), data


def load_synthetic_world(spec: str) -> SyntheticWorld:
    """The synthetic world of a ``synthetic[:key=value,...]`` spec with its ground truth (for
    analyses that need more than the store); errors as ``load_data``'s."""
    prefix, argument, _ = _parse(spec)
    if prefix != "synthetic":
        raise DataSpecError(f"data spec {spec!r} does not name the synthetic world")
    from curvalign.data.synthetic import build_world, config_from_spec

    with _spec_errors(spec):
        world = build_world(config_from_spec(argument))
    world.store.meta["spec"] = spec
    return world


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


def _load_clip_retrieval(argument: str) -> FeatureStore:
    from curvalign.data.clip_retrieval import clip_retrieval_from_spec

    return clip_retrieval_from_spec(argument)


register_data_source(
    "clip-retrieval",
    _load_clip_retrieval,
    ("clip-retrieval:DIR", "clip-retrieval:DIR,val=N,test=N,seed=N,check=1"),
)
