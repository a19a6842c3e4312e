"""The step-0 health check: is the untrained model in a state that training can move?

Run on one training batch before the first step (``Trainer.fit`` calls ``check_step0``; the
benchmark and tuning trials train through it, so they run it too). It reads only the recipe
contract (``recipes/base.py``: ``scores``, ``logit_temperature``, ``distance_to_origin``,
``curvature_value``, ``step0_scalars``, ``scale_knobs``, ``radius_gap_knob``), never a recipe
name, and measures:

- the recipe's step-0 loss against ``log B`` (chance for a B-way softmax), and the step-0
  ranking's recall@1 on the batch (chance ``1/B``);
- the logit spread: mean over text rows of ``max - min`` of ``scores / temperature``;
- per modality the mean distance to the origin ``r`` and ``c r^2`` (below about 0.01 the points
  sit where the hyperboloid is flat: the curvature cannot change the distances);
- for a loss on angles at both ends of a pair (``radius_gap_knob``), whether texts and images
  start at one radius (there the two directions of the loss cancel: AtMG);
- ``|dL / d log v|`` for the learned curvature and temperature: a knob whose gradient is
  nil cannot move the loss.

Each failed test adds a ``Step0Warning``: the test's code, the value it measured, the threshold
that value failed and the config keys that fix it. ``Step0Health`` is the frozen record of the
whole check; ``Trainer.fit`` keeps it (``FitResult.step0``) and records ``to_json()`` in
``meta.json`` (``step0_health``; ``from_json`` reads it back, also from older runs) and its
warnings in the run's notes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from curvalign.data.batch import Batch
from curvalign.recipes.base import Embedding, Progress, Recipe

if TYPE_CHECKING:
    from curvalign.data.sampling import BatchSampler

#: the step-0 loss, as a share of log B, at or above which it counts as "at chance"
LOSS_AT_CHANCE = 0.97
#: a batch recall@1 above this many times chance (1/B) counts as an informative ranking
INFORMATIVE_RANKING = 5.0
#: logits whose mean row span (max - min) is below this make a nearly uniform softmax
#: (e = 2.7: the best match is at most 2.7x as likely as the worst; MERU at 1/sqrt(d) on
#: unit-norm features: 0.34, CLIP from the input: 9)
MIN_LOGIT_SPREAD = 1.0
#: c r^2 below this: the points sit where the hyperboloid is flat (MERU at 1/sqrt(d) on
#: unit-norm features: 0.002); above the upper bound distances saturate (sqrt(c) r > 7)
MIN_CURVED = 0.01
MAX_CURVED = 50.0
#: texts and images at radii closer than this share of the larger count as equal
EQUAL_RADII = 0.05
#: |dL / d log v| below this: the scalar cannot move the loss (a 10% change of v moves the
#: loss by less than 1e-4)
MIN_SENSITIVITY = 1e-3

#: the key of ``meta.json`` that holds the report
META_KEY = "step0_health"
#: how every step-0 warning line starts (``warning_line``)
WARNING_PREFIX = "step-0 check "


@dataclass(frozen=True)
class Step0Warning:
    """One failed test of the step-0 check.

    code       the test: "loss_at_chance", "flat_logits", "flat_geometry", "far_out",
               "equal_radii", "inert_curvature" or "inert_temperature"
    knobs      the config keys that fix it, in the order to try them (empty where the recipe
               declares none: ``message`` then says what to change)
    message    the line for the user (``warning_line`` prefixes it)
    value      what the test measured (loss / log B, the logit span, ``c r^2``, the relative
               radius gap, ``|dL / d log v|``); None in a report saved before it was recorded
    threshold  the bound ``value`` failed (``LOSS_AT_CHANCE``, ``MIN_LOGIT_SPREAD``, ...)
    """

    code: str
    knobs: tuple[str, ...]
    message: str
    value: float | None = None
    threshold: float | None = None

    @property
    def knob(self) -> str:
        """The knobs as one line, "a / b" (how ``meta.json`` holds them under "knob")."""
        return _knobs(self.knobs)

    def to_json(self) -> dict[str, Any]:
        """{"code", "knob", "message", "value", "threshold"}: "knob" joins ``knobs`` with
        " / ", the form reports saved before the other keys existed hold."""
        return {
            "code": self.code,
            "knob": self.knob,
            "message": self.message,
            "value": self.value,
            "threshold": self.threshold,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Step0Warning:
        """Inverse of ``to_json``; reads a report saved before "value" and "threshold" existed
        (None)."""
        knob = str(raw.get("knob") or "")
        return cls(
            code=str(raw["code"]),
            knobs=tuple(k for k in knob.split(" / ") if k),
            message=str(raw.get("message", "")),
            value=_optional_float(raw.get("value")),
            threshold=_optional_float(raw.get("threshold")),
        )


@dataclass(frozen=True)
class Step0Health:
    """What the step-0 check measured on one batch of B pairs (see the module docstring).

    batch_size, log_b          B and log B (the loss of a B-way softmax at chance)
    loss, loss_ratio           the recipe's step-0 loss and loss / log B
    recall_at_1                the step-0 ranking's text-to-image recall@1 on the batch
    logit_spread               mean over text rows of max - min of ``scores / temperature``
    feature_norm               {"image", "text"} -> mean input feature norm
    radius, curvature_radius2  {"image", "text"} -> mean distance to the origin / c r^2
                               (None for a geometry without an origin)
    curvature                  the mean curvature c (None for a recipe without one)
    sensitivity                {"curvature", "temperature"} -> |dL / d log v| of the learned ones
    warnings                   the failed tests, in the order they were run

    ``to_json`` is the form ``meta.json`` holds under ``META_KEY``; ``from_json`` reads it back
    (also from runs saved before the warnings carried their value and threshold).
    """

    batch_size: int
    log_b: float
    loss: float
    loss_ratio: float
    recall_at_1: float
    logit_spread: float
    feature_norm: dict[str, float]
    radius: dict[str, float] | None
    curvature: float | None
    curvature_radius2: dict[str, float] | None
    sensitivity: dict[str, float]
    warnings: tuple[Step0Warning, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.warnings

    @property
    def codes(self) -> list[str]:
        return [w.code for w in self.warnings]

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict: the fields by name, ``warnings`` a list of
        ``Step0Warning.to_json()``."""
        out: dict[str, Any] = {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in fields(self)
            if f.name != "warnings"
        }
        out["warnings"] = [w.to_json() for w in self.warnings]
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Step0Health:
        """Inverse of ``to_json`` (keys it does not know are left out: a report written by a
        later version still loads)."""
        names = {f.name for f in fields(cls)} - {"warnings"}
        values: dict[str, Any] = {k: v for k, v in raw.items() if k in names}
        return cls(
            **values,
            warnings=tuple(Step0Warning.from_json(w) for w in raw.get("warnings") or ()),
        )


