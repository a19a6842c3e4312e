"""Two gloo processes on CPU must take the same step as one process on the concatenated batch.

Every registered recipe is checked: loss (mean over ranks) and every parameter gradient (after
DDP's average) equal the single-process loss and gradients within float tolerance. Recipes run
in eval mode so that dropout and score jitter, which no split of a batch can reproduce, are off;
the gathering, the targets' offsets and the averaged batch statistics are what is tested.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _process_groups import mark_done, spawn_and_wait
from curvalign.recipes import Batch, Gather, Progress, get_recipe, recipe_names
from curvalign.recipes.base import LossOutput
from curvalign.train.distributed import DistributedGather

pytestmark = pytest.mark.slow  # spawns process groups; CI runs it

IMAGE_DIM, TEXT_DIM, GLOBAL_BATCH, WORLD = 24, 16, 8, 2
PROGRESS = Progress(step=95, total=100)  # late in training: every curriculum term is on


def make_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    b = GLOBAL_BATCH
    return Batch(
        image=torch.randn(b, IMAGE_DIM, generator=g),
        text=torch.randn(b, TEXT_DIM, generator=g),
        box_image=torch.randn(b, IMAGE_DIM, generator=g),
        box_text=torch.randn(b, TEXT_DIM, generator=g),
        pair_a=torch.randn(b, TEXT_DIM, generator=g),
        pair_b=torch.randn(b, TEXT_DIM, generator=g),
        pair_score=torch.rand(b, generator=g),
    )


def local_part(batch: Batch, rank: int, world: int) -> Batch:
    def part(t):
        if t is None:
            return None
        n = t.shape[0] // world
        return t[rank * n : (rank + 1) * n]

    return Batch(**{k: part(v) for k, v in batch.__dict__.items()})


def build(name: str, state: dict | None = None):
    cls = get_recipe(name)
    torch.manual_seed(0)
    recipe = cls(cls.Config(), IMAGE_DIM, TEXT_DIM)
    if state is not None:
        recipe.load_state_dict(state)
    recipe.on_step_start(PROGRESS)
    recipe.eval()
    return recipe


def gradients(recipe) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient; DDP gives unused parameters zeros where a single
    process leaves None, so None counts as zero."""
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in recipe.named_parameters()
        if p.requires_grad
    }


def single_process_step(name: str, state: dict) -> tuple[float, dict[str, torch.Tensor]]:
    recipe = build(name, state)
    out = recipe(make_batch(), PROGRESS, Gather())
    out.total.backward()
    return float(out.total.detach()), gradients(recipe)


def _recipes_on_rank(rank: int, names: list[str], states_path: str, out_path: str) -> None:
    states = torch.load(states_path)
    results = {}
    for name in names:
        recipe = build(name, states[name])
        model = DistributedDataParallel(recipe, find_unused_parameters=True)
        out = model(local_part(make_batch(), rank, WORLD), PROGRESS, DistributedGather())
        out.total.backward()
        loss = out.total.detach().clone()
        dist.all_reduce(loss)
        results[name] = (float(loss) / WORLD, gradients(recipe))
    if rank == 0:
        torch.save(results, out_path)


def _worker(rank: int, init_file: str, names: list[str], folder: str) -> None:
    """One process group for every test of this file (a spawn costs two interpreter starts)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    _recipes_on_rank(rank, names, f"{folder}/states.pt", f"{folder}/recipes.pt")
    _global_loss_on_rank(rank, f"{folder}/global")
    dist.barrier()
    mark_done(folder, rank)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[Path, dict]:
    """The workers run once: (their folder, the single-process states they started from)."""
    folder = tmp_path_factory.mktemp("gloo")
    states = {name: build(name).state_dict() for name in recipe_names()}
    torch.save(states, folder / "states.pt")
    init_file = tempfile.mktemp(prefix="curvalign-dist-", dir=str(folder))
    spawn_and_wait(_worker, (init_file, recipe_names(), str(folder)), WORLD, folder)
    return folder, states


def test_every_method_is_registered():
    assert set(recipe_names()) >= {
        "clip",
        "meru",
        "hycoclip",
        "atmg",
        "phyclip",
        "proclip",
        "agr",
        "dualpath",
    }


def test_two_processes_equal_one_process_on_the_global_batch(spawned):
    folder, states = spawned
    names = recipe_names()
    distributed = torch.load(folder / "recipes.pt")

    failures = []
    for name in names:
        loss_1, grads_1 = single_process_step(name, states[name])
        loss_w, grads_w = distributed[name]
        if abs(loss_1 - loss_w) > 1e-5 * max(1.0, abs(loss_1)):
            failures.append(f"{name}: loss {loss_w} with {WORLD} processes, {loss_1} with one")
        assert set(grads_1) == set(grads_w)
        for pname in grads_1:
            if not torch.allclose(grads_1[pname], grads_w[pname], rtol=1e-4, atol=1e-6):
                err = (grads_1[pname] - grads_w[pname]).abs().max().item()
                failures.append(f"{name}: gradient of {pname} differs by {err:.2e}")
    assert not failures, "\n".join(failures)


class _LocalLoss(torch.nn.Module):
    """A loss that is the mean of this rank's rows: NaN where a row is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch: Batch, progress: Progress, gather: Gather) -> LossOutput:
        value = (self.weight * batch.image).mean()
        return LossOutput(
            total=value, terms={"term": value}, logs={"rows": float(batch.image.shape[0])}
        )


def _global_loss_on_rank(rank: int, out_path: str) -> None:
    from curvalign.train.distributed import GlobalLossStep

    model = GlobalLossStep(
        DistributedDataParallel(_LocalLoss()), seed=0, rank=rank, device=torch.device("cpu")
    )
    finite = model(
        Batch(image=torch.full((2,), 1.0 + rank), text=torch.zeros(2)),
        PROGRESS,
        DistributedGather(),
    )
    finite.total.backward()
    local_nan = float("nan") if rank == 1 else 1.0
    bad = model(
        Batch(image=torch.full((2,), local_nan), text=torch.zeros(2)), PROGRESS, DistributedGather()
    )
    torch.save(
        {
            "total": float(finite.total),
            "term": float(finite.terms["term"]),
            "logs": finite.logs,
            "grad": float(model.ddp.module.weight.grad),
            "bad": float(bad.total.detach()),
        },
        f"{out_path}.{rank}",
    )


def test_every_rank_reports_the_global_loss(spawned):
    """Values are the mean over ranks (so a NaN on one rank stops all of them at the same step);
    the gradient stays that of the local loss, which DDP averages."""
    folder, _ = spawned
    for rank in range(WORLD):
        result = torch.load(folder / f"global.{rank}")
        assert result["total"] == pytest.approx(1.5) and result["term"] == pytest.approx(1.5)
        assert result["logs"] == {"rows": 2.0}
        assert result["grad"] == pytest.approx(1.5)  # mean over ranks of d(mean(w x))/dw = x
        assert result["bad"] != result["bad"], f"rank {rank} did not see the other rank's NaN"
