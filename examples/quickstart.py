"""From features to search in the learned geometry, through the Python API.

    python examples/quickstart.py [--steps 300] [--out runs/example-meru]

Trains MERU on the embedded synthetic world, evaluates it with its own score (Lorentz distance;
rates printed in %), and searches the test images for a few captions with an exact Lorentz index. The same steps on
the command line: `curvalign train`, `curvalign eval`, `curvalign embed`, `curvalign index`.
"""

from __future__ import annotations

import argparse

import torch

from curvalign.data import load_data
from curvalign.eval import evaluate
from curvalign.index import build_index
from curvalign.runs import load_run
from curvalign.train import train


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/example-meru")
    args = parser.parse_args()

    store = load_data("synthetic:images=1000")
    run_dir = train(
        "meru",
        store,
        args.out,
        steps=args.steps,
        overrides=["batch_size=128", "embed_dim=64"],
        overwrite=True,
    )
    run = load_run(run_dir)
    recipe = run.recipe

    metrics = evaluate(recipe, store, split="test", diagnostics=False)
    # Rates in %, as everywhere in curvalign (the metrics themselves are fractions in [0, 1]).
    print(
        "retrieval on the test split (%):",
        ", ".join(f"{name} {100 * value:.1f}" for name, value in metrics.retrieval.items()),
    )

    # Exact nearest neighbours by Lorentz distance over the test images.
    test_images = store.split_image_ids("test")
    with torch.no_grad():
        images = recipe.embed_images(store.image_features[test_images])["point"]
        captions = torch.nonzero(torch.isin(store.text_to_image, test_images)).flatten()[:3]
        queries = recipe.embed_texts(store.text_features[captions])["point"]
    index = build_index(images, recipe.curvature(), ids=test_images)
    distances, ids = index.search(queries, k=5)
    for caption, row_ids, row_distances in zip(captions.tolist(), ids, distances, strict=False):
        found = "found" if int(store.text_to_image[caption]) in row_ids.tolist() else "not in top 5"
        print(
            f"caption {caption} (image {int(store.text_to_image[caption])}, {found}): "
            + ", ".join(
                f"{i}@{d:.3f}"
                for i, d in zip(row_ids.tolist(), row_distances.tolist(), strict=False)
            )
        )


if __name__ == "__main__":
    main()
