"""How much of a label-noise control's seed-to-seed spread is its corruption draw's.

A claim study's calibrated control trains its clean arm with a share of the train captions moved
to another image (``curvalign_lab.declare.label_noise``). Its per-seed effect (clean - noisy test
mean R@1, paired by seed) is judged against the claim's size, so its spread decides whether it
can separate. This script trains, per seed, the study's clean control arm, the arm on a
corruption drawn afresh for that seed (``draw=None``) and the arm on the one corruption every
seed shares (the default draw), all at the same learning rate and budget as the study's, and
prints each seed's two effects and their means and SDs over seeds, measured in one run.

    python benchmarks/label_noise_draw.py                       # proclip-product, 5 seeds
    python benchmarks/label_noise_draw.py --study phyclip-factors --dose 0.48 --lr 0.01

Run on the study's own world (``Study.data``), with its budget and validation checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--study", default="proclip-product", help="a study with a label-noise control"
    )
    parser.add_argument("--dose", type=float, default=0.11, help="share of train captions moved")
    parser.add_argument("--seeds", default="1000,1001,1002,1003,1004")
    parser.add_argument("--lr", type=float, default=3e-3, help="the control arm's learning rate")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from curvalign_lab import kit
    from curvalign_lab.common import load_study_data
    from curvalign_lab.declare import NOISE_DRAW
    from curvalign_lab.studies import registry

    study = registry()[args.study]
    if study.control is None or study.control.handicap.apply is None:
        raise SystemExit(f"study {args.study!r} has no label-noise control to measure")
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) < 2:
        raise SystemExit("--seeds: give at least two seeds (an SD needs two)")
    arm = next(a for a in study.arms if a.label == study.control.arm)
    options = [*arm.options, f"lr={args.lr:g}"]
    store, _ = load_study_data(study.data)
    effects: dict[str, list[float]] = {"fresh draw per seed": [], "one shared draw": []}
    with tempfile.TemporaryDirectory() as tmp:
        bench = kit.Bench(
            Path(tmp),
            store,
            study.data,
            study.steps,
            [],
            val_every=max(1, study.steps // study.validations),
            lr_grid=None,
        )
        print(
            f"{args.study}: {arm.label} at {args.dose:g} label noise, lr {args.lr:g}, "
            f"{study.steps} steps; test mean R@1 in points"
        )
        for seed in seeds:
            start = time.process_time()
            runs = {
                "clean": bench.train("clean", arm.recipe, options, seed),
                "fresh draw per seed": bench.train(
                    "fresh",
                    arm.recipe,
                    options,
                    seed,
                    store_from=_constant(kit.with_label_noise(bench.store, args.dose, seed)),
                ),
                "one shared draw": bench.train(
                    "shared",
                    arm.recipe,
                    options,
                    seed,
                    store_from=_constant(kit.with_label_noise(bench.store, args.dose, NOISE_DRAW)),
                ),
            }
            r1 = {
                k: 100 * kit.val_score(run.recipe, bench.store, "test") for k, run in runs.items()
            }
            for k in effects:
                effects[k].append(r1["clean"] - r1[k])
            print(
                f"seed {seed}: clean {r1['clean']:.2f}, "
                + ", ".join(f"{k} {r1[k]:.2f} (effect {r1['clean'] - r1[k]:+.2f})" for k in effects)
                + f"; {time.process_time() - start:.0f} CPU s"
            )
    for k, values in effects.items():
        print(
            f"{k}: effect mean {statistics.mean(values):.2f}, "
            f"SD over {len(values)} seeds {statistics.stdev(values):.2f} points"
        )
    fresh, shared = (statistics.stdev(v) for v in effects.values())
    print(f"SD ratio, fresh / shared draw: {fresh / shared:.2f}")


def _constant(store):
    return lambda step: store


if __name__ == "__main__":
    main()
