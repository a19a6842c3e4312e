"""Train and search at scale on clip-retrieval's layout: CPU time, disk reads and memory against N.

For each N in ``--pairs`` this writes N distinct float16 pairs in clip-retrieval's layout
(``img_emb/``, ``text_emb/``, ``metadata/`` shards of ``--shard-rows`` rows, the last one
shorter; written in chunks, so the writer's memory does not grow with N). Images are random
unit vectors; a text is its image through a fixed random mixing and an elementwise tanh plus
noise (``text_of``), so the untrained heads do not rank the pairs perfectly and training has
something to learn. Then, each in its own process and, where marked cold, after dropping the
page cache of the files it reads (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file):

- ``open``: ``load_data("clip-retrieval:DIR")`` (headers and parquet footers only);
- ``gather``: ``--gather-steps`` batches of ``--gather-batch`` rows of both sides: random rows
  read from the maps with the kernel's default advice, and the training sampler's batches
  (``MADV_RANDOM``) with its uniform ``shuffle="rows"`` and its default ``shuffle="chunks"``
  (runs of neighbouring rows; docs/scale.md, "Reads");
- ``import`` into a native store and open it (with and without the forced value scan);
- ``train <recipe>``: ``curvalign train --recipe R --data clip-retrieval:DIR --steps S`` with the
  defaults (validation on the layout's seeded "val" split; ``--steps default`` passes no steps:
  the store's default run, as long as ``curvalign train`` makes it): time to the end of the
  first step, seconds and CPU seconds per step, each validation call, the best validation step,
  the steps taken, the bytes read before the first step (and, printed, by each stage of the
  run's start) and all bytes read against the bytes its batches hold;
- ``embed``, ``index build``, ``index search`` (10 text queries, cold and warm) with the CLI for
  the first recipe up to ``--search-max``, and the search alone in a process that opened the
  index first (what ``index search`` costs beyond the search); an IVF-PQ index and its
  recall@10 against exact search;
- ``flat search``: ``index search`` over a synthetic exact Lorentz index of N points.

Per stage: wall and CPU seconds, ``read GiB`` (the process's ``read_bytes`` from
``/proc/self/io``: what came from disk, not the page cache), ``peak RSS`` (``ru_maxrss``, which
counts touched pages of memory-mapped files) and ``peak anon`` (the largest ``RssAnon`` sampled
every 50 ms: the memory outside the maps).

    python benchmarks/data_scale.py --pairs 100000,1000000 --threads 1 --out /work/scale-bench

``--keep`` leaves a layout in place and ``--reuse`` measures it again without writing it (a
complete layout carries ``layout.json``); docs/scale.md gives the commands of its figures.

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
#: written beside a complete layout (what it holds), read by ``--reuse``
LAYOUT_FILE = "layout.json"


# --- the layout ---------------------------------------------------------------------------------


#: the noise added to a text, relative to its unit-norm signal: the pair cosine is about 0.2, so
#: that ranking 5,000 validation images is imperfect at step 0 (a ridge map from images to
#: texts fit on 20,000 such pairs finds the true image first for about 40%) and learning shows
NOISE = 5.0
#: gain of the elementwise tanh between the two sides (saturating: no linear map inverts it)
GAIN = 3.0


def text_of(images: np.ndarray, mix: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Texts ``[n, d]`` unit-norm of unit-norm ``images`` ``[n, d]``: a fixed random mixing
    ``mix`` ``[d, d]``, an elementwise ``tanh`` (a nonlinear map), renormalised, plus Gaussian
    noise of norm about ``NOISE``, renormalised."""
    z = np.tanh(GAIN * (images @ mix))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    z += rng.standard_normal(z.shape, dtype=np.float32) * (NOISE / np.sqrt(z.shape[1]))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return z


