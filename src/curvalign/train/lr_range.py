"""The learning-rate range test (Smith 2017, "Cyclical Learning Rates", Sec. 3.3): train a fresh
head for a few steps while the learning rate grows exponentially, and read a curve against it.

The curve read (``read_on``) is the *validation* error by default: 1 - the trainer's validation
score (mean of T2I and I2T R@1 on the validation split, the number tuning selects on), measured
about ``VAL_POINTS`` times along the ramp. The training loss (``read_on="train"``) keeps falling
at rates where validation has already collapsed: on frozen features ``clip``, AtMG and AGR never
diverge in training loss, and trials at the rates it suggested kept their step-0 weights. Where
the run has no validation split the training loss is read (the result says so).

The curve first barely moves (rate too small), then falls fastest, reaches a minimum, then rises
(rate too large). ``suggest_range`` reads the smoothed curve (a centred moving average, which
does not lag):

    at_minimum   the rate at the smoothed curve's minimum (past it the curve rises)
    steepest     the rate where the smoothed curve falls fastest per decade, before the minimum
    suggested    [high / ``SPAN``, high] with high = at_minimum / ``BELOW_MINIMUM`` (the usual
                 reading, Smith 2017 and fastai: the rate at the minimum is already at the edge
                 of stability over a long run): the tuner widens its learning-rate range by it

A ramp whose curve never rose (the minimum at its last point) did not find the divergence point:
its ``reached_divergence`` is False and the suggested upper end is only a lower bound on it.

The ramp trains on the store's train split only and validates on its validation split (never
test); it writes no run files; nothing of it is kept but the curve.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from curvalign.config import parse_override, resolve_config
from curvalign.data import load_store
from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.base import Progress

#: the suggested upper end is the rate at the loss minimum divided by this
BELOW_MINIMUM = 10.0
#: the suggested range spans this factor below its upper end
SPAN = 30.0
#: the smoothing window as a share of the ramp's points (centred moving average)
WINDOW_FRACTION = 0.1
#: the ramp stops once the smoothed training loss exceeds this multiple of its minimum (diverged)
DIVERGENCE_FACTOR = 4.0
#: validations along a ramp read on validation (one every ``steps // VAL_POINTS`` steps)
VAL_POINTS = 20


@dataclass
class LRRangeResult:
    """One ramp: the rates, the curve read at them (``losses``: the validation error 1 - mean
    R@1 when ``read_on`` is "validation", else the training loss), its smoothed values, and the
    reading of them."""

    recipe: str
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    at_minimum: float
    steepest: float
    suggested: tuple[float, float]
    reached_divergence: bool
    stopped_because: str
    read_on: str = "train"

    @property
    def curve_label(self) -> str:
        return (
            "validation error (1 - mean R@1)" if self.read_on == "validation" else "training loss"
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["suggested"] = list(self.suggested)
        return out

    def describe(self) -> str:
        low, high = self.suggested
        note = (
            ""
            if self.reached_divergence
            else " (the curve never rose: raise lr_end to find where it diverges)"
        )
        return (
            f"{self.recipe}: {self.curve_label} lowest at lr {self.at_minimum:.2e}, falling fastest at "
            f"{self.steepest:.2e}; suggested lr range [{low:.2e}, {high:.2e}]{note}"
        )


def smooth(losses: Sequence[float], fraction: float = WINDOW_FRACTION) -> list[float]:
    """Centred moving average of ``losses`` over an odd window of about ``fraction`` of the
    points (at least 3; shorter at the two ends). Centred, so the minimum is not shifted towards
    larger rates the way a trailing average shifts it."""
    n = len(losses)
    half = max(1, round(fraction * n) // 2)
    out = []
    for i in range(n):
        window = losses[max(0, i - half) : i + half + 1]
        out.append(math.fsum(float(v) for v in window) / len(window))
    return out


def suggest_range(lrs: Sequence[float], losses: Sequence[float]) -> dict[str, Any]:
    """Read a ramp ([n] rates, increasing, and their losses): {"at_minimum", "steepest",
    "suggested": (low, high), "reached_divergence", "smoothed"} (module docstring)."""
    if len(lrs) != len(losses) or len(lrs) < 3:
        raise ConfigError(
            f"the lr range test needs at least 3 (lr, loss) points, got {len(lrs)} and {len(losses)}"
        )
    smoothed = smooth(losses)
    low_i = min(range(len(smoothed)), key=lambda i: smoothed[i])
    at_minimum = float(lrs[low_i])
    reached = low_i < len(smoothed) - 1
    # the steepest fall per decade of lr, up to the minimum
    steepest, best_slope = float(lrs[0]), math.inf
    for i in range(1, low_i + 1):
        slope = (smoothed[i] - smoothed[i - 1]) / (math.log10(lrs[i]) - math.log10(lrs[i - 1]))
        if slope < best_slope:
            best_slope, steepest = slope, float(lrs[i])
    return {
        "at_minimum": at_minimum,
        "steepest": steepest,
        "suggested": (at_minimum / BELOW_MINIMUM / SPAN, at_minimum / BELOW_MINIMUM),
        "reached_divergence": reached,
        "smoothed": smoothed,
    }


def lr_range_test(
    recipe: str | None,
    data: str | FeatureStore | None,
    *,
    config_file: str | Path | None = None,
    steps: int = 100,
    lr_start: float = 1e-6,
    lr_end: float = 1.0,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    notify: Callable[[str], None] | None = None,
    read_on: Literal["validation", "train"] = "validation",
) -> LRRangeResult:
    """Ramp the learning rate of a fresh ``recipe`` head (or the one ``config_file`` names) from
    ``lr_start`` to ``lr_end`` (exponentially, one rate per step, ``steps`` steps) on ``data``'s
    train split, reading the validation error about ``VAL_POINTS`` times along the ramp
    (``read_on="validation"``, the default; the training loss where the run has no validation
    split) or the training loss at every step (``read_on="train"``); stop early when the loss
    becomes non-finite or its smoothed value exceeds ``DIVERGENCE_FACTOR`` times its minimum.
    The recipe's config (``overrides``) applies, except that the schedule is the ramp."""
    from curvalign.train.trainer import NonFiniteLossError, Trainer

    if steps < 3:
        raise ConfigError(f"the lr range test needs steps >= 3, got {steps}")
    if not 0 < lr_start < lr_end:
        raise ConfigError(
            f"the lr range test needs 0 < lr_start < lr_end, got {lr_start}, {lr_end}"
        )
    if read_on not in ("validation", "train"):
        raise ConfigError(f"read_on must be 'validation' or 'train', got {read_on!r}")
    notify = notify or (lambda message: None)
    spec = data if isinstance(data, str) or data is None else load_store(data)[1]
    # a validation split is set up (val_every > 0) but only the ramp below validates
    every = max(1, steps // VAL_POINTS)
    ramp = {
        "val_every": every if read_on == "validation" else 0,
        "patience": 0,
        "tensorboard": False,
        "checkpoint_every": 0,
    }
    given = (
        dict(overrides)
        if isinstance(overrides, Mapping)
        else dict(parse_override(o) for o in overrides)
    )
    # the ramp's settings win over a user's, however the key is spelled
    given = {k: v for k, v in given.items() if k.removeprefix("train.") not in ramp}
    config = resolve_config(
        recipe, spec, steps=steps, overrides={**given, **ramp}, config_file=config_file
    )
    recipe = config.recipe
    store, _ = load_store(data if isinstance(data, FeatureStore) else config.data)
    with tempfile.TemporaryDirectory(prefix="curvalign-lr-range-") as tmp:
        trainer = Trainer(config, store, tmp, show_progress=False, notify=notify)
        if read_on == "validation" and trainer.validation is None:
            notify(f"lr range test of {recipe}: no validation split; reading the training loss")
            read_on = "train"
        groups = trainer.optimizer.param_groups
        ratios = [g["lr"] / config.train.lr for g in groups]
        lrs: list[float] = []
        losses: list[float] = []
        read_lrs: list[float] = []
        read: list[float] = []
        stopped = "the ramp ended"
        ratio = (lr_end / lr_start) ** (1 / (steps - 1))
        for step in range(steps):
            lr = lr_start * ratio**step
            for group, r in zip(groups, ratios, strict=True):
                group["lr"] = lr * r
            try:
                out, _ = trainer.train_step(Progress(step, steps))
            except NonFiniteLossError:
                stopped = f"the loss became non-finite at lr {lr:.2e}"
                break
            lrs.append(lr)
            losses.append(float(out.total.detach()))
            if read_on == "validation" and ((step + 1) % every == 0 or step == steps - 1):
                read_lrs.append(lr)
                read.append(1.0 - float(trainer.validate()))
            smoothed = smooth(losses)
            if len(smoothed) > 3 and smoothed[-1] > DIVERGENCE_FACTOR * min(smoothed):
                stopped = f"the smoothed loss exceeded {DIVERGENCE_FACTOR:g}x its minimum"
                break
    if read_on == "train":
        read_lrs, read = lrs, losses
    if len(read) < 3:
        raise ConfigError(
            f"lr range test of {recipe}: {len(read)} point(s) of the {read_on} curve before "
            f"the ramp stopped ({stopped}); lower lr_start or raise steps"
        )
    reading = suggest_range(read_lrs, read)
    return LRRangeResult(
        recipe=recipe,
        lrs=read_lrs,
        losses=read,
        smoothed=reading["smoothed"],
        at_minimum=reading["at_minimum"],
        steepest=reading["steepest"],
        suggested=reading["suggested"],
        reached_divergence=reading["reached_divergence"] or stopped != "the ramp ended",
        stopped_because=stopped,
        read_on=read_on,
    )
