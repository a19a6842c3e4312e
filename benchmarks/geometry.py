"""Speed and peak memory of the geometry scores inside a symmetric InfoNCE, fwd + bwd.

Cases (B x B score matrices from B points of total width D):
  cosine     CLIP's cosine similarity (the baseline every ratio is taken against)
  lorentz    -lorentz.pairwise_dist                 (MERU), the default path: on CPU the fused
             kernel of geometry/_fused_lorentz.py (built once before timing, cached)
  lorentz-ref   the same with fused=False: the eager reference the kernel is tested against
  exterior   -lorentz.pairwise_exterior_angle        (AtMG), the default (fused) path
  exterior-ref  the same with fused=False (eager reference)
  l1         -product.l1_pairwise_dist / k, k x d = D (PHyCLIP), the default path: on CPU the
             fused kernel of geometry/_fused_l1.py (built once before timing, cached)
  l1-ref     the same with fused=False: the eager blocked reference the kernel is tested against
and, at a smaller B, our pairwise Lorentz distance against a broadcast ``[N, M, d]``
implementation of the kind geoopt uses.

Each case runs in a fresh subprocess: inputs are made, the resident set size (RSS) is read,
the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``), one fwd + bwd runs, and
peak RSS minus the starting RSS is reported as the case's peak memory. Times are measured in
one process: one warm-up per case, then ``--repeats`` rounds that run every case once each
(interleaved, so a change in the machine's load during the run hits every case alike), and
the median per case is reported; the ratios to cosine come from that one run.

    python benchmarks/geometry.py                       # B=4096, D=512, k=64, d=8
    python benchmarks/geometry.py --batch 1024 --repeats 3
    python benchmarks/geometry.py --loss-path --repeats 5   # the whole loss path a user runs
    python benchmarks/geometry.py --loss-path --threads 1 --cpu-time   # its CPU seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("cosine", "lorentz", "lorentz-ref", "exterior", "exterior-ref", "l1", "l1-ref")
#: the whole loss path a user runs (``--loss-path``): fresh tangent features in, loss out
LOSS_CASES = ("cosine-loss", "lorentz-loss", "exterior-loss", "l1-loss")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_loss_path(case: str, batch: int, dim: int, k: int):  # noqa: ANN201 - two closures
    """``(prepare, step)`` for one whole-loss-path case: ``prepare`` makes fresh tangent features
    (untimed), ``step`` runs what a recipe runs on them, forward + backward, through the public
    functions (so it times whatever path the recipes take):

      cosine-loss    CLIP: ``F.normalize`` both sides, ``cosine_scores``, symmetric InfoNCE
      lorentz-loss   MERU: ``expmap0(s v, c)`` both sides (learnable scale ``s``, curvature
                     ``c``), ``lorentz_distance_scores``, symmetric InfoNCE on one matrix and
                     its transpose (``recipes/base.py``'s distance InfoNCE)
      exterior-loss  AtMG: ``expmap0(s v, c)``, ``losses.angle_contrastive_loss`` (the angle
                     at the text and the angle at the image, AtMG Eq. 11)
      l1-loss        PHyCLIP: ``[B, k, d]`` tangents, a scale per factor, ``expmap0`` with
                     ``c: [k]``, ``product_average_distance_scores``, symmetric InfoNCE

    Features have norm about ``sqrt(D)`` and the scales start at the recipes' step-0 values
    (tangent norm about 1: ``1/sqrt(D)``, per factor ``1/sqrt(d)``); temperature 0.07, learnable.
    """
    import torch
    import torch.nn.functional as F

    from curvalign import scores as S
    from curvalign.geometry import lorentz
    from curvalign.losses import angle_contrastive_loss, info_nce, symmetric_info_nce

    torch.manual_seed(0)
    tau = torch.tensor(0.07, requires_grad=True)
    is_l1 = case == "l1-loss"
    c = torch.ones(k, requires_grad=True) if is_l1 else torch.tensor(1.0, requires_grad=True)
    scale = (
        torch.full((k, 1), (dim // k) ** -0.5, requires_grad=True)
        if is_l1
        else torch.tensor(dim**-0.5, requires_grad=True)
    )
    inputs: list[torch.Tensor] = []

    def prepare() -> None:
        inputs[:] = [torch.randn(batch, dim).requires_grad_() for _ in range(2)]

    def points(v: torch.Tensor) -> torch.Tensor:
        if is_l1:
            return lorentz.expmap0(v.unflatten(-1, (k, dim // k)) * scale, c)
        return lorentz.expmap0(v * scale, c)

    def step() -> torch.Tensor:
        a, b = inputs
        if case == "cosine-loss":
            s = S.cosine_scores(F.normalize(a, dim=-1), F.normalize(b, dim=-1))
            loss = symmetric_info_nce(s, s.T, tau)
        elif case == "lorentz-loss":
            s = S.lorentz_distance_scores(points(a), points(b), c)
            loss = symmetric_info_nce(s, s.T, tau)
        elif case == "exterior-loss":
            t, y = points(a), points(b)
            loss = angle_contrastive_loss(t, y, t, y, c, tau)
        elif case == "l1-loss":
            s = S.product_average_distance_scores(points(a), points(b), c)
            loss = 0.5 * (info_nce(s, tau) + info_nce(s.T, tau))
        else:
            raise ValueError(case)
        loss.backward()
        finite = all(bool(torch.isfinite(t.grad).all()) for t in inputs if t.grad is not None)
        reached = all(t.grad is not None for t in inputs)
        for t in (*inputs, tau, c, scale):
            t.grad = None
        return torch.tensor([float(loss.detach()), float(finite and reached)])

    return prepare, step


def build_step(case: str, batch: int, dim: int, k: int):  # noqa: ANN201 - returns a closure
    """Inputs for one case and a closure running one fwd + bwd of the symmetric InfoNCE."""
    import torch
    import torch.nn.functional as F

    from curvalign.geometry import euclidean, lorentz, product

    torch.manual_seed(0)
    tau = 0.07
    labels = torch.arange(batch)
    c = torch.tensor(1.0, requires_grad=True)

    if case == "broadcast":

        def pairwise(X, Y, cc):  # noqa: ANN001 - geoopt-style reference: an [N, M, d+1] product
            tx = torch.sqrt(1.0 / cc + (X * X).sum(-1, keepdim=True))
            ty = torch.sqrt(1.0 / cc + (Y * Y).sum(-1, keepdim=True))
            xa = torch.cat([-tx, X], -1).unsqueeze(1)
            ya = torch.cat([ty, Y], -1).unsqueeze(0)
            inner = (xa * ya).sum(-1)
            return torch.acosh((-cc * inner).clamp_min(1.0 + 1e-6)) / torch.sqrt(cc)
    elif case == "ours-at-broadcast":
        pairwise = lorentz.pairwise_dist

    with torch.no_grad():
        if case in ("cosine",):
            X0 = torch.randn(batch, dim)
            Y0 = torch.randn(batch, dim)
        else:
            # Points at typical distances from the origin: exp map of small tangent vectors.
            is_l1 = case.startswith("l1")
            cdim = dim // k if is_l1 else dim
            shape = (batch, k, cdim) if is_l1 else (batch, dim)
            X0 = lorentz.expmap0(torch.randn(shape) / cdim**0.5, 1.0)
            Y0 = lorentz.expmap0(torch.randn(shape) / cdim**0.5, 1.0)
    X = X0.clone().requires_grad_()
    Y = Y0.clone().requires_grad_()
    if case.startswith("l1"):
        c = torch.ones(k, requires_grad=True)

    def scores() -> torch.Tensor:
        if case == "cosine":
            return euclidean.pairwise_cosine(X, Y) / tau
        if case == "lorentz":
            return -lorentz.pairwise_dist(X, Y, c) / tau
        if case == "lorentz-ref":
            return -lorentz.pairwise_dist(X, Y, c, fused=False) / tau
        if case == "exterior":
            return -lorentz.pairwise_exterior_angle(X, Y, c) / tau
        if case == "exterior-ref":
            return -lorentz.pairwise_exterior_angle(X, Y, c, fused=False) / tau
        if case == "l1":
            return -product.l1_pairwise_dist(X, Y, c) / (k * tau)
        if case == "l1-ref":
            return -product.l1_pairwise_dist(X, Y, c, fused=False) / (k * tau)
        return -pairwise(X, Y, c) / tau

    def step() -> None:
        S = scores()
        loss = 0.5 * (F.cross_entropy(S, labels) + F.cross_entropy(S.t(), labels))
        loss.backward()
        X.grad = Y.grad = c.grad = None

    return step


def measure_memory(case: str, batch: int, dim: int, k: int, threads: int | None) -> dict:
    """Peak extra RSS (MiB) of one fwd + bwd, in this (fresh) process."""
    import gc

    import torch

    if threads:
        torch.set_num_threads(threads)
    step = build_step(case, batch, dim, k)
    gc.collect()
    start = _rss_kib("VmRSS")
    peak_ok = _reset_peak()
    step()
    peak = _rss_kib("VmHWM") if peak_ok else None
    return {"case": case, "peak_extra_mib": None if peak is None else (peak - start) / 1024.0}


def time_round_robin(
    cases: list[str], batch: int, dim: int, k: int, repeats: int
) -> dict[str, float]:
    """Median fwd + bwd time per case, the cases interleaved in each round so that a change in
    the machine's load during the run affects every case alike."""
    steps = {case: build_step(case, batch, dim, k) for case in cases}
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for case, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[case].append(time.perf_counter() - t0)
    return {case: statistics.median(ts) for case, ts in times.items()}


def time_loss_paths(
    cases: list[str], batch: int, dim: int, k: int, repeats: int, cpu_time: bool = False
) -> dict[str, dict[str, float]]:
    """Best and median fwd + bwd time per whole-loss-path case, fresh inputs every call (made
    before the clock starts), the cases interleaved in each round. ``cpu_time``: this process's
    CPU seconds (``time.process_time``) instead of wall-clock seconds."""
    clock = time.process_time if cpu_time else time.perf_counter
    built = {case: build_loss_path(case, batch, dim, k) for case in cases}
    for prepare, step in built.values():
        prepare()
        step()  # warm-up
    times: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for case, (prepare, step) in built.items():
            prepare()
            t0 = clock()
            step()
            times[case].append(clock() - t0)
    return {case: {"best": min(ts), "median": statistics.median(ts)} for case, ts in times.items()}


def loss_path_report(args: argparse.Namespace) -> None:
    """``--loss-path``: the whole loss path of each geometry against cosine, one run."""
    import torch

    targets = {"lorentz-loss": 1.10, "exterior-loss": 1.10, "l1-loss": 4.5}
    t = time_loss_paths(
        list(LOSS_CASES), args.batch, args.dim, args.factors, args.repeats, args.cpu_time
    )
    print(
        f"whole loss path (fresh tangent features -> expmap0 -> scores -> symmetric InfoNCE), "
        f"fwd+bwd, B={args.batch}, D={args.dim}, k={args.factors}, d={args.dim // args.factors},"
        f" {torch.get_num_threads()} thread(s), {args.repeats} interleaved rounds"
        f"{', CPU seconds of this process' if args.cpu_time else ''}; load "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"{'case':<14} {'best (s)':>9} {'x cosine':>9} {'median':>9} {'x cosine':>9}  target")
    base = t["cosine-loss"]
    for case in LOSS_CASES:
        rb = t[case]["best"] / base["best"]
        rm = t[case]["median"] / base["median"]
        tgt = targets.get(case)
        verdict = "" if tgt is None else f"<= {tgt}x " + ("met" if rb <= tgt else "MISSED")
        print(
            f"{case:<14} {t[case]['best']:9.3f} {rb:9.2f} {t[case]['median']:9.3f} {rm:9.2f}  "
            f"{verdict}"
        )


def _spawn_memory(case: str, args: argparse.Namespace, batch: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--_case",
        case,
        "--batch",
        str(batch),
        "--dim",
        str(args.dim),
        "--factors",
        str(args.factors),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=4096, help="B for the InfoNCE cases (default 4096)")
    p.add_argument("--dim", type=int, default=512, help="total embedding width D (default 512)")
    p.add_argument(
        "--factors", type=int, default=64, help="k for the l1 product, d = D / k (default 64)"
    )
    p.add_argument(
        "--broadcast-batch", type=int, default=1024, help="B for the broadcast comparison"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats per case, median reported (default 3)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES)
    )
    p.add_argument(
        "--loss-path",
        action="store_true",
        help="time the whole loss path (tangent features in) of each geometry against cosine "
        "instead (best and median of --repeats interleaved rounds)",
    )
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --loss-path: time in CPU seconds of this process instead of wall-clock "
        "seconds (on a loaded machine, with --threads 1, the work each case does; with more "
        "threads it includes OpenMP's spin-waiting)",
    )
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dim % args.factors:
        p.error(f"--dim {args.dim} must be divisible by --factors {args.factors}")

    if args._case:
        print(
            json.dumps(measure_memory(args._case, args.batch, args.dim, args.factors, args.threads))
        )
        return

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    if args.loss_path:
        loss_path_report(args)
        return

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; expected among {CASES}")
    if "cosine" not in cases:
        cases.insert(0, "cosine")
    # issue 13's targets (time and memory as ratios to the cosine InfoNCE in the same run)
    targets = {"lorentz": (1.2, None), "exterior": (1.4, None), "l1": (6.0, 2.0)}
    # Build (or load) the kernels here, once, so that no measured call pays for it.
    kernels = []
    if any(case.startswith("l1") for case in cases):
        from curvalign.geometry import _fused_l1

        kernels.append(("fused l1 kernel", _fused_l1.available, "l1"))
    if any(case.startswith(("lorentz", "exterior")) for case in cases):
        from curvalign.geometry import _fused_lorentz

        kernels.append(
            ("fused Lorentz/exterior kernel", _fused_lorentz.available, "lorentz/exterior")
        )
    for name, available, rows in kernels:
        t0 = time.perf_counter()
        built = available(torch.zeros(1))
        print(
            f"{name}: {'ready' if built else f'OFF (eager reference in every {rows} row)'}"
            f" in {time.perf_counter() - t0:.1f} s (build on first use, then cached)"
        )
    memory = {case: _spawn_memory(case, args, args.batch)["peak_extra_mib"] for case in cases}
    seconds = time_round_robin(cases, args.batch, args.dim, args.factors, args.repeats)
    threads = torch.get_num_threads()
    print(
        f"symmetric InfoNCE fwd+bwd, B={args.batch}, D={args.dim}, k={args.factors}, "
        f"d={args.dim // args.factors}, {threads} thread(s), median of {args.repeats} interleaved rounds"
        " (on a shared machine absolute times vary with its load; compare the ratios)"
    )
    print(f"{'case':<12} {'time (s)':>9} {'x cosine':>9} {'peak MiB':>9} {'x cosine':>9}  target")
    for case in cases:
        t_ratio = seconds[case] / seconds["cosine"]
        m = memory[case]
        m_ratio = m / memory["cosine"] if m is not None and memory["cosine"] else float("nan")
        tgt = targets.get(case)
        tgt_s = (
            ""
            if tgt is None
            else f"time <= {tgt[0]}x" + ("" if tgt[1] is None else f", mem <= {tgt[1]}x")
        )
        ok = ""
        if tgt is not None:
            ok = "met" if t_ratio <= tgt[0] and (tgt[1] is None or m_ratio <= tgt[1]) else "MISSED"
        m_s = "n/a" if m is None else f"{m:9.0f}"
        print(
            f"{case:<12} {seconds[case]:9.3f} {t_ratio:9.2f} {m_s:>9} {m_ratio:9.2f}  {tgt_s} {ok}"
        )

    for case in ("lorentz", "exterior", "l1"):
        if case in seconds and f"{case}-ref" in seconds:
            print(
                f"fused {case} vs its eager reference: "
                f"{seconds[f'{case}-ref'] / seconds[case]:.2f}x faster (same loss, same run)"
            )

    pair = ["ours-at-broadcast", "broadcast"]
    bmem = {
        case: _spawn_memory(case, args, args.broadcast_batch)["peak_extra_mib"] for case in pair
    }
    bsec = time_round_robin(pair, args.broadcast_batch, args.dim, args.factors, args.repeats)
    print(f"\npairwise Lorentz distance in the same loss, B={args.broadcast_batch}, D={args.dim}")
    print(f"{'impl':<22} {'time (s)':>9} {'peak MiB':>9}")
    for name, case in (("ours (Gram matrix)", pair[0]), ("broadcast [N, M, d]", pair[1])):
        print(f"{name:<22} {bsec[case]:9.3f} {bmem[case]:9.0f}")
    print(
        f"speed-up {bsec['broadcast'] / bsec[pair[0]]:.1f}x, memory "
        f"{bmem['broadcast'] / max(bmem[pair[0]], 1e-9):.1f}x less"
    )


if __name__ == "__main__":
    main()
