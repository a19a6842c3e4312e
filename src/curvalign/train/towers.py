"""Training ``towers + recipe``: the trainer's loop, hooks, checkpoints and resume, with the
features of every step computed by towers (``curvalign.towers``) from the store's raw items.

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

The store must have been extracted by the towers' encoder (``meta["encoder"]``): its features
give the data-aware head initialisation and the step-0 health check; a mismatch is noted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from curvalign._io import atomic_write
from curvalign.config import RunConfig, recipe_class
from curvalign.data.batch import Batch
from curvalign.data.features import FeatureStore
from curvalign.errors import TrainError
from curvalign.readout import embed_features
from curvalign.recipes.base import Progress
from curvalign.runs import CheckpointError
from curvalign.towers import (
    StoreItems,
    TowerError,
    Towers,
    TowersConfig,
    build_towers,
    check_recipe_parts,
    describe,
    tower_batch,
)
from curvalign.train.checkpoint import load_train_state, model_tensors
from curvalign.train.trainer import (
    Trainer,
    build_optimizer,
    build_scheduler,
    rng_state,
    seed_everything,
    set_rng_state,
)
from curvalign.train.validation import ValidationSet

TOWERS_CONFIG_FILE = "towers.json"
TOWERS_FILE = "towers.safetensors"
TOWERS_BEST_FILE = "towers-best.safetensors"
TOWER_FILES = (TOWERS_CONFIG_FILE, TOWERS_FILE, TOWERS_BEST_FILE)


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

    def embeddings(self, recipe: Any) -> tuple[Any, Any]:
        """The split re-encoded by the current towers, then embedded by ``recipe``."""
        images, texts = self.encode()
        return (
            embed_features(recipe, images, "image", self.batch_size),
            embed_features(recipe, texts, "text", self.batch_size),
        )


class TowerTrainer(Trainer):
    """``Trainer`` with ``towers`` in front of the recipe (see the module docstring): the same
    arguments, plus ``towers`` (a ``TowersConfig``; on resume, the run's own ``towers.json``)."""

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
                recipe_cls.requires,
                recipe_cls.reads_text_tokens(config.recipe_config_object()),
                repr(config.recipe),
            )
            self.items = StoreItems(store, data=f"data {config.data!r}")
            seed_everything(config.train.seed)  # LoRA's A matrices are random
            self.towers = build_towers(towers_config, config.train.device)
        except TowerError as err:
            raise TrainError(str(err)) from None
        self._best_towers: dict[str, Tensor] | None = None
        super().__init__(config, store, run_dir, resume=resume, **kw)
        for note in self.towers.notes:
            self._note(note)
        if store.meta.get("encoder") not in (None, self.towers.spec):
            self._note(
                f"the store was extracted with {store.meta.get('encoder')!r}, the towers are "
                f"{self.towers.spec!r}: the head initialisation and the step-0 check read the "
                "store's features"
            )
        if self.validation is not None:
            self.validation = TowerValidationSet(
                self.validation_store,
                self.towers,
                self.items,
                text_tokens=self.recipe.text_tokens,
            )
        if not resume:
            self._freeze_unused()
        if self.gather.world_size > 1:  # DDP averages the recipe's gradients, this the towers'
            average_tower_gradients(self.towers, self.gather.world_size)

    # --- Trainer's extension points -------------------------------------------------------
    def _input_dims(self, config: RunConfig, store: FeatureStore) -> tuple[int, int]:
        return (self.towers.image_width, self.towers.text_width)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        optimizer = build_optimizer(self.recipe, self.train_config)
        cfg, tcfg = self.train_config, self.towers_config
        named = self.towers.trainable_named_parameters()
        lr = cfg.lr if tcfg.lr is None else float(tcfg.lr)
        decay = cfg.weight_decay if tcfg.weight_decay is None else float(tcfg.weight_decay)
        for params, weight_decay in (
            ([p for _, p in named if p.ndim >= 2], decay),
            ([p for _, p in named if p.ndim < 2], 0.0),
        ):
            if params:
                optimizer.add_param_group(
                    {"params": params, "lr": lr, "weight_decay": weight_decay}
                )
        return optimizer

    def _next_batch(self) -> Batch:
        indices = self.sampler.next_indices()
        size = len(indices["image"]) // self.gather.world_size
        rank = self.gather.rank
        local = {k: v[rank * size : (rank + 1) * size] for k, v in indices.items()}
        return tower_batch(self.towers, self.items, local, text_tokens=self.recipe.text_tokens)

    @property
    def validation_store(self) -> FeatureStore:
        """The store with its validation split (the sampler's store: the hold-out is marked)."""
        return self.sampler.store

    # --- unused parameters ------------------------------------------------------------------
    def _freeze_unused(self) -> None:
        """One forward/backward on the first batch (random states and sampler restored): tower
        parameters that train but get no gradient are frozen, with a note."""
        if not self.towers.trainable_named_parameters():
            return
        rng, sampler = rng_state(), self.sampler.state_dict()
        try:
            self.recipe.train()
            self.towers.train()
            batch = self._next_batch()
            out = self.recipe(batch, Progress(0, self.train_config.steps), self.gather)
            out.total.backward()
            unused = [n for n, p in self.towers.trainable_named_parameters() if p.grad is None]
        finally:
            for p in [*self.recipe.parameters(), *self.towers.parameters()]:
                p.grad = None
            self.sampler.load_state_dict(sampler)
            set_rng_state(rng)
        if unused:
            self.towers.freeze(unused, "that no encoding or loss uses (no gradient reaches them)")
            self._note(self.towers.notes[-1])
            self.optimizer = self._build_optimizer()
            self.scheduler = build_scheduler(self.optimizer, self.train_config)

    # --- state ------------------------------------------------------------------------------
    def keep_best(self, step: int, score: float) -> None:
        super().keep_best(step, score)
        self._best_towers = self.towers.trainable_state()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["towers"] = self.towers.trainable_state()
        state["best_towers"] = self._best_towers
        return state

    def _load_state(self) -> None:
        state = load_train_state(self.run_dir)
        if "towers" not in state:
            raise CheckpointError(f"the checkpoint in {self.run_dir} holds no tower state")
        frozen = [
            n for n, _ in self.towers.trainable_named_parameters() if n not in state["towers"]
        ]
        if frozen:  # what the run froze before its first step (no gradient reached them)
            self.towers.freeze(frozen, "as the run did (no gradient reaches them)")
            self._note(self.towers.notes[-1])
            self.optimizer = self._build_optimizer()
            self.scheduler = build_scheduler(self.optimizer, self.train_config)
        try:
            self.towers.load_trainable_state(state["towers"])
        except TowerError as err:
            raise CheckpointError(f"cannot resume {self.run_dir}: {err}") from None
        self._best_towers = state.get("best_towers")
        super()._load_state()

    def save_checkpoint(self) -> None:
        # the tower files first: the checkpoint's meta.json then records their checksums
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.towers_config.save(self.run_dir / TOWERS_CONFIG_FILE)
            for name, tensors in (
                (TOWERS_FILE, self.towers.trainable_state()),
                (TOWERS_BEST_FILE, self._best_towers),
            ):
                if tensors is None:
                    continue
                data = model_tensors(tensors) or {"_empty": torch.zeros(0)}
                atomic_write(
                    self.run_dir / name,
                    lambda tmp, data=data: save_file(
                        data, str(tmp), metadata={"step": str(self.step)}
                    ),
                )
        super().save_checkpoint()

    def _meta_extras(self) -> dict[str, Any]:
        # the store's encoder no longer makes this run's features: no encoder is recorded, so
        # search cannot encode queries with the frozen one; export the towers and re-extract
        extras: dict[str, Any] = {
            "towers": {
                **describe(self.towers),
                "export": "curvalign.train.export_towers(RUN, DIR) -> an encoder spec",
                # the recipe's embedding keys the towers' gradient comes through (None: all)
                "trained_through": _listed(self.recipe.trunk_gradient_keys),
            }
        }
        if self.towers_config.trains:  # locked towers give the store's features
            extras["encoder"] = None
        return extras


