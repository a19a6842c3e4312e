"""bf16 soak: every registered recipe trains under bfloat16 autocast for N steps on a tiny
synthetic world, through the Trainer; prints, per recipe, the time, the first and last logged
loss, the largest |parameter| and whether every logged loss and parameter stayed finite.

    python benchmarks/bf16_soak.py                  # 2,000 steps, every recipe
    python benchmarks/bf16_soak.py --steps 300 --recipes clip,phyclip

A recipe that goes non-finite stops with the trainer's message (step, term); the script goes
on with the next recipe and exits with status 1 at the end. (tests/test_bf16.py runs a shorter
version of the same check.)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from curvalign.data import load_data
from curvalign.errors import TrainError
from curvalign.recipes import get_recipe, recipe_names
from curvalign.runs import read_log
from curvalign.train.trainer import train

WORLD = "synthetic:images=400,text_pairs=200,latent_dim=16,image_dim=32,text_dim=24,hidden_dim=32"

#: tiny dimensions, applied to the recipes whose Config has the key
TINY = {
    "embed_dim": 16,
    "num_factors": 4,
    "factor_dim": 8,
    "hyperbolic_dim": 16,
    "euclidean_dim": 16,
    "sphere_dim": 16,
    "hidden_dim": 32,
    "model_dim": 32,
    "lora_rank": 4,
}


def tiny_overrides(name: str, steps: int, batch_size: int) -> dict[str, object]:
    fields = {f.name for f in dataclasses.fields(get_recipe(name).Config)}
    train_keys = {
        "bf16": True,
        "batch_size": batch_size,
        "pair_batch_size": batch_size,
        "log_every": 1,
        "checkpoint_every": 0,
        "tensorboard": False,
        "steps": steps,
    }
    return {**train_keys, **{k: v for k, v in TINY.items() if k in fields}}


def soak(name: str, store, steps: int, batch_size: int, out: Path) -> dict[str, object]:
    start = time.perf_counter()
    try:
        run_dir = train(
            name,
            store,
            out / name,
            overrides=tiny_overrides(name, steps, batch_size),
            show_progress=False,
        )
    except TrainError as err:
        return {
            "recipe": name,
            "ok": False,
            "seconds": time.perf_counter() - start,
            "error": str(err),
        }
    seconds = time.perf_counter() - start
    losses = [record["loss"] for record in read_log(run_dir)]
    from safetensors.torch import load_file

    weights = load_file(run_dir / "model.safetensors")
    floats = [w for w in weights.values() if w.is_floating_point()]
    finite = all(isinstance(x, float) and math.isfinite(x) for x in losses) and all(
        bool(torch.isfinite(w).all()) for w in floats
    )
    return {
        "recipe": name,
        "ok": finite and len(losses) == steps,
        "seconds": seconds,
        "first": losses[0],
        "last": losses[-1],
        "max_abs_param": max(float(w.abs().max()) for w in floats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--recipes", default=None, help="comma-separated (default: every registered recipe)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.recipes.split(",") if args.recipes else recipe_names()
    store = load_data(WORLD)
    print(
        f"bf16 autocast, {args.steps} steps, batch {args.batch_size}, {WORLD}, torch {torch.__version__}"
    )
    print(
        f"{'recipe':10s} {'ok':>3s} {'seconds':>8s} {'first loss':>11s} {'last loss':>10s} {'max|param|':>11s}"
    )
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = soak(name, store, args.steps, args.batch_size, Path(tmp))
            failed |= not r["ok"]
            if "error" in r:
                print(f"{name:10s} {'NO':>3s} {r['seconds']:8.1f}  {r['error']}")
            else:
                print(
                    f"{name:10s} {'yes' if r['ok'] else 'NO':>3s} {r['seconds']:8.1f} {r['first']:11.4f} "
                    f"{r['last']:10.4f} {r['max_abs_param']:11.3g}",
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
