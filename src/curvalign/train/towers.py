"""Training ``towers + recipe``: the trainer's loop, hooks, checkpoints and resume, with the
features of every step computed by towers (``curvalign.towers``) from the store's raw items.
The towers are a component the trainer is given, ``TowerFeatures`` (a
``train.sources.FeatureSource``), which the trainer calls at its fixed points;
``TowerTrainer`` only builds it (``Trainer(features=TowerFeatures(...))``).

What changes against the feature-store trainer, and nothing else:

- the heads take the towers' widths (``Towers.image_width`` / ``text_width``);
- each step, the sampler's index stream (the same draws as a feature-store run) picks the rows;
  the towers encode this rank's images and captions, with gradients;
- the optimizer has the recipe's two groups (``train.lr``; decay / no decay) and two tower
  groups (``towers.lr``, default ``train.lr``; decay on matrices, none on vectors and scalars);
  the warm-up + cosine multiplier applies to all of them;
- validation re-encodes its split with the current towers (eval mode, no gradients) each
  ``val_every`` steps; the best weights kept include the towers' trained tensors;
- a checkpoint adds ``towers.json`` (the ``TowersConfig``), ``towers.safetensors`` and
  ``towers-best.safetensors`` (the trained tensors only: LoRA adapters, a fully trained side's
  weights, nothing for a locked side) and carries them in ``state.pt`` (plain tensors, readable
  with ``weights_only=True``); resume rebuilds the towers from their encoder spec, loads the
  trained tensors, and continues bit for bit.

Before the first step, one forward and backward pass through the towers and the recipe on the
first batch finds tower parameters that are trainable but get no gradient (the recipe or the
encoding never uses them, like open_clip's ``logit_scale``): they are frozen, with a note.
Under DDP such a parameter makes the ranks disagree silently; here every world size trains the
same parameter set. Under torchrun each rank encodes its own rows of the global batch and
``average_tower_gradients`` averages the tower gradients as DDP averages the recipe's.

With ``strategy=fsdp`` (``TowersConfig``) under torchrun the towers are sharded with FSDP2
instead (``shard_towers``): ``fully_shard`` on every transformer block of a trained side, then on
the towers as a whole (the rest: embeddings, norms, projections, a locked side), with
the towers' encoding methods (``encode_images``, ``encode_texts``, the raw-row loader's
``encode_prepared_images`` / ``encode_prepared_texts``, ``encode_text_tokens``) registered as
forward methods; FSDP2's reduce-scatter averages the tower gradients. The towers are built
on the CPU and each rank moves only its shard to the device. A checkpoint then writes the
tower parameters and their optimizer state as a distributed checkpoint
(``torch.distributed.checkpoint``, one directory per step under ``towers-dcp/``, each rank
its shard) that resume loads back into the shards; ``state.pt`` keeps everything else, and
``towers.safetensors`` / ``towers-best.safetensors`` hold the gathered full tensors as before,
so export and ``load_towers`` do not change.

The store must have been extracted by the towers' encoder (``meta["encoder"]``): its features
give the data-aware head initialisation and the step-0 health check; a mismatch is noted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from curvalign._io import atomic_write
from curvalign.config import RunConfig, TrainConfig, recipe_class
from curvalign.data.batch import Batch
from curvalign.data.features import FeatureStore
from curvalign.data.sampling import SamplingError
from curvalign.errors import TrainError
from curvalign.readout import embed_features
from curvalign.recipes.base import Progress, Recipe, cat_embeddings
from curvalign.recipes.health import Step0Health, step0_health, warning_line
from curvalign.runs import CheckpointError, reads_text_tokens
from curvalign.towers import (
    StoreItems,
    TowerError,
    Towers,
    TowersConfig,
    build_towers,
    check_recipe_parts,
    describe,
)
from curvalign.towers.loader import Augment, RawBatchLoader, StoreRows, encode_prepared
from curvalign.towers.stream import WebDatasetRows
from curvalign.train.checkpoint import load_train_state, model_tensors
from curvalign.train.sources import FeatureSource
from curvalign.train.trainer import (
    TrainedRun,
    Trainer,
    rng_state,
    run_steps,
    seed_everything,
    set_rng_state,
)
from curvalign.train.validation import ValidationSet

TOWERS_CONFIG_FILE = "towers.json"
TOWERS_FILE = "towers.safetensors"
TOWERS_BEST_FILE = "towers-best.safetensors"
TOWER_FILES = (TOWERS_CONFIG_FILE, TOWERS_FILE, TOWERS_BEST_FILE)
#: the distributed checkpoints of an FSDP2 run: one ``step-NNNNNNNN`` directory per checkpoint
TOWERS_DCP_DIR = "towers-dcp"


class TowerValidationSet(ValidationSet):
    """The validation split of a store, re-encoded by the current towers at every ``score``."""

    def __init__(self, store: FeatureStore, towers: Towers, items: StoreItems, **kw: Any) -> None:
        super().__init__(store, **kw)
        # the rows the parent scores (its subsample included), as raw items
        self.towers = towers
        self.image_items = items.images(self.image_ids)
        self.text_items = items.texts(self.text_ids)

    def encode(self) -> tuple[Tensor, Tensor]:
        """(images [Ni, Di], texts [Nt, Dt]) of the split, encoded by the towers in eval mode."""
        was_training = self.towers.training
        self.towers.eval()
        try:
            with torch.no_grad():
                size = self.batch_size
                images = [
                    self.towers.encode_images(self.image_items[i : i + size]).cpu()
                    for i in range(0, len(self.image_items), size)
                ]
                texts = [
                    self.towers.encode_texts(self.text_items[i : i + size]).cpu()
                    for i in range(0, len(self.text_items), size)
                ]
        finally:
            self.towers.train(was_training)
        return torch.cat(images), torch.cat(texts)

    def encode_text_tokens(self) -> list[tuple[Tensor, Tensor]]:
        """The split's texts as the text tower's token states, batch by batch (eval mode):
        [(tokens [b, L, Dk], mask [b, L])], each batch padded to its own longest text."""
        was_training = self.towers.training
        self.towers.eval()
        try:
            with torch.no_grad():
                size = self.batch_size
                out = []
                for i in range(0, len(self.text_items), size):
                    tokens, mask = self.towers.encode_text_tokens(self.text_items[i : i + size])
                    out.append((tokens.cpu(), mask.cpu()))
        finally:
            self.towers.train(was_training)
        return out

    def embeddings(self, recipe: Recipe) -> tuple[Any, Any]:
        """The split re-encoded by the current towers, then embedded by ``recipe`` (texts as
        token states + masks when the recipe pools text tokens)."""
        if not recipe.text_tokens:
            images, texts = self.encode()
            return (
                embed_features(recipe, images, "image", self.batch_size),
                embed_features(recipe, texts, "text", self.batch_size),
            )
        was_training = self.towers.training
        self.towers.eval()
        try:
            with torch.no_grad():
                images = torch.cat(
                    [
                        self.towers.encode_images(self.image_items[i : i + self.batch_size]).cpu()
                        for i in range(0, len(self.image_items), self.batch_size)
                    ]
                )
        finally:
            self.towers.train(was_training)
        parts = [
            embed_features(recipe, tokens, "text", self.batch_size, mask=mask)
            for tokens, mask in self.encode_text_tokens()
        ]
        return embed_features(recipe, images, "image", self.batch_size), cat_embeddings(parts)


class TowerFeatures(FeatureSource):
    """Towers in front of the recipe, the component a ``Trainer`` is given
    (``Trainer(features=TowerFeatures(...))``; see the module docstring): batches encoded from
    raw rows, the tower parameter groups, validation re-encoded by the current towers, the
    tower tensors beside each checkpoint, and averaging or FSDP2 sharding over several
    processes. Built before the trainer: ``config`` is the run's config as the trainer must
    receive it (random towers: the heads start at the paper's projections)."""

    def __init__(
        self,
        config: RunConfig,
        store: FeatureStore,
        run_dir: str | Path,
        *,
        towers: TowersConfig | None = None,
        resume: bool = False,
        gather: Any = None,
    ) -> None:
        run_dir = Path(run_dir)
        saved = run_dir / TOWERS_CONFIG_FILE
        if resume and saved.exists():
            towers_config = TowersConfig.load(saved)
            if towers is not None and towers != towers_config:
                raise TrainError(
                    f"{run_dir} trains towers {towers_config.to_dict()}; resume it without "
                    "different tower settings"
                )
        elif towers is None:
            raise TrainError(f"{run_dir}: no tower settings given and no {TOWERS_CONFIG_FILE}")
        else:
            towers_config = towers
        self.towers_config = towers_config
        recipe_cls = recipe_class(config.recipe)
        try:
            check_recipe_parts(
                sorted(recipe_cls.requires),
                repr(config.recipe),
                streamed=towers_config.shards is not None,
            )
            self.items = StoreItems(store, data=f"data {config.data!r}")
            seed_everything(config.train.seed)  # LoRA's A matrices are random
            # FSDP2 moves each rank's shard to the device: the whole towers never go there
            device = "cpu" if towers_config.strategy == "fsdp" else config.train.device
            self.towers = build_towers(towers_config, device)
        except TowerError as err:
            raise TrainError(str(err)) from None
        self.loader: RawBatchLoader | None = None  # built in ready(), after the sampler
        self._best_towers: dict[str, Tensor] | None = None
        self._stream_state: dict[str, Any] | None = None  # a resumed stream position
        #: FSDP2 only in a launch of several processes (one process holds the towers whole)
        self.sharded = towers_config.strategy == "fsdp" and getattr(gather, "world_size", 1) > 1
        self._fsdp_checkpoint: str | None = None  # the run's latest distributed checkpoint
        self._fsdp_digests: dict[str, str] | None = None  # SHA-256 of its files (rank 0)
        self._loading = False
        if towers_config.strategy == "fsdp" and not self.sharded:
            self.towers.to(config.train.device)
        self._scratch_note: str | None = None
        if towers_config.init == "random" and config.recipe_config.get("head_init") in (
            "input",
            "align",
        ):
            # the input-preserving start keeps a shared pretrained space's ranking: random
            # towers have none to keep, so the heads start at the paper's random projections
            config = dataclasses.replace(
                config, recipe_config={**config.recipe_config, "head_init": "paper"}
            )
            self._scratch_note = (
                "towers from scratch (init=random): head_init=paper (head_init=input and align assume "
                "a shared pretrained space)"
            )
        self.config = config

    def ready(self, resume: bool) -> None:
        """The raw-row loader, the notes, validation re-encoded by the towers, the unused
        parameters frozen (a new run), then FSDP2 or gradient averaging over the processes."""
        trainer = self.trainer
        if self._scratch_note is not None:
            trainer.notify_user(self._scratch_note)
        self.loader = self._raw_loader()
        for note in self.towers.notes:
            trainer.notify_user(note)
        store = trainer.store
        if store.meta.get("encoder") not in (None, self.towers.spec):
            trainer.notify_user(
                f"the store was extracted with {store.meta.get('encoder')!r}, the towers are "
                f"{self.towers.spec!r}: the head initialisation and the step-0 check read the "
                "store's features"
            )
        if trainer.validation is not None:
            trainer.validation = TowerValidationSet(
                trainer.sampler.store,  # the sampler's store: its hold-out is marked
                self.towers,
                self.items,
                text_tokens=trainer.recipe.text_tokens,
            )
        if not resume:
            self._freeze_unused()
        if self.sharded:
            if not resume:  # resume shards in load_state, before the optimizer state loads
                self._shard()
        elif trainer.gather.world_size > 1:  # DDP averages the recipe's gradients, this the towers'
            average_tower_gradients(self.towers, trainer.gather.world_size)

    def best_tower_state(self) -> dict[str, Tensor] | None:
        """The towers' trained tensors kept at the best validation (``keep_best``), or None."""
        return self._best_towers

    # --- the trainer's points (train.sources.FeatureSource) ---------------------------------
    def input_dims(self, config: RunConfig, store: FeatureStore) -> tuple[int, int]:
        if not reads_text_tokens(config):
            return (self.towers.image_width, self.towers.text_width)
        width = self.towers.text_token_width
        if width is None:
            raise TrainError(
                f"recipe {config.recipe!r} pools text tokens; towers "
                f"{self.towers_config.encoder!r} give no token states (use a "
                "sentence-transformers, HF CLIP or paired text tower, or configure the recipe "
                "for pooled features)"
            )
        return (self.towers.image_width, int(width))

    def sampler_reads_tokens(self, recipe: Recipe) -> bool:
        # the towers give the token states: the sampler draws indices, never stored tokens
        return False

    def param_groups(self, train: TrainConfig) -> list[dict[str, Any]]:
        """Two tower groups after the recipe's: ``towers.lr`` (default ``train.lr``), decay on
        matrices, none on vectors and scalars."""
        tcfg = self.towers_config
        named = self.towers.trainable_named_parameters()
        lr = train.lr if tcfg.lr is None else float(tcfg.lr)
        decay = train.weight_decay if tcfg.weight_decay is None else float(tcfg.weight_decay)
        groups: list[dict[str, Any]] = []
        for params, weight_decay in (
            ([p for _, p in named if p.ndim >= 2], decay),
            ([p for _, p in named if p.ndim < 2], 0.0),
        ):
            if params:
                groups.append({"params": params, "lr": lr, "weight_decay": weight_decay})
        return groups

    def next_batch(self) -> Batch:
        assert self.loader is not None  # built in ready()
        try:
            if not (self.towers_config.dropout and self.towers.training):
                return self.loader.next_batch(self.trainer.step)
            # dropout=true: this rank's masks from (seed, rank, step), never the process-wide
            # stream every rank shares (that would repeat one rank's masks on the others)
            devices = [self.trainer.device] if self.trainer.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(
                    dropout_seed(
                        self.trainer.train_config.seed, self.trainer.gather.rank, self.trainer.step
                    )
                )
                return self.loader.next_batch(self.trainer.step)
        except TowerError as err:  # an unreadable row: the trainer names the step and checkpoint
            raise SamplingError(str(err)) from None

    def step0_check(self, total: int) -> Step0Health:
        if not self.trainer.recipe.text_tokens:  # the store's features fit the heads
            return super().step0_check(total)
        assert self.loader is not None
        # the store holds pooled texts: a recipe that pools tokens is checked on the towers'
        # first batch (eval mode, no gradients; random states, sampler and loader restored)
        rng, sampler = rng_state(), self.trainer.sampler.state_dict()
        was_training = self.towers.training
        try:
            self.towers.eval()
            with torch.no_grad():
                batch = self.next_batch().to(self.trainer.device)
        finally:
            self.towers.train(was_training)
            self.trainer.sampler.load_state_dict(sampler)
            set_rng_state(rng)
            self.loader.reset(self.trainer.step)
        report = step0_health(self.trainer.recipe, batch, total)
        for warning in report.warnings:
            self.trainer.notify_user(warning_line(warning))
        return report

    # --- raw rows (curvalign.towers.loader) --------------------------------------------------
    def _raw_loader(self) -> RawBatchLoader:
        """This rank's raw rows of each step: the sampler's index stream over the store's
        manifest, or the stream of ``towers.shards``; decoded, augmented and tokenised by
        ``towers.workers`` DataLoader workers."""
        cfg, tcfg = self.trainer.train_config, self.towers_config
        rank, world = self.trainer.gather.rank, self.trainer.gather.world_size
        try:
            if tcfg.shards is not None:
                source: Any = WebDatasetRows(
                    tcfg.shards, cfg.batch_size, seed=cfg.seed, rank=rank, world_size=world
                )
                if self._stream_state is not None:
                    source.load_state_dict(self._stream_state)
            else:
                data = f"data {self.trainer.config.data!r}"
                source = StoreRows(self.trainer.sampler, rank, world, data=data)
        except TowerError as err:
            raise TrainError(str(err)) from None
        augment = (
            Augment(_pair(tcfg.crop_scale), _pair(tcfg.crop_ratio), tcfg.flip)
            if tcfg.augment
            else None
        )
        if augment is not None and getattr(source, "images_are_texts", False):
            self.trainer.notify_user(
                "towers: augment has no effect: the images are texts (a text-only encoder)"
            )
        loader = RawBatchLoader(
            self.towers,
            source,
            workers=tcfg.workers,
            augment=augment,
            seed=cfg.seed,
            text_tokens=self.trainer.recipe.text_tokens,
        )
        loader.reset(self.trainer.step)
        return loader

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()  # the worker processes end with the fit

    def use_store(self, swap: Callable[[], None]) -> None:
        # the sampler back to the last step trained (the loader drew ahead), then a new loader
        if self.loader is not None:
            self.loader.close()
        swap()
        self.loader = self._raw_loader()

    # --- unused parameters ------------------------------------------------------------------
    def _freeze_unused(self) -> None:
        """One forward/backward on the first batch (random states and sampler restored): tower
        parameters that train but get no gradient are frozen, with a note."""
        if not self.towers.trainable_named_parameters():
            return
        assert self.loader is not None
        rng, sampler = rng_state(), self.trainer.sampler.state_dict()
        try:
            self.trainer.recipe.train()
            self.towers.train()
            # on the device: FSDP2 towers are still whole on the CPU here (sharded after this)
            prepared = self.loader.next_prepared(self.trainer.step)
            batch = encode_prepared(self.towers, prepared).to(self.trainer.device)
            out = self.trainer.recipe(
                batch, Progress(0, run_steps(self.trainer.train_config)), self.trainer.gather
            )
            out.total.backward()
            unused = [n for n, p in self.towers.trainable_named_parameters() if p.grad is None]
            random_by = None if self.towers_config.dropout else self._randomness(prepared)
        finally:
            for p in [*self.trainer.recipe.parameters(), *self.towers.parameters()]:
                p.grad = None
            self.trainer.sampler.load_state_dict(sampler)
            set_rng_state(rng)
            self.loader.reset(self.trainer.step)
        if random_by is not None and random_by > 1e-3:
            self.trainer.notify_user(
                f"towers: dropout=false, yet two train-mode encodings of the first batch differ "
                f"by up to {random_by:.1%} of their largest value: a module of this encoder draws random numbers that "
                "switch_off_dropout does not reach, so several processes will not equal one"
            )
        if unused:
            self.towers.freeze(unused, "that no encoding or loss uses (no gradient reaches them)")
            self.trainer.notify_user(self.towers.notes[-1])
            self.trainer.rebuild_optimizer()

    def _randomness(self, prepared: dict[str, Any]) -> float:
        """The largest difference between two train-mode encodings of ``prepared`` under two
        seeds, relative to the largest value (0: the towers are a deterministic function of
        their weights, as ``dropout=false`` makes them; a non-deterministic GPU kernel gives
        rounding noise far below the 1e-3 that a note needs)."""
        encodings = []
        with torch.no_grad():
            for seed in (1, 2):
                torch.manual_seed(seed)
                encodings.append(encode_prepared(self.towers, prepared))
        worst = 0.0
        for name, first in encodings[0].__dict__.items():
            second = getattr(encodings[1], name)
            if isinstance(first, Tensor) and first.is_floating_point() and first.numel():
                scale = max(float(first.float().abs().max()), 1e-12)
                worst = max(worst, float((first.float() - second.float()).abs().max()) / scale)
        return worst

    # --- state ------------------------------------------------------------------------------
    def keep_best(self) -> None:
        self._best_towers = self._tower_state()  # every rank: FSDP2 gathers the shards

    def _tower_state(self) -> dict[str, Tensor]:
        """The towers' trained tensors, whole, on the CPU (sharded: a collective, every rank)."""
        if not self.sharded:
            return self.towers.trainable_state()
        reshard(self.towers)
        return {n: _whole(p).cpu().clone() for n, p in self.towers.trainable_named_parameters()}

    def add_state(self, state: dict[str, Any]) -> None:
        # the rows of the last step trained (the loader's workers draw ahead of it); no loader
        # yet while a resume rewrites its checkpoint: the loaded state is that position
        loader = self.loader
        if loader is None:
            if self._stream_state is not None:
                state["stream"] = self._stream_state
        elif isinstance(loader.source, WebDatasetRows):
            state["stream"] = loader.state_dict()
        else:
            state["sampler"] = loader.state_dict()
        state["best_towers"] = self._best_towers
        if not self.sharded:
            state["towers"] = self.towers.trainable_state()
            return
        # the shards and their optimizer state are in the distributed checkpoint
        state["towers"] = {}
        state["fsdp"] = {
            "trainable": [n for n, _ in self.towers.trainable_named_parameters()],
            "checkpoint": self._fsdp_checkpoint,
            # the SHA-256 of its files: resume checks them before torch reads a byte
            "sha256": self._fsdp_digests,
        }
        tower_slots = {index for index, _, _ in self._tower_optimizer_slots()}
        optimizer = state["optimizer"]
        optimizer["state"] = {k: v for k, v in optimizer["state"].items() if k not in tower_slots}

    def load_state(self, load: Callable[[], None]) -> None:
        state = load_train_state(self.trainer.run_dir)
        if "towers" not in state:
            raise CheckpointError(f"the checkpoint in {self.trainer.run_dir} holds no tower state")
        if self.sharded != ("fsdp" in state):
            raise CheckpointError(
                f"the run in {self.trainer.run_dir} was trained with {state.get('world_size', 1)} "
                f"process(es) and tower strategy {self.towers_config.strategy}; resume it with "
                f"the same number (--nproc {state.get('world_size', 1)}), not {self.trainer.gather.world_size}"
            )
        trained = state["fsdp"]["trainable"] if self.sharded else state["towers"]
        frozen = [n for n, _ in self.towers.trainable_named_parameters() if n not in trained]
        if frozen:  # what the run froze before its first step (no gradient reached them)
            self.towers.freeze(frozen, "as the run did (no gradient reaches them)")
            self.trainer.notify_user(self.towers.notes[-1])
            self.trainer.rebuild_optimizer()
        self._best_towers = state.get("best_towers")
        self._stream_state = state.get("stream")
        if self.sharded:
            self._resume_sharded(state["fsdp"]["checkpoint"], state["fsdp"].get("sha256"), load)
            return
        try:
            self.towers.load_trainable_state(state["towers"])
        except TowerError as err:
            raise CheckpointError(f"cannot resume {self.trainer.run_dir}: {err}") from None
        load()

    # --- FSDP2 ------------------------------------------------------------------------------
    def _shard(self) -> None:
        """Shard the towers (``shard_towers``) and rebuild the optimizer on the sharded
        parameters (FSDP2 replaces every parameter by a DTensor one)."""
        blocks = shard_towers(self.towers, self.trainer.device)
        self.trainer.notify_user(
            f"towers: FSDP2 over {self.trainer.gather.world_size} processes, {len(blocks)} "
            "transformer block(s) sharded one by one"
        )
        self.trainer.rebuild_optimizer()

    def _tower_optimizer_slots(self) -> Iterator[tuple[int, str, nn.Parameter]]:
        """(index in ``optimizer.state_dict()``, name, parameter) of every tower parameter."""
        reshard(self.towers)
        names = {id(p): n for n, p in self.towers.trainable_named_parameters()}
        index = 0
        for group in self.trainer.optimizer.param_groups:
            for param in group["params"]:
                if id(param) in names:
                    yield index, names[id(param)], param
                index += 1

    def _sharded_state(self) -> dict[str, dict[str, Tensor]]:
        """What the distributed checkpoint holds: the tower parameters (DTensors: each rank
        writes its shard) and their optimizer state (``NAME/KEY``)."""
        optimizer = {}
        for _, name, param in self._tower_optimizer_slots():
            for key, value in self.trainer.optimizer.state.get(param, {}).items():
                optimizer[f"{name}/{key}"] = value
        towers = {n: p.detach() for _, n, p in self._tower_optimizer_slots()}
        return {"towers": towers, "optimizer": optimizer}

    def _resume_sharded(
        self, checkpoint: str | None, digests: dict[str, str] | None, load: Callable[[], None]
    ) -> None:
        """Check the files of the distributed checkpoint ``checkpoint`` (a directory of the run)
        against the SHA-256 recorded in ``state.pt`` (``digests``) and ``meta.json``, shard,
        load its shards, then the rest of ``state.pt``, then the towers' optimizer state. The
        metadata is read by ``read_sharded_metadata`` (no pickle of the file's choosing)."""
        import torch.distributed.checkpoint as dcp

        if checkpoint is None or not (self.trainer.run_dir / checkpoint).is_dir():
            raise CheckpointError(
                f"cannot resume {self.trainer.run_dir}: its distributed checkpoint {checkpoint} is missing"
            )
        note = verify_sharded_checkpoint(self.trainer.run_dir, checkpoint, digests)
        if note:
            self.trainer.notify_user(note)
        path = str(self.trainer.run_dir / checkpoint)
        # read here first: torch's loader would log a refusal as a warning and go on
        metadata = read_sharded_metadata(path)
        self._shard()
        self._fsdp_checkpoint, self._fsdp_digests = checkpoint, digests
        tensors = self._sharded_state()["towers"]
        dcp.load({"towers": tensors}, storage_reader=sharded_reader(path))
        self._loading = True  # a re-save of an incomplete checkpoint keeps this directory
        try:
            load()
        finally:
            self._loading = False
        stored = metadata.state_dict_metadata
        params = {n: p for _, n, p in self._tower_optimizer_slots()}
        slots: dict[str, Tensor] = {}
        for key, meta in stored.items():
            section, _, rest = key.partition(".")
            if section != "optimizer":
                continue
            name, _, slot = rest.rpartition("/")
            like = params[name]
            slots[rest] = (
                torch.zeros_like(like.detach())
                if tuple(meta.size) == tuple(like.shape)
                else torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
            )
        dcp.load({"optimizer": slots}, storage_reader=sharded_reader(path))
        for key, value in slots.items():
            name, _, slot = key.rpartition("/")
            self.trainer.optimizer.state[params[name]][slot] = value

    def _save_sharded(self) -> None:
        """Every rank writes its shards into a new ``towers-dcp/step-N`` directory."""
        import torch.distributed.checkpoint as dcp

        if self._loading:
            return
        name = f"{TOWERS_DCP_DIR}/step-{self.trainer.step:08d}"
        dcp.save(self._sharded_state(), checkpoint_id=str(self.trainer.run_dir / name))
        self._fsdp_checkpoint = name
        # the coordinator (rank 0) returns once every rank's files and the metadata are written
        self._fsdp_digests = (
            sharded_checksums(self.trainer.run_dir, name) if self.trainer.is_main else None
        )

    def _drop_old_sharded(self) -> None:
        """Remove the distributed checkpoints the run's checkpoint no longer names."""
        root = self.trainer.run_dir / TOWERS_DCP_DIR
        keep = self.trainer.run_dir / self._fsdp_checkpoint if self._fsdp_checkpoint else None
        for path in root.glob("step-*") if root.is_dir() else ():
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def clip_gradients(self) -> Tensor | None:
        """The global gradient norm (before clipping) over the recipe's plain tensors and the
        towers' sharded ones (each rank sums the squares of its shards; one all-reduce); None
        unsharded (the trainer clips)."""
        if not self.sharded:
            return None
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        grads = [
            p.grad
            for g in self.trainer.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        sharded = sum(
            (s.float().square().sum() for s in shards), torch.zeros((), device=self.trainer.device)
        )
        dist.all_reduce(sharded)
        total = torch.sqrt(
            sharded
            + sum(
                (g.float().square().sum() for g in plain),
                torch.zeros((), device=self.trainer.device),
            )
        )
        limit = (
            self.trainer.train_config.grad_clip
            if self.trainer.train_config.grad_clip > 0
            else math.inf
        )
        if bool(torch.isfinite(total)) and float(total) > limit:
            scale = limit / (float(total) + 1e-6)
            for g in plain + shards:
                g.mul_(scale)
        return total

    def before_checkpoint(self) -> None:
        # every rank: FSDP2 gathers the whole tensors and writes its shards (collectives)
        current = self._tower_state() if self.sharded or self.trainer.is_main else None
        if self.sharded:
            self._save_sharded()
        # the tower files first: the checkpoint's meta.json then records their checksums
        if self.trainer.writes:
            self.trainer.run_dir.mkdir(parents=True, exist_ok=True)
            self.towers_config.save(self.trainer.run_dir / TOWERS_CONFIG_FILE)
            for name, tensors in (
                (TOWERS_FILE, current),
                (TOWERS_BEST_FILE, self._best_towers),
            ):
                if tensors is None:
                    continue
                atomic_write(
                    self.trainer.run_dir / name,
                    functools.partial(
                        _save_tensors,
                        model_tensors(tensors) or {"_empty": torch.zeros(0)},
                        {"step": str(self.trainer.step)},
                    ),
                )

    def after_checkpoint(self) -> None:
        if self.sharded and self.trainer.is_main and not self._loading:
            self._drop_old_sharded()

    def meta_extras(self) -> dict[str, Any]:
        # the store's encoder no longer makes this run's features: no encoder is recorded, so
        # search cannot encode queries with the frozen one; export the towers and re-extract
        extras: dict[str, Any] = {
            "towers": {
                **describe(self.towers),
                "export": "curvalign.train.export_towers(RUN, DIR) -> an encoder spec",
                # the recipe's embedding keys the towers' gradient comes through (None: all)
                "trained_through": _listed(self.trainer.recipe.trunk_gradient_keys),
            }
        }
        if self.towers_config.trains:  # locked towers give the store's features
            extras["encoder"] = None
        if self.sharded:  # the distributed checkpoint's files, as meta records the run's files
            extras["towers"]["sharded_sha256"] = self._fsdp_digests
        loader = self.loader
        if loader is not None and isinstance(loader.source, WebDatasetRows):
            # the training rows came from the shards (the sampler summary is the store's)
            extras["towers"]["stream"] = loader.state_dict()
        return extras


class TowerTrainer(Trainer):
    """A ``Trainer`` given ``TowerFeatures`` (towers in front of the recipe): the same
    arguments, plus ``towers`` (a ``TowersConfig``; on resume, the run's own ``towers.json``).
    It only builds the component; the trainer calls it at its fixed points."""

    def __init__(
        self,
        config: RunConfig,
        store: FeatureStore,
        run_dir: str | Path,
        *,
        towers: TowersConfig | None = None,
        resume: bool = False,
        **kw: Any,
    ) -> None:
        source = TowerFeatures(
            config, store, run_dir, towers=towers, resume=resume, gather=kw.get("gather")
        )
        self.tower_features = source
        super().__init__(source.config, store, run_dir, resume=resume, features=source, **kw)

    @property
    def towers(self) -> Towers:
        """The towers in front of the recipe."""
        return self.tower_features.towers

    @property
    def towers_config(self) -> TowersConfig:
        return self.tower_features.towers_config

    @property
    def loader(self) -> RawBatchLoader | None:
        """The raw-row loader of this rank's batches."""
        return self.tower_features.loader

    @property
    def sharded(self) -> bool:
        """Whether the towers are sharded with FSDP2 over the processes."""
        return self.tower_features.sharded


def sharded_checksums(run_dir: Path, checkpoint: str) -> dict[str, str]:
    """``{"towers-dcp/step-N/FILE": SHA-256}`` of every file of the distributed checkpoint
    ``checkpoint`` (a directory of ``run_dir``), ``.metadata`` included."""
    from curvalign._io import sha256_file

    root = Path(run_dir) / checkpoint
    return {
        f"{checkpoint}/{path.name}": sha256_file(path)
        for path in sorted(root.iterdir())
        if path.is_file()
    }


def verify_sharded_checkpoint(
    run_dir: Path, checkpoint: str, digests: dict[str, str] | None
) -> str | None:
    """Check every file of the distributed checkpoint ``checkpoint`` against the SHA-256 that
    ``state.pt`` recorded (``digests``) and that ``meta.json`` recorded for it
    (``towers.sharded_sha256``), before torch's reader opens any of them (its ``.metadata`` is
    a pickle; a ``.distcp`` file may hold pickled bytes). CheckpointError naming the file on a
    mismatch or a missing file; a note (and no check) for a run written before checksums."""
    from curvalign.runs import read_meta

    records = [digests] if digests else []
    try:
        recorded = (read_meta(run_dir).get("towers") or {}).get("sharded_sha256") or {}
    except CheckpointError:
        recorded = {}
    if any(name.startswith(f"{checkpoint}/") for name in recorded):
        records.append(recorded)
    if not records:
        return (
            f"{run_dir}/{checkpoint} was written without checksums (by an older curvalign): its "
            "files are not verified (its metadata is still read without running any code)"
        )
    found = sharded_checksums(Path(run_dir), checkpoint)
    for record in records:
        for name, digest in record.items():
            if not name.startswith(f"{checkpoint}/"):
                continue
            if name not in found:
                raise CheckpointError(
                    f"{Path(run_dir) / name} is missing: the distributed checkpoint is incomplete; "
                    "restore the file or retrain"
                )
            if found[name] != digest:
                raise CheckpointError(
                    f"{Path(run_dir) / name} is damaged or was changed after the run wrote it: "
                    f"its SHA-256 {found[name][:12]}... differs from the {digest[:12]}... "
                    "recorded at its checkpoint; it is not read (restore the file or retrain)"
                )
    return None


#: what a distributed checkpoint's ``.metadata`` pickle may name: torch's metadata records,
#: torch.Size, dtypes, layouts, paths (never bytes items: curvalign writes tensors only)
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def read_sharded_metadata(path: str | Path) -> Any:
    """The ``Metadata`` of the distributed checkpoint in directory ``path``, unpickled with an
    allow-list (``_METADATA_GLOBALS``, ``torch.Size`` and torch dtypes): a ``.metadata`` that
    names anything else is refused with a CheckpointError, its code never run."""
    import pickle

    file = Path(path) / ".metadata"

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name in _METADATA_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
            ):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"{module}.{name}")

    try:
        with open(file, "rb") as handle:
            metadata = _Restricted(handle).load()
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read ({err.strerror or err})") from None
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{file} is not the metadata of a distributed checkpoint curvalign wrote: it names "
            f"{err}, which is refused without running it"
        ) from None
    except Exception as err:  # a damaged pickle raises many types
        raise CheckpointError(f"{file} is corrupt ({type(err).__name__})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} is not the metadata of a distributed checkpoint")
    return metadata


