"""The trainer: runs any recipe on a feature store, with checkpoints, logs and exact resume.

One step::

    progress = Progress(step, total)            # step counts from 0
    recipe.on_step_start(progress)              # curriculum hook
    batch = sampler.next_batch()                # B images, one caption each (+ boxes, text pairs)
    out = model(batch, progress, gather)        # Recipe.forward -> loss, under bf16 autocast if asked
    out.total.backward(); clip; AdamW step; warm-up + cosine scheduler step

Determinism: parameters are initialised after seeding torch with ``seed``; the sampler has its
own generator seeded with ``seed``; ``torch.use_deterministic_algorithms`` is on during the run.
A checkpoint stores weights, optimizer, scheduler, sampler and the torch/numpy/python RNG states,
so a run resumed from step N ends with the same weights, bit for bit, as one never stopped (on
the same machine and thread count).

Multi-process: the sampler draws the *global* batch on every rank (same seed, same draws); rank
r trains on rows ``[r B/W, (r+1) B/W)`` and the injected ``gather`` joins the embeddings, so W
processes equal one process on the global batch. Only the main rank writes files.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from curvalign._io import (
    WRITE_FAILURES,
    Terminated,
    describe_write_failure,
    remove_stale_temp_files,
)
from curvalign.config import (
    RunConfig,
    TrainConfig,
    resolve_config,
    resolve_steps,
    resolve_val_every,
)
from curvalign.data import load_store
from curvalign.data.features import FeatureStore, FeatureStoreError
from curvalign.data.sampling import BatchSampler, SamplingError
from curvalign.data.validation_split import copies_of_train, describe_copies
from curvalign.errors import ConfigError, TrainError
from curvalign.recipes.base import Batch, Gather, LossOutput, Progress, Recipe
from curvalign.recipes.health import META_KEY as STEP0_META_KEY
from curvalign.recipes.health import Step0Health
from curvalign.runs import (
    BEST_FILE,
    CONFIG_FILE,
    META_FILE,
    RUN_FILES,
    STATE_FILE,
    TB_DIR,
    CheckpointError,
    build_recipe,
    build_started_recipe,
    is_run_dir,
    read_config,
    read_meta,
    recipe_input_dims,
    seed_everything,
)
from curvalign.schedules import warmup_cosine
from curvalign.train.checkpoint import load_train_state, save_checkpoint, versions
from curvalign.train.hooks import (
    Decision,
    TrainerHook,
    ValidationEvent,
    combine,
    validations_since_best,
    with_builtin_hooks,
)
from curvalign.train.logging import RunLogger
from curvalign.train.sources import FeatureSource
from curvalign.train.validation import ValidationSet, validation_store

if TYPE_CHECKING:
    from curvalign.towers import TowersConfig

#: TrainConfig keys that may change when resuming (they do not change what is computed)
RESUMABLE_KEYS = ("steps", "log_every", "checkpoint_every", "num_threads", "device", "tensorboard")


class NonFiniteLossError(TrainError):
    """The loss or its gradient became NaN/inf; training stopped before the bad update."""


# --- building blocks (reused by the distributed launcher) -----------------------------------


def lr_multiplier(step: int, train: TrainConfig) -> float:
    """Learning-rate factor for 0-based ``step``: linear warm-up, then cosine to ``min_lr_ratio``."""
    return float(
        warmup_cosine(step, run_steps(train), train.warmup_steps, min_ratio=train.min_lr_ratio)
    )


def run_steps(train: TrainConfig) -> int:
    """``train.steps`` of a run being trained: resolved from the store when unset
    (``config.resolve_steps``) before any step, so an int here."""
    if train.steps is None:
        raise TrainError("train.steps is unset: resolve it from the store (resolve_steps) first")
    return int(train.steps)


def build_model(
    config: RunConfig, image_dim: int, text_dim: int, device: str | torch.device = "cpu"
) -> Recipe:
    """The recipe with its initial parameters: seeded by ``config.train.seed``, so every rank and
    every resume builds the same model before loading any state."""
    seed_everything(config.train.seed)
    recipe = build_recipe(config, image_dim, text_dim)
    return recipe.to(device)


def start_of_run(config: RunConfig, store: FeatureStore) -> Recipe:
    """The recipe a new run of ``config`` on ``store`` starts from, in eval mode: the same
    validation hold-out the trainer takes, then ``runs.build_started_recipe`` (data-aware
    scales, the warm start), so it equals the run's step-0 weights. The benchmark's and the
    studies' untrained rows are this."""
    cfg = config.train
    train_store = store
    if cfg.validates:
        train_store, _ = validation_store(
            store, cfg.val_fraction, cfg.seed, f"data {config.data!r}", cfg.val_max_images
        )
    return build_started_recipe(config, train_store, recipe_input_dims(config, store)).recipe.eval()


