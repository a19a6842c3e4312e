"""Train and search at scale on clip-retrieval's layout: time and memory against N (issue 26).

For each N in ``--pairs`` this writes N random unit-norm float16 pairs in clip-retrieval's
layout (``img_emb/``, ``text_emb/``, ``metadata/`` shards, written shard by shard in chunks, so
the writer's memory does not grow with N), then measures, each in its own process:

- ``open``: ``load_data("clip-retrieval:DIR")`` (headers and parquet footers only);
- ``train <recipe>``: ``curvalign train --recipe R --data clip-retrieval:DIR --steps S`` with the
  defaults (validation every 50 steps on the layout's seeded "val" split): time to the end of the
  first step (opening, sampler, the step-0 validation, one step), seconds per step (the log's
  ``pairs_per_s``), the time of each validation call, and peak memory;
- ``embed``, ``index build``, ``index search`` (10 text queries) with the CLI, for the first
  recipe (``--search-max`` caps the N at which these run: embedding 10M pairs on two shared cores
  takes most of an hour);
- ``flat search``: ``index search`` over a synthetic exact Lorentz index of N points written in
  chunks (``write_flat_index``), so search memory is measured at every N without embedding it.

Memory: ``peak RSS`` is the kernel's high-water mark (``ru_maxrss``), which counts the pages of
memory-mapped files the process touched; ``peak anon`` is the largest anonymous resident memory
sampled every 50 ms from ``/proc/self/status`` (``RssAnon``): the memory outside the maps, the
issue's target (< 2 GB at 10M). Times are wall seconds (CPU seconds beside them: the machine is
shared, so wall times are inflated by other jobs).

    python benchmarks/data_scale.py --pairs 1000000 --out /work/scale-bench
    python benchmarks/data_scale.py --pairs 1000000,10000000 --out /work/scale-bench --search-max 1000000

The data is deleted at the end unless ``--keep``. Disk: about 2 GB per million pairs at 512
dimensions (float16), plus the embeddings and index of the search stages (about 8 GB at 1M) and
the synthetic flat index (4 (d + 1) bytes per point).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MARK = "DATA_SCALE_RESULT "


# --- the layout ---------------------------------------------------------------------------------


def write_layout(
    root: Path, n: int, dim: int, shard_rows: int, seed: int = 0, replicate: int = 1
) -> float:
    """N unit-norm float16 pairs in clip-retrieval's layout under ``root``; returns seconds.

    Texts are their image plus noise (renormalised), so that training has something to learn.
    Each shard is written through a memory map in chunks of 65,536 rows: the writer's memory
    does not grow with N. ``replicate=R`` writes the first ``N / R`` pairs and hard-links
    those shards R times (shard numbers continue): N rows for the reader, a 1/R of the disk,
    and a page cache that holds all of it (so reads are warm: say so with the figures).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    for folder in ("img_emb", "text_emb", "metadata"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    chunk = 1 << 16
    unique = n // replicate
    if unique * replicate != n or unique % shard_rows:
        raise SystemExit(f"--replicate {replicate}: N / R must be a multiple of --shard-rows")
    shards = 0
    for k, start in enumerate(range(0, unique, shard_rows)):
        rows = min(shard_rows, unique - start)
        rng = np.random.default_rng([seed, k])
        img = np.lib.format.open_memmap(
            root / "img_emb" / f"img_emb_{k}.npy", "w+", np.float16, (rows, dim)
        )
        txt = np.lib.format.open_memmap(
            root / "text_emb" / f"text_emb_{k}.npy", "w+", np.float16, (rows, dim)
        )
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            x = rng.standard_normal((b - a, dim), dtype=np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            img[a:b] = x
            x += rng.standard_normal((b - a, dim), dtype=np.float32) * (0.7 / np.sqrt(dim))
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            txt[a:b] = x
        img.flush()
        txt.flush()
        del img, txt
        ids = np.arange(start, start + rows)
        pq.write_table(
            pa.table(
                {
                    "caption": pa.array([f"pair {i}" for i in ids.tolist()]),
                    "url": pa.array([f"https://example.org/{i}.jpg" for i in ids.tolist()]),
                }
            ),
            root / "metadata" / f"metadata_{k}.parquet",
        )
        shards += 1
    for copy in range(1, replicate):
        for k in range(shards):
            for folder, suffix in (
                ("img_emb", ".npy"),
                ("text_emb", ".npy"),
                ("metadata", ".parquet"),
            ):
                os.link(
                    root / folder / f"{folder}_{k}{suffix}",
                    root / folder / f"{folder}_{copy * shards + k}{suffix}",
                )
    return time.perf_counter() - started


def write_synthetic_index(path: Path, n: int, dim: int, seed: int = 0) -> float:
    """An exact Lorentz index of ``n`` random points (curvature 1) written in chunks."""
    from curvalign.index.search import (
        FORMAT_VERSION,
        GEOMETRY,
        database_vectors,
        write_flat_index,
    )

    started = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    max_norm = 0.0

    def chunks():
        nonlocal max_norm
        for k, a in enumerate(range(0, n, 1 << 16)):
            rng = np.random.default_rng([seed, k])
            x = rng.standard_normal((min(n, a + (1 << 16)) - a, dim), dtype=np.float32)
            x *= 0.5 / np.sqrt(dim)
            u = database_vectors(x, 1.0)
            max_norm = max(max_norm, float(np.linalg.norm(u.astype(np.float64), axis=1).max()))
            yield u

    write_flat_index(path / "index.faiss", dim + 1, chunks())
    np.save(path / "ids.npy", np.arange(n, dtype=np.int64))
    rng = np.random.default_rng([seed, 0])
    queries = rng.standard_normal((10, dim), dtype=np.float32) * (0.5 / np.sqrt(dim))
    np.save(path / "queries.npy", queries * 1.001)
    info = {
        "geometry": GEOMETRY,
        "curvature": 1.0,
        "dim": dim,
        "count": n,
        "kind": "exact",
        "method": None,
        "options": {},
        "max_norm": max_norm,
        "meta": {"recipe": "meru", "side": "images", "key": "lorentz"},
        "format_version": FORMAT_VERSION,
    }
    (path / "index.json").write_text(json.dumps(info))
    return time.perf_counter() - started


# --- measuring one process ------------------------------------------------------------------------


class _Peaks:
    """Largest VmRSS / RssAnon / RssFile of this process, sampled every ``every`` seconds."""

    def __init__(self, every: float = 0.05) -> None:
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with open("/proc/self/status") as fh:
            for line in fh:
                key = line.split(":", 1)[0]
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(line.split()[1]))

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(every)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak


def _child(argv: list[str]) -> None:
    """Run one stage in this process and print its measurements (one JSON line)."""
    import resource

    mode, *rest = argv
    peaks = _Peaks()
    out: dict = {}
    # imports first: the times below are the work's, not Python's start-up
    import curvalign.cli as cli
    import curvalign.train.trainer as trainer_module
    from curvalign.data import load_data
    from curvalign.train import train
    from curvalign.train.validation import ValidationSet

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    if mode == "open":
        store = load_data(rest[0])
        out["pairs"] = store.num_images
    elif mode == "import":
        load_data(rest[0]).save(rest[1])  # validates (the NaN/inf scan) and records it
    elif mode == "train":
        recipe, spec, run_dir, steps, *overrides = rest
        first: list[float] = []
        step_cpu: list[float] = []  # process CPU seconds (all threads) of each step
        validations: list[float] = []
        original_step = trainer_module.Trainer.train_step
        # what a validation costs: the split's embedding and ranks (fit calls it through its
        # hooks' path, so the trainer's public validate() is not where to time it)
        original_validate = ValidationSet.score

        def train_step(self, *args, **kwargs):
            cpu = time.process_time()
            result = original_step(self, *args, **kwargs)
            step_cpu.append(time.process_time() - cpu)
            if not first:
                first.append(time.perf_counter() - started)
            return result

        def validate(self, *args, **kwargs):
            t = time.perf_counter()
            result = original_validate(self, *args, **kwargs)
            validations.append(time.perf_counter() - t)
            return result

        trainer_module.Trainer.train_step = train_step
        ValidationSet.score = validate
        train(recipe, spec, run_dir, steps=int(steps), overrides=overrides, show_progress=False)
        log = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
        meta = json.loads((Path(run_dir) / "meta.json").read_text())
        batch = _batch_size(run_dir)
        rates = [r["pairs_per_s"] for r in log if "pairs_per_s" in r]
        out.update(
            first_step_s=first[0] if first else None,
            s_per_step=float(np.median([batch / r for r in rates])) if rates else None,
            cpu_s_per_step=float(np.median(step_cpu)) if step_cpu else None,
            validation_s=validations,
            validation_images=(meta.get("validation") or {}).get("images"),
        )
    elif mode == "cli":
        sys.argv = ["curvalign", *rest]
        try:
            cli.main()
        except SystemExit as exit:
            out["exit"] = exit.code or 0
    else:
        raise SystemExit(f"unknown child mode {mode!r}")
    out["wall_s"] = time.perf_counter() - started
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    peak = peaks.stop()
    out["peak_rss_gb"] = cpu1.ru_maxrss / 2**20
    out["peak_anon_gb"] = peak["RssAnon"] / 2**20
    out["peak_file_gb"] = peak["RssFile"] / 2**20
    print(MARK + json.dumps(out), file=sys.stderr, flush=True)


def _batch_size(run_dir: str) -> int:
    config = json.loads((Path(run_dir) / "config.json").read_text())
    for section in (config, config.get("train", {})):
        if isinstance(section, dict) and "batch_size" in section:
            return int(section["batch_size"])
    return 256


def measure(*args: str, threads: int, check: bool = False) -> dict:
    """Run ``_child(args)`` in a fresh process; its measurements. ``check``: as ``curvalign
    --check`` (the NaN/inf scan forced on open)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if check:
        env["CURVALIGN_CHECK_VALUES"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise SystemExit(f"stage {' '.join(args[:2])} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(MARK) :])
    result["stdout"] = proc.stdout
    return result


# --- the benchmark --------------------------------------------------------------------------------


def _row(n: int, stage: str, r: dict, note: str = "") -> list[str]:
    return [
        f"{n:,}",
        stage,
        f"{r['wall_s']:.2f}",
        f"{r['cpu_s']:.1f}",
        f"{r['peak_rss_gb']:.2f}",
        f"{r['peak_anon_gb']:.2f}",
        note,
    ]


def _ann_rows(n: int, emb: Path, exact: Path, ann: Path, args: argparse.Namespace) -> list:
    """Build an IVF-PQ candidate index and measure recall@10 of ``--ann-queries`` text queries
    (seeded sample) against the exact index: the share of the exact top 10 it returns."""
    rng = np.random.default_rng(0)
    queries = np.sort(rng.choice(n, size=min(n, args.ann_queries), replace=False))
    ids = ",".join(str(i) for i in queries.tolist())
    r = measure(
        "cli",
        "index",
        "build",
        str(emb),
        "--out",
        str(ann),
        "--ann",
        "ivfpq",
        "--nprobe",
        str(args.nprobe),
        threads=args.threads,
    )
    size = sum(f.stat().st_size for f in ann.rglob("*") if f.is_file()) / 2**30
    out = [_row(n, f"index build --ann ivfpq (nprobe {args.nprobe})", r, f"index {size:.2f} GB")]
    found = {}
    for name, path in (("exact", exact), ("ivfpq", ann)):
        r = measure(
            "cli",
            "index",
            "search",
            str(path),
            "--query-text-ids",
            ids,
            "--k",
            "10",
            "--json",
            threads=args.threads,
        )
        found[name] = [res["ids"] for res in json.loads(r["stdout"])["results"]]
        out.append(_row(n, f"index search {name} ({len(queries)} texts)", r))
    recall = np.mean(
        [len(set(a) & set(b)) / len(b) for a, b in zip(found["ivfpq"], found["exact"], strict=True)]
    )
    out[-1][-1] = f"recall@10 vs exact {recall:.3f}"
    print(" | ".join(out[-1]), flush=True)
    shutil.rmtree(ann, ignore_errors=True)
    return out


def run(args: argparse.Namespace) -> list[list[str]]:
    rows: list[list[str]] = []
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="data_scale_"))
    base.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in args.recipes.split(",") if r]
    for n in (int(p) for p in args.pairs.split(",")):
        root = base / f"pairs_{n}"
        if root.exists():
            shutil.rmtree(root)
        try:
            data = root / "clip-retrieval"
            seconds = write_layout(data, n, args.dim, args.shard_rows, replicate=args.replicate)
            gb = sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 2**30
            what = f"{gb:.1f} GB" + (
                f" ({n // args.replicate:,} pairs written, linked {args.replicate}x)"
                if args.replicate > 1
                else ""
            )
            print(f"N={n:,}: wrote {what} in {seconds:.0f} s", flush=True)
            rows.append([f"{n:,}", "write layout", f"{seconds:.1f}", "", "", "", what])
            spec = f"clip-retrieval:{data}"
            r = measure("open", spec, threads=args.threads)
            rows.append(_row(n, "open clip-retrieval:DIR", r))
            if n <= args.import_max:
                native = root / "native"
                r = measure("import", spec, str(native), threads=args.threads)
                rows.append(_row(n, "import into a native store", r))
                r = measure("open", f"features:{native}", threads=args.threads)
                rows.append(_row(n, "open features:PATH", r))
                r = measure("open", f"features:{native}", threads=args.threads, check=True)
                rows.append(_row(n, "open features:PATH --check", r))
                print(" | ".join(rows[-1]), flush=True)
                shutil.rmtree(native, ignore_errors=True)
            for recipe in recipes:
                run_dir = root / f"run_{recipe}"
                r = measure(
                    "train",
                    recipe,
                    spec,
                    str(run_dir),
                    str(args.steps),
                    *args.override,
                    threads=args.threads,
                )
                vals = r["validation_s"]
                note = (
                    f"first step {r['first_step_s']:.1f} s; {r['s_per_step']:.3f} s/step "
                    f"({r.get('cpu_s_per_step') or 0:.3f} CPU s); "
                ) + (
                    f"{len(vals)} validations of {r['validation_images']} images, "
                    f"{np.mean(vals):.1f} s each"
                    if vals
                    else "no validation"
                )
                rows.append(_row(n, f"train {recipe} ({args.steps} steps)", r, note))
                print(" | ".join(rows[-1]), flush=True)
            if n <= args.search_max and recipes:
                run_dir, emb, idx = root / f"run_{recipes[0]}", root / "emb", root / "index"
                r = measure(
                    "cli", "embed", str(run_dir), "--out", str(emb), "-q", threads=args.threads
                )
                rows.append(_row(n, f"embed ({recipes[0]})", r))
                r = measure(
                    "cli", "index", "build", str(emb), "--out", str(idx), threads=args.threads
                )
                size = sum(f.stat().st_size for f in idx.rglob("*") if f.is_file()) / 2**30
                rows.append(_row(n, "index build (exact)", r, f"index {size:.2f} GB"))
                r = measure(
                    "cli",
                    "index",
                    "search",
                    str(idx),
                    "--query-text-ids",
                    ",".join(str(i) for i in range(10)),
                    "--k",
                    "10",
                    "--json",
                    threads=args.threads,
                )
                rows.append(_row(n, "index search (10 texts)", r, f"index {size:.2f} GB"))
                print(" | ".join(rows[-1]), flush=True)
                if args.ann_queries:
                    rows += _ann_rows(n, emb, idx, root / "index_ivfpq", args)
                shutil.rmtree(emb, ignore_errors=True)
                shutil.rmtree(idx, ignore_errors=True)
            if args.flat_dim:
                flat = root / "flat_index"
                seconds = write_synthetic_index(flat, n, args.flat_dim)
                size = (flat / "index.faiss").stat().st_size / 2**30
                r = measure(
                    "cli",
                    "index",
                    "search",
                    str(flat),
                    "--query-npy",
                    str(flat / "queries.npy"),
                    "--k",
                    "10",
                    "--json",
                    threads=args.threads,
                )
                rows.append(
                    _row(
                        n,
                        f"flat search (d={args.flat_dim}, 10 queries)",
                        r,
                        f"index {size:.2f} GB, written in {seconds:.0f} s",
                    )
                )
                print(" | ".join(rows[-1]), flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    if not args.keep and not args.out:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="1000000", help="comma-separated N (default 1M)")
    parser.add_argument("--dim", type=int, default=512, help="feature width (default 512)")
    parser.add_argument("--shard-rows", type=int, default=500_000, help="rows per shard")
    parser.add_argument("--out", default=None, help="directory for the data (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    parser.add_argument("--recipes", default="clip,meru")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per stage")
    parser.add_argument(
        "--search-max",
        type=int,
        default=1_000_000,
        help="run embed / index build / index search only for N up to this (default 1M)",
    )
    parser.add_argument(
        "--import-max",
        type=int,
        default=1_000_000,
        help="import into a native store and time its opening only for N up to this",
    )
    parser.add_argument(
        "--flat-dim",
        type=int,
        default=256,
        help="point width of the synthetic flat index searched at every N (0: skip)",
    )
    parser.add_argument(
        "--ann-queries",
        type=int,
        default=100,
        help="text queries for the IVF-PQ recall against exact search (0: skip the ANN stage)",
    )
    parser.add_argument("--nprobe", type=int, default=32, help="IVF-PQ cells probed per query")
    parser.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="write N/R pairs and hard-link their shards R times (disk and time for 10M)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the data written")
    parser.add_argument("override", nargs="*", help="key=value training overrides")
    args = parser.parse_args()
    rows = run(args)
    header = ["N", "stage", "wall s", "CPU s", "peak RSS GB", "peak anon GB", "notes"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
