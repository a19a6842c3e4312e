"""Multi-process training with torch.distributed: global-batch negatives with local losses.

Scheme (the "local loss with gathered features" of open_clip): each rank embeds its local
batch, gathers every rank's embeddings with gradients, and scores its local rows against all
columns. The gather's backward sums the gradients that every rank sends to each slice; DistributedDataParallel then averages parameter gradients over
the ``W`` ranks. For a loss that is a mean over rows, rank r computes L_r (mean over its rows)
and the global loss is L = (1/W) sum_r L_r, so the averaged gradient is exactly dL/dtheta.
A term computed identically on every rank from gathered or averaged quantities (a centroid of
the gathered batch, a load-balance penalty of the global mean weight) reaches each rank's
slice W times through the summing backward and is divided by W by DDP's average: again exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from curvalign.recipes.base import Embedding, Gather


class _AllGatherWithGrad(torch.autograd.Function):
    """[n, ...] per rank -> [W n, ...] on every rank. Backward: every rank's loss may depend on
    every slice, so the gradient of this rank's slice is the sum over ranks of their gradients
    for it (all-reduce, then keep our rows)."""

    @staticmethod
    def forward(ctx, local: Tensor) -> Tensor:
        ctx.rows = local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows]


class _AllReduceSumWithGrad(torch.autograd.Function):
    """Sum over ranks; each rank's output depends on every input, so backward sums too."""

    @staticmethod
    def forward(ctx, value: Tensor) -> Tensor:
        total = value.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


class DistributedGather(Gather):
    """Gather for an initialised default process group; each rank's local batch must have the
    same size (the trainer's sampler drops the ragged tail)."""

    def __init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedGather needs an initialised torch.distributed process group")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def __call__(self, emb: Embedding) -> Embedding:
        return {key: _AllGatherWithGrad.apply(value) for key, value in emb.items()}

    def average(self, value: Tensor) -> Tensor:
        return _AllReduceSumWithGrad.apply(value) / self.world_size


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands in a torchrun launch (world_size 1 when not launched so)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def context_from_env() -> DistributedContext:
    """Read torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return DistributedContext(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
    )


def init_process_group(context: DistributedContext, device: str = "cpu") -> None:
    """Initialise the default group for a torchrun launch: gloo on CPU, nccl on CUDA."""
    if not context.enabled or dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend, rank=context.rank, world_size=context.world_size)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
