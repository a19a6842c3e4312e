"""PHyCLIP's l1-product distance on a CUDA GPU: the Triton kernels against the alternatives.

Cases, each inside a symmetric InfoNCE, forward + backward, B x B scores from B points of
total width D = k x d (k = 64 factors of d = 8 by default):
  cosine        CLIP's cosine similarity (the baseline every ratio is taken against)
  l1            -product.l1_pairwise_dist / k, the default CUDA path: the Triton kernels of
                geometry/_triton_l1.py (the script checks that this path is the one taken)
  l1-ref        the same with fused=False: the eager blocked reference the kernels are tested
                against (custom autograd function, recomputing blocks in the backward)
  l1-compiled   torch.compile of the plain formula (bmm, clamp, sqrt, log1p, sum over factors),
                Inductor's default: what "compile it instead" would give; it keeps [k, B, B]
                intermediates for the backward, so at large B it can run out of memory (reported)

Times are CUDA-event times of one step, median over ``--repeats`` interleaved rounds (every case
once per round) after a warm-up that also compiles; peak memory is
``torch.cuda.max_memory_allocated`` during one step beyond what was allocated before it.
Before timing, the Triton path's value and gradients (X, Y, c) are compared with the reference.

    python benchmarks/gpu_l1.py                          # B = 1024 and 4096, k = 64, d = 8
    python benchmarks/gpu_l1.py --batches 4096 --repeats 10
    python benchmarks/gpu_l1.py --batches 4096 --forward-only  # the forward's share of a step
    python benchmarks/gpu_l1.py --ptxas 90               # no GPU needed: registers and spills
    python benchmarks/gpu_l1.py --ptxas 90 --tiles 64,64 # the same for other tiles
    python benchmarks/gpu_l1.py --interpret              # no GPU needed: CPU smoke test
    python benchmarks/gpu_l1.py --sweep                  # the l1 case under each kernel setting

``--sweep`` times the ``l1`` case once per kernel setting (tiles, row groups, the backward's dot
precision, warps and stages of the backward and optionally of the forward; the list is ``SWEEP``
below, or ``--sweep "64x32:16:ieee:8x1,..."``) interleaved with ``cosine`` and
``l1-compiled``, and checks each setting's value and gradients against the reference first: the
measurement the defaults in ``geometry/_triton_l1.py`` were chosen from.

Without a CUDA GPU the timing run stops with a message. ``--ptxas ARCH`` compiles the kernels
for compute capability ARCH with Triton's own compiler and prints their registers, spills and
shared memory (what ``LAUNCH`` in geometry/_triton_l1.py was chosen from). ``--interpret`` runs
the whole harness on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``) at a tiny
size: it checks that the script and the kernels run; its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = ("cosine", "l1", "l1-ref", "l1-compiled")
#: kernel settings of ``--sweep``: BLOCK_NxBLOCK_M:row groups:dot precision:warpsxstages of the
#: backward[:warpsxstages of the forward]
SWEEP = (
    "32x32:16:ieee:4x1",
    "32x32:8:tf32x3:4x1",
    "32x32:16:tf32x3:4x1",
    "32x32:32:tf32x3:4x1",
    "32x32:16:tf32x3:4x2",
    "32x32:16:tf32x3:4x1:8x2",
    "64x32:16:tf32x3:8x1",
    "64x64:16:tf32x3:4x1:8x3",
    "32x64:16:tf32x3:4x1:4x3",
)


def build_step(case: str, batch: int, k: int, d: int, device, dtype, forward_only=False):  # noqa: ANN001, ANN201
    """Inputs for one case and a closure running one fwd + bwd of the symmetric InfoNCE (the
    forward alone, without autograd, with ``forward_only``)."""
    import torch
    import torch.nn.functional as F

    from curvalign.geometry import euclidean, lorentz, product

    g = torch.Generator().manual_seed(0)
    tau = 0.07
    labels = torch.arange(batch, device=device)
    if case == "cosine":
        X0 = torch.randn(batch, k * d, generator=g)
        Y0 = torch.randn(batch, k * d, generator=g)
    else:
        # Points at typical distances from the origin: exp map of small tangent vectors.
        X0 = lorentz.expmap0(torch.randn(batch, k, d, generator=g) / d**0.5, 1.0)
        Y0 = lorentz.expmap0(torch.randn(batch, k, d, generator=g) / d**0.5, 1.0)
    X = X0.to(device, dtype).requires_grad_()
    Y = Y0.to(device, dtype).requires_grad_()
    c = torch.ones(k, device=device, dtype=dtype, requires_grad=True)
    compiled = torch.compile(plain_l1) if case == "l1-compiled" else None

    def scores() -> torch.Tensor:
        if case == "cosine":
            return euclidean.pairwise_cosine(X, Y) / tau
        if case == "l1":
            return -product.l1_pairwise_dist(X, Y, c) / (k * tau)
        if case == "l1-ref":
            return -product.l1_pairwise_dist(X, Y, c, fused=False) / (k * tau)
        return -compiled(X, Y, c) / (k * tau)

    def step() -> None:
        if forward_only:
            with torch.no_grad():
                S = scores()
                0.5 * (F.cross_entropy(S, labels) + F.cross_entropy(S.t(), labels))
            return
        S = scores()
        loss = 0.5 * (F.cross_entropy(S, labels) + F.cross_entropy(S.t(), labels))
        loss.backward()
        X.grad = Y.grad = c.grad = None

    return step


def plain_l1(X, Y, c):  # noqa: ANN001, ANN201
    """The l1-product distance as plain torch ops (what torch.compile is given): [N, M]."""
    import torch

    Xk, Yk = X.transpose(0, 1), Y.transpose(0, 1)  # [k, N, d], [k, M, d]
    cv = c.view(-1, 1)
    tx = torch.sqrt(1.0 / cv + (Xk * Xk).sum(-1))
    ty = torch.sqrt(1.0 / cv + (Yk * Yk).sum(-1))
    w = (tx.unsqueeze(-1) * ty.unsqueeze(1) - torch.bmm(Xk, Yk.transpose(1, 2))) * (
        0.5 * c.view(-1, 1, 1)
    ) - 0.5
    u = w.clamp_min(0.0)
    acosh = torch.log1p(2.0 * (u + torch.sqrt(u + u * u)))
    return (acosh * torch.rsqrt(c).view(-1, 1, 1)).sum(0)


def check_triton_path(batch: int, k: int, d: int, device, dtype) -> str:  # noqa: ANN001
    """Value and gradients of the default path against the reference; fails if it is not Triton."""
    import torch

    from curvalign.geometry import lorentz, product

    g = torch.Generator().manual_seed(1)
    X0 = lorentz.expmap0(torch.randn(batch, k, d, generator=g) / d**0.5, 1.0)
    Y0 = lorentz.expmap0(torch.randn(batch, k, d, generator=g) / d**0.5, 1.0)
    W = torch.randn(batch, batch, generator=g).to(device, dtype)
    results = []
    for fused in (None, False):
        X = X0.to(device, dtype).requires_grad_()
        Y = Y0.to(device, dtype).requires_grad_()
        c = torch.linspace(0.5, 2.0, k, device=device, dtype=dtype).requires_grad_()
        out = product.l1_pairwise_dist(X, Y, c, fused=fused)
        if fused is None and "curvalign_l1_triton_forward" not in type(out.grad_fn).__name__:
            raise SystemExit(
                f"gpu_l1.py: the default path took {type(out.grad_fn).__name__}, not the Triton "
                "kernels (is triton installed, CURVALIGN_FUSED unset? see the warnings above)"
            )
        grads = torch.autograd.grad((out * W).sum(), (X, Y, c))
        results.append((out, *grads))
    errors = []
    for name, a, b in zip(("value", "dX", "dY", "dc"), *results, strict=True):
        a, b = a.detach(), b.detach()
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1.0))
        errors.append(f"{name} {err:.2g}")
    return "max error of the Triton path vs the reference (relative to the largest entry): " + (
        ", ".join(errors)
    )


def measure(cases, batch, k, d, repeats, device, dtype, sync, clock, forward_only=False):  # noqa: ANN001, ANN201
    """Median step time and peak extra memory per case; cases interleaved in every round."""
    import torch

    steps, failed = {}, {}
    for case in cases:
        try:
            steps[case] = build_step(case, batch, k, d, device, dtype, forward_only)
            steps[case]()  # warm-up: Triton / Inductor compile here
            sync()
        except torch.OutOfMemoryError:
            failed[case] = "out of memory"
        except Exception as exc:  # noqa: BLE001 - report the case, time the others
            failed[case] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        if case in failed:
            steps.pop(case, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    times: dict[str, list[float]] = {case: [] for case in steps}
    for _ in range(repeats):
        for case, step in steps.items():
            times[case].append(clock(step))
    peaks = {}
    for case, step in steps.items():
        if device.type == "cuda":
            sync()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            sync()
            peaks[case] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return {case: statistics.median(t) for case, t in times.items()}, peaks, failed


def print_table(batch, k, d, dtype, times, peaks, failed, what, passes="fwd+bwd") -> None:  # noqa: ANN001
    print(
        f"\nsymmetric InfoNCE {passes}, B={batch}, k={k}, d={d}, {dtype}, {what} "
        "(ratios from one run, cases interleaved)"
    )
    base_t = times.get("cosine")
    base_m = peaks.get("cosine")
    print(f"{'case':<13}{'time (ms)':>11}{'x cosine':>10}{'peak MiB':>10}{'x cosine':>10}")
    for case in CASES:
        if case in failed:
            print(f"{case:<13}  {failed[case]}")
            continue
        if case not in times:
            continue
        t = times[case]
        rt = f"{t / base_t:10.2f}" if base_t else f"{'':>10}"
        if case in peaks:
            m = peaks[case]
            rm = f"{m / base_m:10.2f}" if base_m else f"{'':>10}"
            mem = f"{m:10.0f}{rm}"
        else:
            mem = ""
        print(f"{case:<13}{t * 1e3:11.2f}{rt}{mem}")


def report_ptxas(arch: int, dtype_name: str, width: int, tiles: tuple[int, int]) -> None:
    import torch
    import triton

    from curvalign.geometry import _triton_l1

    dtype = getattr(torch, dtype_name)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    print(f"Triton {triton.__version__}, sm_{arch}, {dtype}, d + 1 = {width}, ", end="")
    print(f"tiles {tiles}, (warps, stages) {_triton_l1.LAUNCH[dtype]}")
    compiled = _triton_l1.compile_for(arch, dtype, width, tiles)
    for name, kernel in compiled.items():
        path = f"/tmp/curvalign_l1_{name}_{os.getpid()}.cubin"
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        try:
            usage = subprocess.run(
                [cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True
            ).stdout
        finally:
            os.unlink(path)
        line = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), "?")
        fields = dict(f.split(":") for f in line.split() if ":" in f)
        print(
            f"  {name:<8} registers {fields.get('REG', '?'):>4}, spill stack "
            f"{fields.get('STACK', '?'):>5} B, shared {kernel.metadata.shared:>6} B"
        )


def apply_setting(setting: str, dtype) -> None:  # noqa: ANN001
    """Set the kernels' module knobs from ``NxM:groups:precision:warpsxstages`` (the backward's;
    optionally ``:warpsxstages`` of the forward kernel)."""
    from curvalign.geometry import _triton_l1

    tiles, groups, precision, launch, *forward = setting.split(":")
    _triton_l1.BLOCKS = tuple(int(t) for t in tiles.split("x"))
    _triton_l1.ROW_GROUPS = int(groups)
    _triton_l1.DOT_PRECISION[dtype] = precision
    _triton_l1.LAUNCH[dtype]["backward"] = tuple(int(t) for t in launch.split("x"))
    if forward:
        _triton_l1.LAUNCH[dtype]["forward"] = tuple(int(t) for t in forward[0].split("x"))


def run_sweep(settings, batches, k, d, repeats, device, dtype, sync, clock) -> None:  # noqa: ANN001
    """The l1 case per kernel setting, interleaved with cosine and Inductor's compile."""
    import torch

    for batch in batches:
        steps = {}
        for case in ("cosine", "l1-compiled"):
            try:
                steps[case] = build_step(case, batch, k, d, device, dtype)
                steps[case]()
            except Exception as exc:  # noqa: BLE001 - report, time the rest
                print(f"B={batch} {case}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        for setting in settings:
            apply_setting(setting, dtype)
            try:
                if batch == batches[0]:
                    print(setting, check_triton_path(min(batch, 512), k, d, device, dtype))
                step = build_step("l1", batch, k, d, device, dtype)
                step()
                sync()
            except Exception as exc:  # noqa: BLE001 - report, time the rest
                print(
                    f"B={batch} {setting}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                )
                continue
            times: dict[str, list[float]] = {"l1": []}
            for case in steps:
                times.setdefault(case, [])
            for _ in range(repeats):
                times["l1"].append(clock(step))
                for case, other in steps.items():
                    times[case].append(clock(other))
            sync()
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            step()
            sync()
            peak = (
                (torch.cuda.max_memory_allocated(device) - base) / 2**20
                if device.type == "cuda"
                else float("nan")
            )
            med = {case: statistics.median(t) for case, t in times.items()}
            comp = med.get("l1-compiled")
            print(
                f"B={batch:<5} {setting:<28} l1 {med['l1'] * 1e3:8.2f} ms  "
                f"x cosine {med['l1'] / med['cosine']:6.2f}  "
                + (f"x compiled {med['l1'] / comp:5.2f}  " if comp else "")
                + f"peak {peak:7.0f} MiB",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1024,4096")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--forward-only",
        action="store_true",
        help="time the forward pass alone (no autograd): with the default run, where time goes",
    )
    parser.add_argument(
        "--ptxas", type=int, metavar="ARCH", help="compile for sm_ARCH and report registers"
    )
    parser.add_argument(
        "--interpret", action="store_true", help="CPU smoke test under TRITON_INTERPRET=1"
    )
    parser.add_argument(
        "--tiles", help="BLOCK_N,BLOCK_M of the Triton kernels (default: _triton_l1.BLOCKS)"
    )
    parser.add_argument(
        "--sweep",
        nargs="?",
        const=",".join(SWEEP),
        default=None,
        help="time the l1 case under each kernel setting (default list: SWEEP)",
    )
    args = parser.parse_args()
    tiles = tuple(int(t) for t in args.tiles.split(",")) if args.tiles else None
    if args.ptxas:
        from curvalign.geometry import _triton_l1

        report_ptxas(args.ptxas, args.dtype, args.d + 1, tiles or _triton_l1.BLOCKS)
        return
    if args.interpret:
        # Triton reads the variable when it decorates kernels: set before anything imports it.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    dtype = getattr(torch, args.dtype)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; expected among {CASES}")
    if args.interpret:
        from curvalign.geometry import _triton_l1, product

        device = torch.device("cpu")
        product._l1_path = lambda device, dtype, width: "triton"  # CPU tensors: Triton path
        _triton_l1.BLOCKS = (16, 16)
        batches = [int(b) for b in args.batches.split(",")] if "--batches" in sys.argv else [24]
        k = args.k if "--k" in sys.argv else 4
        cases = [c for c in cases if c != "l1-compiled"]  # Inductor on CPU is not the point here

        def sync() -> None:
            pass

        def clock(step) -> float:  # noqa: ANN001
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

        what = "CPU, Triton interpreter: a smoke test, the times mean nothing"
    else:
        if not torch.cuda.is_available():
            raise SystemExit(
                "gpu_l1.py: no CUDA GPU here (torch.cuda.is_available() is False). Run it on a "
                "machine with one; without a GPU, --ptxas 90 reports the kernels' registers and "
                "--interpret runs a CPU smoke test under Triton's interpreter."
            )
        device = torch.device("cuda")
        batches, k = [int(b) for b in args.batches.split(",")], args.k

        def sync() -> None:
            torch.cuda.synchronize(device)

        def clock(step) -> float:  # noqa: ANN001
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        what = f"{torch.cuda.get_device_name(device)}, CUDA events, median of {args.repeats}"
    if args.sweep:
        run_sweep(
            args.sweep.split(","), batches, k, args.d, args.repeats, device, dtype, sync, clock
        )
        return
    if tiles:
        from curvalign.geometry import _triton_l1

        _triton_l1.BLOCKS = tiles
    print(check_triton_path(min(batches[0], 512), k, args.d, device, dtype))
    for batch in batches:
        times, peaks, failed = measure(
            cases, batch, k, args.d, args.repeats, device, dtype, sync, clock, args.forward_only
        )
        passes = "forward only" if args.forward_only else "fwd+bwd"
        print_table(batch, k, args.d, dtype, times, peaks, failed, what, passes)


if __name__ == "__main__":
    main()