def build_optimizer(recipe: Recipe, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: weight decay on matrices, none on ``recipe.no_decay_parameter_names()``."""
    no_decay = set(recipe.no_decay_parameter_names())
    named = [(n, p) for n, p in recipe.named_parameters() if p.requires_grad]
    unknown = no_decay - {n for n, _ in recipe.named_parameters()}
    if unknown:
        raise TrainError(
            f"recipe {recipe.name!r}: no_decay_parameter_names() names unknown parameters {sorted(unknown)}"
        )
    if not named:
        raise TrainError(f"recipe {recipe.name!r} has no trainable parameters")
    groups = [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": train.weight_decay},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]
    # foreach=False: one kernel per tensor, the same arithmetic on every run and device count
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=train.lr, betas=(0.9, 0.98), eps=1e-6, foreach=False
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, train))


def local_rows(batch: Batch, gather: Gather) -> Batch:
    """This rank's rows of a global batch (all of it in one process)."""
    if gather.world_size == 1:
        return batch

    def part(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        size = t.shape[0] // gather.world_size
        return t[gather.rank * size : (gather.rank + 1) * size]

    return Batch(**{k: part(v) for k, v in batch.__dict__.items()})  # type: ignore[arg-type]


def rng_state() -> dict[str, Any]:
    """Every RNG's state, in types ``torch.load(weights_only=True)`` reads (numpy's key array
    as a tensor: no pickled numpy object in ``state.pt``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)


class TrainingInterrupted(TrainError):
    """Training stopped on request (Ctrl-C or SIGTERM) after writing a checkpoint;
    ``signum`` is the signal that asked (the CLI exits with 128 + signum, as shells expect)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class _StopRequest:
    """Turns the first Ctrl-C or SIGTERM (what schedulers and preemption send) into a request
    honoured between steps, so the checkpoint written on the way out is exact; a second one
    interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int = signal.SIGINT
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:  # the second signal: at once, named as the signal it is
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self.requested and exc_type is None and self._previous:
            # asked to stop while the loop was ending (the last step, a hook's stop): the request
            # goes to the handler outside the loop, so that a benchmark or study that trains
            # run after run stops too instead of starting the next one
            signal.raise_signal(self.signum)


class _ThroughputWatch:
    """Warns once when training slows to a fraction of its own early pace for two log windows
    in a row (one slow window is a hiccup): the usual cause is another process competing for the
    CPU cores with torch's default thread count."""

    def __init__(self, reference_windows: int = 3, collapse_ratio: float = 0.2) -> None:
        self.reference_windows = reference_windows
        self.collapse_ratio = collapse_ratio
        self.early: list[float] = []
        self.slow_in_a_row = 0
        self.warned = False

    def observe(self, rate: float, num_threads: int) -> str | None:
        """``rate``: pairs/s of one log window; returns the warning the first time the rate has
        been below ``collapse_ratio`` times the best of the first ``reference_windows`` windows
        for two windows in a row."""
        if len(self.early) < self.reference_windows:
            self.early.append(rate)
            return None
        reference = max(self.early)
        self.slow_in_a_row = self.slow_in_a_row + 1 if rate < self.collapse_ratio * reference else 0
        if self.warned or self.slow_in_a_row < 2:
            return None
        self.warned = True
        return (
            f"throughput fell to {rate:.0f} pairs/s from {reference:.0f} in the first steps "
            f"({num_threads} torch threads); if another process is competing for the CPU cores, "
            "set num_threads=1 (or the number of idle cores) as a key=value override"
        )


# --- the trainer ----------------------------------------------------------------------------


class Trainer:
    """Trains ``config.recipe`` on ``store``, writing into ``run_dir``.

    ``resume=True`` continues from ``run_dir``'s checkpoint (which must exist). ``gather`` and
    ``is_main`` are for multi-process training (see the module docstring); ``notify`` receives
    one-line notes for the user (images left out, resumed step). ``hooks``: trainer events
    (``curvalign.train.hooks``); the built-in ``KeepBestWeights`` and ``EarlyStopping`` are
    added unless ``hooks`` holds an instance of the same class. ``write=False``: nothing is
    written (no folder, checkpoint or log; ``run_dir`` only names the run in notes): a run
    kept in memory (``train.fitting.fit`` without ``out``, a tuning trial). ``features``:
    what feeds the recipe (``train.sources.FeatureSource``, the default: the store's own
    features; ``train.towers.TowerFeatures``: encoders trained in front of it).
    """

    def __init__(
        self,
        config: RunConfig,
        store: FeatureStore,
        run_dir: str | Path,
        *,
        resume: bool = False,
        gather: Gather | None = None,
        is_main: bool = True,
        show_progress: bool = True,
        notify: Callable[[str], None] | None = None,
        hooks: Iterable[TrainerHook] = (),
        write: bool = True,
        features: FeatureSource | None = None,
    ) -> None:
        self.hooks = with_builtin_hooks(hooks)
        self.config = config
        self.train_config = config.train
        self.store = store
        self.run_dir = Path(run_dir)
        self.gather = gather or Gather()
        self.is_main = is_main
        #: whether this process writes the run's files (the main rank of a written run)
        self.writes = is_main and write
        self.show_progress = show_progress
        self.notify = notify or (lambda message: None)
        self.notes: list[str] = []
        self.features = features if features is not None else FeatureSource()
        self.features.attach(self)
        for message in store.meta.get("notes") or ():  # what the store's reader found: not errors
            self._note(str(message))
        cfg = self.train_config
        if cfg.batch_size % self.gather.world_size:
            raise ConfigError(
                f"batch_size {cfg.batch_size} is not divisible by the {self.gather.world_size} processes"
            )
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        try:
            self.device = torch.device(cfg.device)
            if self.device.type == "cuda" and not torch.cuda.is_initialized():
                # deterministic cuBLAS needs a fixed workspace, set before CUDA starts
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as err:
            raise ConfigError(
                f"device {cfg.device!r} is not usable here ({str(err).splitlines()[0]})"
            ) from None

        try:
            # the text width is the token width Dk when the recipe pools text tokens
            self.input_dims = self.features.input_dims(config, store)
        except FeatureStoreError as err:
            raise TrainError(f"recipe {config.recipe!r} on data {config.data!r}: {err}") from None
        train_store = self._set_up_validation(store)
        self.warm_start_info: dict[str, Any] | None = None
        #: the step-0 health check's report (``recipes.health``): measured at step 0, read
        #: back from ``meta.json`` on resume
        self.step0_health: Step0Health | None = None
        try:
            if resume:  # the saved state replaces every parameter
                self.recipe = build_model(self.config, *self.input_dims, self.device)
            else:  # scales resolved from the train rows, the warm start: saved with the run
                started = build_started_recipe(
                    self.config, train_store, self.input_dims, self.device
                )
                self.recipe, self.config = started.recipe, started.config
                self.train_config = self.config.train
                self.warm_start_info = started.warm_start
                if started.note:
                    self._note(started.note)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise ConfigError(
                f"recipe {config.recipe!r} cannot be built with this config: {err}"
            ) from None
        self.model: nn.Module = self.recipe  # the distributed launcher may wrap it (DDP)
        self.config = resolve_steps(self.config, train_store)  # unset steps: the store's default
        self.train_config = self.config.train
        config, cfg = self.config, self.train_config
        self.val_history: list[tuple[int, float]] = []
        self.best_step: int | None = None
        self.best_val: float | None = None
        self._best_state: dict[str, Tensor] | None = None
        self.stopped_early = False
        try:
            self.sampler = BatchSampler(
                train_store,
                cfg.batch_size,
                seed=cfg.seed,
                requires=self.recipe.requires,
                pair_batch_size=cfg.pair_batch_size,
                recipe=repr(config.recipe),
                data=config.data,
                text_tokens=self.features.sampler_reads_tokens(self.recipe),
                shuffle=cfg.shuffle,
            )
        except SamplingError as err:
            raise TrainError(str(err)) from None
        summary = self.sampler.summary()
        if summary["skipped_without_caption"]:
            self._note(
                f"{summary['skipped_without_caption']} train images have no caption and are not trained on"
            )
        if summary["skipped_without_box"]:
            self._note(
                f"{summary['skipped_without_box']} train images have no box and are not trained on "
                f"(recipe {config.recipe!r} needs a box for every image in a batch)"
            )
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.step = 0
        self.checkpoint_step: int | None = None
        if resume:
            self.features.load_state(self._load_state)
        self.features.ready(resume)

    def _set_up_validation(self, store: FeatureStore) -> FeatureStore:
        """The store the run trains on: ``store`` with its validation split held out (the
        store's "val" split, or a seeded hold-out that the sampler then skips), the split's
        ``ValidationSet``, and an unset ``val_every`` resolved by the epoch rule on it (saved in
        config.json)."""
        self.validation: ValidationSet | None = None
        self.validation_info: dict[str, Any] | None = None
        cfg = self.train_config
        if self.is_main:  # val or test rows copied from train: their scores measure memory
            data = f"data {self.config.data!r}"
            leak = describe_copies(copies_of_train(store, data), data)
            if leak:
                self._note(f"warning: {leak}")
        if not cfg.validates:
            return store
        train_store, self.validation_info = validation_store(
            store, cfg.val_fraction, cfg.seed, f"data {self.config.data!r}", cfg.val_max_images
        )
        if cfg.val_every is None:
            self.config = resolve_val_every(self.config, train_store)
            self.train_config = self.config.train
        if self.validation_info["source"] == "none":
            self._note(f"no validation: {self.validation_info['reason']}")
        else:
            self.validation = ValidationSet(
                train_store, max_images=cfg.val_max_images, seed=cfg.seed
            )
        if self.validation_info.get("identical_to_test"):
            self._note(
                f"{self.validation_info['identical_to_test']} validation image(s) have "
                "features identical to a test image (duplicates in the data)"
            )
        return train_store

    # --- the optimizer: the recipe's groups and the feature source's ----------------------
    def _build_optimizer(self) -> torch.optim.Optimizer:
        optimizer = build_optimizer(self.recipe, self.train_config)
        for group in self.features.param_groups(self.train_config):
            optimizer.add_param_group(group)
        return optimizer

    def rebuild_optimizer(self) -> None:
        """A fresh optimizer and schedule over the parameters that train now (a feature source
        froze or sharded some of its own)."""
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, self.train_config)

    def _note(self, message: str) -> None:
        self.notes.append(message)
        self.notify(message)

    def notify_user(self, message: str) -> None:
        """A one-line note for the user, also kept in the run's meta.json (``notes``)."""
        self._note(message)

    def keep_best(self, step: int, score: float) -> None:
        """Record the current weights as the best (at ``step``, validation ``score``): the next
        checkpoint writes them as ``best.safetensors``."""
        self.best_val, self.best_step = score, step
        self._best_state = {
            k: v.detach().to("cpu").clone() for k, v in self.recipe.state_dict().items()
        }
        self.features.keep_best()

    def best_weights(self) -> dict[str, Tensor] | None:
        """The state dict kept at the best validation so far (``keep_best``), or None."""
        return self._best_state

    def use_store(self, store: FeatureStore) -> None:
        """Train on ``store`` from the next step on (a control arm that changes its data mid-run):
        the sampler is rebuilt on it and continues its draws exactly where it was, as a resume on
        that store would. ``store`` must have the same images and splits."""
        self.features.use_store(lambda: self._swap_store(store))

    def _swap_store(self, store: FeatureStore) -> None:
        train_store = store
        if self.validation_info is not None and self.validation_info.get("source") != "none":
            train_store, _ = validation_store(
                store,
                self.train_config.val_fraction,
                self.train_config.seed,
                data=f"data {self.config.data!r}",
            )
        if train_store.num_images != self.sampler.store.num_images:
            raise TrainError(
                f"the replacement store has {train_store.num_images} images, the run trains on "
                f"{self.sampler.store.num_images}: a store swapped mid-run must keep the images"
            )
        state = self.sampler.state_dict()
        try:
            sampler = BatchSampler(
                train_store,
                self.train_config.batch_size,
                seed=self.train_config.seed,
                requires=self.recipe.requires,
                pair_batch_size=self.train_config.pair_batch_size,
                recipe=repr(self.config.recipe),
                data=self.config.data,
                text_tokens=self.features.sampler_reads_tokens(self.recipe),
                shuffle=self.train_config.shuffle,
            )
            sampler.load_state_dict(state)
        except SamplingError as err:
            raise TrainError(str(err)) from None
        self.sampler, self.store = sampler, store

    def extend(self, steps: int) -> None:
        """Lengthen the run by ``steps``: ``train.steps`` grows and the learning-rate schedule is
        stretched over the new total from the current step on, exactly as resuming the run with
        more ``steps`` does."""
        train = dataclasses.replace(
            self.train_config, steps=run_steps(self.train_config) + int(steps)
        )
        self.config = dataclasses.replace(self.config, train=train)
        self.train_config = train
        self.scheduler.lr_lambdas = [
            (lambda step: lr_multiplier(step, train)) for _ in self.scheduler.lr_lambdas
        ]
        for group, base_lr in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, strict=False
        ):
            group["lr"] = base_lr * lr_multiplier(self.step, train)
        if self.writes:
            self.config.save(self.run_dir)

    # --- state ------------------------------------------------------------------------------
    def _load_state(self) -> None:
        notes: list[str] = []
        state = load_train_state(self.run_dir, notes=notes)
        for note in notes:
            self._note(note)
        dims = (state.get("image_dim"), state.get("text_dim"))
        if dims != self.input_dims:
            raise CheckpointError(
                f"feature dimensions differ from the checkpoint in {self.run_dir}: the data has image/text "
                f"dims {self.input_dims[0]}/{self.input_dims[1]}, the run was trained on {dims[0]}/{dims[1]}"
            )
        if state.get("recipe") != self.config.recipe:
            raise CheckpointError(
                f"the checkpoint in {self.run_dir} is of recipe {state.get('recipe')!r}, "
                f"not {self.config.recipe!r}"
            )
        saved_world = int(state.get("world_size", 1))
        if (
            saved_world != self.gather.world_size
        ):  # per-rank dropout streams differ: not the same run
            raise CheckpointError(
                f"the run in {self.run_dir} was trained with {saved_world} process(es); resume "
                f"it with the same number (--nproc {saved_world}), not {self.gather.world_size}"
            )
        try:
            self.recipe.load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.sampler.load_state_dict(state["sampler"])
        except SamplingError as err:
            raise CheckpointError(f"cannot resume {self.run_dir}: {err}") from None
        except (RuntimeError, ValueError, KeyError) as err:
            raise CheckpointError(
                f"cannot resume {self.run_dir}: its state does not fit this recipe "
                f"({str(err).splitlines()[0]})"
            ) from None
        # the lambda reads train.steps, which may have been extended: recompute the current lr
        for group, base_lr in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, strict=False
        ):
            group["lr"] = base_lr * lr_multiplier(int(state["step"]), self.train_config)
        set_rng_state(state["rng"])
        validation = state.get("validation") or {}
        self.val_history = [(int(a), float(b)) for a, b in validation.get("history", [])]
        self.best_step = validation.get("best_step")
        self.best_val = validation.get("best_val")
        self.stopped_early = bool(validation.get("stopped_early", False))
        self._best_state = state.get("best_model")
        self.step = self.checkpoint_step = int(state["step"])
        self._note(f"resuming {self.run_dir} at step {self.step}")
        try:
            saved_meta = read_meta(self.run_dir)
            checkpoint_complete = saved_meta["step"] == self.step
            self.warm_start_info = saved_meta.get("warm_start")
            saved_step0 = saved_meta.get(STEP0_META_KEY)
            if isinstance(saved_step0, dict):
                self.step0_health = Step0Health.from_json(saved_step0)
        except CheckpointError:
            checkpoint_complete = False
        if not checkpoint_complete:  # state.pt was written, the rest of its checkpoint was not
            rng = rng_state()
            self.save_checkpoint()
            set_rng_state(rng)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "step": self.step,
            "recipe": self.config.recipe,
            "image_dim": self.input_dims[0],
            "text_dim": self.input_dims[1],
            "world_size": self.gather.world_size,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "validation": {
                "history": [list(item) for item in self.val_history],
                "best_step": self.best_step,
                "best_val": self.best_val,
                "since_best": validations_since_best(self.val_history),
                "stopped_early": self.stopped_early,
            },
        }
        self.features.add_state(state)
        return state

    def save_checkpoint(self) -> None:
        """Write the checkpoint for the current step (main rank only; nothing unless
        ``writes``), the feature source's files first."""
        self.features.before_checkpoint()
        self._save_checkpoint()
        self.features.after_checkpoint()

    def _save_checkpoint(self) -> None:
        if self.writes:
            meta = {
                "step": self.step,
                "recipe": self.config.recipe,
                "image_dim": self.input_dims[0],
                "text_dim": self.input_dims[1],
                # "tokens": text_dim is the token width Dk, eval/index feed tokens + masks
                "text_input": "tokens" if self.recipe.text_tokens else "features",
                "data": self.config.data,
                # the local encoder behind the features: `curvalign search` encodes queries with it
                "encoder": self.store.meta.get("encoder"),
                "epoch": self.sampler.epoch,
                "sampler": self.sampler.summary(),
                "notes": self.notes,
                "versions": versions(),
                "validation": self.validation_info,
                "val_history": [list(item) for item in self.val_history],
                "best_step": self.best_step,
                "best_val": self.best_val,
                "stopped_early": self.stopped_early,
                STEP0_META_KEY: None if self.step0_health is None else self.step0_health.to_json(),
                "warm_start": self.warm_start_info,
                **self.features.meta_extras(),
            }
            try:
                save_checkpoint(
                    self.run_dir,
                    model_state=self.recipe.state_dict(),
                    train_state=self.state_dict(),
                    meta=meta,
                    best_state=self._best_state,
                )
            except OSError as err:
                if err.errno not in WRITE_FAILURES:
                    raise
                kept = (
                    "no checkpoint had been written before it, so no training state is kept"
                    if self.checkpoint_step is None
                    else self._kept_message()
                )
                raise TrainError(
                    f"the checkpoint of step {self.step} could not be written: "
                    f"{describe_write_failure(err, self.run_dir)}; {kept}"
                ) from None
        self.checkpoint_step = self.step

    # --- the loop ---------------------------------------------------------------------------
    def train_step(self, progress: Progress) -> tuple[LossOutput, Tensor]:
        """One optimizer step; returns the loss output (detached) and the gradient norm.
        Raises NonFiniteLossError before updating anything if the loss or gradient is not finite."""
        cfg = self.train_config
        self.recipe.train()
        self.recipe.on_step_start(progress)
        autocast = (
            torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
            if cfg.bf16
            else nullcontext()
        )
        try:
            with autocast:  # towers in front of the recipe encode under the same autocast
                batch = self.features.next_batch()
        except SamplingError as err:
            raise TrainError(f"step {progress.step + 1}: {err}; " + self._kept_message()) from None
        with autocast:
            out = self.model(batch, progress, self.gather)
        if not bool(torch.isfinite(out.total.detach())):
            raise NonFiniteLossError(self._nonfinite_message(out, progress.step + 1))
        self.optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        grad_norm = self._clip_gradients()
        if not bool(torch.isfinite(grad_norm)):
            bad = [
                n
                for n, p in self.recipe.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
            raise NonFiniteLossError(
                f"the gradient became non-finite at step {progress.step + 1} (loss {float(out.total.detach()):.4g} was "
                f"finite) in parameter(s) {', '.join(bad[:5]) or '?'}; stopped before the update; "
                + self._kept_message()
            )
        self.optimizer.step()
        self.scheduler.step()
        return out, grad_norm.detach()

    def _clip_gradients(self) -> Tensor:
        """Clip the global gradient norm of the optimized parameters to ``train.grad_clip``
        (0: no clipping); returns the norm before clipping. (Towers sharded with FSDP2 clip
        themselves: their gradients are DTensors, the recipe's plain tensors.)"""
        own = self.features.clip_gradients()
        if own is not None:
            return own
        cfg = self.train_config
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(
            params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        )

    def validate(self) -> float:
        """Score the current weights (the trainer's validation split, mean R@1 in [0, 1], or a
        hook's ``score``), record it and tell the hooks (the built-in ones keep the best weights).
        Returns the value."""
        return self._validate()[0]

    def _has_validation(self) -> bool:
        """Whether anything scores the weights: the validation split or a hook's ``score``."""
        return self.validation is not None or any(
            type(hook).score is not TrainerHook.score for hook in self.hooks
        )

    def _validate(self) -> tuple[float, Decision, int]:
        """The validation, then ``on_validation`` of every hook: (value, decision, extend by)."""
        with self._in_hook():
            value = None
            for hook in self.hooks:
                value = hook.score(self)
                if value is not None:
                    break
            if value is None:
                if self.validation is None:
                    raise TrainError(
                        "no validation: the run has no validation split and no hook scores it"
                    )
                value = self.validation.score(self.recipe)
            value = float(value)
            self.val_history.append((self.step, value))
            event = ValidationEvent(self.step, value, tuple(self.val_history))
            decision, steps = combine(hook.on_validation(self, event) for hook in self.hooks)
        return value, decision, steps

    @contextmanager
    def _in_hook(self) -> Iterator[None]:
        """Hooks see the recipe in eval mode without gradients and cannot move the random
        states: training after a hook is the training without it, bit for bit."""
        rng = rng_state()
        was_training = self.recipe.training
        self.recipe.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.recipe.train(was_training)
            set_rng_state(rng)

    def _kept_message(self) -> str:
        if self.checkpoint_step is None:
            return (
                "no checkpoint had been written yet (lower checkpoint_every to keep earlier states)"
            )
        return f"the last good checkpoint (step {self.checkpoint_step}) is kept in {self.run_dir}"

    def _nonfinite_message(self, out: LossOutput, step: int) -> str:
        values = {name: float(value.detach().float()) for name, value in out.terms.items()}
        bad = [f"{name} = {value}" for name, value in values.items() if not math.isfinite(value)]
        what = (
            ("term " + ", ".join(bad))
            if bad
            else f"the total ({float(out.total.detach().float())}; every term was finite)"
        )
        return (
            f"the loss became non-finite at step {step}: {what}; training stopped; "
            + self._kept_message()
        )

    def fit(self, stop_at: int | None = None) -> TrainedRun:
        """Train until ``train.steps`` (or until ``stop_at`` steps, leaving a checkpoint there, as a
        killed run would have), writing checkpoints and logs and emitting the hooks' events
        (``curvalign.train.hooks``). Returns the run directory (with ``best_step``, ``best_val``
        and ``val_history``)."""
        try:
            return self._fit(stop_at)
        finally:
            self.features.close()  # e.g. the raw-row loader's worker processes

    def _fit(self, stop_at: int | None) -> TrainedRun:
        cfg = self.train_config
        total = run_steps(cfg)
        end = total if stop_at is None else min(total, stop_at)
        if not self._open_run(end):
            return self.result()
        logger = (
            RunLogger(self.run_dir, resume_step=self.step, tensorboard=cfg.tensorboard)
            if self.writes
            else None
        )
        schedule = _HookSchedule.of(self.hooks)
        validates = self._has_validation()
        for hook in self.hooks:
            hook.on_fit_start(self)
        if self.step == 0 and self.is_main:  # loss vs log B, logit spread, radii (step-0 check)
            self.step0_health = self.features.step0_check(total)
        # the history lives in meta.json (val_history), not the log
        if validates and cfg.validates and self.step == 0 and not self.val_history:
            self._validate()  # the untrained head: the baseline model selection must beat
        window = _Window()
        throughput = _ThroughputWatch()
        try:
            with deterministic_algorithms(), _StopRequest() as stop, self._progress_bar(end) as bar:
                while self.step < end:
                    if self._stop_agreed(stop.requested):
                        self._checkpoint_and_interrupt(stop.signum)
                    lr = self.optimizer.param_groups[0]["lr"]
                    started = time.perf_counter()
                    out, grad_norm = self.train_step(Progress(self.step, total))
                    self.step += 1
                    window.add(out, grad_norm, time.perf_counter() - started)
                    is_last = self.step == end
                    record: dict[str, Any] = {}
                    if self.step % cfg.log_every == 0 or is_last:
                        record = self._log_window(window, lr, out, logger, bar, throughput)
                        window = _Window()
                    if schedule.step_hooks:
                        self._emit_step_end(schedule.step_hooks, record, out, lr)
                    decision, more = Decision.CONTINUE, 0
                    if validates and self._validation_due(schedule.validation_steps):
                        _, decision, more = self._validate()
                    self._emit_marks(schedule.marks.get(self.step, ()))
                    if decision is Decision.STOP:
                        self.stopped_early = True
                        self.save_checkpoint()
                        break
                    if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or is_last:
                        self.save_checkpoint()
                    if decision is Decision.EXTEND:
                        self.extend(more)
                        cfg, total = self.train_config, run_steps(self.train_config)
                        end = total if stop_at is None else min(total, stop_at)
                        bar.extend(end)
        finally:
            if logger is not None:
                logger.close()
        self._warn_if_best_is_untrained()
        run = self.result()
        with self._in_hook():
            for hook in self.hooks:
                hook.on_fit_end(self, run)
        return run

    def _open_run(self, end: int) -> bool:
        """Create the run folder (main process) and say whether there is training to do before
        ``end``; a run a hook stopped early, or already at ``end``, is left as it is."""
        if self.writes:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # temporaries of a writer killed mid-checkpoint (kill -9) would otherwise stay forever
            remove_stale_temp_files(self.run_dir, RUN_FILES)
            self.config.save(self.run_dir)
        total = run_steps(self.train_config)
        if self.stopped_early:
            self._note(
                f"{self.run_dir} stopped early at step {self.step} (a trainer hook stopped it; "
                f"the built-in early stopping has patience {self.train_config.patience}); "
                "nothing to do"
            )
            return False
        if self.step >= end:
            if self.step >= total:
                self._note(
                    f"{self.run_dir} is already trained to step {self.step} of {total}; nothing to do"
                )
            return False
        return True

    def _checkpoint_and_interrupt(self, signum: int) -> None:
        """Save a checkpoint at the current step and raise ``TrainingInterrupted`` (SIGINT or
        SIGTERM agreed by every process), saying how to resume."""
        self.save_checkpoint()
        name = signal.Signals(signum).name
        raise TrainingInterrupted(
            f"interrupted ({name}): stopped at step {self.step} of {self.train_config.steps} "
            f"with a checkpoint in {self.run_dir}; continue with: curvalign train "
            f"--out {self.run_dir} --resume",
            int(signum),
        )

    def _log_window(
        self,
        window: _Window,
        lr: float,
        out: LossOutput,
        logger: RunLogger | None,
        bar: _Bar,
        throughput: _ThroughputWatch,
    ) -> dict[str, Any]:
        """The log record of the steps in ``window`` (means, lr, throughput, epoch, then the
        recipe's own values): written to the log and the bar; a throughput warning noted."""
        record: dict[str, Any] = {
            "step": self.step,
            **window.means(),
            "lr": lr,
            "pairs_per_s": window.rate(self.train_config.batch_size),
            "epoch": self.sampler.epoch,
        }
        extras = {**self.recipe.log_values(), **out.logs}
        for key, value in extras.items():  # the trainer's own keys win
            record.setdefault(key, float(value))
        if logger is not None:
            logger.log(record)
        bar.update(self.step, record)
        warning = throughput.observe(record["pairs_per_s"], torch.get_num_threads())
        if warning and self.is_main:
            self._note(warning)
        return record

    def _emit_step_end(
        self, hooks: list[TrainerHook], record: dict[str, Any], out: LossOutput, lr: float
    ) -> None:
        """``on_step_end`` of ``hooks`` with this step's loss beside a log step's window means."""
        step_record = {
            **{k: float(v) for k, v in record.items() if k != "loss"},
            "step": self.step,
            "loss": float(out.total.detach()),
            "lr": lr,
        }
        with self._in_hook():
            for hook in hooks:
                hook.on_step_end(self, self.step, step_record)

    def _emit_marks(self, hooks: Iterable[TrainerHook]) -> None:
        """``on_mark`` of the hooks marked at the current step."""
        for hook in hooks:
            with self._in_hook():
                hook.on_mark(self, self.step)

    def _validation_due(self, extra_steps: set[int]) -> bool:
        """Whether the current step validates: every ``val_every`` steps, at the last step of
        ``train.steps``, and at the steps a hook asked for."""
        every = self.train_config.val_every or 0
        return (
            (every > 0 and self.step % every == 0)
            or self.step == self.train_config.steps
            or self.step in extra_steps
        )

    def _warn_if_best_is_untrained(self) -> None:
        """A note when no validation after step 0 beat the untrained head: best.safetensors then
        holds untrained weights, most often because the validation split is too small to rank."""
        if self.best_step != 0 or self.step == 0 or self.validation is None:
            return
        images = self.validation.num_images
        texts = int(self.validation.text_ids.shape[0])
        if self.warm_start_info is not None:  # step 0 is the data's linear alignment, not noise
            ceiling = self.best_val is not None and self.best_val >= 1.0
            why = (
                "it already ranks every validation caption first"
                if ceiling
                else "training did not improve on it"
            )
            self._note(
                f"note: the best validation step is 0: {BEST_FILE} of {self.run_dir} holds the "
                f"start, the data's linear alignment ({why}; the validation split has {images} "
                f"images and {texts} captions)"
            )
            return
        self._note(
            f"warning: the best validation step is 0 (the untrained head): {BEST_FILE} of "
            f"{self.run_dir} holds untrained weights; the validation split has {images} images "
            f"and {texts} captions, too few for recall@1 to tell the steps apart (raise "
            "val_fraction or use --weights last)"
        )

    def result(self) -> TrainedRun:
        """The run directory, carrying the validation outcome."""
        run = TrainedRun(self.run_dir)
        run.best_step, run.best_val = self.best_step, self.best_val
        run.val_history = list(self.val_history)
        run.last_step, run.stopped_early = self.step, self.stopped_early
        return run

    def _stop_agreed(self, requested: bool) -> bool:
        """Whether to stop now: this process was asked to or, with several processes, any was
        (all ranks must leave the loop at the same step or the next collective would hang)."""
        if self.gather.world_size == 1:
            return requested
        flag = torch.tensor([1.0 if requested else 0.0], device=self.device)
        return bool(self.gather.average(flag).item() > 0)

    def _progress_bar(self, end: int) -> _Bar:
        return _Bar(self.config.recipe, self.step, end, enabled=self.show_progress and self.is_main)


class TrainedRun(type(Path())):  # type: ignore[misc]  # a concrete Path (PosixPath/WindowsPath) with the outcome
    """What ``train`` returns: the run directory, plus ``best_step`` / ``best_val`` (None without
    validation), ``val_history`` [(step, mean R@1)], ``last_step`` and ``stopped_early``."""

    best_step: int | None = None
    best_val: float | None = None
    val_history: list[tuple[int, float]] = []  # noqa: RUF012 (replaced per instance)
    last_step: int = 0
    stopped_early: bool = False


@dataclasses.dataclass(frozen=True)
class _HookSchedule:
    """When ``Trainer.fit`` calls which hooks: ``marks`` {step: hooks marked there}, the extra
    ``validation_steps`` the hooks ask for, and the hooks that override ``on_step_end`` (the
    others are not called every step)."""

    marks: dict[int, list[TrainerHook]]
    validation_steps: set[int]
    step_hooks: list[TrainerHook]

    @classmethod
    def of(cls, hooks: Iterable[TrainerHook]) -> _HookSchedule:
        hooks = list(hooks)
        marks: dict[int, list[TrainerHook]] = {}
        validation_steps: set[int] = set()
        for hook in hooks:
            for mark in hook.marks():
                marks.setdefault(int(mark), []).append(hook)
            validation_steps.update(int(s) for s in hook.validation_steps())
        step_hooks = [h for h in hooks if type(h).on_step_end is not TrainerHook.on_step_end]
        return cls(marks, validation_steps, step_hooks)


class _Window:
    """Loss, terms and gradient norm summed over the steps since the last log record. A term
    may be absent on some steps (a curriculum phase): each key is averaged over its own steps."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.steps = 0
        self.seconds = 0.0

    def add(self, out: LossOutput, grad_norm: Tensor, seconds: float) -> None:
        """One step's output and the seconds it took (checkpoint and log writes excluded, so
        that throughput measures training alone)."""
        self.steps += 1
        self.seconds += seconds
        values = {
            "loss": out.total,
            **{f"loss/{k}": v for k, v in out.terms.items()},
            "grad_norm": grad_norm,
        }
        for name, value in values.items():
            value = value.detach().float()
            self.sums[name] = self.sums[name] + value if name in self.sums else value
            self.counts[name] = self.counts.get(name, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: float(v) / self.counts[k] for k, v in self.sums.items()}

    def rate(self, pairs_per_step: int) -> float:
        """Image-text pairs per second over the window's steps."""
        return pairs_per_step * self.steps / max(self.seconds, 1e-9)


