"""What a fresh [N, M] float32 tensor costs on CPU, against a pass over an existing one.

The fused Lorentz kernels (docs/scale.md, "The fused Lorentz and exterior-angle kernels") were
built on this measurement: at B = 4096 an elementwise map that writes a *new* 64 MiB tensor
pays the page faults of fresh memory, several times the cost of the same pass over a buffer
that already exists. Printed, for one thread, median of ``--repeats``:

- ``fresh``: ``torch.empty(N, N).fill_(1)`` (allocate, touch every page);
- ``reused``: ``b.fill_(1)`` on an existing buffer;
- ``transposed copy``: ``g.t().contiguous()`` (what a kernel reading a transposed gradient
  without strides would pay);

each in a fresh process with PyTorch's allocator as it is, and again with
``THP_MEM_ALLOC_ENABLE=1`` (transparent huge pages for large CPU allocations, read by PyTorch at
start-up; it only helps where ``/sys/kernel/mm/transparent_hugepage/enabled`` allows
``madvise``).

    python benchmarks/allocation.py            # N = 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(n: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)

    def median_ms(fn) -> float:  # noqa: ANN001
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    buffer = torch.empty(n, n)
    grad = torch.randn(n, n)
    return {
        "fresh": median_ms(lambda: torch.empty(n, n).fill_(1.0)),
        "reused": median_ms(lambda: buffer.fill_(1.0)),
        "transposed copy": median_ms(lambda: grad.t().contiguous()),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=4096, help="the tensor is [n, n] float32")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        print(json.dumps(measure(args.n, args.repeats)))
        return

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    runs = {}
    for label, extra in (
        ("default", {}),
        ("THP_MEM_ALLOC_ENABLE=1", {"THP_MEM_ALLOC_ENABLE": "1"}),
    ):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | extra
        out = subprocess.run(
            [sys.executable, __file__, "--_child", "--n", str(args.n), "--repeats", str(args.repeats)],
            check=True, capture_output=True, text=True, env=env,
        )  # fmt: skip
        runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = args.n * args.n * 4 / 2**20
    print(f"[{args.n}, {args.n}] float32 ({mib:.0f} MiB), 1 thread, median of {args.repeats}; "
          f"transparent huge pages: {thp}")  # fmt: skip
    print(f"{'ms':<18}" + "".join(f"{label:>26}" for label in runs))
    for what in ("fresh", "reused", "transposed copy"):
        print(f"{what:<18}" + "".join(f"{runs[label][what]:26.1f}" for label in runs))
    d = runs["default"]
    print(f"fresh / reused: {d['fresh'] / d['reused']:.1f}x; fresh with THP / without: "
          f"{runs['THP_MEM_ALLOC_ENABLE=1']['fresh'] / d['fresh']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
