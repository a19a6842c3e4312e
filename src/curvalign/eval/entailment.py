"""Entailment AP / AUROC: does the recipe's own entailment quantity put (general, specific) pairs
above (unrelated general, same specific) pairs?

Pairs (docs/evaluation.md, "Entailment"):

- ``taxonomy``: for every labelled image of class y, each class a whose node is y's node or one
  of its ancestors gives a positive (text of a, image); the text of a class is the recipe's
  class embedding of its prompts (``Recipe.class_embedding``, each method's prompt ensemble).
  Each positive gets one negative with the **same image** and a class a' drawn uniformly (seeded)
  among the classes at **the same depth** as a that are neither y nor an ancestor of y (any such
  class when that depth has none; no negative when there is none at all). Matching the depth
  means that a quantity reading only how general the text is (its distance to the origin) cannot
  separate positives from negatives: the pair's relation has to.
- ``chains``: for every text chain (general -> specific, e.g. attribute -> noun phrase ->
  caption) and levels j < j', a positive (chain[c, j], chain[c, j']) and a negative
  (chain[c', j], chain[c, j']) with c' != c drawn uniformly (seeded): the same specific text, a
  general text of the same level from another chain.

This follows the HierarCaps evaluation (Alper & Averbuch-Elor, ECCV 2024) as Hyper3-CLIP reports
it: positives are the dataset's own (general, specific) pairs, negatives pair the same specific
item with a general text that does not entail it; the depth matching is this project's addition,
stated so. Scores are ``Recipe.entailment_scores`` (cone margin, exterior angle, distance-to-origin
order); AP / AUROC with ties handled as ``eval/ranking.py`` says, with tie diagnostics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from curvalign.eval.hierarchy import Taxonomy
from curvalign.eval.ranking import binary_ranking_metrics

#: positives kept at most per source (a seeded subsample beyond it), bounding the cost on large stores
MAX_POSITIVES = 20000


def taxonomy_pairs(
    labels: Tensor,
    class_to_node: Tensor,
    tax: Taxonomy,
    seed: int = 0,
    max_positives: int = MAX_POSITIVES,
) -> tuple[Tensor, Tensor, Tensor]:
    """(general class [m], specific image [m] (index into ``labels``), positive [m] bool) for the
    labelled entries of ``labels`` [n] (-1 left out); see the module docstring."""
    nodes = [int(v) for v in class_to_node.tolist()]
    classes_of_node: dict[int, list[int]] = {}
    for c, node in enumerate(nodes):
        classes_of_node.setdefault(node, []).append(c)
    by_depth: dict[int, list[int]] = {}
    for c, node in enumerate(nodes):
        by_depth.setdefault(tax.real_depth(node), []).append(c)
    gen = torch.Generator().manual_seed(seed)
    general: list[int] = []
    specific: list[int] = []
    positive: list[bool] = []
    items = [(i, int(y)) for i, y in enumerate(labels.tolist()) if y >= 0]
    positives = [
        (i, a)
        for i, y in items
        for node in [nodes[y]] + [n for n in tax.ancestors[nodes[y]] if n < tax.num_nodes]
        for a in classes_of_node.get(node, [])
    ]
    if len(positives) > max_positives:
        keep = torch.randperm(len(positives), generator=gen)[:max_positives].sort().values
        positives = [positives[k] for k in keep.tolist()]

    def draw(pool: list[int], entailing: set[int]) -> int:
        """A uniform member of ``pool`` whose node is not in ``entailing`` (rejection: the
        entailing nodes are few, one chain of ancestors, so a draw takes few tries)."""
        while True:
            b = pool[int(torch.randint(len(pool), (1,), generator=gen))]
            if nodes[b] not in entailing:
                return b

    everything = list(range(len(nodes)))
    for i, a in positives:
        y_node = nodes[int(labels[i])]
        entailing = {y_node, *tax.ancestors[y_node]}
        general.append(a)
        specific.append(i)
        positive.append(True)
        depth = tax.real_depth(nodes[a])
        blocked = [n for n in entailing if n < tax.num_nodes]
        same_depth_blocked = sum(
            len(classes_of_node.get(n, [])) for n in blocked if tax.real_depth(n) == depth
        )
        if len(by_depth[depth]) > same_depth_blocked:
            pool = by_depth[depth]
        elif len(nodes) > sum(len(classes_of_node.get(n, [])) for n in blocked):
            pool = everything
        else:
            continue  # every class entails this image: no negative
        general.append(draw(pool, entailing))
        specific.append(i)
        positive.append(False)
    return (
        torch.tensor(general, dtype=torch.long),
        torch.tensor(specific, dtype=torch.long),
        (torch.tensor(positive, dtype=torch.bool)),
    )


def chain_pairs(
    num_chains: int, length: int, seed: int = 0, max_positives: int = MAX_POSITIVES
) -> tuple[Tensor, Tensor, Tensor]:
    """(general row [m], specific row [m], positive [m]) over the flattened chain texts (row
    ``c * length + j`` = level j of chain c); see the module docstring. Empty without two
    chains."""
    if num_chains < 2 or length < 2:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, torch.zeros(0, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    levels = [(j, k) for j in range(length) for k in range(j + 1, length)]
    chains = torch.arange(num_chains)
    if num_chains * len(levels) > max_positives:
        chains = (
            torch.randperm(num_chains, generator=gen)[: max(1, max_positives // len(levels))]
            .sort()
            .values
        )
    general, specific, positive = [], [], []
    for c in chains.tolist():
        for j, k in levels:
            other = int(torch.randint(num_chains - 1, (1,), generator=gen))
            other += other >= c  # uniform over the other chains
            general += [c * length + j, other * length + j]
            specific += [c * length + k, c * length + k]
            positive += [True, False]
    return (
        torch.tensor(general, dtype=torch.long),
        torch.tensor(specific, dtype=torch.long),
        torch.tensor(positive, dtype=torch.bool),
    )


def entailment_metrics(scores: Tensor, positive: Tensor) -> dict[str, float] | None:
    """``binary_ranking_metrics`` of one source's pair scores, or None without both kinds."""
    if not bool(positive.any()) or bool(positive.all()):
        return None
    return binary_ranking_metrics(scores, positive)


__all__ = ["MAX_POSITIVES", "chain_pairs", "entailment_metrics", "taxonomy_pairs"]
