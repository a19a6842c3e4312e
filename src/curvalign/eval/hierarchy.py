"""Hierarchical classification metrics on a taxonomy (seed 002, Table 2; HyCoCLIP's protocol).

Convention (docs/design.md; the one in HyCoCLIP's and PHyCLIP's evaluation code):
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

Beside them (docs/evaluation.md, "Which hierarchy metric to trust"): ``depth_metrics`` (how deep
the predictions are: LCA and PH reward general ones) and ``relative_recall_at_k`` (sibling and
cousin recall@k of the classes the recipe ranks for an image: hierarchy-local structure).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
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
        has_child = [False] * n
        for p in parent_list:
            if p != -1:
                has_child[p] = True
        #: True for a node without children in the real tree (the virtual root is not a node)
        self.is_leaf = [not h for h in has_child]

    def real_depth(self, node: int) -> int:
        """Edges from ``node`` up to the root of its own tree (a forest's virtual root not
        counted): 0 for a root."""
        return len(self.ancestors[node]) - (1 if self.virtual_root else 0)

    def parent(self, node: int) -> int | None:
        """The nearest ancestor (the virtual root, id ``num_nodes``, for a root of a forest), or
        None for the root of a single tree."""
        chain = self.ancestors[node]
        return chain[0] if chain else None

    def grandparent(self, node: int) -> int | None:
        chain = self.ancestors[node]
        return chain[1] if len(chain) > 1 else None

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


#: image rows ranked at once by ``relative_recall_at_k``
ROW_CHUNK = 1024


def _node_list(values: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (values.tolist() if isinstance(values, Tensor) else values)]


def depth_metrics(
    pred: Tensor | Sequence[int],
    true: Tensor | Sequence[int],
    parents: Tensor | Sequence[int] | Taxonomy,
) -> dict[str, float]:
    """What LCA and PH cannot show: how deep the predictions are.

    {"depth_match": share of predictions at the depth of their true node, "leaf_rate": share of
    predictions that are leaves of the taxonomy, "pred_depth": mean depth of the predictions,
    "true_depth": mean depth of the true nodes}; depth = edges from the node's own root (a
    forest's virtual root not counted). LCA and PH reward a general prediction (an ancestor of
    the truth scores PH = 1), so a model that predicts near the root wins them; a prediction
    depth far below ``true_depth`` and a low ``depth_match`` give it away.

    pred, true: [n] node ids; parents: [T] child -> parent or a ``Taxonomy``.
    """
    tax = parents if isinstance(parents, Taxonomy) else Taxonomy(parents)
    p, t = _node_list(pred), _node_list(true)
    if len(p) != len(t) or not p:
        raise InputError(
            f"pred and true must be non-empty and of one length; got {len(p)}, {len(t)}"
        )
    if any(not 0 <= v < tax.num_nodes for v in p + t):
        raise InputError(f"pred/true node ids must lie in [0, {tax.num_nodes})")
    n = len(p)
    return {
        "depth_match": sum(
            tax.real_depth(a) == tax.real_depth(b) for a, b in zip(p, t, strict=True)
        )
        / n,
        "leaf_rate": sum(tax.is_leaf[a] for a in p) / n,
        "pred_depth": sum(tax.real_depth(a) for a in p) / n,
        "true_depth": sum(tax.real_depth(b) for b in t) / n,
    }


def relative_classes(
    class_to_node: Tensor | Sequence[int], tax: Taxonomy, relation: str
) -> list[list[int]]:
    """For every class, the other classes that are its ``relation`` in the taxonomy:

    - "sibling": a different node with the same parent;
    - "cousin": a node with the same grandparent but a different parent (so the same depth
      below their common ancestor, two edges up from each).

    A forest's roots are siblings under its virtual root; the root of a single tree has none.
    Classes mapped to the same node are neither (they are the same concept)."""
    if relation not in ("sibling", "cousin"):
        raise InputError(f"relation must be 'sibling' or 'cousin', got {relation!r}")
    nodes = _node_list(class_to_node)
    key = tax.parent if relation == "sibling" else tax.grandparent
    groups: dict[int, list[int]] = {}
    for c, node in enumerate(nodes):
        k = key(node)
        if k is not None:
            groups.setdefault(k, []).append(c)
    out = []
    for node in nodes:
        k = key(node)
        members = groups.get(k, []) if k is not None else []
        if relation == "sibling":
            out.append([m for m in members if nodes[m] != node])
        else:
            parent = tax.parent(node)
            out.append([m for m in members if tax.parent(nodes[m]) != parent])
    return out


def relative_recall_at_k(
    class_scores: Tensor,
    labels: Tensor,
    class_to_node: Tensor | Sequence[int],
    parents: Tensor | Sequence[int] | Taxonomy,
    ks: Sequence[int] = (5,),
    relations: Sequence[str] = ("sibling", "cousin"),
) -> dict[str, float]:
    """Hierarchy-local recall of the retrieved classes: {"sibling@k", "cousin@k"}.

    For an image of true class y, rank every class except y by its score (higher first; ties
    broken *against* the model: among equal scores the relatives come last). With R(y) the
    relatives of y (``relative_classes``), the image's recall@k is
    ``|R(y) ∩ top-k| / min(k, |R(y)|)`` (1 when every slot that relatives could fill is filled
    by them); the metric averages it over the labelled images whose class has at least one
    relative. A key is absent when no image qualifies.

    class_scores: [n, C] (higher better, the recipe's zero-shot scores); labels: [n] in [0, C)
    (-1: left out); class_to_node: [C]; parents: [T] or a ``Taxonomy``.
    """
    tax = parents if isinstance(parents, Taxonomy) else Taxonomy(parents)
    if class_scores.ndim != 2 or labels.shape != class_scores.shape[:1]:
        raise InputError(
            f"class_scores must be [n, C] and labels [n]; got {tuple(class_scores.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if not bool(torch.isfinite(class_scores).all()):
        raise InputError("class scores contain NaN or infinite values")
    keep = labels >= 0
    scores, labels = class_scores[keep].double(), labels[keep].long()
    n, num_classes = scores.shape
    out: dict[str, float] = {}
    for relation in relations:
        rel = relative_classes(class_to_node, tax, relation)
        member = torch.zeros(num_classes, num_classes, dtype=torch.bool)
        for c, others in enumerate(rel):
            member[c, others] = True
        sums = dict.fromkeys(ks, 0.0)
        counted = 0
        for start in range(0, n, ROW_CHUNK):  # bounded memory: a few [chunk, C] tensors
            rows = slice(start, start + ROW_CHUNK)
            is_rel = member[labels[rows]]  # [m, C]
            size = is_rel.sum(1)
            has = size > 0
            if not bool(has.any()):
                continue
            # the true class leaves the ranking; ties against the model: relatives last
            masked = scores[rows].clone()
            masked[torch.arange(len(size)), labels[rows]] = -torch.inf
            secondary = torch.sort(is_rel.double(), dim=1, stable=True).indices
            primary = torch.sort(
                masked.gather(1, secondary), dim=1, descending=True, stable=True
            ).indices
            ranked_rel = is_rel.gather(1, secondary.gather(1, primary))
            for k in ks:
                found = ranked_rel[:, :k].sum(1).double()
                recall = found / size.clamp_min(1).clamp_max(k).double()
                sums[k] += float(recall[has].sum())
            counted += int(has.sum())
        if counted:
            out.update({f"{relation}@{k}": sums[k] / counted for k in ks})
    return out
