"""``curvalign train --nproc 2``: two gloo processes train like one process on the global batch.

The learning rate is constant (``warmup=0 min_lr_ratio=1``) so that a run of 3 steps resumed to
6 equals a run of 6 steps; CLIP has no dropout, so the two runs compute the same function and
differ only by float rounding (the gathered score matrix is summed in another order).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from curvalign.data.features import FeatureStore, TextPart
from curvalign.data.sampling import BatchSampler
from curvalign.recipes.base import Gather
from curvalign.runs import CheckpointError, read_log
from curvalign.train.trainer import local_rows, train

pytestmark = pytest.mark.slow  # launches torchrun; CI runs it

DATA = "synthetic:images=120,text_pairs=60,latent_dim=16,image_dim=32,text_dim=24,hidden_dim=32"
OVERRIDES = [
    "embed_dim=16",
    "batch_size=16",
    "log_every=1",
    "checkpoint_every=0",
    "warmup=0",
    "min_lr_ratio=1",
    "tensorboard=false",
    "num_threads=1",
]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "curvalign", "train", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A single-process run of 6 steps, and a 2-process run of 3 steps resumed to 6."""
    base = tmp_path_factory.mktemp("ddp")
    single = train("clip", DATA, base / "single", steps=6, overrides=OVERRIDES, show_progress=False)
    first = cli(
        "--nproc",
        "2",
        "--recipe",
        "clip",
        "--data",
        DATA,
        "--steps",
        "3",
        "--out",
        str(base / "ddp"),
        "-q",
        *OVERRIDES,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = cli("--nproc", "2", "--resume", "--steps", "6", "--out", str(base / "ddp"), "-q")
    assert second.returncode == 0, second.stderr[-3000:]
    return single, base / "ddp", second


def test_two_processes_end_with_the_weights_of_one_process(runs):
    single, ddp, _ = runs
    weights_1, weights_2 = (
        load_file(single / "model.safetensors"),
        load_file(ddp / "model.safetensors"),
    )
    assert set(weights_1) == set(weights_2)
    for name in weights_1:
        torch.testing.assert_close(weights_2[name], weights_1[name], rtol=1e-4, atol=1e-5, msg=name)
    log_1, log_2 = read_log(single), read_log(ddp)
    # the logged loss is the global one: the two logs agree step by step
    assert [r["step"] for r in log_2] == [1, 2, 3, 4, 5, 6] == [r["step"] for r in log_1]
    for a, b in zip(log_1, log_2, strict=False):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_rank_zero_alone_writes_and_reports(runs):
    single, ddp, second = runs
    # one record per step (two writers would duplicate them), the same files as one process
    assert sorted(p.name for p in ddp.iterdir()) == sorted(p.name for p in single.iterdir())
    assert second.stdout.count("trained to step 6") == 1


def test_resume_with_another_number_of_processes_is_refused(runs):
    _, ddp, _ = runs
    with pytest.raises(CheckpointError, match=r"2 process\(es\).*--nproc 2"):
        train(None, None, ddp, steps=8, resume=True, show_progress=False)


class _Rank(Gather):
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def test_the_ranks_rows_cover_every_train_image_once_per_epoch():
    """Every rank draws the same global batch and keeps its slice: over an epoch, the union of
    the ranks' rows is each train image exactly once."""
    n, batch, world = 48, 12, 3
    store = FeatureStore(
        image_features=torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 4),
        text=TextPart(torch.randn(n, 4)),
        text_to_image=torch.arange(n),
    )
    samplers = [BatchSampler(store, batch, seed=5) for _ in range(world)]
    seen = []
    for _ in range(n // batch):
        for rank, sampler in enumerate(samplers):
            part = local_rows(sampler.next_batch(), _Rank(rank, world))
            assert part.image.shape[0] == batch // world
            seen += part.image[:, 0].long().tolist()
    assert sorted(seen) == list(range(n))