def write_layout(
    root: Path, n: int, dim: int, shard_rows: int, seed: int = 0, shards: list[int] | None = None
) -> float:
    """N distinct unit-norm float16 pairs in clip-retrieval's layout under ``root``; returns
    seconds. Shards of ``shard_rows`` rows (the last one shorter), each drawn from its own
    seeded stream, so no two rows repeat. Each shard is written through a memory map in
    chunks of 65,536 rows: the writer's memory does not grow with N. ``shards``: write only
    these shard numbers (the others' processes write the rest; no ``LAYOUT_FILE`` then)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if shard_rows < 1:
        raise SystemExit(f"--shard-rows must be positive, got {shard_rows}")
    started = time.perf_counter()
    for folder in ("img_emb", "text_emb", "metadata"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    chunk = 1 << 16
    mix = np.random.default_rng([seed, 1 << 30]).standard_normal((dim, dim), dtype=np.float32)
    mix /= np.sqrt(dim)
    for k, start in enumerate(range(0, n, shard_rows)):
        if shards is not None and k not in shards:
            continue
        rows = min(shard_rows, n - start)
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
            txt[a:b] = text_of(x, mix, rng)
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
    seconds = time.perf_counter() - started
    if shards is not None:  # a part of the layout (several processes write one): no marker
        return seconds
    # written last: a layout without it (an interrupted write) is never reused
    info = {"pairs": n, "dim": dim, "shard_rows": shard_rows, "seed": seed, "seconds": seconds}
    (root / LAYOUT_FILE).write_text(json.dumps(info))
    return seconds


def _written(root: Path) -> dict | None:
    """What the complete layout under ``root`` holds (``LAYOUT_FILE`` less its seconds), or
    None where there is none."""
    try:
        info = json.loads((root / LAYOUT_FILE).read_text())
    except (OSError, ValueError):
        return None
    info.pop("seconds", None)
    return info


def drop_cache(root: Path) -> bool:
    """Ask the kernel to drop the cached pages of every file under ``root``
    (``posix_fadvise(POSIX_FADV_DONTNEED)``, which frees clean pages no process maps), so the
    next stage reads from disk. False where the platform has no ``posix_fadvise``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io`` ``read_bytes``;
    0 where the file is missing)."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


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
    io0 = read_bytes()
    started = time.perf_counter()
    if mode == "open":
        store = load_data(rest[0])
        out["pairs"] = store.num_images
    elif mode == "import":
        load_data(rest[0]).save(rest[1])  # validates (the NaN/inf scan) and records it
    elif mode == "train":
        recipe, spec, run_dir, steps, *overrides = rest
        first: list[float] = []
        first_cpu: list[float] = []
        cpu_start = time.process_time()
        step_cpu: list[float] = []  # process CPU seconds (all threads) of each step
        validations: list[float] = []
        original_step = trainer_module.Trainer.train_step
        # what a validation costs: the split's embedding and ranks (fit calls it through its
        # hooks' path, so the trainer's public validate() is not where to time it)
        original_validate = ValidationSet.score

        before_first: list[int] = []  # bytes read when the first step starts
        first_step_reads: list[int] = []

        def train_step(self, *args, **kwargs):
            cpu = time.process_time()
            if not before_first:
                before_first.append(read_bytes() - io0)
            result = original_step(self, *args, **kwargs)
            if not first_step_reads:
                first_step_reads.append(read_bytes() - io0 - before_first[0])
            step_cpu.append(time.process_time() - cpu)
            if not first:
                first.append(time.perf_counter() - started)
                first_cpu.append(time.process_time() - cpu_start)  # to the end of step 1
            return result

        def validate(self, *args, **kwargs):
            t = time.perf_counter()
            result = original_validate(self, *args, **kwargs)
            validations.append(time.perf_counter() - t)
            return result

        # bytes read from disk by each stage of the run's start (inclusive of what it calls)
        import curvalign.data.alignment as alignment_module
        import curvalign.data.sampling as sampling_module
        import curvalign.data.statistics as statistics_module

        stage_reads: dict[str, int] = {}

        def counted(owner: object, name: str, label: str) -> None:
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                before = read_bytes()
                try:
                    return original(*args, **kwargs)
                finally:
                    if not first:  # the start only
                        stage_reads[label] = stage_reads.get(label, 0) + read_bytes() - before

            setattr(owner, name, wrapper)

        counted(statistics_module, "feature_norms", "norm statistics")
        counted(trainer_module, "copies_of_train", "copy check")
        counted(trainer_module, "validation_store", "validation split")
        counted(ValidationSet, "__init__", "validation set")
        counted(alignment_module, "fit_alignment", "warm start fit")
        counted(sampling_module.BatchSampler, "__init__", "sampler")
        counted(ValidationSet, "score", "validation before step 1")
        original_validate = ValidationSet.score
        trainer_module.Trainer.train_step = train_step
        ValidationSet.score = validate
        train(
            recipe,
            spec,
            run_dir,
            steps=None if steps == "default" else int(steps),
            overrides=overrides,
            show_progress=False,
        )
        log = [json.loads(line) for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]
        meta = json.loads((Path(run_dir) / "meta.json").read_text())
        batch = _batch_size(run_dir)
        rates = [r["pairs_per_s"] for r in log if "pairs_per_s" in r]
        out.update(
            first_step_s=first[0] if first else None,
            first_step_cpu_s=first_cpu[0] if first_cpu else None,
            s_per_step=float(np.median([batch / r for r in rates])) if rates else None,
            cpu_s_per_step=float(np.median(step_cpu)) if step_cpu else None,
            validation_s=validations,
            validation_images=(meta.get("validation") or {}).get("images"),
            steps=len(step_cpu),
            before_first_step_gb=before_first[0] / 2**30 if before_first else None,
            start_reads_gb={
                **{k: v / 2**30 for k, v in stage_reads.items()},
                "first step": first_step_reads[0] / 2**30 if first_step_reads else None,
            },
        )
    elif mode == "gather":
        # what a sampler's reads cost: random rows with the kernel's default advice, or the
        # training sampler's batches (MADV_RANDOM) with its row or chunk shuffle, both sides
        from curvalign.data.sampling import BatchSampler

        spec, how, steps, batch = rest
        store = load_data(spec)
        sides = (store.image_features, store.text_features)
        n, steps, batch = len(sides[0]), int(steps), int(batch)
        rng = np.random.default_rng(0)
        sampler = None
        if how == "normal":
            for rows in sides:
                rows.advise(how)
        else:
            sampler = BatchSampler(store, batch, seed=0, shuffle=how)
        cpu0, io0 = resource.getrusage(resource.RUSAGE_SELF), read_bytes()  # the gathers only
        for _ in range(steps):
            if sampler is not None:
                sampler.next_batch()
                continue
            ids = rng.integers(0, n, size=batch)
            for rows in sides:
                rows[ids]
        row_bytes = sum(int(r.shape[1]) * r.shards[0].dtype.itemsize for r in sides)
        out["needed_gb"] = steps * batch * row_bytes / 2**30
    elif mode == "faiss-search":
        # the search of `index search` alone: the index opened and the queries read first
        from curvalign.index.embed import load_embeddings, open_index, open_rerank_engine
        from curvalign.index.rerank import as_torch_embedding
        from curvalign.runs import load_run

        path, count = rest
        raw, lorentz = open_index(path)
        meta = raw["meta"]
        side = load_embeddings(meta["embeddings"]).side(
            "texts" if meta["side"] == "images" else "images"
        )
        q = {key: np.asarray(v[: int(count)]) for key, v in side.items()}
        if lorentz is not None:
            search = lambda: lorentz.search(q[meta["key"]], 10)  # noqa: E731
        else:
            run = load_run(meta["run_dir"], weights=meta.get("weights") or "last")
            engine = open_rerank_engine(path, raw, run)
            search = lambda: engine.search(as_torch_embedding(q), 10, 200)  # noqa: E731
        cpu0, io0 = resource.getrusage(resource.RUSAGE_SELF), read_bytes()
        started = time.perf_counter()
        search()
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
    out["read_gb"] = (read_bytes() - io0) / 2**30
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


