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

Each failed test adds a ``Step0Warning`` naming the config key that fixes it. ``Step0Health``
is a frozen dataclass with ``to_json()``; the trainer records it in ``meta.json``
(``step0_health``) and its warnings in the run's notes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
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
    """One failed test: ``code`` names the test ("loss_at_chance", "flat_logits",
    "flat_geometry", "far_out", "equal_radii", "inert_curvature", "inert_temperature"),
    ``knob`` the config key(s) that fix it, ``message`` the line for the user."""

    code: str
    knob: str
    message: str


@dataclass(frozen=True)
class Step0Health:
    """What the step-0 check measured on one batch of B pairs (see the module docstring).

    radius, curvature_radius2  {"image", "text"} -> mean distance to the origin / c r^2
                               (None for a geometry without an origin)
    sensitivity                {"curvature", "temperature"} -> |dL / d log v| of the learned ones
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
        out = asdict(self)
        out["warnings"] = [asdict(w) for w in self.warnings]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Step0Health:
        values = dict(raw)
        values["warnings"] = tuple(Step0Warning(**w) for w in raw.get("warnings", []))
        return cls(**values)


def _knobs(keys: tuple[str, ...] | list[str]) -> str:
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
    scale = _knobs(recipe.scale_knobs)
    fix_flat = (
        _knobs(
            [*recipe.scale_knobs, *([recipe.temperature_knob] if recipe.temperature_knob else [])]
        )
        or "the recipe's scale or temperature"
    )
    ratio = loss / log_b
    gap = recipe.radius_gap_knob if recipe.radius_gap_knob and _equal(radius) else None
    if ratio >= LOSS_AT_CHANCE and recall >= INFORMATIVE_RANKING / b:
        knob = gap or fix_flat
        why = f"set {gap} below 1 (texts nearer the origin)" if gap else f"raise {fix_flat}"
        warnings.append(
            Step0Warning(
                "loss_at_chance",
                knob,
                f"the step-0 loss is {loss:.3f} = {100 * ratio:.0f}% of log B ({log_b:.3f}) "
                f"although the step-0 ranking finds {100 * recall:.0f}% of the batch's matches "
                f"(chance {100 / b:.1f}%): the loss does not read the ranking; {why}",
            )
        )
    if spread < MIN_LOGIT_SPREAD:
        warnings.append(
            Step0Warning(
                "flat_logits",
                fix_flat,
                f"the step-0 logits span {spread:.2f} on average (a softmax over {b} is nearly "
                f"uniform below {MIN_LOGIT_SPREAD:g}); raise {fix_flat}",
            )
        )
    if curved is not None and radius is not None:
        side, low = min(curved.items(), key=lambda kv: kv[1])
        if low < MIN_CURVED:
            warnings.append(
                Step0Warning(
                    "flat_geometry",
                    scale or "curvature_init",
                    f"the {side} points start at radius {radius[side]:.3g} (c r^2 = {low:.2g} < "
                    f"{MIN_CURVED:g}): there the hyperboloid is flat and the curvature cannot "
                    f"change the distances; raise {scale or 'curvature_init'}",
                )
            )
        side, high = max(curved.items(), key=lambda kv: kv[1])
        if high > MAX_CURVED:
            warnings.append(
                Step0Warning(
                    "far_out",
                    scale or "curvature_init",
                    f"the {side} points start at radius {radius[side]:.3g} (c r^2 = {high:.3g} > "
                    f"{MAX_CURVED:g}): distances saturate; lower {scale or 'curvature_init'}",
                )
            )
    if gap and radius is not None:  # a gap is only found between two radii
        warnings.append(
            Step0Warning(
                "equal_radii",
                gap,
                f"texts and images start at one radius ({radius['text']:.3g} vs "
                f"{radius['image']:.3g}): there the angle at the text equals the angle at the "
                f"image and the loss's two directions cancel; set {recipe.radius_gap_knob} "
                "below 1",
            )
        )
    for role, value in sensitivity.items():
        if value < MIN_SENSITIVITY:
            key = learned[role][1]
            fix = scale if role == "curvature" and scale else key
            warnings.append(
                Step0Warning(
                    f"inert_{role}",
                    fix,
                    f"the learned {role} cannot move the step-0 loss (|dL/d log {role}| = "
                    f"{value:.1e} < {MIN_SENSITIVITY:g}); "
                    + (
                        f"the points sit too near the origin: raise {fix}"
                        if role == "curvature" and scale
                        else f"change {fix}"
                    ),
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


def _equal(radius: dict[str, float] | None) -> bool:
    if not radius:
        return False
    a, b = radius["image"], radius["text"]
    return abs(a - b) <= EQUAL_RADII * max(abs(a), abs(b), 1e-12)


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
