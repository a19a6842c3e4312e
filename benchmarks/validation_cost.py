"""What one validation costs (CPU seconds, peak RSS) against the size of the validation split.

Training validates at step 0 and every ``val_every`` steps: mean recall@1 both ways on the
validation split (``train/validation.py``). The ranks of the true matches are counted in tiles
of ``readout.PAIR_BUDGET`` pairs, so the memory no longer grows with N x N, and at most
``val_max_images`` images are scored (a seeded subsample), so the time stops growing past it.
Each N runs in a fresh process (``ru_maxrss`` is a high-water mark), one thread, a CLIP head
on random 64-d features, one caption per image:

    python benchmarks/validation_cost.py                       # N = 2000 8000, every image
    python benchmarks/validation_cost.py --sizes 20000 100000 --max-images 5000
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def one(n: int, max_images: int) -> str:
    import torch

    from curvalign.data.features import FeatureStore, TextPart
    from curvalign.recipes import get_recipe
    from curvalign.train.validation import ValidationSet

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    store = FeatureStore(
        image_features=torch.randn(n, 64, generator=g),
        text=TextPart(torch.randn(n, 64, generator=g)),
        text_to_image=torch.arange(n),
        image_split=torch.ones(n, dtype=torch.long),
        split_names=["train", "val"],
    )
    torch.manual_seed(0)
    cls = get_recipe("clip")
    recipe = cls(cls.Config(), 64, 64).eval()
    validation = ValidationSet(store, max_images=max_images)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    validation.score(recipe)
    cpu = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (
        f"| {n} | {validation.num_images} | {cpu:.2f} | {peak / 1024:.0f} | "
        f"{(peak - before) / 1024:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--max-images", type=int, default=0, help="0 = every image")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(one(args.one, args.max_images))
        return
    print("| val images N | scored | CPU s | peak RSS MiB | RSS added by validation MiB |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(n), "--max-images", str(args.max_images)],
            capture_output=True,
            text=True,
            check=True,
        )
        print(next(line for line in out.stdout.splitlines() if line.startswith("|")))


if __name__ == "__main__":
    main()