def sharded_reader(path: str | Path) -> Any:
    """torch's ``FileSystemReader`` for the distributed checkpoint in ``path``, its metadata
    read by ``read_sharded_metadata`` instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # per-rank metadata: curvalign writes none
                raise CheckpointError(f"{path}: per-rank metadata is not read")
            metadata = read_sharded_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(str(path))


def _pair(values: Any) -> tuple[float, float]:
    """A two-number setting (``crop_scale``, ``crop_ratio``) as a pair of floats."""
    low, high = values
    return float(low), float(high)


def _save_tensors(tensors: dict[str, Tensor], metadata: dict[str, str], path: Path) -> None:
    save_file(tensors, str(path), metadata=metadata)


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """The seed of the tower dropout masks of (run seed, rank, step) under ``dropout=true``:
    independent across ranks and steps, and a resumed run draws what an uninterrupted one
    would."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 17) % (2**63 - 1)


def _average_gradient(param: Tensor) -> None:
    """Average ``param.grad`` over the ranks in place (a post-accumulate-grad hook)."""
    import torch.distributed as dist

    grad = param.grad
    assert grad is not None  # a post-accumulate-grad hook runs once the gradient exists
    dist.all_reduce(grad)
    grad.div_(dist.get_world_size())


def _listed(keys: tuple[str, ...] | None) -> list[str] | None:
    return None if keys is None else list(keys)


