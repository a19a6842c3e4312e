"""The trainer is given what feeds the recipe (``train.sources.FeatureSource``) and calls it at
fixed points; no trainer subclass overrides a private method of ``Trainer``."""

from __future__ import annotations

import inspect

from curvalign.config import resolve_config
from curvalign.data import load_store
from curvalign.train.sources import FeatureSource
from curvalign.train.trainer import Trainer

TINY = "synthetic:images=120,text_pairs=60,captions_max=3"
TRAIN = ["batch_size=16", "tensorboard=false", "checkpoint_every=2", "val_every=2", "log_every=1"]


class _Recording(FeatureSource):
    """The default source, recording which points the trainer called, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if callable(value) and not name.startswith("_"):
            object.__getattribute__(self, "calls").append(name)
        return value


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_no_trainer_subclass_overrides_a_private_method():
    import curvalign.train.distributed  # noqa: F401  (every trainer subclass of the library)
    import curvalign.train.towers  # noqa: F401

    private = {n for n, _ in inspect.getmembers(Trainer) if n.startswith("_")}
    private -= {n for n in private if n.startswith("__") and n.endswith("__")}
    for cls in _subclasses(Trainer):
        if not cls.__module__.startswith("curvalign."):
            continue
        assert not private & set(vars(cls)), (cls, sorted(private & set(vars(cls))))


def test_the_trainer_calls_its_feature_source_at_fixed_points_and_trains_the_same(tmp_path):
    config = resolve_config("clip", TINY, steps=4, overrides=TRAIN)
    store, _ = load_store(TINY)
    plain = Trainer(config, store, tmp_path / "plain", show_progress=False)
    plain.fit()
    source = _Recording()
    given = Trainer(config, store, tmp_path / "given", show_progress=False, features=source)
    given.fit()
    assert given.features is source and isinstance(plain.features, FeatureSource)
    calls = [c for c in source.calls if c != "attach"]
    assert source.calls[0] == "attach"
    # construction, then the step-0 check, four batches, checkpoints around their files, close
    assert calls[:3] == ["input_dims", "sampler_reads_tokens", "param_groups"]
    assert calls[3] == "ready" and calls[4] == "step0_check"
    assert calls.count("next_batch") == 4 and calls[-1] == "close"
    assert calls.count("before_checkpoint") == calls.count("after_checkpoint") == 2
    assert "keep_best" in calls and "add_state" in calls and "meta_extras" in calls
    # the default source is the store's features: the same computation, the same weights
    for name, value in plain.recipe.state_dict().items():
        assert value.equal(given.recipe.state_dict()[name]), name
