"""What the studies share: their world, data loading, Spearman and the graph
reconstruction."""

from __future__ import annotations

import math
from typing import Any

import torch

from curvalign.data.features import FeatureStore
from curvalign.eval.result import EvaluationResult
from curvalign.recipes.atmg import Atmg
from curvalign.recipes.base import Recipe
from curvalign.recipes.meru import Meru

#: each study tests a claim about named methods: it names them through their recipe classes
MERU, ATMG = Meru.name, Atmg.name

#: the synthetic world of the studies: 2500 images, so that validation and test hold 500 images
#: each (with 80 validation images a 1-point tolerance was at the noise level)
STUDY_WORLD = "synthetic:images=2500,val_fraction=0.2,text_pairs=0"


# --- shared helpers -----------------------------------------------------------------------------


def metric_of(result: EvaluationResult, path: str) -> float:
    """``result.metric(path)`` as a float: ``nan`` where the evaluation has no number there."""
    value = result.metric(path, math.nan)
    return math.nan if value is None else float(value)


def load_study_data(data: str) -> tuple[FeatureStore, Any]:
    """(store, SyntheticWorld or None): synthetic specs through ``data.load_synthetic_world``
    (the same store ``load_data`` returns, with its ground truth), others through
    ``data.load_store``."""
    from curvalign.data import load_store, load_synthetic_world

    if data.strip().partition(":")[0] == "synthetic":
        world = load_synthetic_world(data)
        return world.store, world
    return load_store(data)[0], None


def matched_test_pairs(
    store: FeatureStore, split: str = "test"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids, the first caption of each) of ``split``: matched rows."""
    images = store.split_image_ids(split)
    t2i = store.text_to_image.long()
    first = torch.full((store.num_images,), -1, dtype=torch.long)
    order = torch.arange(len(t2i)).flip(0)
    first[t2i[order]] = order  # the last write is the smallest caption id
    texts = first[images]
    keep = texts >= 0
    return images[keep], texts[keep]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation with average ranks for ties."""

    def ranks(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        order = torch.argsort(v)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        uniq, inverse = torch.unique(v, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, r)
        counts = torch.bincount(inverse, minlength=len(uniq)).double()
        return (sums / counts)[inverse]

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denom) if denom > 0 else 0.0


def reconstruction(recipe: Recipe, store: FeatureStore) -> dict[str, float] | None:
    """Graph reconstruction (Nickel & Kiela 2017, Sec. 4.1) of the store's taxonomy from the
    embeddings of its view-A items ("images", one per class node): for every node u and every
    v in the transitive closure of u (its ancestors and descendants), the rank of v among the
    nodes unrelated to u by ``recipe``'s score (higher = nearer), and the average precision of
    u's related nodes among all others. Returns ``{"mean_rank", "map", "nodes"}``; None for a
    store without a taxonomy or image labels."""
    from curvalign.eval import embed, score_matrix

    if store.taxonomy_parents is None or store.image_labels is None or store.class_to_node is None:
        return None
    parents = store.taxonomy_parents.long().tolist()
    node_of_image = store.class_to_node.long()[store.image_labels.long()]
    keep = torch.nonzero(store.image_labels.long() >= 0).flatten()
    nodes = node_of_image[keep].tolist()
    index = {n: i for i, n in enumerate(nodes)}
    ancestors: list[set[int]] = []
    for n in nodes:
        up, p = set(), parents[n]
        while p >= 0:
            if p in index:
                up.add(index[p])
            p = parents[p]
        ancestors.append(up)
    related = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for i, up in enumerate(ancestors):
        for j in up:
            related[i, j] = related[j, i] = True
    with torch.no_grad():
        emb = embed(recipe, store.image_features[keep].float(), "image")
        scores = score_matrix(recipe, emb, emb, query="text")
    return rank_closure(scores, related)


def rank_closure(scores: torch.Tensor, related: torch.Tensor) -> dict[str, float] | None:
    """Graph reconstruction (Nickel & Kiela 2017, Sec. 4.1) from a score matrix ``[n, n]``
    (higher = nearer; ``-distance`` for an embedding) and the closure ``related: [n, n]`` (bool,
    symmetric; the diagonal is ignored): for every node u and every related v, the rank of v
    among the nodes unrelated to u (1 = nearer than all of them), and u's average precision
    of its related nodes among all others. ``{"mean_rank", "map", "nodes"}``; None when no
    node has a related one."""
    n = scores.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    related = related & ~eye
    ranks, precisions = [], []
    for i in range(n):
        rel = related[i]
        if not rel.any():
            continue
        row = scores[i].masked_fill(eye[i], -math.inf)
        unrelated = row[~rel & ~eye[i]]
        # rank of each related v among the unrelated nodes (1 = nearer than all of them)
        ranks.append(1.0 + (unrelated[None, :] > row[rel][:, None]).sum(1).float())
        order = torch.argsort(row, descending=True)[: n - 1]
        hits = rel[order].float()
        cum = hits.cumsum(0) / torch.arange(1, len(hits) + 1)
        precisions.append(float((cum * hits).sum() / hits.sum()))
    if not ranks:
        return None
    return {
        "mean_rank": float(torch.cat(ranks).mean()),
        "map": sum(precisions) / len(precisions),
        "nodes": n,
    }