def _optional_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _knobs(keys: tuple[str, ...] | list[str]) -> str:
    """Config keys as one line, \"a / b\"."""
    return " / ".join(keys)


def _embed_texts(recipe: Recipe, batch: Batch) -> Embedding:
    if recipe.text_tokens:
        return recipe.embed_texts(batch.text, batch.text_mask)
    return recipe.embed_texts(batch.text)


def step0_health(recipe: Recipe, batch: Batch, total_steps: int = 1) -> Step0Health:
    """Measure ``recipe`` as it is (before its first step) on ``batch`` (B matched pairs).

    The RNG state is restored afterwards (a recipe's loss may draw dropout or jitter), no
    parameter and no ``.grad`` is changed, so training goes on exactly as without the check."""
    progress = Progress(0, max(1, total_steps))
    b = int(batch.image.shape[0])
    log_b = math.log(b)
    scalars = recipe.step0_scalars()
    learned = {
        role: (s, key) for role, (s, key) in scalars.items() if s.learnable and s.log_value.numel()
    }
    was_training = recipe.training
    devices = [batch.image.device] if batch.image.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        recipe.train()
        try:
            out = recipe.loss(batch, progress)
            params = [s.log_value for s, _ in learned.values()]
            grads = torch.autograd.grad(out.total, params, allow_unused=True) if params else []
            recipe.eval()
            with torch.no_grad():
                images = recipe.embed_images(batch.image)
                texts = _embed_texts(recipe, batch)
                logits = recipe.scores(texts, images, "text").double()
                logits = logits / recipe.logit_temperature(progress)
                r_image = recipe.distance_to_origin(images)
                r_text = recipe.distance_to_origin(texts)
                c = recipe.curvature_value()
        finally:
            recipe.train(was_training)
    loss = float(out.total.detach())
    sensitivity = {
        role: (0.0 if g is None else float(g.detach().abs().sum()))
        for role, g in zip(learned, grads, strict=True)
    }
    target = torch.arange(b, device=logits.device)
    recall = float((logits.argmax(dim=1) == target).double().mean())
    spread = float((logits.max(dim=1).values - logits.min(dim=1).values).mean())
    feature_norm = {
        "image": float(batch.image.double().norm(dim=-1).mean()),
        "text": float(batch.text.double().norm(dim=-1).mean()),
    }
    radius: dict[str, float] | None = None
    curved: dict[str, float] | None = None
    c_mean = None if c is None else float(c.double().mean())
    if r_image is not None and r_text is not None:
        radius = {"image": float(r_image.mean()), "text": float(r_text.mean())}
        if c_mean is not None:
            curved = {k: c_mean * v**2 for k, v in radius.items()}

    warnings: list[Step0Warning] = []
    scale_knobs = tuple(recipe.scale_knobs)
    flat_knobs = (*scale_knobs, *((recipe.temperature_knob,) if recipe.temperature_knob else ()))
    fix_flat = _knobs(flat_knobs) or "the recipe's scale or temperature"
    radius_knobs = scale_knobs or ("curvature_init",)
    ratio = loss / log_b
    gap = recipe.radius_gap_knob if recipe.radius_gap_knob and _equal(radius) else None
    if ratio >= LOSS_AT_CHANCE and recall >= INFORMATIVE_RANKING / b:
        why = f"set {gap} below 1 (texts nearer the origin)" if gap else f"raise {fix_flat}"
        warnings.append(
            Step0Warning(
                "loss_at_chance",
                (gap,) if gap else flat_knobs,
                f"the step-0 loss is {loss:.3f} = {100 * ratio:.0f}% of log B ({log_b:.3f}) "
                f"although the step-0 ranking finds {100 * recall:.0f}% of the batch's matches "
                f"(chance {100 / b:.1f}%): the loss does not read the ranking; {why}",
                value=ratio,
                threshold=LOSS_AT_CHANCE,
            )
        )
    if spread < MIN_LOGIT_SPREAD:
        warnings.append(
            Step0Warning(
                "flat_logits",
                flat_knobs,
                f"the step-0 logits span {spread:.2f} on average (a softmax over {b} is nearly "
                f"uniform below {MIN_LOGIT_SPREAD:g}); raise {fix_flat}",
                value=spread,
                threshold=MIN_LOGIT_SPREAD,
            )
        )
    if curved is not None and radius is not None:
        side, low = min(curved.items(), key=lambda kv: kv[1])
        if low < MIN_CURVED:
            warnings.append(
                Step0Warning(
                    "flat_geometry",
                    radius_knobs,
                    f"the {side} points start at radius {radius[side]:.3g} (c r^2 = {low:.2g} < "
                    f"{MIN_CURVED:g}): there the hyperboloid is flat and the curvature cannot "
                    f"change the distances; raise {_knobs(radius_knobs)}",
                    value=low,
                    threshold=MIN_CURVED,
                )
            )
        side, high = max(curved.items(), key=lambda kv: kv[1])
        if high > MAX_CURVED:
            warnings.append(
                Step0Warning(
                    "far_out",
                    radius_knobs,
                    f"the {side} points start at radius {radius[side]:.3g} (c r^2 = {high:.3g} > "
                    f"{MAX_CURVED:g}): distances saturate; lower {_knobs(radius_knobs)}",
                    value=high,
                    threshold=MAX_CURVED,
                )
            )
    if gap and radius is not None:  # a gap is only found between two radii
        warnings.append(
            Step0Warning(
                "equal_radii",
                (gap,),
                f"texts and images start at one radius ({radius['text']:.3g} vs "
                f"{radius['image']:.3g}): there the angle at the text equals the angle at the "
                f"image and the loss's two directions cancel; set {gap} below 1",
                value=_relative_gap(radius),
                threshold=EQUAL_RADII,
            )
        )
    for role, value in sensitivity.items():
        if value < MIN_SENSITIVITY:
            key = learned[role][1]
            by_radius = role == "curvature" and bool(scale_knobs)
            fix = scale_knobs if by_radius else (key,)
            warnings.append(
                Step0Warning(
                    f"inert_{role}",
                    fix,
                    f"the learned {role} cannot move the step-0 loss (|dL/d log {role}| = "
                    f"{value:.1e} < {MIN_SENSITIVITY:g}); "
                    + (
                        f"the points sit too near the origin: raise {_knobs(fix)}"
                        if by_radius
                        else f"change {_knobs(fix)}"
                    ),
                    value=value,
                    threshold=MIN_SENSITIVITY,
                )
            )
    return Step0Health(
        batch_size=b,
        log_b=log_b,
        loss=loss,
        loss_ratio=ratio,
        recall_at_1=recall,
        logit_spread=spread,
        feature_norm=feature_norm,
        radius=radius,
        curvature=c_mean,
        curvature_radius2=curved,
        sensitivity=sensitivity,
        warnings=tuple(warnings),
    )


