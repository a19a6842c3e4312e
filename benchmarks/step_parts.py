"""Where a training step's time goes: head, score, router, loss, optimiser (benchmarks/scale.py)."""

from __future__ import annotations

import time

import torch

# --- where a step's time goes -----------------------------------------------------------------

PARTS = ("head", "score", "router", "loss", "optimiser")


class _Mark(torch.autograd.Function):
    """Identity whose backward records when the gradient of a part's output arrives (the part's
    backward is about to run: the engine runs nodes in reverse creation order on one thread)."""

    @staticmethod
    def forward(ctx, label: str, events: list, x):  # type: ignore[no-untyped-def, override]
        ctx.label, ctx.events = label, events
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        ctx.events.append((time.perf_counter(), ctx.label))
        return None, None, grad


def part_breakdown(trainer, progress) -> dict[str, float]:  # noqa: ANN001 - Trainer, Progress
    """Seconds of one training step per part (forward + backward): ``head`` (embed_images /
    embed_texts), ``score`` (the B x B score functions of curvalign.scores and the pairwise
    geometry), ``router`` (AGR's PairwiseRouter.matrix_logits), ``optimiser`` (clipping, step,
    schedule) and ``loss`` (the rest of the recipe's loss). Forward times are measured around
    each call (outermost labelled call only); backward time is attributed by marks on each
    part's outputs (the interval from a mark to the next belongs to the part whose output
    gradient arrived), so it is approximate where parts' backward nodes interleave."""
    import sys

    import curvalign.geometry.euclidean as euclidean
    import curvalign.geometry.lorentz as lorentz
    import curvalign.geometry.product as product
    import curvalign.geometry.sphere as sphere
    import curvalign.scores as scores
    from curvalign.nn.router import PairwiseRouter

    forward = dict.fromkeys(PARTS, 0.0)
    events: list[tuple[float, str]] = []
    stack: list[str] = []

    def mark(label: str, out):  # noqa: ANN001, ANN202
        if isinstance(out, torch.Tensor):
            return _Mark.apply(label, events, out) if out.requires_grad else out
        if isinstance(out, dict):
            return {k: mark(label, v) for k, v in out.items()}
        if isinstance(out, tuple):
            return tuple(mark(label, v) for v in out)
        return out

    def wrap(label: str, fn):  # noqa: ANN001, ANN202
        def inner(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if stack:  # nested in a labelled call: counted there
                return fn(*args, **kwargs)
            stack.append(label)
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                forward[label] += time.perf_counter() - start
                stack.pop()
            return mark(label, out)

        return inner

    score_fns = {
        getattr(m, n)
        for m, names in (
            (scores, [n for n in dir(scores) if n.endswith("_scores")]),
            (lorentz, ["pairwise_dist", "pairwise_exterior_angle", "pairwise_inner"]),
            (product, ["l1_pairwise_dist", "mixed_pairwise_sqdist"]),
            (sphere, ["pairwise_dist"]),
            (euclidean, ["pairwise_cosine", "pairwise_sqdist"]),
        )
        for n in names
        if hasattr(m, n)
    }
    patched: list[tuple[object, str, object]] = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("curvalign") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and any(value is f for f in score_fns):
                patched.append((module, attr, value))
                setattr(module, attr, wrap("score", value))
    recipe = trainer.recipe
    for attr in ("embed_images", "embed_texts"):
        patched.append((recipe, attr, None))
        setattr(recipe, attr, wrap("head", getattr(recipe, attr)))
    original_router = PairwiseRouter.matrix_logits
    PairwiseRouter.matrix_logits = wrap("router", original_router)
    original_backward = torch.Tensor.backward
    original_clip = torch.nn.utils.clip_grad_norm_
    times: dict[str, float] = {}

    def backward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        times["backward_start"] = time.perf_counter()
        original_backward(self, *args, **kwargs)
        times["backward_end"] = time.perf_counter()

    torch.Tensor.backward = backward
    try:
        start = time.perf_counter()
        trainer.train_step(progress)
        total = time.perf_counter() - start
    finally:
        torch.Tensor.backward = original_backward
        PairwiseRouter.matrix_logits = original_router
        torch.nn.utils.clip_grad_norm_ = original_clip
        for module, attr, value in reversed(patched):
            if value is None:
                delattr(module, attr)
            else:
                setattr(module, attr, value)
    seconds = dict(forward)
    b0, b1 = times.get("backward_start", start), times.get("backward_end", start)
    marks = [(b0, "loss"), *sorted(events), (b1, "")]
    for (t0, label), (t1, _) in zip(marks, marks[1:], strict=False):
        seconds[label] += max(t1 - t0, 0.0)
    seconds["optimiser"] += max(total - (b1 - start), 0.0) if b1 > start else 0.0
    # the forward's remainder (recipe glue, the loss functions) is "loss"
    seconds["loss"] += max((b0 - start) - sum(forward.values()), 0.0)
    seconds["total"] = total
    return seconds
