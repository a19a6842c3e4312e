"""What feeds the recipe its features: a component the trainer is given (``Trainer(features=
...)``) and calls at fixed points, instead of a trainer subclass.

``FeatureSource`` (the default) is the store's own frozen features: the sampler's batches, no
parameters of its own, nothing to save. ``train.towers.TowerFeatures`` puts encoders (towers)
in front of the recipe: its batches are encoded from raw rows, it adds parameter groups,
re-encodes the validation split, saves its tensors beside each checkpoint and wraps itself for
several processes. The points, in the order a run meets them:

    attach(trainer)               the trainer, before it builds anything
    input_dims(config, store)     (image, text) widths the recipe's heads take
    sampler_reads_tokens(recipe)  whether the sampler reads stored token features
    param_groups(train)           optimizer groups beside the recipe's two
    load_state(load)              resume: around the trainer's own loading (``load()``)
    ready(resume)                 the end of the trainer's construction
    step0_check(total)            the step-0 health check (``recipes.health``)
    next_batch()                  this rank's rows of the next global batch, on the device
    clip_gradients()              the global gradient norm when the source clips (else None)
    keep_best()                   the best validation's weights were kept: keep its own too
    add_state(state)              what a checkpoint's ``state.pt`` holds of it
    before_checkpoint() / after_checkpoint()   its files beside each checkpoint
    meta_extras()                 keys it adds to each checkpoint's meta.json
    use_store(swap)               around a store swapped mid-run (``swap()``)
    close()                       the end of ``fit``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from curvalign.recipes.health import Step0Health, check_step0
from curvalign.runs import recipe_input_dims

if TYPE_CHECKING:
    from curvalign.config import RunConfig, TrainConfig
    from curvalign.data.batch import Batch
    from curvalign.data.features import FeatureStore
    from curvalign.recipes.base import Recipe
    from curvalign.train.trainer import Trainer


class FeatureSource:
    """The store's own features (the default): every point does what a plain run needs."""

    trainer: Trainer

    def attach(self, trainer: Trainer) -> None:
        """Called first by ``Trainer.__init__``: the trainer this source feeds."""
        self.trainer = trainer

    def input_dims(self, config: RunConfig, store: FeatureStore) -> tuple[int, int]:
        """(image, text) widths the recipe's heads take: the store's feature widths (the text
        width is the token width Dk when the recipe pools text tokens)."""
        return recipe_input_dims(config, store)

    def sampler_reads_tokens(self, recipe: Recipe) -> bool:
        """Whether the sampler reads stored token features (the recipe pools text tokens)."""
        return bool(recipe.text_tokens)

    def param_groups(self, train: TrainConfig) -> list[dict[str, Any]]:
        """Optimizer parameter groups beside the recipe's (``train.trainer.build_optimizer``)."""
        return []

    def load_state(self, load: Callable[[], None]) -> None:
        """Resume: its own state around the trainer's (``load()`` loads the trainer's)."""
        load()

    def ready(self, resume: bool) -> None:
        """The trainer is built (resumed when ``resume``)."""

    def step0_check(self, total: int) -> Step0Health:
        """The step-0 check (``recipes.health``) on the next batch, not consuming it."""
        t = self.trainer
        return check_step0(t.recipe, t.sampler, total, t.notify_user)

    def next_batch(self) -> Batch:
        """This rank's rows of the next global batch, on the device (called under autocast)."""
        from curvalign.train.trainer import local_rows

        t = self.trainer
        return local_rows(t.sampler.next_batch(), t.gather).to(t.device)

    def clip_gradients(self) -> Tensor | None:
        """The global gradient norm before clipping when this source clips itself (sharded
        parameters), else None (the trainer clips)."""
        return None

    def keep_best(self) -> None:
        """The trainer kept the current weights as the best: keep this source's too."""

    def add_state(self, state: dict[str, Any]) -> None:
        """Add this source's part to (or edit) a checkpoint's training state, in place."""

    def before_checkpoint(self) -> None:
        """Before the trainer writes a checkpoint (every rank: collectives are allowed)."""

    def after_checkpoint(self) -> None:
        """After the trainer wrote a checkpoint."""

    def meta_extras(self) -> dict[str, Any]:
        """Keys this source adds to (or replaces in) each checkpoint's meta.json."""
        return {}

    def use_store(self, swap: Callable[[], None]) -> None:
        """Around a store swapped mid-run (``swap()`` rebuilds the trainer's sampler)."""
        swap()

    def close(self) -> None:
        """The end of ``fit``: release what the source holds (worker processes)."""


__all__ = ["FeatureSource"]
