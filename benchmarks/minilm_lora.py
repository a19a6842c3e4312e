"""LoRA on the shipped MiniLM text tower vs the frozen-feature head vs the frozen features.

Issue 23 item 7: on ``wordnet:mammal.n.01`` (both views are MiniLM texts: lemma names stand for
images, glosses are the captions), one recipe (MERU by default) is trained

* **head**: on the store's frozen MiniLM features (the feature-store trainer);
* **lora**: with LoRA adapters on MiniLM's attention projections (``query``, ``key``, ``value``
  of every layer, rank 8, alpha 16) trained together with the same head; each step re-encodes
  the batch's texts with the current tower (``curvalign train --towers "minilm;image=lora;
  text=lora"``), validation re-encodes its split;

with **the same tuning budget for both arms**: the same learning-rate grid (``--lrs``; for the
LoRA arm the tower and the head take the grid value), the same steps, batch, validation cadence
and seeds. Each arm's learning rate is the grid value with the best mean validation score over
the seeds (the test split is never read to choose); the table reports the test split at that
learning rate, seed by seed, with a 95% Student-t interval. LoRA runs are evaluated on the store
re-encoded by their best towers (``curvalign.train.towers.reencode_store``: names, glosses, the
zero-shot prompts, which are the glosses, and the gloss chains). The frozen features row ranks
MiniLM's own features by cosine.

    python benchmarks/minilm_lora.py --out bench/minilm-lora            # docs/results.md
    python benchmarks/minilm_lora.py --out /tmp/x --steps 2 --lrs 1e-3 --seeds 1   # a smoke run

Wall time is printed per arm; results.json and results.md go to ``--out``. A run directory
already finished is reused (the script can be restarted after an interruption).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from curvalign.stats import mean_interval

DATA = "wordnet:mammal.n.01"
LORA = "minilm;image=lora;text=lora;lora_rank=8;lora_alpha=16;lr={lr}"
METRICS = (
    ("T2I R@1", ("retrieval", "t2i@1")),
    ("I2T R@1", ("retrieval", "i2t@1")),
    ("ZS top1", ("zeroshot", "top1")),
)


def run_arm(arm: str, lr: float, seed: int, args: argparse.Namespace, store: Any) -> dict:
    """Train one (arm, lr, seed) cell (reusing a finished run) and evaluate it on the test split."""
    from curvalign.eval import evaluate
    from curvalign.runs import load_run
    from curvalign.train import train
    from curvalign.train.towers import load_towers, reencode_store

    out = Path(args.out) / arm / f"lr{lr:g}" / f"seed{seed}"
    overrides = [
        f"lr={lr}",
        f"seed={seed}",
        f"batch_size={args.batch}",
        f"val_every={args.val_every}",
        f"num_threads={args.threads}",
    ]
    started = time.perf_counter()
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    towers = LORA.format(lr=lr) if arm == "lora" else None
    run = train(
        args.recipe,
        DATA,
        out,
        steps=args.steps,
        towers=towers,
        overrides=overrides,
        overwrite=True,
        show_progress=False,
    )
    loaded = load_run(run, weights="best")
    test_store = store
    if arm == "lora":
        test_store = reencode_store(store, load_towers(run, "best"), data=DATA)
    metrics = evaluate(loaded.recipe, test_store, split="test", diagnostics=False)
    cell = {
        "arm": arm,
        "lr": lr,
        "seed": seed,
        "best_step": run.best_step,
        "best_val": run.best_val,
        "test": {name: float(metrics[a][b]) for name, (a, b) in METRICS},
        "wall_s": time.perf_counter() - started,
    }
    done.write_text(json.dumps(cell, indent=2) + "\n")
    return cell


def frozen_row(store: Any) -> dict[str, float]:
    from curvalign.eval import evaluate
    from curvalign.eval.frozen import FrozenFeatures

    metrics = evaluate(
        FrozenFeatures(store.image_dim, store.text_dim), store, split="test", diagnostics=False
    )
    return {name: float(metrics[a][b]) for name, (a, b) in METRICS}


def table(cells: list[dict], frozen: dict[str, float], args: argparse.Namespace) -> list[str]:
    lines = [
        f"data {DATA}, recipe {args.recipe}, {args.steps} steps, batch {args.batch}, validation "
        f"every {args.val_every}, lr grid {args.lrs} (both arms), seeds {args.seeds}",
        "",
        "| arm | lr chosen (mean val) | best step per seed | "
        + " | ".join(f"{m} (95% CI)" for m, _ in METRICS)
        + " | mean R@1 minus frozen | wall s (all lrs) |",
        "|---|---|---|" + "---:|" * len(METRICS) + "---:|---:|",
    ]
    frozen_r1 = 50 * (frozen["T2I R@1"] + frozen["I2T R@1"])
    picked: dict[str, list[dict]] = {}
    for arm in ("head", "lora"):
        mine = [c for c in cells if c["arm"] == arm]
        if not mine:
            continue
        by_lr: dict[float, list[dict]] = {}
        for c in mine:
            by_lr.setdefault(c["lr"], []).append(c)
        val = {lr: sum(c["best_val"] for c in cs) / len(cs) for lr, cs in by_lr.items()}
        lr = max(val, key=lambda k: val[k])
        chosen = sorted(by_lr[lr], key=lambda c: c["seed"])
        picked[arm] = chosen
        cols = []
        for name, _ in METRICS:
            iv = mean_interval([100 * c["test"][name] for c in chosen])
            cols.append(f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]")
        diff = mean_interval(
            [50 * (c["test"]["T2I R@1"] + c["test"]["I2T R@1"]) - frozen_r1 for c in chosen]
        )
        lines.append(
            f"| {arm} | {lr:g} ({', '.join(f'{k:g}: {v:.4f}' for k, v in sorted(val.items()))}) | "
            f"{', '.join(str(c['best_step']) for c in chosen)} | {' | '.join(cols)} | "
            f"{diff.mean:+.2f} [{diff.low:+.2f}, {diff.high:+.2f}] | "
            f"{sum(c['wall_s'] for c in mine):.0f} |"
        )
    if len(picked) == 2 and [c["seed"] for c in picked["head"]] == [
        c["seed"] for c in picked["lora"]
    ]:

        def r1(c: dict) -> float:
            return 50 * (c["test"]["T2I R@1"] + c["test"]["I2T R@1"])

        paired = mean_interval(
            [r1(a) - r1(b) for a, b in zip(picked["lora"], picked["head"], strict=True)]
        )
        summary = (
            f"lora minus head, mean R@1 paired by seed: {paired.mean:+.2f} "
            f"[{paired.low:+.2f}, {paired.high:+.2f}]"
        )
    else:
        summary = ""
    lines.append(
        "| frozen features | - | - | "
        + " | ".join(f"{100 * frozen[m]:.2f}" for m, _ in METRICS)
        + " | 0 | - |"
    )
    if summary:
        lines += ["", summary]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", default="meru")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--lrs", default="5e-4,2e-3", help="comma-separated, for both arms")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arms", default="head,lora")
    parser.add_argument(
        "--only-seed", type=int, default=None, help="train this seed only (parallel processes)"
    )
    args = parser.parse_args(argv)
    from curvalign.data import load_store

    store, _ = load_store(DATA)
    lrs = [float(v) for v in args.lrs.split(",")]
    started = time.perf_counter()
    cells = []
    for arm in args.arms.split(","):
        for lr in lrs:
            for seed in range(args.seeds):
                if args.only_seed is not None and seed != args.only_seed:
                    continue
                cell = run_arm(arm, lr, seed, args, store)
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    frozen = frozen_row(store)
    lines = table(cells, frozen, args)
    lines.append("")
    lines.append(f"wall time {time.perf_counter() - started:.0f} s")
    out = Path(args.out)
    (out / "results.json").write_text(
        json.dumps({"args": vars(args), "cells": cells, "frozen": frozen}, indent=2) + "\n"
    )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