def average_tower_gradients(towers: Towers, world_size: int) -> None:
    """Average the gradient of every trainable tower parameter over the ``world_size`` ranks as
    soon as it is accumulated (what DDP does for the recipe's parameters): each rank encodes
    its own rows, so W processes then take the step one process takes on the global batch.
    Every rank must train the same parameter set (``TowerFeatures`` freezes the parameters no
    gradient reaches before the first step), or the all-reduces would not pair up."""
    import torch.distributed as dist

    def hook(param: Tensor) -> None:
        grad = param.grad
        assert grad is not None  # a post-accumulate-grad hook runs once the gradient exists
        dist.all_reduce(grad)
        grad.div_(world_size)

    for _, param in towers.trainable_named_parameters():
        param.register_post_accumulate_grad_hook(hook)


def _whole(param: Tensor) -> Tensor:
    """A parameter's whole value: a DTensor's shards gathered (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    detached = param.detach()
    return detached.full_tensor() if isinstance(detached, DTensor) else detached


def transformer_blocks(towers: Towers) -> list[str]:
    """Names (in ``towers.model``) of the transformer blocks of the sides that train: the
    items of every ``nn.ModuleList`` of one module class with parameters (open_clip's
    ``resblocks``, HF CLIP's ``layers``, BERT's ``layer``), outermost lists only."""
    found: list[str] = []
    model = towers.model
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        if any(name.startswith(f"{block}.") for block in found):
            continue
        if len({type(m) for m in module}) != 1:
            continue
        for index, block in enumerate(module):
            first = next(iter(block.named_parameters()), None)
            if first is None:
                continue
            side = towers._side_of(f"{name}.{index}.{first[0]}")
            if side is not None and towers.mode(side) != "locked":
                found.append(f"{name}.{index}")
    return found


def reshard(towers: Towers) -> None:
    """Put the sharded parameters back in every FSDP2 module of ``towers``. FSDP2 keeps the
    root's parameters gathered after a forward (the backward would gather them again): after a
    forward without backward (validation) the module would name the gathered tensors, not the
    sharded parameters the optimizer and the checkpoints hold."""
    from torch.distributed.fsdp import FSDPModule

    for module in towers.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def shard_towers(towers: Towers, device: torch.device) -> list[str]:
    """FSDP2 over the default process group: ``fully_shard`` on every transformer block of a
    trained side (``transformer_blocks``), then on ``towers`` (everything else), with
    the encoding methods (``encode_images``, ``encode_texts``, ``encode_prepared_images``,
    ``encode_prepared_texts``, ``encode_text_tokens``) as forward methods (they, not
    ``forward``, run the towers). Parameters become DTensors sharded on dim 0 and move to ``device``; gradients
    are reduce-scattered and averaged over the ranks. Returns the block names."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = transformer_blocks(towers)
    for name in blocks:
        fully_shard(towers.model.get_submodule(name), mesh=mesh)
    # FSDP2 cannot shard a 0-d parameter (open_clip's logit_scale): it stays whole on every
    # rank, on the device, its gradient (if it trains) averaged as under DDP
    scalars = {p for p in towers.parameters() if p.ndim == 0}
    for param in scalars:
        param.data = param.data.to(device)
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(_average_gradient)
    fully_shard(towers, mesh=mesh, ignored_params=scalars)
    # the raw-row loader runs encode_prepared_*; a recipe that pools text tokens (DualPath's
    # pool_tokens) reads encode_text_tokens; validation runs encode_images / encode_texts
    for method in (
        "encode_images",
        "encode_texts",
        "encode_prepared_images",
        "encode_prepared_texts",
        "encode_text_tokens",
    ):
        register_fsdp_forward_method(towers, method)
    return blocks