def measure(*args: str, threads: int, check: bool = False, cold: Path | None = None) -> dict:
    """Run ``_child(args)`` in a fresh process; its measurements. ``check``: as ``curvalign
    --check`` (the NaN/inf scan forced on open). ``cold``: drop the page cache of every file
    under it first (``drop_cache``)."""
    if cold is not None:
        drop_cache(cold)
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
    row = [
        f"{n:,}",
        stage,
        f"{r['wall_s']:.2f}",
        f"{r['cpu_s']:.2f}",
        f"{r['read_gb']:.2f}",
        f"{r['peak_rss_gb']:.2f}",
        f"{r['peak_anon_gb']:.2f}",
        note,
    ]
    print(" | ".join(row), flush=True)
    return row


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
        cold=emb,
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
        out.append(_row(n, f"index search {name} ({len(queries)} texts, warm)", r))
    recall = np.mean(
        [len(set(a) & set(b)) / len(b) for a, b in zip(found["ivfpq"], found["exact"], strict=True)]
    )
    out[-1][-1] = f"recall@10 vs exact {recall:.3f} (random pairs: the worst case)"
    shutil.rmtree(ann, ignore_errors=True)
    return out


def _gather_rows(n: int, spec: str, data: Path, args: argparse.Namespace) -> list:
    """Cold reads of ``--gather-steps`` batches of ``--gather-batch`` rows of both sides: random
    rows with the kernel's default advice (up to ``--gather-default-max`` pairs: at 10M they
    read several GiB a step), and the training sampler's batches (``MADV_RANDOM``) with its
    uniform row shuffle and with its chunk shuffle."""
    out = []
    for how, label in (
        ("normal", "random rows, default advice"),
        ("rows", "sampler, shuffle=rows"),
        ("chunks", "sampler, shuffle=chunks"),
    ):
        if how == "normal" and n > args.gather_default_max:
            continue
        r = measure(
            "gather",
            spec,
            how,
            str(args.gather_steps),
            str(args.gather_batch),
            threads=args.threads,
            cold=data,
        )
        ratio = r["read_gb"] / r["needed_gb"] if r["needed_gb"] else float("nan")
        note = f"{ratio:.2f}x the {r['needed_gb'] * 1024:.0f} MiB the rows hold"
        out.append(_row(n, f"gather {args.gather_steps} x {args.gather_batch}: {label}", r, note))
    return out


