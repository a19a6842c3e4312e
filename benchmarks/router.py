"""AGR's B x B router: the folded path (``matrix_logits``) against the explicit 34-feature path
(``pair_logits`` on every pair, the way a naive implementation builds ``[B, B, 34]``).

Reports, for one B x B batch in training mode (forward + backward of the logits' sum):
  saved    bytes kept for backward per pair (``torch.autograd.graph.saved_tensors_hooks``)
  time     median fwd + bwd time over ``--repeats`` runs, and the ratio folded / explicit
Both paths run in one process on the same inputs, so the ratios are measured in one run.

    python benchmarks/router.py                 # B = 512
    python benchmarks/router.py --batch 1024 --threads 2
    python benchmarks/router.py --kernel --batch 1024 --threads 1   # the folded path alone

``--kernel`` times only the folded path (on CPU the fused kernel, dropout on as in training),
its forward and its backward apart, in CPU seconds of this process (``time.process_time``: the
steadier figure on a loaded machine with one thread; with several it sums their time), median
and best of ``--repeats`` after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from curvalign.nn.router import PairwiseRouter


def saved_bytes_per_pair(fn, pairs: int) -> float:
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / pairs


def median_time(fn, repeats: int) -> float:
    fn().sum().backward()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_times(fn, weight: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
    """CPU seconds of ``fn()`` (the forward) and of its backward with ``weight`` as the
    gradient, ``repeats`` times after one warm-up."""
    fn().backward(weight)
    forward, backward = [], []
    for _ in range(repeats):
        start = time.process_time()
        out = fn()
        mid = time.process_time()
        out.backward(weight)
        forward.append(mid - start)
        backward.append(time.process_time() - mid)
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument(
        "--dim", type=int, default=512, help="trunk feature size of both modalities"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--kernel",
        action="store_true",
        help="only the folded path: forward and backward apart, CPU seconds",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b = args.batch
    router = PairwiseRouter(args.dim, args.dim).train()
    s_e, s_h = torch.randn(b, b), -5 * torch.rand(b, b)
    h_t, h_i = torch.randn(b, args.dim), torch.randn(b, args.dim)

    def folded():
        return router.matrix_logits(s_e, s_h, router.text_context(h_t), router.image_context(h_i))

    def explicit():
        return router.pair_logits(
            s_e, s_h, router.text_context(h_t)[:, None], router.image_context(h_i)[None]
        )

    if args.kernel:
        weight = torch.randn(b, b)
        fwd, bwd = kernel_times(folded, weight, args.repeats)
        print(
            f"B = {b}, {torch.get_num_threads()} thread(s), training mode (dropout 0.1), "
            "CPU seconds, "
            f"median / best of {args.repeats}: forward {statistics.median(fwd):.3f} / "
            f"{min(fwd):.3f} s, backward {statistics.median(bwd):.3f} / {min(bwd):.3f} s"
        )
        return

    rows = []
    for name, fn in (
        ("folded (matrix_logits)", folded),
        ("explicit [B,B,34] (pair_logits)", explicit),
    ):
        rows.append((name, saved_bytes_per_pair(fn, b * b), median_time(fn, args.repeats)))
    print(f"B = {b}, {torch.get_num_threads()} threads, training mode, fwd + bwd")
    for name, saved, seconds in rows:
        print(f"  {name:34s} saved {saved:7.0f} B/pair   time {seconds * 1e3:8.1f} ms")
    print(
        f"  ratio folded / explicit: saved {rows[0][1] / rows[1][1]:.2f}, time {rows[0][2] / rows[1][2]:.2f}"
    )


if __name__ == "__main__":
    main()
