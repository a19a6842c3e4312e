"""Graph embedding as Nickel & Kiela (2017) pose it: one point per node of a hierarchy, trained
from the edges of its transitive closure, measured by how well distances reconstruct it.

Not image-text alignment: no recipe, no feature store. The study ``wordnet-dimensions`` trains
its arms here (``declare.ArmTrainer``); the math is the library's (``curvalign.geometry``).

* ``Graph``: the nodes and the closure's pairs ``(u, v)`` (``v`` an ancestor of ``u``), from a
  WordNet noun subtree (``wordnet_graph``: Debian's ``wordnet-base`` through the project's
  reader, every hypernym path, so a synset with two hypernyms in the subtree keeps both, as in
  Nickel & Kiela's mammal closure) or a complete synthetic tree (``tree_graph``).
* ``embed_graph``: one parameter ``v_i`` in R^d per node; the point is ``expmap0(v_i, c)`` on
  the Lorentz model (``geometry.lorentz``; the parameter is a tangent vector at the origin, so
  plain Adam trains it) or ``v_i`` itself in R^d. The loss is Nickel & Kiela's Eq. (6): for each
  closure pair (u, v), the softmax of ``-d(u, v)`` against ``-d(u, v')`` for ``negatives``
  sampled nodes v' unrelated to u (InfoNCE with scores = -distance). Seeded, bounded in steps,
  notifies progress every tenth of a long run.
* ``reconstruction``: mean rank and MAP of the closure ranked by distance
  (``common.rank_closure``, the measure ``common.reconstruction`` applies to a recipe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from curvalign.errors import ConfigError
from curvalign.geometry import euclidean, lorentz
from curvalign.recipes.health import MAX_CURVED, MIN_CURVED

Notify = Callable[[str], None]

LORENTZ = "lorentz"
EUCLIDEAN = "euclidean"
GEOMETRIES = (LORENTZ, EUCLIDEAN)
#: a run at least this long says how far it is every tenth of its steps
PROGRESS_FROM = 500


@dataclass(frozen=True)
class Graph:
    """A hierarchy's transitive closure: ``names`` of the n nodes, ``pairs: [E, 2]`` (long) with
    ``(u, v)``: v is an ancestor of u (the closure's edges, each once)."""

    names: list[str]
    pairs: Tensor
    spec: str = ""

    @property
    def n(self) -> int:
        return len(self.names)

    def related(self) -> Tensor:
        """``[n, n]`` bool: u and v are joined by a closure edge (either direction)."""
        rel = torch.zeros(self.n, self.n, dtype=torch.bool)
        rel[self.pairs[:, 0], self.pairs[:, 1]] = True
        return rel | rel.T


def _closure_pairs(parents: Sequence[int]) -> Tensor:
    pairs = []
    for u in range(len(parents)):
        p = parents[u]
        while p >= 0:
            pairs.append((u, p))
            p = parents[p]
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def tree_graph(branching: int, depth: int) -> Graph:
    """The complete tree of ``branching`` children per node and ``depth`` levels below the root
    (nodes in breadth-first order), as its transitive closure."""
    if branching < 1 or depth < 1:
        raise ConfigError(f"tree: branching and depth must be >= 1, got {branching}, {depth}")
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(branching):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    spec = f"tree:branching={branching},depth={depth}"
    return Graph([f"n{i}" for i in range(len(parents))], _closure_pairs(parents), spec)


def wordnet_graph(synset: str) -> Graph:
    """The noun subtree below ``synset`` (``curvalign.data.wordnet.build_tree``'s nodes) with
    every hypernym path inside it: (u, v) for each v among u's transitive hypernyms (and
    instance hypernyms) in the subtree. ``mammal.n.01``: 1182 nodes, 6542 pairs."""
    from curvalign.data.wordnet import build_tree, open_wordnet

    wn = open_wordnet()
    tree = build_tree(synset, wn)
    index = {s: i for i, s in enumerate(tree.synsets)}
    pairs = []
    for u, name in enumerate(tree.synsets):
        up = wn.synset(name).closure(lambda s: s.hypernyms() + s.instance_hypernyms())
        pairs += sorted((u, index[a.name()]) for a in up if a.name() in index)
    return Graph(tree.synsets, torch.tensor(pairs, dtype=torch.long), f"wordnet:{synset}")


def load_graph(spec: str) -> Graph:
    """``wordnet:SYNSET`` (a WordNet noun subtree) or ``tree:branching=B,depth=D``."""
    kind, _, rest = spec.partition(":")
    if kind == "wordnet" and rest:
        return wordnet_graph(rest)
    if kind == "tree":
        values = dict(item.partition("=")[::2] for item in rest.split(",") if item)
        unknown = set(values) - {"branching", "depth"}
        try:
            if unknown:
                raise ValueError
            return tree_graph(int(values.get("branching", 2)), int(values.get("depth", 3)))
        except ValueError:
            pass
    raise ConfigError(
        f"graph data {spec!r}: expected wordnet:SYNSET (e.g. wordnet:mammal.n.01) or "
        "tree:branching=B,depth=D"
    )


def rewired(graph: Graph, share: float, seed: int) -> Graph:
    """The control's handicap: ``share`` of the closure's pairs (drawn with ``seed``) have their
    ancestor replaced by a node drawn uniformly (not the node itself); the rest are kept."""
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"rewired share must be in [0, 1], got {share}")
    g = torch.Generator().manual_seed(seed)
    pairs = graph.pairs.clone()
    e = pairs.shape[0]
    moved = torch.randperm(e, generator=g)[: int(round(share * e))]
    # a node other than u: draw from n - 1 and skip u
    other = torch.randint(0, graph.n - 1, (moved.numel(),), generator=g)
    other = other + (other >= pairs[moved, 0]).long()
    pairs[moved, 1] = other
    return replace(graph, pairs=pairs)


