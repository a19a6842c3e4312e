"""What the studies share: their world, data loading, the tables of their pages and the graph
reconstruction."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.data.features import FeatureStore
from curvalign.eval.result import EvaluationResult
from curvalign.recipes.atmg import Atmg
from curvalign.recipes.base import Recipe
from curvalign.recipes.meru import Meru
from curvalign.stats import mean_interval
from curvalign_lab import kit

#: each study tests a claim about named methods: it names them through their recipe classes
MERU, ATMG = Meru.name, Atmg.name

Notify = Callable[[str], None]


#: the synthetic world of the studies: 2500 images, so that validation and test hold 500 images
#: each (with 80 validation images a 1-point tolerance was at the noise level)
STUDY_WORLD = "synthetic:images=2500,val_fraction=0.2,text_pairs=0"

#: the calibrated control's handicap: this share of the train captions describe another image
CONTROL_NOISE = 0.1


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


def noisy_store(bench: kit.Bench, rate: float) -> Callable[[int], FeatureStore]:
    """``store_from`` for a calibrated label-noise control arm (``kit.with_label_noise``)."""
    noisy = kit.with_label_noise(bench.store, rate)
    return lambda step: noisy


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


def interval_row(label: str, values: dict[int, float], scale: float = 100.0) -> str:
    """One row of a metric table; a label ending in "(count)" is printed unscaled."""
    if label.endswith("(count)"):
        scale = 1.0
    vals = [v for v in kit.per_seed(values) if v is not None and math.isfinite(v)]
    if not vals:
        return f"| {label} | n/a | |"
    iv = mean_interval(vals)
    seeds = ", ".join(f"{v * scale:.1f}" for v in vals)
    return f"| {label} | {iv.format(scale, 1)} | {seeds} |"


def metric_table(title: str, rows: dict[str, dict[int, float]], scale: float = 100.0) -> str:
    lines = [f"| {title} | mean ± 95% | per seed |", "|---|---:|---|"]
    lines += [interval_row(k, v, scale) for k, v in rows.items()]
    return "\n".join(lines) + "\n"


def claims_table(claims: list[dict[str, Any]]) -> str:
    lines = [
        "| claim | paper's effect | MDE at these seeds | effect (95% interval) | calibrated "
        "control (95% interval) | verdict | Holm-adjusted verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        ok = "separated" if c.get("control_ok") else "did not separate"
        lines.append(
            f"| {c['claim']} ({c.get('role', 'primary')}) | {c.get('paper_effect_text', '')} | "
            f"{c.get('mde_text', '')} | {c['effect_text']} | {c['control_what']}: "
            f"{c['control_text']} ({ok}) | {c['outcome']} | **{c.get('holm_outcome', '')}** |"
        )
    sanity = [c for c in claims if c.get("sanity_text")]
    if sanity:
        lines.append("")
        lines.append("Sanity rows (trained - untrained: always passes; never decides a verdict):")
        lines.append("")
        for text in dict.fromkeys(c["sanity_text"] for c in sanity):
            lines.append(f"- {text}")
    return "\n".join(lines) + "\n"


def convergence_table(conv: dict[str, dict[str, Any]]) -> str:
    lines = ["| arm | seeds converged | best steps | stopped at |", "|---|---:|---|---|"]
    for arm, c in conv.items():
        lines.append(
            f"| {arm} | {c['converged']}/{c['seeds']} | {', '.join(map(str, c['best_steps']))} | "
            f"{', '.join(map(str, c.get('last_steps', [])))} |"
        )
    return "\n".join(lines) + "\n"


def finite_difference(a: dict[int, float], b: dict[int, float]) -> kit.Interval:
    """``kit.difference(a, b)``, or a nan interval (n = 0) where a value is missing or not
    finite (a metric the store cannot give)."""
    values = [*a.values(), *b.values()]
    if not values or not all(math.isfinite(v) for v in values):
        return nan_interval()
    return kit.difference(a, b)


def seed_interval(values: dict[int, float], offset: float = 0.0) -> kit.Interval:
    return mean_interval([v - offset for v in kit.per_seed(values)])


def l2_normalised(store: FeatureStore) -> FeatureStore:
    """Every feature tensor of ``store`` L2-normalised per row (ProCLIP Sec. 3.2 normalises the
    frozen CLIP features before its heads). Minimum stand-in for the recipe-owned input
    normalisation of the comparisons issue."""
    changes = {}
    for name, value in store.fields().items():  # on-disk names: each text part's files too
        if name.endswith("features") and isinstance(value, torch.Tensor) and value.ndim >= 2:
            changes[name] = torch.nn.functional.normalize(value.float(), dim=-1)
    return store.with_fields(**changes)


def make_bench(
    out: Path,
    store: FeatureStore,
    data: str,
    steps: int,
    overrides: Sequence[str],
    notify: Notify,
    show_progress: bool,
    validations: int = 3,
    lr_grid: Sequence[float] | None = kit.LR_GRID,
    lr_cache: Path | None = None,
) -> kit.Bench:
    """The study's bench on ``store`` (``data`` is its spec): a ``steps`` budget with
    ``validations`` validation evaluations over it, each arm's learning rate chosen on
    validation from ``lr_grid`` (None or empty: ``kit.STUDY_LR_SCALE`` x the paper rate), the
    runs of that choice stored in ``lr_cache`` (``kit.cached_value``; None: not stored)."""
    return kit.Bench(
        out,
        store,
        data,
        steps,
        overrides,
        val_every=max(1, steps // validations),
        lr_grid=lr_grid,
        lr_cache=lr_cache,
        notify=notify,
        show_progress=show_progress,
    )


def study_result(
    name: str,
    paper: str,
    claims: list[dict[str, Any]],
    *,
    setup: str,
    bench: kit.Bench,
    seeds: Sequence[int],
    timer: kit.Timer,
    tables: str,
    convergence: dict[str, dict[str, Any]],
    figures: Sequence[Path],
    notes: str = "",
    val_what: str = "validation mean R@1",
    **extra: Any,
) -> dict[str, Any]:
    kit.apply_holm(claims)
    family = (
        f"Family for the multiplicity correction: the {len(claims)} claims of this study "
        f"({sum(c.get('holm_family') is not None for c in claims)} testable here), Holm at "
        f"family-wise alpha {kit.ALPHA:g}.\n\n"
    )
    body = (
        tables
        + f"\nConvergence ({val_what} every "
        + f"{bench.val_every} steps; converged = curvalign.stats.curve_converged: the best is not "
        + "the last validation and the last third of the curve rises by no more than its own "
        + f"noise (2 SD) or {bench.plateau_tol:g}):\n\n"
        + convergence_table(convergence)
        + f"\nTraining: {bench.lr_text()}; an arm not flat at its {bench.steps}-step budget trains "
        + f"on in segments of {bench.val_every} steps up to {bench.max_steps} steps (the "
        + "'stopped at' column).\n"
    )
    markdown = family + claims_table(claims) + "\n" + body
    return {
        "name": name,
        "paper": paper,
        "setup": setup,
        "notes": notes,
        "rule": kit.RULE,
        "claims": claims,
        "verdict": "; ".join(f"{c['claim']}: {c['holm_outcome']}" for c in claims),
        "holds": all(c["holm_verdict"] == kit.HOLDS for c in claims),
        "lr_choice": {
            label: {
                "recipe": c["recipe"],
                "chosen": c["chosen"],
                "grid": list(c["grid"].items()),
                "excluded": c.get("excluded", {}),
            }
            for label, c in bench.lr_choice.items()
        },
        "lr_grid": list(bench.lr_grid or ()),
        "seeds": list(seeds),
        "steps": bench.steps,
        "data": bench.spec,
        "convergence": convergence,
        "learning_rates": {
            k: {"paper": p, "study": v} for k, (p, v) in bench.learning_rates.items()
        },
        "lr_scale": bench.lr_scale,
        "max_steps": bench.max_steps,
        "markdown": markdown,
        # the page's tables below its verdicts (``page.study_body``)
        "tables": body,
        "starts": {a: {str(s): r for s, r in v.items()} for a, v in bench.starts.items()},
        "starts_fired": kit.starts_fired(bench.starts),
        "figures": [str(f) for f in figures],
        "wall_s": timer.seconds(),
        **extra,
    }


def nan_interval() -> kit.Interval:
    return kit.Interval(math.nan, math.nan, math.nan, 0)


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