def load_towers(run_dir: str | Path, weights: str = "best", device: str = "cpu") -> Towers:
    """The towers of a tower run: rebuilt from ``towers.json`` and the trained tensors of its
    best (``towers-best.safetensors``, when validation kept one) or last weights."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    config_path = run_dir / TOWERS_CONFIG_FILE
    if not config_path.exists():
        raise CheckpointError(f"{run_dir} is not a tower run: no {TOWERS_CONFIG_FILE}")
    towers = build_towers(TowersConfig.load(config_path), device)
    path = run_dir / (TOWERS_BEST_FILE if weights == "best" else TOWERS_FILE)
    if not path.exists():
        path = run_dir / TOWERS_FILE
    tensors = {k: v for k, v in load_file(str(path)).items() if k != "_empty"}
    try:
        towers.load_trainable_state(tensors)
    except TowerError as err:
        raise CheckpointError(f"{path}: {err}") from None
    return towers.eval()


def export_towers(run_dir: str | Path, out_dir: str | Path, weights: str = "best") -> str:
    """Export a tower run's towers (adapters merged) into ``out_dir``; returns the encoder spec
    for ``curvalign extract --encoder`` (then eval, index and search run unchanged on the
    re-extracted features)."""
    return load_towers(run_dir, weights).export(out_dir)


#: the store parts re-encoding can rebuild from raw texts: (features field, raw texts field)
_RAW_TEXT_PARTS = (("pair_a_features", "pair_a_texts"), ("pair_b_features", "pair_b_texts"))
#: parts with no raw items to re-encode: the field and what it is
_NOT_REENCODABLE = {"negative_features": "hard negatives (the store keeps no raw negative texts)"}


def _caption_rows(features: Tensor, captions: Tensor) -> Tensor | None:
    """For each row of ``features`` [n, D], the caption row [N, D] it equals; None when some row
    equals no caption (the store keeps the prompts' and chains' texts only as captions)."""
    flat = features.float().reshape(-1, captions.shape[1])
    if flat.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    rows = torch.cdist(flat, captions).argmin(dim=1)
    return rows if torch.allclose(captions[rows], flat) else None


def _box_crops(store: FeatureStore, items: StoreItems, ids: list[int]) -> list[Any]:
    """Boxes ``ids`` of ``store`` as PIL images cut at their stored corners from their images, as
    ``curvalign extract --boxes`` and the raw-row loader cut them."""
    from curvalign.data.extract import crop_box
    from curvalign.towers.loader import decode_item, parse_corners

    assert store.box_to_image is not None and store.box_corners is not None
    owners = items.images([int(store.box_to_image[i]) for i in ids])
    return [
        crop_box(decode_item(o), parse_corners(store.box_corners[i]))
        for o, i in zip(owners, ids, strict=True)
    ]


def prompt_texts(store: FeatureStore) -> list[str] | None:
    """The texts of the store's zero-shot prompts, one per row of ``prompt_features``, when the
    store records how it made them: ``meta["prompt_templates"]`` (each with ``{c}``) filled
    with every class name, class by class (``prompt_to_class`` = 0,0,..,1,1,..), as
    ``curvalign.data.coco.extract_coco`` writes them; None otherwise."""
    templates = store.meta.get("prompt_templates")
    names = store.class_names
    if (
        store.prompt_features is None
        or store.prompt_to_class is None
        or not names
        or not isinstance(templates, list)
        or not templates
        or not all(isinstance(t, str) and "{c}" in t for t in templates)
    ):
        return None
    order = [c for c in range(len(names)) for _ in templates]
    if store.prompt_to_class.tolist() != order:
        return None
    return [t.replace("{c}", str(n)) for n in names for t in templates]


def check_reencodable(
    store: FeatureStore, data: str = "the data", text_locked: bool = False
) -> None:
    """TowerError, one line naming the first part of ``store`` that ``reencode_store`` cannot
    rebuild from raw items: images need ``image_paths`` (+ ``meta["images_root"]``) or
    ``image_texts``, captions ``texts``; prompts must be caption rows, or texts the store
    records (``prompt_texts``), or stay as stored when ``text_locked`` (a locked text tower
    gives the store's own text features); gloss chains must be caption rows; text pairs need
    their raw texts; boxes the image files, ``box_corners`` and ``box_phrases``; hard negatives
    and stored token features are refused."""
    StoreItems(store, data=data)
    if store.box_image_features is not None and (
        store.image_paths is None or store.box_corners is None or store.box_phrases is None
    ):
        raise TowerError(
            f"{data}: cannot re-encode its boxes (box_image_features) with trained towers: they "
            "need the image files and each box's corners and phrase (manifest 'image_paths', "
            "'box_corners', 'box_phrases')"
        )
    for name, what in _NOT_REENCODABLE.items():
        if store.field(name) is not None:
            raise TowerError(f"{data}: cannot re-encode its {what} ({name}) with trained towers")
    for name, value in store.fields().items():
        if name.endswith("_token_features") and value is not None:
            raise TowerError(
                f"{data}: cannot re-encode its stored token features ({name}) with trained "
                "towers; extract the store without tokens"
            )
    for name, raw in _RAW_TEXT_PARTS:
        if store.field(name) is not None and store.field(raw) is None:
            raise TowerError(
                f"{data}: cannot re-encode {name} with trained towers: the store keeps no {raw}"
            )
    captions = store.text_features.float()
    chains = store.field("chain_features")
    if chains is not None and _caption_rows(chains, captions) is None:
        raise TowerError(
            f"{data}: cannot re-encode chain_features with trained towers: its rows are not "
            "caption rows and the store keeps no texts for them"
        )
    prompts = store.prompt_features
    if (
        prompts is not None
        and not text_locked
        and _caption_rows(prompts, captions) is None
        and prompt_texts(store) is None
    ):
        raise TowerError(
            f"{data}: cannot re-encode its zero-shot prompts (prompt_features) with a trained "
            "text tower: they are not caption rows and the store records no prompt texts "
            "(meta 'prompt_templates' filled with 'class_names', class by class); keep the "
            "text side locked (text=locked: the store's prompts stay valid), or re-extract the "
            "store so that it records its templates"
        )


def reencode_store(
    store: FeatureStore, towers: Towers, batch_size: int = 256, data: str = "the data"
) -> FeatureStore:
    """``store`` with every feature part encoded by ``towers`` (eval mode, no gradients), so that
    eval, index and the benchmark read a tower run's features unchanged: images [Ni, Di] from
    ``image_paths`` (or ``image_texts`` for a text-only encoder), captions [Nt, Dt] from
    ``texts``, text pairs from their raw texts, and prompts / gloss chains (rows of the caption
    features, as a WordNet store keeps them) as the re-encoded caption rows they equal.
    ``check_reencodable``'s TowerError for a part it cannot rebuild."""
    text_locked = towers.config.text == "locked"
    check_reencodable(store, data, text_locked=text_locked)
    items = StoreItems(store, data=data)

    def encode(raw: list[Any], fn: Any, prepare: Any = list) -> Tensor:
        with torch.no_grad():
            return torch.cat(
                [
                    fn(prepare(raw[i : i + batch_size])).float().cpu()
                    for i in range(0, len(raw), batch_size)
                ]
            )

    was_training = towers.training
    towers.eval()
    try:
        ids = range(store.num_images)
        images = encode(items.images(ids), towers.encode_images)
        texts = encode(items.texts(range(store.num_texts)), towers.encode_texts)
        changes: dict[str, Any] = {"image_features": images, "text_features": texts}
        for name, raw in _RAW_TEXT_PARTS:
            if store.field(name) is not None:
                changes[name] = encode(list(store.field(raw)), towers.encode_texts)
        if store.box_image_features is not None:
            boxes = list(range(int(store.box_image_features.shape[0])))
            crops = functools.partial(_box_crops, store, items)  # a batch of crops at a time
            changes["box_image_features"] = encode(boxes, towers.encode_images, crops)
            assert store.box_phrases is not None  # check_reencodable
            changes["box_text_features"] = encode(list(store.box_phrases), towers.encode_texts)
        captions = store.text_features.float()
        for name in ("prompt_features", "chain_features"):
            part = store.field(name)
            if part is None:
                continue
            rows = _caption_rows(part, captions)
            if rows is not None:  # caption rows (a WordNet store): the re-encoded captions
                changes[name] = texts[rows].reshape((*part.shape[:-1], texts.shape[1]))
                continue
            own = prompt_texts(store) if name == "prompt_features" else None
            if own is not None:  # the prompts' own texts (COCO: templates x class names)
                changes[name] = encode(own, towers.encode_texts)
            else:  # a locked text tower: the store's own prompt features (check_reencodable)
                assert name == "prompt_features" and text_locked
    finally:
        towers.train(was_training)
    return store.with_fields(**changes)


def tower_trainer_factory(towers: TowersConfig | str | None, base: Any = None) -> Any:
    """A ``trainer_factory`` for ``curvalign.train.trainer.train`` that builds a TowerTrainer;
    ``base``: another factory that takes ``trainer_cls`` (the distributed launcher's
    ``build_distributed_trainer``), given ``trainer_cls=TowerTrainer`` and ``towers``."""

    if isinstance(towers, str):
        try:
            towers = TowersConfig.parse(towers)
        except TowerError as err:
            raise TrainError(str(err)) from None

    def factory(*args: Any, **kw: Any) -> TowerTrainer:
        if base is not None:
            return base(*args, trainer_cls=TowerTrainer, towers=towers, **kw)
        return TowerTrainer(*args, towers=towers, **kw)

    return factory


def train(*args: Any, **kw: Any) -> TrainedRun:
    """Deprecated: ``curvalign.train.train`` (``curvalign.train.trainer.train``) takes
    ``towers=`` itself; this alias goes in 0.3.0."""
    import warnings

    from curvalign.train.trainer import train as one_train

    warnings.warn(
        "curvalign.train.towers.train is deprecated and will be removed in 0.3.0: call "
        "curvalign.train.train (from curvalign.train import train), which takes towers=",
        DeprecationWarning,
        stacklevel=2,
    )
    return one_train(*args, **kw)


__all__ = [
    "TOWERS_BEST_FILE",
    "TOWERS_CONFIG_FILE",
    "TOWERS_FILE",
    "TOWERS_DCP_DIR",
    "TOWER_FILES",
    "TowerFeatures",
    "TowerTrainer",
    "TowerValidationSet",
    "average_tower_gradients",
    "check_reencodable",
    "dropout_seed",
    "read_sharded_metadata",
    "sharded_checksums",
    "sharded_reader",
    "verify_sharded_checkpoint",
    "export_towers",
    "load_towers",
    "prompt_texts",
    "reencode_store",
    "reshard",
    "shard_towers",
    "tower_trainer_factory",
    "transformer_blocks",
    "train",
]