def _relative_gap(radius: Mapping[str, float]) -> float:
    """|r_image - r_text| as a share of the larger radius."""
    a, b = radius["image"], radius["text"]
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _equal(radius: dict[str, float] | None) -> bool:
    return bool(radius) and _relative_gap(radius or {}) <= EQUAL_RADII


def check_step0(
    recipe: Recipe,
    sampler: BatchSampler,
    total_steps: int,
    notify: Callable[[str], None] | None = None,
) -> Step0Health:
    """``step0_health`` on the next batch ``sampler`` (a ``data.sampling.BatchSampler``) would
    draw, without consuming it (its state is restored), each warning passed to ``notify`` as
    ``warning_line`` writes it ("step-0 check [code]: ..."). Train-time entry point (``Trainer.fit``)."""
    state = sampler.state_dict()
    try:
        batch = sampler.next_batch()
    finally:
        sampler.load_state_dict(state)
    device = next((p.device for p in recipe.parameters()), torch.device("cpu"))
    report = step0_health(recipe, batch.to(device), total_steps)
    for warning in report.warnings:
        if notify is not None:
            notify(warning_line(warning))
    return report


def warning_line(warning: Step0Warning) -> str:
    """The one line a step-0 warning is shown and recorded as: "step-0 check [code]: ..."
    (``step0_codes`` reads the codes back, e.g. for a table's marker)."""
    return f"{WARNING_PREFIX}[{warning.code}]: {warning.message}"


def step0_codes(lines: list[str]) -> list[str]:
    """The codes of the step-0 warnings among ``lines`` (as ``warning_line`` writes them,
    possibly behind a prefix such as "seed 3: "), in order, without repeats."""
    codes: list[str] = []
    for line in lines:
        start = line.find(WARNING_PREFIX + "[")
        if start < 0:
            continue
        rest = line[start + len(WARNING_PREFIX) + 1 :]
        code = rest.split("]", 1)[0]
        if code and code not in codes:
            codes.append(code)
    return codes


__all__ = [
    "META_KEY",
    "WARNING_PREFIX",
    "Step0Health",
    "Step0Warning",
    "check_step0",
    "step0_codes",
    "step0_health",
    "warning_line",
]
