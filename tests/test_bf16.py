"""bf16 autocast training stays finite for every registered recipe.

Each recipe trains through the Trainer under bfloat16 autocast on a tiny synthetic world with
tiny dimensions; every logged loss (one record per step) and every final parameter must be
finite. The CI run is short (STEPS); ``benchmarks/bf16_soak.py`` runs the same check for
2,000 steps (see docs/scale.md for its last result).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from curvalign.data import load_data
from curvalign.recipes import get_recipe, recipe_names
from curvalign.runs import read_log
from curvalign.train.trainer import train

# every recipe trains STEPS bf16 steps: slow; CI runs the slow tests too
pytestmark = pytest.mark.slow

STEPS = 50  # the soak (benchmarks/bf16_soak.py) is what runs long
WORLD = "synthetic:images=400,text_pairs=200,latent_dim=16,image_dim=32,text_dim=24,hidden_dim=32"
TINY = {
    "embed_dim": 16,
    "num_factors": 4,
    "factor_dim": 8,
    "hyperbolic_dim": 16,
    "euclidean_dim": 16,
    "sphere_dim": 16,
    "hidden_dim": 32,
    "model_dim": 32,
    "lora_rank": 4,
}


@pytest.fixture(scope="module")
def store():
    return load_data(WORLD)


@pytest.mark.parametrize("name", recipe_names())
def test_bf16_training_stays_finite(name, store, tmp_path):
    fields = {f.name for f in dataclasses.fields(get_recipe(name).Config)}
    overrides = {
        "bf16": True,
        "batch_size": 32,
        "pair_batch_size": 32,
        "log_every": 1,
        "checkpoint_every": 0,
        "tensorboard": False,
        "num_threads": 1,
        **{k: v for k, v in TINY.items() if k in fields},
    }
    # a non-finite loss or gradient would raise NonFiniteLossError naming the step and term
    run_dir = train(
        name, store, tmp_path / name, steps=STEPS, overrides=overrides, show_progress=False
    )
    losses = [record["loss"] for record in read_log(run_dir)]
    assert len(losses) == STEPS
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    weights = load_file(run_dir / "model.safetensors")
    bad = [
        k for k, w in weights.items() if w.is_floating_point() and not bool(torch.isfinite(w).all())
    ]
    assert not bad, f"non-finite parameters after bf16 training: {bad}"
    assert losses[-1] != losses[0]  # it trained
