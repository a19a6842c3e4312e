"""Multi-process training with torch.distributed: global-batch negatives with local losses.

Scheme (the "local loss with gathered features" of open_clip): each rank embeds its local
batch, gathers every rank's embeddings with gradients, and scores its local rows against all
columns. The gather's backward sums the gradients that every rank sends to each slice; DistributedDataParallel then averages parameter gradients over
the ``W`` ranks. For a loss that is a mean over rows, rank r computes L_r (mean over its rows)
and the global loss is L = (1/W) sum_r L_r, so the averaged gradient is exactly dL/dtheta.
A term computed identically on every rank from gathered or averaged quantities (a centroid of
the gathered batch, a load-balance penalty of the global mean weight) reaches each rank's
slice W times through the summing backward and is divided by W by DDP's average: again exact.

Launching: ``torchrun --nproc_per_node N -m curvalign train ...`` runs ``run_training`` on every
rank (``curvalign train --nproc N ...`` starts the same through torchrun's agent). Each rank
builds the Trainer with ``DistributedGather`` and the recipe wrapped in DDP (``GlobalLossStep``:
the logged loss is the global one, identical on every rank); rank 0 alone writes the run
directory. A checkpoint records its world size and is resumed with the same one.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from curvalign.config import RunConfig
from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.base import Batch, Embedding, Gather, LossOutput, Progress
from curvalign.train.trainer import Trainer, clear_run_files, train


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
        return grad[start : start + ctx.rows]


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
            raise RuntimeError(
                "DistributedGather needs an initialised torch.distributed process group"
            )
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


def init_process_group(context: DistributedContext) -> None:
    """Initialise the default group for a torchrun launch: gloo for CPU tensors, and nccl for
    CUDA tensors where CUDA is available (then ``device=cuda`` means this rank's local GPU)."""
    if not context.enabled or dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(context.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, rank=context.rank, world_size=context.world_size)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- launching training ----------------------------------------------------------------------


def _step_seed(seed: int, rank: int, step: int) -> int:
    """A seed of its own for (run seed, rank, step): the stochastic layers (dropout, score jitter)
    draw independent numbers on each rank, and a resumed run draws what an uninterrupted one would."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 1) % (2**63 - 1)


class GlobalLossStep(nn.Module):
    """The model the distributed trainer calls: a DDP-wrapped recipe whose reported loss is global.

    ``forward`` returns a LossOutput whose *values* (total, terms, logs) are the means over ranks
    of the local values (what one process on the global batch reports), while the gradient of
    ``total`` is that of this rank's local loss (``local + (global - local).detach()``), which
    DDP then averages into the global gradient. Every rank therefore sees the same loss, so the
    trainer's non-finite check stops all ranks at the same step, before any update.

    The forward runs under a forked RNG seeded from (seed, rank, step): dropout and jitter masks
    differ across ranks (the same seed on every rank would repeat one rank's masks on the next),
    while the process-wide RNG, identical on every rank and saved by rank 0, is left untouched.
    """

    def __init__(
        self, ddp: DistributedDataParallel, seed: int, rank: int, device: torch.device
    ) -> None:
        super().__init__()
        self.ddp = ddp
        self.seed = seed
        self.rank = rank
        self.device = device

    def forward(self, batch: Batch, progress: Progress, gather: Gather) -> LossOutput:
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_step_seed(self.seed, self.rank, progress.step))
            out = self.ddp(batch, progress, gather)
        names = list(out.terms)
        log_names = list(out.logs)
        local = torch.stack(
            [
                out.total.detach().float(),
                *(out.terms[n].detach().float() for n in names),
                *(torch.tensor(float(out.logs[n]), device=out.total.device) for n in log_names),
            ]
        )
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        means = local / dist.get_world_size()
        total = out.total.float()
        total = total + (means[0] - total).detach()
        terms = {n: means[1 + i] for i, n in enumerate(names)}
        logs = {n: float(means[1 + len(names) + i]) for i, n in enumerate(log_names)}
        return LossOutput(total=total, terms=terms, logs=logs)


def build_distributed_trainer(
    config: RunConfig,
    store: FeatureStore,
    run_dir: str | Path,
    *,
    context: DistributedContext,
    **kwargs: Any,
) -> Trainer:
    """A Trainer for this rank: DistributedGather, main rank = rank 0, recipe wrapped in DDP.

    ``find_unused_parameters=True`` because curriculum recipes (AGR, DualPath) leave some
    parameters out of the loss in some phases."""
    gather = DistributedGather()
    trainer_cls = kwargs.pop("trainer_cls", Trainer)  # TowerTrainer: encoders in front (towers.py)
    trainer = trainer_cls(config, store, run_dir, gather=gather, is_main=context.is_main, **kwargs)
    if "text_pairs" in trainer.recipe.requires and config.train.pair_batch_size % gather.world_size:
        raise ConfigError(
            f"pair_batch_size {config.train.pair_batch_size} is not divisible by the "
            f"{gather.world_size} processes"
        )
    device_ids = (
        [trainer.device.index if trainer.device.index is not None else torch.cuda.current_device()]
        if trainer.device.type == "cuda"
        else None
    )
    ddp = DistributedDataParallel(
        trainer.recipe, device_ids=device_ids, find_unused_parameters=True
    )
    trainer.model = GlobalLossStep(ddp, config.train.seed, context.rank, trainer.device)
    return trainer


def run_training(
    recipe: str | None,
    data: str | None,
    out_dir: str | Path,
    *,
    notify: Callable[[str], None] | None = None,
    show_progress: bool = True,
    **kwargs: Any,
) -> Path:
    """``curvalign.train.trainer.train`` in a torchrun launch (same arguments); plain ``train``
    when this process was not launched by torchrun (WORLD_SIZE unset or 1).

    Every rank draws the same global batches and trains on its slice; only rank 0 writes the
    run directory, prints notes and shows progress. A rank that fails raises its error and
    exits; torchrun then stops the other ranks (a rank blocked in a collective does not wait
    for a peer that has gone: gloo raises once the peer's connection closes).
    """
    context = context_from_env()
    if not context.enabled:
        return train(recipe, data, out_dir, notify=notify, show_progress=show_progress, **kwargs)
    init_process_group(context)
    try:
        if (
            context.is_main
            and kwargs.get("overwrite")
            and not kwargs.get("resume")
            and Path(out_dir).is_dir()
        ):
            # rank 0 clears the old run files before any rank looks at the directory, so that
            # no two ranks delete the same files at once
            clear_run_files(Path(out_dir))
        dist.barrier()
        factory = functools.partial(build_distributed_trainer, context=context)
        return train(
            recipe,
            data,
            out_dir,
            notify=notify if context.is_main else None,
            show_progress=show_progress and context.is_main,
            trainer_factory=factory,
            **kwargs,
        )
    finally:
        shutdown()


def is_main_process() -> bool:
    """True outside a torchrun launch and on its rank 0."""
    return context_from_env().is_main


def train_arguments(
    *,
    recipe: str | None,
    data: str | None,
    steps: int | None,
    out: str | Path,
    config: str | Path | None,
    resume: bool,
    overwrite: bool,
    quiet: bool,
    overrides: Sequence[str],
    towers: str | None = None,
) -> list[str]:
    """The ``curvalign train`` arguments that reproduce these options (for the ranks to parse)."""
    args = ["--out", str(out)]
    for flag, value in (
        ("--recipe", recipe),
        ("--data", data),
        ("--steps", steps),
        ("--config", config),
        ("--towers", towers),
    ):
        if value is not None:
            args += [flag, str(value)]
    args += [
        flag
        for flag, on in (("--resume", resume), ("--overwrite", overwrite), ("--quiet", quiet))
        if on
    ]
    if overrides:
        args += ["--", *overrides]
    return args


def launch_training(nproc: int, arguments: Sequence[str]) -> int:
    """Run ``curvalign train ARGUMENTS`` in ``nproc`` processes on this machine through torchrun
    (``torch.distributed.run --standalone``, its agent in this process); returns the exit status
    (that of the first rank to fail, 0 when all succeed). torchrun stops every rank as soon as
    one fails; only rank 0's output is shown (every rank raises the same configuration errors)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    context = context_from_env()
    if context.enabled:
        raise ConfigError(
            f"--nproc cannot be used inside a torchrun launch (it already runs {context.world_size} "
            "processes)"
        )
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # torch's C++ warnings (DDP's "find_unused_parameters=True ... did not find any unused
    # parameters", needed for curriculum recipes) are addressed to library authors, not users;
    # a user who wants them sets TORCH_CPP_LOG_LEVEL=WARNING
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--local-ranks-filter=0",
            "-m",
            "curvalign",
            "train",
            *arguments,
        ]
    )
    # the ranks print their own one-line errors; the agent's report of a failed rank would repeat them
    elastic_logger = logging.getLogger("torch.distributed.elastic")
    level = elastic_logger.level
    elastic_logger.setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as err:
        # SIGTERM/SIGINT reached the agent: it passed the signal on to the ranks, which stopped
        # together at a step boundary, rank 0 wrote a checkpoint and said how to resume
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if 0 not in err.failures:  # rank 0 printed nothing: say which rank failed
            print(
                f"error: rank {rank} of {nproc} failed (exit status {failure.exitcode}); its output is not "
                "shown: launch with torchrun to see every rank's",
                file=sys.stderr,
            )
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        elastic_logger.setLevel(level)
    return 0