@dataclass(frozen=True)
class EmbedConfig:
    """One arm's settings (``key=value`` options, ``parse``).

    geometry      "lorentz" (curvature -``curvature``) or "euclidean"
    dim           d, the embedding's degrees of freedom (the Lorentz point's space part)
    lr            Adam's learning rate on the parameters (tangent vectors for Lorentz)
    batch_size    closure pairs per step
    negatives     nodes sampled per pair, those related to u masked (Nickel & Kiela's paper:
                  10)
    init_radius   the start: each parameter ~ N(0, init_radius^2 / d I), so the mean squared
                  distance to the origin is ``init_radius^2`` (Lorentz: c r^2 ~ c init_radius^2;
                  well above the flat 0.01 of the step-0 check)
    burn_in       share of the steps trained at lr / 10 first (Nickel & Kiela's burn-in)
    """

    geometry: str = LORENTZ
    dim: int = 2
    lr: float = 0.1
    batch_size: int = 256
    negatives: int = 10
    curvature: float = 1.0
    init_radius: float = 1.0
    burn_in: float = 0.1

    @classmethod
    def parse(cls, options: Sequence[str]) -> EmbedConfig:
        """``["geometry=lorentz", "dim=5", ...]`` -> the config; an unknown key or a bad value
        is one ``ConfigError`` naming it and what is expected."""
        known = {f: type(getattr(cls(), f)) for f in cls.__dataclass_fields__}
        values: dict[str, Any] = {}
        for item in options:
            key, sep, raw = item.partition("=")
            if not sep or key not in known:
                raise ConfigError(
                    f"graph embedding option {item!r}: expected KEY=VALUE with KEY one of "
                    f"{', '.join(known)}"
                )
            try:
                values[key] = known[key](raw)
            except ValueError:
                kind = {int: "an integer", float: "a number"}.get(known[key], "a string")
                raise ConfigError(
                    f"graph embedding option {key}={raw!r}: expected {kind}"
                ) from None
        config = cls(**values)
        if config.geometry not in GEOMETRIES:
            raise ConfigError(f"geometry must be one of {GEOMETRIES}, got {config.geometry!r}")
        if config.dim < 1 or config.batch_size < 1 or config.negatives < 1:
            raise ConfigError("dim, batch_size and negatives must be >= 1")
        if not (config.lr > 0 and config.curvature > 0 and config.init_radius > 0):
            raise ConfigError("lr, curvature and init_radius must be > 0")
        return config


@dataclass
class GraphRun:
    """One trained embedding: ``points: [n, d]`` (Lorentz: space components), its config, the
    loss every tenth of the run (``history``: (step, loss)), the start (``start``: mean
    distance to the origin ``radius``, ``c r^2`` for Lorentz, warnings in the step-0 check's
    format) and the reconstruction of the graph it was measured on (``values``)."""

    points: Tensor
    config: EmbedConfig
    steps: int
    history: list[tuple[int, float]] = field(default_factory=list)
    start: dict[str, Any] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)


def points_of(params: Tensor, config: EmbedConfig) -> Tensor:
    """The embedding of parameters ``[n, d]``: ``expmap0`` (Lorentz) or themselves."""
    if config.geometry == LORENTZ:
        return lorentz.expmap0(params, config.curvature)
    return params


def distances(x: Tensor, y: Tensor, config: EmbedConfig) -> Tensor:
    """Row-wise distances of broadcast points ``[..., d]`` -> ``[...]``: the Lorentz geodesic
    distance, or the Euclidean one (``sqrt`` of ``euclidean.sqdist``, floored so its gradient
    stays finite at 0)."""
    if config.geometry == LORENTZ:
        return lorentz.dist(x, y, config.curvature)
    return euclidean.sqdist(x, y).clamp_min(1e-12).sqrt()