class _Bar:
    """A rich progress bar with the last logged loss and throughput (nothing when disabled)."""

    def __init__(self, recipe: str, start: int, end: int, enabled: bool) -> None:
        self.enabled = enabled
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            console = Console(stderr=True)
            self.enabled = console.is_terminal
            if self.enabled:
                self.progress = Progress(
                    TextColumn(f"train {recipe}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                    console=console,
                    transient=False,
                )
                self.task = self.progress.add_task("train", total=end, completed=start, info="")

    def __enter__(self) -> _Bar:
        if self.progress is not None:
            self.progress.start()
        return self

    def extend(self, end: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, total=end)

    def update(self, step: int, record: Mapping[str, Any]) -> None:
        if self.progress is not None:
            info = f"loss {record['loss']:.4f}  {record['pairs_per_s']:.0f} pairs/s"
            self.progress.update(self.task, completed=step, info=info)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


# --- the entry point ------------------------------------------------------------------------


def clear_run_files(run_dir: Path) -> None:
    """Remove the files a run writes (``RUN_FILES``) and its TensorBoard folder from
    ``run_dir``, leaving anything else there (a lock, a user's own files): the start of a fresh
    run in a directory that held one (``--overwrite``), on one process or on rank 0."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    if (run_dir / TB_DIR).is_dir():
        shutil.rmtree(run_dir / TB_DIR)


#: the lock file ``train`` holds in a run directory while it runs (``_run_lock``)
LOCK_FILE = ".curvalign-train.lock"


class RunLockedError(TrainError):
    """The run directory is in use by another ``train`` process (its lock is held)."""


def _holds_files(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds anything besides a lock file."""
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


def _has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / STATE_FILE).exists() or (run_dir / META_FILE).exists()


