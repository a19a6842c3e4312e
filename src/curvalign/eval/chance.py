"""What a ranking by chance scores on a split: the floor every table row is read against.

Retrieval and zero-shot are exact expectations under a uniformly random ranking (ties against
the model do not arise): text->image R@k = k / Ni; image->text R@k = 1 - C(Nt - m, k) / C(Nt, k)
for an image with m captions among Nt; zero-shot top-k = k / C, mean per-class recall = 1 / C.
Hard negatives: 0.5 (a random score beats the negative half the time). Sibling/cousin recall@k:
k' = min(k, C - 1) of the C - 1 other classes are drawn, so an image whose class has r relatives
finds k' r / (C - 1) of them on average, recall ``k' r / ((C - 1) min(k, r))``. The hierarchical
metrics and prediction depths of a random class have no closed form: they are averaged over
``draws`` seeded uniform guesses per image (an estimate, with the seed fixed so that the row is
reproducible). Ordering: random distances order a chain of L items with probability 1/L! (16.7%
for a 3-item text chain), an adjacent pair with 1/2. Entailment and multi-label mAP are left out
(n/a).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from curvalign.data.features import present
from curvalign.eval.hierarchy import (
    Taxonomy,
    depth_metrics,
    hierarchical_metrics,
    relative_classes,
)

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore


def _miss_all(n: int, m: int, k: int) -> float:
    """C(n - m, k) / C(n, k): probability that k random picks out of n avoid m given items."""
    if k > n - m:
        return 0.0
    p = 1.0
    for i in range(k):
        p *= (n - m - i) / (n - i)
    return p


def chance_evaluation(
    store: FeatureStore,
    split: str = "test",
    ks: tuple[int, ...] = (1, 5, 10),
    draws: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """An ``evaluate``-shaped dict (retrieval, zeroshot, hierarchy, compositional) of chance."""
    image_ids = store.split_image_ids(split)
    in_split = torch.zeros(store.num_images, dtype=torch.bool)
    in_split[image_ids] = True
    owners = store.text_to_image.long()
    owners = owners[in_split[owners]]
    n_image, n_text = len(image_ids), len(owners)
    captions = torch.bincount(owners, minlength=store.num_images)[image_ids].tolist()
    retrieval = {f"t2i@{k}": min(1.0, k / n_image) for k in ks}
    for k in ks:
        retrieval[f"i2t@{k}"] = sum(1.0 - _miss_all(n_text, m, k) for m in captions) / n_image
    result: dict[str, Any] = {
        "meta": {"recipe": "chance", "split": split, "num_images": n_image, "num_texts": n_text},
        "retrieval": retrieval,
    }
    labels = store.image_labels[image_ids].long() if store.image_labels is not None else None
    if store.has_classes and labels is not None and bool((labels >= 0).any()):
        n_class = (
            len(store.class_names)
            if store.class_names
            else int(present(store.prompt_to_class, "prompt_to_class").max()) + 1
        )
        result["zeroshot"] = {
            "top1": 1 / n_class,
            "top5": min(1.0, 5 / n_class),
            "mean_per_class": 1 / n_class,
        }
        if store.has_taxonomy and store.class_to_node is not None:
            true = labels[labels >= 0]
            gen = torch.Generator().manual_seed(seed)
            guesses = torch.randint(n_class, (draws, len(true)), generator=gen)
            class_to_node = store.class_to_node.long()
            tax = Taxonomy(present(store.taxonomy_parents, "taxonomy_parents"))
            pred, truth = class_to_node[guesses.flatten()], class_to_node[true.repeat(draws)]
            result["hierarchy"] = {
                **hierarchical_metrics(pred, truth, tax),
                **depth_metrics(pred, truth, tax),
                **relative_recall_chance(true, class_to_node, tax, n_class),
            }
    if store.has_negatives:
        result["compositional"] = {"overall": 0.5}
    ordering: dict[str, Any] = {}
    if store.has_chains and store.chain_features is not None:
        # random distances order a chain of L items strictly increasing with probability 1/L!
        length = int(store.chain_features.shape[1])
        ordering["text"] = {"chain": 1.0 / math.factorial(length), "pairs": 0.5}
    if store.has_boxes:
        ordering["image"] = {"chain": 0.5, "pairs": 0.5}  # crop -> full image: one pair
    if ordering:
        result["ordering"] = ordering
    return result


def relative_recall_chance(
    labels: torch.Tensor, class_to_node: torch.Tensor, tax: Taxonomy, n_class: int, k: int = 5
) -> dict[str, float]:
    """Expected sibling/cousin recall@k of a uniformly random class ranking (module docstring),
    over the images whose class has relatives; keys as ``hierarchy.relative_recall_at_k``."""
    out: dict[str, float] = {}
    drawn = min(k, n_class - 1)
    for relation in ("sibling", "cousin"):
        sizes = [len(r) for r in relative_classes(class_to_node, tax, relation)]
        per_image = [
            drawn * sizes[y] / ((n_class - 1) * min(k, sizes[y]))
            for y in labels.tolist()
            if sizes[y] > 0
        ]
        if per_image:
            out[f"{relation}@{k}"] = sum(per_image) / len(per_image)
    return out
