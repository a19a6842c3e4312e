"""Write a captions file of everyday scenes, two captions each, in the Karpathy layout.

    python examples/scenes.py --out scenes.json [--scenes 600] [--seed 0]

Each scene is a subject with a colour doing something somewhere; its two captions say it in
different words ("a red dog running on the beach" / "a crimson puppy jogs along the shore").
Many scenes share a subject, a colour or a place, so telling them apart takes more than the
sentence encoder's first guess: a text-only store extracted from it (``curvalign extract
--encoder minilm --captions scenes.json``) is large enough that training a head shows learning
on its validation split. Splits: 80% train (the trainer holds out its validation from train),
20% test. The same arguments write the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# (word in the first caption, its paraphrase in the second)
SUBJECTS = [
    ("dog", "puppy"), ("cat", "kitten"), ("man", "gentleman"), ("woman", "lady"),
    ("child", "kid"), ("horse", "pony"), ("bird", "sparrow"), ("car", "automobile"),
    ("bus", "coach"), ("boat", "sailboat"), ("bicycle", "bike"), ("cow", "calf"),
    ("train", "locomotive"), ("sheep", "lamb"), ("truck", "lorry"), ("duck", "duckling"),
]  # fmt: skip
COLOURS = [
    ("red", "crimson"), ("blue", "navy"), ("green", "olive"), ("white", "snowy"),
    ("black", "dark"), ("yellow", "golden"), ("brown", "chocolate"), ("grey", "silver"),
]  # fmt: skip
ACTIONS = [
    ("running", "jogs"), ("resting", "lies still"), ("waiting", "stands by"),
    ("moving fast", "speeds"), ("turning", "swerves"), ("standing", "stays upright"),
]  # fmt: skip
PLACES = [
    ("on the beach", "along the shore"), ("in the park", "across the lawn"),
    ("on a city street", "down an urban road"), ("near a lake", "beside the pond"),
    ("in the snow", "through the winter drifts"), ("by a farm", "next to the barn"),
    ("under a bridge", "beneath the overpass"), ("in a field", "over the meadow"),
]  # fmt: skip


def scenes(n: int, seed: int) -> list[dict]:
    """``n`` distinct scenes (at most every combination), each as a Karpathy image record."""
    combos = [
        (s, c, a, p) for s in SUBJECTS for c in COLOURS for a in ACTIONS for p in PLACES
    ]  # 6,144 combinations
    if not 1 <= n <= len(combos):
        raise SystemExit(f"--scenes must lie in [1, {len(combos)}], got {n}")
    rng = random.Random(seed)
    chosen = rng.sample(combos, n)
    n_train = round(0.8 * n)
    return [
        {
            "filename": f"{i:04d}.jpg",
            "split": "train" if i < n_train else "test",
            "sentences": [
                {"raw": f"a {c[0]} {s[0]} {a[0]} {p[0]}"},
                {"raw": f"the {c[1]} {s[1]} {a[1]} {p[1]}"},
            ],
        }
        for i, (s, c, a, p) in enumerate(chosen)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenes", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps({"images": scenes(args.scenes, args.seed)}, indent=1) + "\n")
    print(f"wrote {args.out}: {args.scenes} scenes, two captions each")


if __name__ == "__main__":
    main()