def run(args: argparse.Namespace, rows: list[list[str]]) -> None:
    """Every stage for every N of ``args.pairs``; appends a table row per stage to ``rows`` as it
    finishes (so a stage that fails leaves the rows measured before it)."""
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="data_scale_"))
    base.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in args.recipes.split(",") if r]
    for n in (int(p) for p in args.pairs.split(",")):
        root = base / f"pairs_{n}"
        data = root / "clip-retrieval"
        wanted = {"pairs": n, "dim": args.dim, "shard_rows": args.shard_rows, "seed": 0}
        reuse = args.reuse and _written(data) == wanted
        if root.exists() and not reuse:
            shutil.rmtree(root)
        try:
            if reuse:
                seconds = float(json.loads((data / LAYOUT_FILE).read_text())["seconds"])
                label = "layout (written before)"
            else:
                seconds = write_layout(data, n, args.dim, args.shard_rows)
                label = "write layout"
            gb = sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 2**30
            print(f"N={n:,}: {label}: {gb:.1f} GB of distinct pairs, {seconds:.0f} s", flush=True)
            rows.append([f"{n:,}", label, f"{seconds:.1f}", "", "", "", "", f"{gb:.1f} GB"])
            spec = f"clip-retrieval:{data}"
            rows.append(
                _row(
                    n,
                    "open clip-retrieval:DIR",
                    measure("open", spec, threads=args.threads, cold=data),
                )
            )
            if args.gather_steps:
                rows += _gather_rows(n, spec, data, args)
            if n <= args.import_max:
                native = root / "native"
                r = measure("import", spec, str(native), threads=args.threads, cold=data)
                rows.append(_row(n, "import into a native store", r))
                r = measure("open", f"features:{native}", threads=args.threads, cold=native)
                rows.append(_row(n, "open features:PATH", r))
                r = measure(
                    "open", f"features:{native}", threads=args.threads, check=True, cold=native
                )
                rows.append(_row(n, "open features:PATH --check", r))
                shutil.rmtree(native, ignore_errors=True)
            for recipe in recipes:
                run_dir = root / f"run_{recipe}"
                shutil.rmtree(run_dir, ignore_errors=True)  # a run left by --keep: start anew
                r = measure(
                    "train",
                    recipe,
                    spec,
                    str(run_dir),
                    str(args.steps),
                    *args.override,
                    threads=args.threads,
                    cold=data,
                )
                vals = r["validation_s"]
                note = (
                    f"first step {r['first_step_s']:.1f} s "
                    f"({r.get('first_step_cpu_s') or 0:.1f} CPU s); {r['s_per_step']:.3f} s/step "
                    f"({r.get('cpu_s_per_step') or 0:.3f} CPU s); "
                ) + (
                    f"{len(vals)} validations of {r['validation_images']} images, "
                    f"{np.mean(vals):.1f} s each"
                    if vals
                    else "no validation"
                )
                # what the batches hold: an image and a caption row per pair (float16), for the
                # steps the run took (the default length resolves and may extend them)
                steps = r["steps"]
                needed = steps * _batch_size(str(run_dir)) * 2 * args.dim * 2 / 2**30
                note += (
                    f"; {steps} steps; read {r['before_first_step_gb']:.2f} GiB before step 1, "
                    f"{r['read_gb'] / needed:.2f}x the batches' {needed * 1024:.0f} MiB in all"
                )
                stages = dict(r["start_reads_gb"])
                stages["other (open, config)"] = r["before_first_step_gb"] - sum(
                    v for k, v in stages.items() if k != "first step" and v is not None
                )
                print(
                    f"N={n:,} train {recipe}: GiB read before step 1 by stage: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in stages.items() if v is not None),
                    flush=True,
                )
                best = _best_step(run_dir)
                if best is not None:
                    note += f"; best validation step {best}"
                rows.append(_row(n, f"train {recipe} ({_length(args.steps)})", r, note))
            if n <= args.search_max and recipes:
                run_dir, emb, idx = root / f"run_{recipes[0]}", root / "emb", root / "index"
                if args.search_overrides:
                    # the search stages on a run of their own (a narrower head: embeddings
                    # and index of N pairs then fit beside the layout), trained as above
                    run_dir = root / f"run_{recipes[0]}_search"
                    shutil.rmtree(run_dir, ignore_errors=True)
                    extra = args.search_overrides.split(",")
                    r = measure(
                        "train",
                        recipes[0],
                        spec,
                        str(run_dir),
                        str(args.steps),
                        *args.override,
                        *extra,
                        threads=args.threads,
                        cold=data,
                    )
                    rows.append(
                        _row(
                            n,
                            f"train {recipes[0]} {' '.join(extra)} ({_length(args.steps)})",
                            r,
                            "the run the search stages below embed",
                        )
                    )
                r = measure(
                    "cli",
                    "embed",
                    str(run_dir),
                    "--out",
                    str(emb),
                    "-q",
                    threads=args.threads,
                    cold=data,
                )
                rows.append(_row(n, f"embed ({recipes[0]})", r))
                r = measure(
                    "cli",
                    "index",
                    "build",
                    str(emb),
                    "--out",
                    str(idx),
                    threads=args.threads,
                    cold=emb,
                )
                size = sum(f.stat().st_size for f in idx.rglob("*") if f.is_file()) / 2**30
                rows.append(_row(n, "index build (exact)", r, f"index {size:.2f} GB"))
                query = ("--query-text-ids", ",".join(str(i) for i in range(10)))
                search = ("cli", "index", "search", str(idx), *query, "--k", "10", "--json")
                r = measure(*search, threads=args.threads, cold=root)
                rows.append(_row(n, "index search (10 texts, cold)", r, f"index {size:.2f} GB"))
                r = measure(*search, threads=args.threads)
                rows.append(_row(n, "index search (10 texts, warm)", r))
                r = measure("faiss-search", str(idx), "10", threads=args.threads)
                rows.append(_row(n, "the search alone (10 texts, in process)", r))
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
                    cold=flat,
                )
                rows.append(
                    _row(
                        n,
                        f"flat search (d={args.flat_dim}, 10 queries, cold)",
                        r,
                        f"index {size:.2f} GB, written in {seconds:.0f} s",
                    )
                )
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    if not args.keep and not args.out:
        shutil.rmtree(base, ignore_errors=True)