def _listed(keys: tuple[str, ...] | None) -> list[str] | None:
    return None if keys is None else list(keys)


def average_tower_gradients(towers: Towers, world_size: int) -> None:
    """Average the gradient of every trainable tower parameter over the ``world_size`` ranks as
    soon as it is accumulated (what DDP does for the recipe's parameters): each rank encodes
    its own rows, so W processes then take the step one process takes on the global batch.
    Every rank must train the same parameter set (``TowerTrainer`` freezes the parameters no
    gradient reaches before the first step), or the all-reduces would not pair up."""
    import torch.distributed as dist

    def hook(param: Tensor) -> None:
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)

    for _, param in towers.trainable_named_parameters():
        param.register_post_accumulate_grad_hook(hook)


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


def train(
    recipe: str | None,
    data: Any,
    out_dir: str | Path,
    *,
    towers: TowersConfig | str | None = None,
    **kw: Any,
) -> Any:
    """``curvalign.train.trainer.train`` with ``towers`` (a ``TowersConfig`` or its
    ``"SPEC;key=value"`` string) trained in front of the recipe; without ``towers`` (and not
    resuming a tower run) it is exactly that function. A resumed tower run reads its own
    ``towers.json``. Errors are ``TrainError`` with one clear message."""
    from curvalign.train.trainer import train as train_features

    run_dir = Path(out_dir)
    resuming_towers = bool(kw.get("resume")) and (run_dir / TOWERS_CONFIG_FILE).exists()
    if towers is None and not resuming_towers:
        return train_features(recipe, data, out_dir, **kw)
    if kw.get("overwrite") and not kw.get("resume"):
        for name in TOWER_FILES:  # the feature trainer clears its own files
            (run_dir / name).unlink(missing_ok=True)
    base = kw.get("trainer_factory", Trainer)  # the distributed launcher passes its own
    kw["trainer_factory"] = tower_trainer_factory(towers, None if base is Trainer else base)
    return train_features(recipe, data, out_dir, **kw)


__all__ = [
    "TOWERS_BEST_FILE",
    "TOWERS_CONFIG_FILE",
    "TOWERS_FILE",
    "TOWER_FILES",
    "TowerTrainer",
    "TowerValidationSet",
    "average_tower_gradients",
    "export_towers",
    "load_towers",
    "tower_trainer_factory",
    "train",
]