def _remove_unfinished(run_dir: Path, keep_dir: bool) -> None:
    """Remove what a run that never wrote a checkpoint left in ``run_dir`` (the directory too,
    unless it existed before)."""
    if not keep_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    clear_run_files(run_dir)


def _is_main_rank() -> bool:
    """True outside a multi-process launch and on its rank 0 (the rank that writes the run):
    a torchrun launch says so in its environment, processes that joined a process group
    themselves (``torch.multiprocessing.spawn``) through ``torch.distributed``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0


@contextmanager
def _run_lock(run_dir: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``run_dir`` while the block runs (the main rank only; yields
    whether this process holds it): ``fcntl.flock`` on ``run_dir/LOCK_FILE``, which holds the
    owner's pid. A second ``train`` into the same directory gets ``RunLockedError`` at once. The
    kernel releases the lock when its process dies (kill -9 included), so a lock file left by a
    dead process is simply taken over; the file is removed on the way out."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no lock
        yield False
        return
    if not _is_main_rank():
        yield False
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunLockedError(
                f"{run_dir} is in use by another curvalign train (pid {holder}); wait for it "
                "to finish, or train into another --out"
            ) from None
        except OSError:  # a file system without flock: train unlocked, as before
            os.close(fd)
            yield False
            return
        try:  # the holder before us may have removed the file we opened: lock the live one
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield True
    finally:
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.unlink()
        except FileNotFoundError:
            pass
        os.close(fd)


def _describe_existing(run_dir: Path) -> str:
    try:
        config = read_config(run_dir)
        what = f"a run of recipe {config.recipe!r}"
    except TrainError:
        what = "a run"
    try:
        what += f" at step {read_meta(run_dir)['step']}"
    except TrainError:
        pass
    return what


def _refuse_restart_over_progress(run_dir: Path) -> None:
    """Raise ``CheckpointError`` when ``meta.json`` records trained steps but ``state.pt`` (what
    resume reads) is gone: starting again from step 0 would overwrite the trained weights."""
    try:
        meta = read_meta(run_dir)
    except CheckpointError:
        return  # no meta.json: the first checkpoint was never completed
    recorded = int(meta.get("step") or 0)
    if recorded > 0:
        raise CheckpointError(
            f"cannot resume {run_dir}: {META_FILE} records step {recorded} but "
            f"{run_dir / STATE_FILE} is missing; nothing was overwritten (restore {STATE_FILE}, "
            "or train into a new directory, or pass --overwrite to start again from step 0)"
        )


def _resume_config(
    run_dir: Path,
    recipe: str | None,
    data_spec: str | None,
    steps: int | None,
    overrides: Iterable[str] | Mapping[str, Any],
    config_file: str | Path | None,
) -> RunConfig:
    saved = read_config(run_dir)
    if config_file is not None:
        raise ConfigError(
            "--config cannot be combined with --resume: the run's own config.json is used "
            "(pass key=value overrides for steps, log_every, checkpoint_every, device)"
        )
    if recipe is not None and recipe != saved.recipe:
        raise ConfigError(f"{run_dir} holds a run of recipe {saved.recipe!r}, not {recipe!r}")
    config = resolve_config(
        saved.recipe, data_spec or saved.data, steps=steps, overrides=overrides, base=saved
    )
    old, new = dataclasses.asdict(saved.train), dataclasses.asdict(config.train)
    changed = [k for k in new if new[k] != old[k] and k not in RESUMABLE_KEYS]
    changed += [
        f"recipe.{k}"
        for k in config.recipe_config
        if config.recipe_config[k] != saved.recipe_config.get(k)
    ]
    if changed:
        raise ConfigError(
            f"cannot change {', '.join(changed)} when resuming {run_dir} (that would not continue "
            f"the same run); only {', '.join(RESUMABLE_KEYS)} may change"
        )
    return config


def train(
    recipe: str | None,
    data: str | FeatureStore | None,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    config_file: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
    notify: Callable[[str], None] | None = None,
    stop_at: int | None = None,
    trainer_factory: Callable[..., Trainer] = Trainer,
    hooks: Iterable[TrainerHook] = (),
    towers: TowersConfig | str | None = None,
) -> TrainedRun:
    """Train ``recipe`` on ``data`` (a spec such as ``"synthetic"``, ``"features:PATH"``, or a
    FeatureStore) into ``out_dir``; returns the run directory. The one entry point for a run
    (``curvalign.train.train``; ``train.fitting.fit`` is the typed one that returns the model).

    ``overrides``: ``"key=value"`` strings (or a mapping) on top of ``config_file``. ``resume``
    continues the run in ``out_dir`` (recipe and data default to the saved ones; ``steps`` may
    extend it); without it a directory that already holds files is refused unless ``overwrite``.
    ``stop_at`` ends the call early at that step with a checkpoint, as if the process were killed
    there. ``hooks``: trainer events (``curvalign.train.hooks``), passed to the Trainer.
    ``towers``: encoders trained in front of the recipe (a ``TowersConfig`` or its
    ``"SPEC;key=value"`` string, ``curvalign.train.towers``); a resumed tower run reads its own
    ``towers.json``. Errors are ``TrainError`` with one clear message.
    """
    run_dir = Path(out_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output {run_dir} exists and is not a directory")
    trainer_factory = _with_towers(trainer_factory, towers, run_dir, resume, overwrite)
    existed = run_dir.is_dir()
    fresh = not existed or not _holds_files(run_dir)
    with _run_lock(run_dir) as held:
        try:
            return _train_locked(
                recipe,
                data,
                run_dir,
                steps=steps,
                overrides=overrides,
                config_file=config_file,
                resume=resume,
                overwrite=overwrite,
                show_progress=show_progress,
                notify=notify,
                stop_at=stop_at,
                trainer_factory=trainer_factory,
                hooks=hooks,
            )
        except BaseException:
            # a run that failed (or was stopped) before its first checkpoint leaves no folder
            # that a second `train` would refuse as "already holds a run"
            if held and fresh and not _has_checkpoint(run_dir):
                _remove_unfinished(run_dir, keep_dir=existed)
            raise


def trainer_factory_for(
    factory: Callable[..., Trainer], towers: TowersConfig | str | None
) -> Callable[..., Trainer]:
    """``factory`` itself for a run on the store's features (``towers`` None); with ``towers``
    (a ``TowersConfig`` or its ``"SPEC;key=value"`` string) the factory of a trainer with
    towers in front of the recipe (``train.towers``)."""
    if towers is None:
        return factory
    return _tower_factory(factory, towers)


def _tower_factory(
    factory: Callable[..., Trainer], towers: TowersConfig | str | None
) -> Callable[..., Trainer]:
    """The factory of a tower trainer (``towers`` None: a resumed run reads its own)."""
    from curvalign.train.towers import tower_trainer_factory

    return tower_trainer_factory(towers, None if factory is Trainer else factory)


def _with_towers(
    factory: Callable[..., Trainer],
    towers: TowersConfig | str | None,
    run_dir: Path,
    resume: bool,
    overwrite: bool,
) -> Callable[..., Trainer]:
    """``trainer_factory_for`` for a tower run (``towers`` given, or a resumed run that holds
    ``towers.json``), the tower files of an overwritten run removed first; else ``factory``."""
    from curvalign.train import towers as tower_training

    resuming_towers = resume and (run_dir / tower_training.TOWERS_CONFIG_FILE).exists()
    if towers is None and not resuming_towers:
        return factory
    if overwrite and not resume:
        for name in tower_training.TOWER_FILES:  # clear_run_files clears the trainer's own
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / tower_training.TOWERS_DCP_DIR, ignore_errors=True)
    return _tower_factory(factory, towers)


def _train_locked(
    recipe: str | None,
    data: str | FeatureStore | None,
    run_dir: Path,
    *,
    steps: int | None,
    overrides: Iterable[str] | Mapping[str, Any],
    config_file: str | Path | None,
    resume: bool,
    overwrite: bool,
    show_progress: bool,
    notify: Callable[[str], None] | None,
    stop_at: int | None,
    trainer_factory: Callable[..., Trainer],
    hooks: Iterable[TrainerHook],
) -> TrainedRun:
    """``train`` while this process holds the run directory's lock."""
    notify = notify or (lambda message: None)
    non_empty = _holds_files(run_dir)
    has_run = is_run_dir(run_dir)
    data_spec = data if isinstance(data, str) else None

    resuming = False
    if resume and has_run and (run_dir / CONFIG_FILE).exists():
        config = _resume_config(run_dir, recipe, data_spec, steps, overrides, config_file)
        resuming = (run_dir / STATE_FILE).exists()
        if not resuming:
            _refuse_restart_over_progress(run_dir)
            notify(f"{run_dir} has a config but no checkpoint yet: starting it from step 0")
    else:
        if resume and non_empty:
            raise ConfigError(
                f"cannot resume {run_dir}: it holds files but no curvalign run (no {CONFIG_FILE})"
            )
        if resume:
            notify(f"{run_dir} holds no run yet: starting a new one")
        if non_empty and not resume:
            if not overwrite:
                if has_run:
                    raise ConfigError(
                        f"{run_dir} already holds {_describe_existing(run_dir)}; pass --resume to "
                        "continue it or --overwrite to replace it"
                    )
                raise ConfigError(
                    f"output directory {run_dir} is not empty; choose a new directory or pass --overwrite"
                )
            clear_run_files(run_dir)
        config = resolve_config(
            recipe,
            data_spec or ("<in-memory FeatureStore>" if data is not None else None),
            steps=steps,
            overrides=overrides,
            config_file=config_file,
        )
    if data is None:
        if config.data.startswith("<in-memory"):
            raise ConfigError(
                f"{run_dir} was trained on an in-memory FeatureStore: pass that store as data to resume"
            )
        data = config.data
    store, spec = load_store(data)
    if isinstance(data, FeatureStore) and not resuming:
        config = dataclasses.replace(config, data=spec)
    # trainer_factory: the distributed launcher builds a DDP-wrapped Trainer with the same arguments
    trainer = trainer_factory(
        config,
        store,
        run_dir,
        resume=resuming,
        show_progress=show_progress,
        notify=notify,
        hooks=hooks,
    )
    return trainer.fit(stop_at=stop_at)
