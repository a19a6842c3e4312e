"""Hierarchical classification metrics on a taxonomy (seed 002, Table 2; HyCoCLIP's protocol).

Convention (DESIGN.md; the one in HyCoCLIP's and PHyCLIP's evaluation code):
A(n) = the ancestors of n up to and including the root, *excluding n itself*.

- TIE = undirected path length between pred and true (tree-induced error);
- LCA = |A(pred)| - |A(pred) ∩ A(true)| + 1;
- J   = |A(pred) ∩ A(true)| / |A(pred) ∪ A(true)|;
- PH  = |A(pred) ∩ A(true)| / |A(pred)|;
- RH  = |A(pred) ∩ A(true)| / |A(true)|.

Two edge rules the papers leave open, chosen so each metric keeps its stated meaning:
- a forest (several roots, e.g. one tree per concept family) is joined under one virtual root,
  as WordNet's "entity" joins ImageNet's synsets; the virtual root belongs to every A(n) of a
  real node, and a path between two trees passes through it;
- an empty ratio 0/0 (the root itself as pred or true) counts as 1: the root is an ancestor of
  every node, which is what PH = 1 / RH = 1 mean ("pred is true or one of its ancestors").

Note on LCA: the seed's prose calls it "the maximum of the distances from predicted and true
classes to their LCA", but the formula above (the code behind the tables) is the distance from
*pred* to the LCA when pred and true lie on different branches, and that distance + 1 when one is
an ancestor of the other (so a correct prediction scores 1, not 0). The project reports the
formula, so numbers compare with the papers' tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from curvalign.errors import InputError


class Taxonomy:
    """A tree (or forest) given child -> parent; ancestors and depths precomputed.

    parents: [T] parent node of each node, -1 for a root.
    """

    def __init__(self, parents: Tensor | Sequence[int]) -> None:
        parent_list = [
            int(p) for p in (parents.tolist() if isinstance(parents, Tensor) else parents)
        ]
        n = len(parent_list)
        if n == 0:
            raise InputError("taxonomy is empty (no nodes)")
        if any(p < -1 or p >= n for p in parent_list):
            raise InputError(f"taxonomy parents must lie in [-1, {n}); got values outside")
        roots = [i for i, p in enumerate(parent_list) if p == -1]
        if not roots:
            raise InputError("taxonomy has no root (no parent of -1): it contains a cycle")
        self.virtual_root = len(roots) > 1
        # ancestors of each node, nearest first; the virtual root (id n) tops every chain of a forest
        self.ancestors: list[list[int]] = []
        for node in range(n):
            chain, seen, current = [], {node}, parent_list[node]
            while current != -1:
                if current in seen:
                    raise InputError(f"taxonomy contains a cycle through node {current}")
                seen.add(current)
                chain.append(current)
                current = parent_list[current]
            if self.virtual_root:
                chain.append(n)
            self.ancestors.append(chain)
        self.ancestor_sets = [frozenset(a) for a in self.ancestors]
        self.num_nodes = n

    def depth(self, node: int) -> int:
        return len(self.ancestors[node])

    def path_length(self, a: int, b: int) -> int:
        """Number of edges on the undirected path between a and b."""
        if a == b:
            return 0
        line_a = [a] + self.ancestors[a]
        pos_in_b = {node: i for i, node in enumerate([b] + self.ancestors[b])}
        for i, node in enumerate(line_a):
            if node in pos_in_b:
                return i + pos_in_b[node]
        raise AssertionError("nodes of one taxonomy always share an ancestor")  # pragma: no cover


def _ratio(num: int, den: int) -> float:
    return 1.0 if den == 0 else num / den


def hierarchical_metrics(
    pred: Tensor | Sequence[int],
    true: Tensor | Sequence[int],
    parents: Tensor | Sequence[int] | Taxonomy,
) -> dict[str, float]:
    """{"TIE", "LCA", "J", "PH", "RH"} averaged over samples.

    pred, true: [n] node ids (not class ids: map classes with ``class_to_node`` first);
    parents: [T] child -> parent (-1 for roots), or a prepared ``Taxonomy``.
    """
    tax = parents if isinstance(parents, Taxonomy) else Taxonomy(parents)
    pred_list = [int(p) for p in (pred.tolist() if isinstance(pred, Tensor) else pred)]
    true_list = [int(t) for t in (true.tolist() if isinstance(true, Tensor) else true)]
    if len(pred_list) != len(true_list):
        raise InputError(
            f"pred and true must have the same length, got {len(pred_list)} and {len(true_list)}"
        )
    if not pred_list:
        raise InputError("no samples: hierarchical metrics are undefined")
    if any(not 0 <= v < tax.num_nodes for v in pred_list + true_list):
        raise InputError(f"pred/true node ids must lie in [0, {tax.num_nodes})")
    sums = dict.fromkeys(("TIE", "LCA", "J", "PH", "RH"), 0.0)
    for p, t in zip(pred_list, true_list, strict=False):
        ap, at = tax.ancestor_sets[p], tax.ancestor_sets[t]
        inter, union = len(ap & at), len(ap | at)
        sums["TIE"] += tax.path_length(p, t)
        sums["LCA"] += len(ap) - inter + 1
        sums["J"] += _ratio(inter, union)
        sums["PH"] += _ratio(inter, len(ap))
        sums["RH"] += _ratio(inter, len(at))
    n = len(pred_list)
    return {k: v / n for k, v in sums.items()}