def _length(steps: str) -> str:
    """A training row's length: ``--steps`` as the table names it."""
    return "default length" if steps == "default" else f"{steps} steps"


def _best_step(run_dir: Path) -> int | None:
    try:
        meta = json.loads((Path(run_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    best = meta.get("best_step")
    if best is None and isinstance(meta.get("validation"), dict):
        best = meta["validation"].get("best_step")
    return best


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="1000000", help="comma-separated N (default 1M)")
    parser.add_argument("--dim", type=int, default=512, help="feature width (default 512)")
    parser.add_argument("--shard-rows", type=int, default=500_000, help="rows per shard")
    parser.add_argument("--out", default=None, help="directory for the data (default: a temp dir)")
    parser.add_argument(
        "--steps",
        default="50",
        help="training steps (default 50), or 'default': no --steps, the store's default run "
        "(its length resolved and extended as `curvalign train` does; the steps taken reported)",
    )
    parser.add_argument("--recipes", default="clip,meru")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per stage")
    parser.add_argument(
        "--search-max",
        type=int,
        default=1_000_000,
        help="run embed / index build / index search only for N up to this (default 1M)",
    )
    parser.add_argument(
        "--search-overrides",
        default="",
        help="comma-separated key=value training overrides of a run of its own for the search "
        "stages (e.g. embed_dim=128: float32 embeddings of both sides and an exact index take "
        "12 (2 + 1) bytes per pair per dimension, 15 GB at 10M pairs and 128-d, 61 GB at 512-d)",
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
        "--gather-steps",
        type=int,
        default=128,
        help="batches of the cold gather comparison (0: skip it; default 128: whole windows "
        "of the chunk shuffle)",
    )
    parser.add_argument(
        "--gather-batch", type=int, default=256, help="rows per gathered batch (default 256)"
    )
    parser.add_argument(
        "--gather-default-max",
        type=int,
        default=1_000_000,
        help="gather random rows with the default advice only for N up to this (default 1M)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the data written")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use a complete layout of the same N, dim and shard rows left under --out by "
        "--keep instead of writing it again",
    )
    parser.add_argument("override", nargs="*", help="key=value training overrides")
    args = parser.parse_args()
    if args.steps != "default" and not (args.steps.isdigit() and int(args.steps) > 0):
        parser.error(f"--steps must be a positive integer or 'default', got {args.steps!r}")
    if args.shard_rows < 1:
        parser.error(f"--shard-rows must be positive, got {args.shard_rows}")
    print(
        "page cache: "
        + (
            "dropped (posix_fadvise DONTNEED on each file) before every stage marked cold"
            if hasattr(os, "posix_fadvise")
            else "not dropped (no posix_fadvise here): read GiB shows what came from disk"
        ),
        flush=True,
    )
    rows: list[list[str]] = []
    try:
        run(args, rows)
    finally:  # the table of what was measured, also when a stage failed
        if rows:
            print_table(rows)


def print_table(rows: list[list[str]]) -> None:
    """``rows`` as a Markdown table (the columns of ``_row``)."""
    header = ["N", "stage", "wall s", "CPU s", "read GiB", "peak RSS GB", "peak anon GB", "notes"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
