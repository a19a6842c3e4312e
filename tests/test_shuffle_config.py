"""The sampler's shuffle as a run setting (``train.shuffle``): CLI and YAML, validation, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from curvalign.config import SHUFFLES, TrainConfig, resolve_config
from curvalign.data import sampling
from curvalign.data.sampling import BatchSampler, SamplingError
from curvalign.errors import ConfigError

pytest.importorskip("pyarrow")
from test_clip_retrieval import write_layout  # noqa: E402


def test_the_config_offers_the_samplers_shuffles():
    assert SHUFFLES == sampling.SHUFFLES
    assert TrainConfig().shuffle == "auto"


def test_shuffle_is_set_by_override_and_yaml_and_checked(tmp_path: Path):
    assert resolve_config("clip", "synthetic", overrides=["shuffle=rows"]).train.shuffle == "rows"
    assert (
        resolve_config("clip", "synthetic", overrides=["train.shuffle=chunks"]).train.shuffle
        == "chunks"
    )
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text("train: {shuffle: rows}\n")
    flat.write_text("shuffle: chunks\n")
    assert resolve_config("clip", "synthetic", config_file=nested).train.shuffle == "rows"
    assert resolve_config("clip", "synthetic", config_file=flat).train.shuffle == "chunks"
    with pytest.raises(ConfigError, match=r"shuffle.*'pages'.*\['auto', 'rows', 'chunks'\]"):
        resolve_config("clip", "synthetic", overrides=["shuffle=pages"])
    with pytest.raises(ConfigError, match=r"shuffle must be one of \['auto', 'rows', 'chunks'\]"):
        TrainConfig(shuffle="pages")  # type: ignore[arg-type]


def _train(spec: str, run: Path, *extra: str, resume: bool = False) -> dict:
    from curvalign.train import train

    overrides = ["embed_dim=8", "batch_size=16", "val_every=0", "tensorboard=false", *extra]
    train("clip", spec, run, steps=2, overrides=overrides, resume=resume, show_progress=False)
    return json.loads((run / "meta.json").read_text())


def test_a_run_draws_with_the_configured_shuffle_and_keeps_it_on_resume(tmp_path: Path):
    write_layout(tmp_path / "cr", shard_rows=(150, 150, 40), dtype=np.float32)
    spec = f"clip-retrieval:{tmp_path / 'cr'},val=20,test=20"
    from curvalign.data import load_data

    assert BatchSampler(load_data(spec), 16).shuffle == "chunks"  # "auto" on memory maps
    rows = _train(spec, tmp_path / "rows", "shuffle=rows")
    assert "shuffle" not in rows["sampler"]  # the uniform row shuffle records nothing
    assert json.loads((tmp_path / "rows" / "config.json").read_text())["train"]["shuffle"] == "rows"
    # the saved config holds the shuffle, so a resume cannot switch it
    with pytest.raises(ConfigError, match="cannot change shuffle"):
        _train(spec, tmp_path / "rows", "steps=3", "shuffle=chunks", resume=True)


def test_an_explicit_shuffle_the_state_was_not_drawn_with_is_refused():
    from _train_toy import toy_store

    store = toy_store(num_images=90, captions=2)
    rows = BatchSampler(store, 16, seed=4, shuffle="rows")
    rows.next_indices()
    chunks = BatchSampler(store, 16, seed=4, shuffle="chunks", chunk_rows=8, window_chunks=3)
    with pytest.raises(SamplingError, match="saved with shuffle 'rows', not the 'chunks'"):
        chunks.load_state_dict(rows.state_dict())
    # "auto" takes the state's shuffle and continues its draws
    chunks.next_indices()
    auto = BatchSampler(store, 16, seed=0, shuffle="auto")
    auto.load_state_dict(chunks.state_dict())
    assert auto.shuffle == "chunks"
    assert torch.equal(auto.next_indices()["image"], chunks.next_indices()["image"])
