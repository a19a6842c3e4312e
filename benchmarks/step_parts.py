"""Where a training step's time goes: head, score, router, loss, optimiser (benchmarks/scale.py),
and PHyCLIP's loss part by part (``python benchmarks/step_parts.py --batch 1024``)."""

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


# --- PHyCLIP's loss, part by part -------------------------------------------------------------


def phyclip_loss_parts(batch: int, k: int, d: int, rounds: int) -> dict[str, float]:
    """Best seconds (forward + backward, fresh inputs, interleaved rounds) of the pieces of
    PHyCLIP's loss against a cosine InfoNCE of the same batch and width ``k d``: ``cosine``
    (CLIP's score + both InfoNCE directions), ``l1 score`` (one ``product_average_distance_scores``
    matrix + both directions; a step has two), ``l1 forward`` and ``l1 backward`` (the kernel's
    two passes under an incoming gradient), ``entailment`` (one ``entailment_cone_loss`` on
    ``[B, k, d]``; a step has four) and ``expmap0`` (one head's map; a step has four)."""
    import torch.nn.functional as F

    from curvalign.geometry import lorentz, product
    from curvalign.losses import entailment_cone_loss, info_nce
    from curvalign.scores import cosine_scores, product_average_distance_scores

    torch.manual_seed(0)
    c = torch.ones(k, requires_grad=True)

    def points() -> torch.Tensor:
        return lorentz.expmap0(torch.randn(batch, k, d) / d**0.5, 1.0).requires_grad_()

    def timed(fn) -> float:  # noqa: ANN001
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def cosine() -> float:
        a, b = (torch.randn(batch, k * d).requires_grad_() for _ in range(2))

        def run() -> None:
            s = cosine_scores(F.normalize(a, dim=-1), F.normalize(b, dim=-1))
            (0.5 * (info_nce(s, 0.07) + info_nce(s.T, 0.07))).backward()

        return timed(run)

    def l1_score() -> float:
        a, b = points(), points()

        def run() -> None:
            s = product_average_distance_scores(a, b, c)
            (0.5 * (info_nce(s, 0.07) + info_nce(s.T, 0.07))).backward()

        return timed(run)

    split: dict[str, float] = {}

    def l1_forward() -> float:
        a, b = points(), points()
        start = time.perf_counter()
        out = product.l1_pairwise_dist(a, b, c)
        split["forward"] = time.perf_counter() - start
        grad = torch.randn(batch, batch)
        start = time.perf_counter()
        out.backward(grad)
        split["backward"] = time.perf_counter() - start
        return split["forward"]

    def entailment() -> float:
        a, b = points(), points()
        return timed(lambda: entailment_cone_loss(a, b, c, eta=0.7).backward())

    def expmap0() -> float:
        v = torch.randn(batch, k, d, requires_grad=True)
        return timed(lambda: lorentz.expmap0(v * 0.3, c).sum().backward())

    cases = {
        "cosine": cosine,
        "l1 score": l1_score,
        "l1 forward": l1_forward,
        "l1 backward": lambda: split["backward"],
        "entailment": entailment,
        "expmap0": expmap0,
    }
    for fn in cases.values():
        fn()  # warm-up (and the kernels' build on first use)
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], fn())
    return best


def main() -> None:
    import argparse
    import os

    p = argparse.ArgumentParser(
        description="PHyCLIP's loss part by part against cosine InfoNCE (best of interleaved "
        "rounds). The per-part breakdown of whole training steps is in benchmarks/scale.py."
    )
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--factors", type=int, default=64)
    p.add_argument("--factor-dim", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    best = phyclip_loss_parts(args.batch, args.factors, args.factor_dim, args.rounds)
    print(
        f"PHyCLIP loss parts, B={args.batch}, k={args.factors}, d={args.factor_dim}, "
        f"{torch.get_num_threads()} thread(s), best of {args.rounds} interleaved rounds, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'part':<12} {'best (s)':>9} {'x cosine':>9}")
    for name, seconds in best.items():
        print(f"{name:<12} {seconds:9.4f} {seconds / best['cosine']:9.2f}")


if __name__ == "__main__":
    main()
