"""How training cost grows: throughput and peak memory per recipe and batch size, PHyCLIP's
factor count, and two gloo processes against one, all measured in one run on cached features.

    python benchmarks/scale.py                                   # the default tables (~10 min, 2 cores)
    python benchmarks/scale.py --recipes clip,phyclip --batches 256,1024 --no-k --no-ddp   # smaller
    python benchmarks/scale.py --l1 8192      # only: PHyCLIP's product distance, memory and time
    python benchmarks/scale.py --profile agr --batches 1024   # only: the ops of one AGR step
    python benchmarks/scale.py --interleave meru,agr --batches 1024   # only: ratios, interleaved
    python benchmarks/scale.py --interleave meru,agr,router-floor --batches 1024   # + AGR's floor
    python benchmarks/scale.py --interleave meru,agr --batches 1024 --threads 1 --cpu-time   # CPU s

A synthetic feature store (``--world``) is generated once and saved; every case then runs in a
fresh subprocess that loads it, builds the Trainer (the recipes' paper-default dimensions unless
``KEY=VALUE`` overrides are given), takes ``--warmup`` steps and times the next ones, keeping the fastest (the least disturbed by
other processes on the machine). Peak memory
is the subprocess's ``ru_maxrss`` (the high-water mark of its resident set, the reliable figure on
CPU, store loading included); "train MiB" is the high-water mark of the training steps alone
(the kernel's VmHWM, reset after loading) minus the resident set before them.
Cases whose step time or memory, extrapolated from the smaller batch sizes (``_predict_skip``),
would exceed ``--max-step-seconds`` or ``--max-gib`` are skipped and reported as such. The
defaults (600 s a step, 12 GiB) let every recipe run at B = 256, 1024 and 4096, the slowest
(AGR at 4096) in minutes and about 6-7 GiB; lower them on a smaller or busier machine. A case
that runs past its time budget (``_case_timeout``) is stopped and reported, not waited for.
Timings on a shared machine are noisy: compare ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS_AT = {
    256: 3,
    1024: 2,
    4096: 1,
}  # timed steps per batch size (after the warm-up); the best is kept


# --- the measured case (runs in its own process) ---------------------------------------------


def _rss_mib() -> float:
    """Peak resident set of this process so far (ru_maxrss, KiB on Linux), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM), so that the peak of the training
    steps is measured apart from the peak of loading the store (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run_case(spec: dict) -> dict:
    import torch

    from curvalign.config import resolve_config
    from curvalign.data import load_data
    from curvalign.recipes.base import Progress
    from curvalign.train.distributed import (
        build_distributed_trainer,
        context_from_env,
        init_process_group,
    )
    from curvalign.train.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    context = context_from_env()
    overrides = {
        "batch_size": spec["batch"],
        "pair_batch_size": spec["batch"],
        "tensorboard": False,
        "checkpoint_every": 0,
        "steps": 1000,
        **spec["overrides"],
    }
    data = f"features:{spec['store']}"
    store = load_data(data)
    config = resolve_config(spec["recipe"], data, overrides=overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        if context.enabled:
            init_process_group(context)
            trainer = build_distributed_trainer(
                config, store, run_dir, context=context, show_progress=False
            )
        else:
            trainer = Trainer(config, store, run_dir, show_progress=False)
        import gc

        gc.collect()
        exact_peak = _reset_peak()
        loaded = _status_mib("VmRSS") if exact_peak else _rss_mib()
        for step in range(spec["warmup"]):
            trainer.train_step(Progress(step, 1000))
        times = []
        for step in range(spec["warmup"], spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            trainer.train_step(Progress(step, 1000))
            times.append(time.perf_counter() - start)
        seconds = min(times)  # the least disturbed step: other processes share the cores
        train_peak = (_status_mib("VmHWM") if exact_peak else _rss_mib()) or 0.0
        profile_table = ""
        if spec.get("profile"):  # one more step under torch.profiler: the ops that take the time
            from torch.profiler import profile

            with profile() as prof:
                trainer.train_step(Progress(spec["warmup"] + spec["steps"], 1000))
            profile_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        parts = {}
        if spec.get("parts"):  # one more step, instrumented (after the timed ones)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from step_parts import part_breakdown

            step = spec["warmup"] + spec["steps"]
            parts = part_breakdown(trainer, Progress(step, 1000))
    return {
        "step_s": seconds,
        "pairs_per_s": spec["batch"] / seconds,
        "peak_mib": _rss_mib(),
        "train_mib": max(train_peak - loaded, 0.0),
        "parts": parts,
        "profile": profile_table,
    }


def router_floor_step(batch: int):  # noqa: ANN201
    """A floor for AGR's router in one training step at this batch, as fast as this CPU does
    the two things it cannot avoid: per pair, 4 x 2048 multiply-adds (the ``64 x 32`` layer's
    product in the forward, again in the backward's recompute, and its two backward products),
    timed as MKL's ``512 x 512 x 512`` products of the same total (its best rate here), and
    2 x 96 exponentials (one per GELU evaluation, forward and recompute: erf's approximation and
    the GELU's derivative share it), timed as ``torch.exp`` on a cache-resident buffer. The
    first and output layers, the polynomials and divisions of erf, the dropout masks and every
    load and store are left out: a floor, not an estimate."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(512, 512, generator=g) for _ in range(3))
    x, y = 0.5 * torch.randn(1 << 16, generator=g), torch.empty(1 << 16)
    pairs = batch * batch
    products = max(1, round(pairs * 4 * 2048 / 512**3))
    exps = max(1, round(pairs * 2 * 96 / (1 << 16)))

    def step(_: int) -> None:
        for _ in range(products):
            torch.mm(a, b, out=c)
        for _ in range(exps):
            torch.exp(x, out=y)

    return step


def run_interleaved_case(spec: dict) -> dict:
    """Several recipes' Trainers in one process, their steps timed in interleaved rounds (a
    change of the machine's load hits every recipe alike): median seconds a step per recipe
    (``cpu_time``: this process's CPU seconds, ``time.process_time``, the steadier figure on a
    loaded machine with one thread; with several threads it sums them)."""
    import statistics

    import torch

    from curvalign.data import load_data
    from curvalign.recipes.base import Progress
    from curvalign.train.config import resolve_config
    from curvalign.train.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    data = f"features:{spec['store']}"
    store = load_data(data)
    overrides = {
        "batch_size": spec["batch"],
        "pair_batch_size": spec["batch"],
        "tensorboard": False,
        "checkpoint_every": 0,
        "steps": 1000,
        **spec["overrides"],
    }
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        steps = {}
        for r in spec["recipes"]:
            if r == "router-floor":
                steps[r] = router_floor_step(spec["batch"])
                continue
            trainer = Trainer(
                resolve_config(r, data, overrides=overrides),
                store,
                f"{run_dir}/{r}",
                show_progress=False,
            )
            steps[r] = lambda step, trainer=trainer: trainer.train_step(Progress(step, 1000))
        for run in steps.values():
            run(0)  # warm-up
        clock = time.process_time if spec.get("cpu_time") else time.perf_counter
        for step in range(1, spec["rounds"] + 1):
            for r, run in steps.items():
                start = clock()
                run(step)
                times.setdefault(r, []).append(clock() - start)
    return {r: statistics.median(ts) for r, ts in times.items()}


def run_l1_case(spec: dict) -> dict:
    """Forward + backward of ``l1_pairwise_dist`` at N = M = ``n`` (k factors of dimension d)."""
    import torch

    from curvalign.geometry.product import l1_pairwise_dist

    torch.set_num_threads(spec["threads"])
    n, k, d = spec["n"], spec["k"], spec["d"]
    g = torch.Generator().manual_seed(0)
    X = (0.3 * torch.randn(n, k, d, generator=g)).requires_grad_()
    Y = (0.3 * torch.randn(n, k, d, generator=g)).requires_grad_()
    c = torch.ones(k, requires_grad=True)
    before = _rss_mib()
    start = time.perf_counter()
    D = l1_pairwise_dist(X, Y, c)
    forward = time.perf_counter() - start
    D.mean().backward()
    backward = time.perf_counter() - start - forward
    peak = _rss_mib()
    finite = all(bool(torch.isfinite(t).all()) for t in (D, X.grad, Y.grad, c.grad))
    return {
        "forward_s": forward,
        "backward_s": backward,
        "peak_mib": peak,
        "before_mib": before,
        "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime,
        "finite": finite,
    }


def _case_timeout(spec: dict, max_step_seconds: float) -> float:
    """Seconds a case may take: its steps (warm-up, timed, the instrumented one) at the step-time
    limit, plus start-up (imports, loading the store, building the Trainer)."""
    steps = spec.get("warmup", 0) + spec.get("steps", 1) + (1 if spec.get("parts") else 0)
    return max(900.0, 300.0 + 1.5 * steps * max_step_seconds)


def _case_in_subprocess(spec: dict, nproc: int = 1, timeout: float = 900) -> dict:
    """Run ``spec`` in ``nproc`` fresh processes (gloo when 2+); the result of rank 0. A case
    still running after ``timeout`` seconds is killed and reported as an error."""
    command = [sys.executable, __file__, "--case", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    if nproc == 1:
        runs = [
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        ]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        runs = [
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    **env,
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
            )
            for r in range(nproc)
        ]
    deadline = time.monotonic() + timeout
    try:
        outputs = [run.communicate(timeout=max(deadline - time.monotonic(), 1)) for run in runs]
    except subprocess.TimeoutExpired:
        for run in runs:
            run.kill()
            run.communicate()
        return {"error": f"timed out after {timeout:.0f} s (raise --max-step-seconds)"}
    if any(run.returncode for run in runs):
        err = next(o[1] for o, run in zip(outputs, runs, strict=False) if run.returncode)
        return {"error": (err.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(outputs[0][0].strip().splitlines()[-1])


# --- the tables ------------------------------------------------------------------------------


def _growth(prev: dict | None, cur: dict, key: str) -> str:
    if not prev or "error" in prev or "error" in cur or "skipped" in cur or "skipped" in prev:
        return ""
    return f"x{cur[key] / prev[key]:.1f}" if prev[key] > 0 else ""


def _exponent(prev: dict | None, cur: dict, ratio: float) -> str:
    """Exponent p of step time ~ B^p between two successive batch sizes."""
    if not prev or any(k in d for d in (prev, cur) for k in ("error", "skipped")):
        return ""
    return f"{math.log(cur['step_s'] / prev['step_s']) / math.log(ratio):.2f}"


def _row(cells: list[str], widths: list[int]) -> str:
    return (
        "| "
        + " | ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        )
        + " |"
    )


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}\n")
    print(_row(header, widths))
    print(
        "|"
        + "|".join(
            ("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)
        )
        + "|"
    )
    for r in rows:
        print(_row(r, widths))
    sys.stdout.flush()


def _fmt(result: dict) -> tuple[str, str, str, str]:
    if "error" in result:
        return ("error: " + result["error"], "", "", "")
    if "skipped" in result:
        return (result["skipped"], "", "", "")
    return (
        f"{result['pairs_per_s']:.0f}",
        f"{result['step_s']:.3f}",
        f"{result['peak_mib']:.0f}",
        f"{result['train_mib']:.0f}",
    )


def predict_case(
    batch: int, prev: tuple[int, dict], prev2: tuple[int, dict] | None = None
) -> tuple[float, float]:
    """(seconds a step, peak GiB) at ``batch`` from the measured ``(batch, result)`` of the
    previous one or two sizes.

    Time: at least quadratic in B (the B x B score matrices), or the growth measured between the
    two previous sizes if faster. Memory: the training memory as an affine function of B^2
    through the two previous sizes (fixed and O(B) parts plus the B x B matrices and their
    gradients; with one size, all of it quadratic). On the docs/scale.md cost table the former
    linear extrapolation predicted 2.2 GiB for AGR at B = 4096, which then peaked at 6.6 GiB
    (5.1 GiB of it training memory); this fit gives 5.0 GiB of training memory, 5.3 GiB peak,
    and over-predicts the recipes whose memory grows slower than B^2 (up to 2x). Read the
    prediction to within about 1.3x.
    """
    b1, r1 = prev
    ratio = batch / b1
    time_growth = ratio**2
    if prev2 is not None:
        b0, r0 = prev2
        time_growth = max(
            time_growth, (r1["step_s"] / r0["step_s"]) ** (math.log(ratio) / math.log(b1 / b0))
        )
        per_pair2 = max(r1["train_mib"] - r0["train_mib"], 0.0) / (b1**2 - b0**2)
    else:
        per_pair2 = r1["train_mib"] / b1**2
    train = r1["train_mib"] + per_pair2 * (batch**2 - b1**2)
    return r1["step_s"] * time_growth, (r1["peak_mib"] + train - r1["train_mib"]) / 1024


def _predict_skip(
    batch: int,
    prev: tuple[int, dict] | None,
    prev2: tuple[int, dict] | None,
    args: argparse.Namespace,
) -> str | None:
    """Why the case at ``batch`` is skipped (the prediction of ``predict_case`` exceeds
    ``--max-step-seconds`` or ``--max-gib``), or None to run it."""
    if prev is None:
        return None
    if "step_s" not in prev[1]:
        return "skipped (smaller batch failed or was skipped)"
    usable = prev2 if prev2 is not None and "step_s" in prev2[1] else None
    step_s, gib = predict_case(batch, prev, usable)
    if step_s > args.max_step_seconds or gib > args.max_gib:
        return (
            f"skipped (predicted {step_s:.0f} s/step, {gib:.1f} GiB; limits "
            f"{args.max_step_seconds:.0f} s, {args.max_gib:.0f} GiB)"
        )
    return None


def print_cost_table(
    recipes: list[str], batches: list[int], by_case: dict[tuple[str, int], dict]
) -> None:
    """One table: step time as a ratio to clip's at the same batch, peak memory, and the share of
    the step each part takes (one instrumented step, see benchmarks/step_parts.py)."""
    from step_parts import PARTS

    rows = []
    for recipe in recipes:
        for batch in batches:
            r = by_case.get((recipe, batch), {})
            clip = by_case.get(("clip", batch), {})
            if "step_s" not in r:
                rows.append([recipe, str(batch), r.get("skipped") or r.get("error", "?")])
                rows[-1] += [""] * (5 + len(PARTS))
                continue
            ratio = f"{r['step_s'] / clip['step_s']:.1f}" if "step_s" in clip else ""
            parts = r.get("parts") or {}
            total = sum(parts.get(p, 0.0) for p in PARTS) or 1.0
            shares = [f"{100 * parts.get(p, 0.0) / total:.0f}%" for p in PARTS]
            top = max(PARTS, key=lambda p: parts.get(p, 0.0)) if parts else ""
            rows.append(
                [
                    recipe,
                    str(batch),
                    f"{r['step_s']:.3f}",
                    ratio,
                    f"{r['peak_mib']:.0f}",
                    f"{r['train_mib']:.0f}",
                    *shares,
                    top,
                ]
            )
    print_table(
        "Cost per recipe: step time as a ratio to clip's at the same batch, peak memory, and the "
        "share of one step per part (forward + backward)",
        ["recipe", "B", "s/step", "x clip", "peak MiB", "train MiB", *PARTS, "largest"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for every case"
    )
    parser.add_argument("--recipes", default="clip,meru,hycoclip,atmg,phyclip,proclip,agr,dualpath")
    parser.add_argument("--batches", default="256,1024,4096")
    parser.add_argument(
        "--world",
        default="synthetic:images=6000,text_pairs=4096",
        help="synthetic spec of the store: enough train images for the largest batch (the "
        "synthetic world keeps 20%% for test and 10%% for val: 6000 images leave 4200)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of a one-process case"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--max-step-seconds",
        type=float,
        default=600.0,
        help="skip a case whose predicted step exceeds this (the default runs every case)",
    )
    parser.add_argument(
        "--max-gib",
        type=float,
        default=12.0,
        help="skip a case whose predicted peak memory exceeds this (AGR at B=4096 needs ~7)",
    )
    parser.add_argument("--factors", default="8,32,64", help="PHyCLIP k values (d = 8)")
    parser.add_argument(
        "--k-batch", type=int, default=512, help="batch size of the PHyCLIP k sweep"
    )
    parser.add_argument("--ddp-recipes", default="clip,phyclip")
    parser.add_argument("--ddp-batch", type=int, default=512)
    parser.add_argument("--no-k", action="store_true", help="skip the PHyCLIP k sweep")
    parser.add_argument("--no-ddp", action="store_true", help="skip two processes against one")
    parser.add_argument(
        "--l1",
        type=int,
        default=0,
        metavar="N",
        help="only measure l1_pairwise_dist forward+backward at N = M (k=64, d=8) and exit",
    )
    parser.add_argument(
        "--profile",
        metavar="RECIPE",
        help="only profile one training step of RECIPE at the first of --batches (torch.profiler)",
    )
    parser.add_argument(
        "--interleave",
        metavar="R1,R2,...",
        help="only time these recipes' steps in one process, interleaved rounds, at each of "
        "--batches; ratios to the first recipe ('router-floor': the arithmetic AGR's router "
        "cannot avoid in one step, see router_floor_step)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --interleave")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="--interleave: CPU seconds of the process instead of wall-clock seconds (steadier "
        "under load with --threads 1; with more threads it sums their CPU time)",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # a measured case, in its own process
        case = json.loads(args.case)
        kind = case.get("kind")
        result = (
            run_l1_case(case)
            if kind == "l1"
            else run_interleaved_case(case)
            if kind == "interleaved"
            else run_case(case)
        )
        from curvalign.train.distributed import context_from_env, shutdown

        shutdown()
        if context_from_env().is_main:
            print(json.dumps(result))
        return 0

    if args.l1:
        r = _case_in_subprocess(
            {"kind": "l1", "n": args.l1, "k": 64, "d": 8, "threads": args.threads},
            timeout=24 * 3600,
        )
        print(
            f"l1_pairwise_dist, N = M = {args.l1}, k = 64, d = 8, {args.threads} thread(s): "
            + (
                f"error {r['error']}"
                if "error" in r
                else f"forward {r['forward_s']:.1f} s, backward {r['backward_s']:.1f} s, CPU {r['cpu_s']:.0f} s; peak RSS "
                f"{r['peak_mib'] / 1024:.2f} GiB (before the call {r['before_mib'] / 1024:.2f} GiB; the [N, M] output "
                f"{args.l1**2 * 4 / 2**30:.2f} GiB; a [k, N, M] intermediate would be "
                f"{64 * args.l1**2 * 4 / 2**30:.1f} GiB); finite: {r['finite']}"
            )
        )
        return 0

    import torch

    from curvalign.data import load_data

    overrides = dict(item.split("=", 1) for item in args.overrides)
    batches = [int(b) for b in args.batches.split(",")]
    recipes = [r for r in args.recipes.split(",") if r]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = Path(tmp) / "store"
        world = load_data(args.world)
        train_images = (
            len(world.split_image_ids("train"))
            if "train" in (world.split_names or [])
            else world.num_images
        )
        largest = max(
            batches
            + ([args.k_batch] if not args.no_k else [])
            + ([args.ddp_batch] if not args.no_ddp else [])
        )
        if largest > train_images:  # every case at that batch would fail after minutes of others
            print(
                f"error: --world {args.world!r} has {train_images} train images, fewer than the "
                f"largest batch {largest}: give it more images (--world synthetic:images=N,...)",
                file=sys.stderr,
            )
            return 2
        world.save(store_path)
        print(
            f"store: {args.world}, saved once to features:PATH; torch {torch.__version__}, "
            f"{os.cpu_count()} cores; one-process cases use {args.threads} thread(s); "
            f"warm-up {args.warmup} step(s), then {', '.join(f'{STEPS_AT.get(b, 2)} at B={b}' for b in batches)}",
            flush=True,
        )

        def spec(
            recipe: str, batch: int, extra: dict | None = None, threads: int | None = None
        ) -> dict:
            return {
                "recipe": recipe,
                "batch": batch,
                "store": str(store_path),
                "threads": threads or args.threads,
                "warmup": args.warmup,
                "steps": STEPS_AT.get(batch, 2),
                "overrides": {**overrides, **(extra or {})},
                "parts": True,
            }

        if args.interleave:
            names = [r for r in args.interleave.split(",") if r]
            for batch in batches:
                result = _case_in_subprocess(
                    {
                        **spec(names[0], batch),
                        "kind": "interleaved",
                        "recipes": names,
                        "rounds": args.rounds,
                        "cpu_time": args.cpu_time,
                    }
                )
                if "error" in result:
                    print(f"B={batch}: error {result['error']}")
                    continue
                print(
                    f"B={batch}, median of {args.rounds} interleaved rounds"
                    f"{' (CPU seconds)' if args.cpu_time else ''}: "
                    + ", ".join(
                        f"{r} {result[r]:.3f} s ({result[r] / result[names[0]]:.1f}x {names[0]})"
                        for r in names
                    )
                )
            return 0

        if args.profile:
            batch = batches[0]
            result = _case_in_subprocess({**spec(args.profile, batch), "profile": True})
            if "error" in result:
                print(f"error: {result['error']}")
                return 1
            print(
                f"\n{args.profile} at B={batch}: {result['step_s']:.3f} s/step; one step profiled:"
            )
            print(result["profile"])
            return 0

        rows = []
        by_case: dict[tuple[str, int], dict] = {}
        for recipe in recipes:
            results: list[dict] = []
            for i, batch in enumerate(batches):
                prev = results[-1] if results else None
                prev2 = results[-2] if len(results) > 1 else None
                ratio = batch / batches[i - 1] if i else 1.0
                skip = _predict_skip(
                    batch,
                    (batches[i - 1], prev) if prev is not None else None,
                    (batches[i - 2], prev2) if prev2 is not None else None,
                    args,
                )
                case = spec(recipe, batch)
                result = (
                    {"skipped": skip}
                    if skip
                    else _case_in_subprocess(
                        case, timeout=_case_timeout(case, args.max_step_seconds)
                    )
                )
                results.append(result)
                by_case[(recipe, batch)] = result
                rows.append(
                    [
                        recipe,
                        str(batch),
                        *_fmt(result),
                        _growth(prev, result, "step_s"),
                        _exponent(prev, result, ratio),
                        _growth(prev, result, "train_mib"),
                    ]
                )
                print(f"  {recipe} B={batch}: {_fmt(result)}", file=sys.stderr, flush=True)
        print_table(
            "Throughput and peak memory per recipe and batch size (paper-default dimensions)",
            [
                "recipe",
                "B",
                "pairs/s",
                "s/step",
                "peak MiB",
                "train MiB",
                "time growth",
                "p (time ~ B^p)",
                "train-mem growth",
            ],
            rows,
        )

        print_cost_table(recipes, batches, by_case)

        if not args.no_k:
            rows, prev = [], None
            for k in [int(k) for k in args.factors.split(",")]:
                result = _case_in_subprocess(
                    spec("phyclip", args.k_batch, {"num_factors": k, "factor_dim": 8})
                )
                rows.append(
                    [
                        str(k),
                        *_fmt(result),
                        _growth(prev, result, "step_s"),
                        _growth(prev, result, "train_mib"),
                    ]
                )
                prev = result
            print_table(
                f"PHyCLIP, factors k at d = 8, B = {args.k_batch}",
                [
                    "k",
                    "pairs/s",
                    "s/step",
                    "peak MiB",
                    "train MiB",
                    "time growth",
                    "train-mem growth",
                ],
                rows,
            )

        if not args.no_ddp:
            rows = []
            for recipe in [r for r in args.ddp_recipes.split(",") if r]:
                one_1 = _case_in_subprocess(spec(recipe, args.ddp_batch, threads=1))
                one_2 = _case_in_subprocess(spec(recipe, args.ddp_batch, threads=2))
                two = _case_in_subprocess(spec(recipe, args.ddp_batch, threads=1), nproc=2)
                for label, result in (
                    ("1 process, 1 thread", one_1),
                    ("1 process, 2 threads", one_2),
                    ("2 gloo processes, 1 thread each", two),
                ):
                    speedup = (
                        f"x{result['pairs_per_s'] / one_1['pairs_per_s']:.2f}"
                        if "pairs_per_s" in result and "pairs_per_s" in one_1
                        else ""
                    )
                    rows.append([recipe, label, *_fmt(result)[:3], speedup])
            print_table(
                f"Two processes against one, global batch {args.ddp_batch} (peak MiB: rank 0's process)",
                ["recipe", "run", "pairs/s", "s/step", "peak MiB", "vs 1 process 1 thread"],
                rows,
            )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