def pairwise_distances(points: Tensor, config: EmbedConfig) -> Tensor:
    """All distances ``[n, n]``."""
    if config.geometry == LORENTZ:
        return lorentz.pairwise_dist(points, points, config.curvature)
    return euclidean.pairwise_sqdist(points, points).sqrt()


def start_health(points: Tensor, config: EmbedConfig) -> dict[str, Any]:
    """The start as the step-0 check reports it (``recipes.health``): mean distance to the
    origin ``radius`` and, on the hyperboloid, ``c r^2`` with its "flat_geometry" (< 0.01) or
    "far_out" (> 50) warning."""
    with torch.no_grad():
        if config.geometry == LORENTZ:
            radius = float(lorentz.dist0(points, config.curvature).mean())
        else:
            radius = float(points.norm(dim=-1).mean())
    out: dict[str, Any] = {"checked": True, "radius": radius, "warnings": []}
    if config.geometry != LORENTZ:
        out |= {"curvature": None, "curvature_radius2": None}
        return out
    cr2 = config.curvature * radius**2
    out |= {"curvature": config.curvature, "curvature_radius2": cr2}
    if cr2 < MIN_CURVED:
        out["warnings"].append(
            {"code": "flat_geometry", "message": f"c r^2 = {cr2:.2g} < {MIN_CURVED:g}"}
        )
    if cr2 > MAX_CURVED:
        out["warnings"].append({"code": "far_out", "message": f"c r^2 = {cr2:.3g} > {MAX_CURVED}"})
    return out


def embed_graph(
    graph: Graph,
    config: EmbedConfig,
    *,
    steps: int,
    seed: int,
    notify: Notify = lambda m: None,
    label: str = "",
) -> GraphRun:
    """Train one embedding of ``graph`` for ``steps`` Adam steps with ``seed`` (module
    docstring): each step takes ``batch_size`` closure pairs (u, v) (an epoch-wise shuffle),
    draws ``negatives`` nodes per pair and masks those related to u (or u itself), and
    minimises ``-log softmax(-d)`` at v (Nickel & Kiela Eq. 6). The first ``burn_in`` share
    of the steps runs at lr / 10."""
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if graph.pairs.shape[0] == 0:
        raise ConfigError(f"graph {graph.spec or '?'}: no closure pairs to train on")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    d = config.dim
    params = (torch.randn(graph.n, d, generator=g) * (config.init_radius / math.sqrt(d))).to(
        torch.float64
    )
    params.requires_grad_(True)
    run = GraphRun(points=torch.empty(0), config=config, steps=steps)
    run.start = start_health(points_of(params.detach(), config), config)
    opt = torch.optim.Adam([params], lr=config.lr)
    related = graph.related()
    related.fill_diagonal_(True)
    pairs = graph.pairs
    e = pairs.shape[0]
    order = torch.randperm(e, generator=g)
    cursor = 0
    burn = int(round(config.burn_in * steps))
    every = max(1, steps // 10)
    loud = steps >= PROGRESS_FROM
    for step in range(steps):
        lr = config.lr / 10 if step < burn else config.lr
        for group in opt.param_groups:
            group["lr"] = lr
        if cursor + config.batch_size > e:
            order, cursor = torch.randperm(e, generator=g), 0
        batch = pairs[order[cursor : cursor + config.batch_size]]
        cursor += config.batch_size
        u, v = batch[:, 0], batch[:, 1]
        negs = torch.randint(0, graph.n, (u.numel(), config.negatives), generator=g)
        candidates = torch.cat([v[:, None], negs], dim=1)  # [B, 1 + K]: the true one first
        points = points_of(params, config)
        dist = distances(points[u][:, None, :], points[candidates], config)
        logits = (-dist).masked_fill(
            torch.cat(
                [torch.zeros_like(v[:, None], dtype=torch.bool), related[u[:, None], negs]], 1
            ),
            -math.inf,
        )
        loss = torch.nn.functional.cross_entropy(logits, torch.zeros_like(u))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            value = float(loss.detach())
            run.history.append((step + 1, value))
            if loud:
                notify(
                    f"{label or config.geometry} seed {seed}: step {step + 1}/{steps}, loss {value:.4f}"
                )
    run.points = points_of(params.detach(), config)
    return run


def reconstruction(graph: Graph, points: Tensor, config: EmbedConfig) -> dict[str, float]:
    """Nickel & Kiela's reconstruction of ``graph`` from ``points: [n, d]``: every closure pair
    ranked by distance among u's unrelated nodes; ``{"mean_rank", "map", "nodes"}``
    (``common.rank_closure``)."""
    from curvalign_lab.common import rank_closure

    with torch.no_grad():
        scores = -pairwise_distances(points, config)
    out = rank_closure(scores, graph.related())
    if out is None:
        raise ConfigError(f"graph {graph.spec or '?'}: no node has a related node")
    return out
