"""Studies: one per claim of the seed papers, each trained and measured on the synthetic world.

Each study is a function ``study_NAME(out, *, steps, data, overrides, show_progress, notify)``
returning a dict with ``name``, ``claim`` (what the paper says), ``verdict`` (one line: holds /
does not hold / mixed, with the deciding figures), ``rows`` (the numbers), ``markdown`` (a table)
and ``figures`` (PNG paths); ``run_study`` also writes ``study.json`` and ``study.md`` into ``out``.

The synthetic world is not the papers' data (no pixels, no real language, a small known
taxonomy): a claim that holds or fails here is evidence about the mechanism at this scale, not a
reproduction of the papers' tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.data.features import FeatureStore
from curvalign.errors import ConfigError
from curvalign.recipes.agr import AGR
from curvalign.recipes.atmg import Atmg
from curvalign.recipes.dualpath import DualPath
from curvalign.recipes.meru import Meru
from curvalign.recipes.phyclip import Phyclip
from curvalign.recipes.proclip import Proclip
from curvalign.report.tables import format_cell, lookup, write_json

#: each study tests a claim about named methods: it names them through their recipe classes
MERU, ATMG = Meru.name, Atmg.name

Notify = Callable[[str], None]

#: every study run: batch 64 and no TensorBoard, so a study finishes in minutes on two CPU cores
COMMON_OVERRIDES = (
    "batch_size=64",
    "pair_batch_size=32",
    "tensorboard=false",
    "checkpoint_every=0",
    "log_every=5",
)


# --- shared machinery ---------------------------------------------------------------------------


class _Context:
    def __init__(
        self,
        out: Path,
        data: str,
        steps: int,
        overrides: Sequence[str],
        show_progress: bool,
        notify: Notify,
    ) -> None:
        self.out, self.steps, self.show_progress, self.notify = out, steps, show_progress, notify
        self.overrides = list(COMMON_OVERRIDES) + list(overrides)
        self.store, self.spec, self.world = _load(data)
        out.mkdir(parents=True, exist_ok=True)
        notify(f"data {self.spec}: {self.store.num_images} images, {self.store.num_texts} captions")

    def train(
        self,
        label: str,
        recipe: str,
        extra: Iterable[str] = (),
        stop_at: int | None = None,
        resume: bool = False,
    ) -> Path:
        from curvalign.train.trainer import train

        self.notify(
            f"training {label} ({recipe}, {self.steps} steps)"
            + (f", stopping at {stop_at}" if stop_at else "")
        )
        return train(
            recipe,
            self.store,
            self.out / "runs" / label,
            steps=self.steps,
            overrides=self.overrides + list(extra),
            overwrite=not resume,
            resume=resume,
            show_progress=self.show_progress,
            stop_at=stop_at,
        )

    def evaluate(self, run_dir: Path) -> tuple[Any, dict[str, Any]]:
        from curvalign.eval import evaluate
        from curvalign.runs import load_run

        loaded = load_run(run_dir)
        return loaded, evaluate(loaded.recipe, self.store, split="test")


def _load(data: str) -> tuple[FeatureStore, str, Any]:
    """(store, spec, SyntheticWorld or None): the world object is kept for ground-truth analyses."""
    from curvalign.data import load_store, load_synthetic_world

    if data.strip().partition(":")[0] == "synthetic":
        world = load_synthetic_world(data)
        return world.store, data, world
    store, spec = load_store(data)
    return store, spec, None


def _table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str, str]], first: str) -> str:
    header = [first] + [c[0] for c in columns]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(columns)) + "|",
    ]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(
                [str(row["label"])] + [format_cell(lookup(row, p), k) for _, p, k in columns]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


# --- agr-curriculum (seed 000, Definition 5.2, Theorem 5.3) -------------------------------------


def study_agr_curriculum(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = False,
    notify: Notify = lambda m: None,
) -> dict[str, Any]:
    """Four-phase curriculum vs single-schedule warm-up: mean routing weight at the end of the
    warm-up and whether one geometry dominates (w > 0.9 Euclidean, w < 0.1 hyperbolic)."""
    from curvalign.eval.diagnostics import dominance, routing_statistics
    from curvalign.report import plots
    from curvalign.runs import read_log
    from curvalign.schedules import agr_warmup_end_step

    ctx = _Context(
        out,
        data or "synthetic:images=800,text_pairs=0",
        steps or 150,
        overrides,
        show_progress,
        notify,
    )
    rows, logs, marks = [], {}, {}
    for label, extra in (
        ("four-phase", ["single_schedule=false"]),
        ("single-schedule", ["single_schedule=true"]),
    ):
        run_dir = ctx.train(label, AGR.name, extra)
        loaded, ev = ctx.evaluate(run_dir)
        log = read_log(run_dir)
        t_w = agr_warmup_end_step(ctx.steps, loaded.recipe.config.curriculum)
        stats = routing_statistics(log, t_w, weight_key="routing_weight", gate_key="gate")
        exact = [
            r["routing_weight_at_warmup_end"]
            for r in log
            if isinstance(r.get("routing_weight_at_warmup_end"), float)
        ]
        w_end = exact[-1] if exact else stats.get("weight_at_warmup_end")
        rows.append(
            {
                "label": label,
                "warmup_end_step": t_w,
                "w_at_warmup_end": w_end,
                "dominance": dominance(w_end),
                "w_mean": stats.get("weight_mean_over_training"),
                "w_final": stats.get("weight_final"),
                "gate_final": stats.get("gate_final"),
                "curvature_final": float(loaded.recipe.curvature_value()),
                "retrieval": ev["retrieval"],
                "zeroshot": ev.get("zeroshot"),
                "hierarchy": ev.get("hierarchy"),
            }
        )
        logs[label], marks[f"T_w {label}"] = log, t_w
    keys = [
        k
        for k in ("routing_weight", "gate", "alpha", "beta", "curvature")
        if any(k in r for r in logs["four-phase"])
    ]
    figures = [
        str(
            plots.log_curves(
                logs,
                keys,
                out / "agr_routing.png",
                title="AGR: four-phase vs single schedule",
                marks={"T_w": rows[0]["warmup_end_step"]},
            )
        )
    ]
    four, single = rows
    holds = four["dominance"] == "balanced" and single["dominance"] in ("euclidean", "hyperbolic")
    verdict = (
        f"{'holds' if holds else 'does not hold'}: mean routing weight at the end of warm-up "
        f"{format_cell(four['w_at_warmup_end'])} ({four['dominance']}) with the four-phase curriculum vs "
        f"{format_cell(single['w_at_warmup_end'])} ({single['dominance']}) with a single schedule "
        "(paper: single schedule -> Euclidean dominance w > 0.9, four-phase balanced)"
    )
    cols = [
        ("T_w", "warmup_end_step", "num"),
        ("w at T_w", "w_at_warmup_end", "num"),
        ("dominance", "dominance", "str"),
        ("mean w", "w_mean", "num"),
        ("final w", "w_final", "num"),
        ("final gate", "gate_final", "num"),
        ("T2I R@1", "retrieval/t2i@1", "pct"),
        ("I2T R@1", "retrieval/i2t@1", "pct"),
        ("ZS top1", "zeroshot/top1", "pct"),
    ]
    return {
        "name": "agr-curriculum",
        "claim": "A single-schedule warm-up lets one geometry dominate the router "
        "(mean w outside [0.1, 0.9] at the end of warm-up); the four-phase curriculum keeps it balanced "
        "(seed 000, Definition 5.2, Theorem 5.3).",
        "verdict": verdict,
        "holds": holds,
        "rows": rows,
        "markdown": _table(rows, cols, "schedule"),
        "figures": figures,
    }


# --- atmg-curvature (seed 001, Tables 3-4 and the curvature discussion) ---------------------------

CURVATURES = (0.1, 0.2, 0.5, 1.0, 2.0, 3.0)


def study_atmg_curvature(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = False,
    notify: Notify = lambda m: None,
    curvatures: Sequence[float] = CURVATURES,
) -> dict[str, Any]:
    """AtMG vs MERU at fixed curvatures: zero-shot top-1 and hierarchy ordering (text chains,
    crop -> image chains) per curvature."""
    from curvalign.report import plots

    ctx = _Context(
        out,
        data or "synthetic:images=800,text_pairs=0",
        steps or 100,
        overrides,
        show_progress,
        notify,
    )
    rows = []
    for c in curvatures:
        for recipe in (MERU, ATMG):
            run_dir = ctx.train(
                f"{recipe}-c{c:g}",
                recipe,
                [f"curvature_init={c}", "learn_curvature=false", f"curvature_min={min(c, 0.1)}"],
            )
            _, ev = ctx.evaluate(run_dir)
            rows.append(
                {
                    "label": f"{recipe} c={c:g}",
                    "recipe": recipe,
                    "c": c,
                    "zeroshot": ev.get("zeroshot"),
                    "ordering": ev.get("ordering"),
                    "retrieval": ev["retrieval"],
                    "hierarchy": ev.get("hierarchy"),
                }
            )
    by = {(r["recipe"], r["c"]): r for r in rows}
    figures = []
    for metric, path, label in (
        ("zeroshot/top1", "atmg_zeroshot.png", "zero-shot top-1"),
        ("ordering/text/chain", "atmg_text_order.png", "text chain ordering"),
        ("ordering/image/chain", "atmg_image_order.png", "image chain ordering"),
    ):
        series = {r: [_num(lookup(by[(r, c)], metric)) for c in curvatures] for r in (MERU, ATMG)}
        figures.append(
            str(
                plots.line_plot(
                    curvatures,
                    series,
                    out / path,
                    "curvature c",
                    label,
                    f"AtMG vs MERU: {label}",
                    logx=True,
                )
            )
        )
    wins = {}
    for metric in ("zeroshot/top1", "ordering/text/chain", "ordering/image/chain"):
        wins[metric] = sum(
            _num(lookup(by[(ATMG, c)], metric)) > _num(lookup(by[(MERU, c)], metric))
            for c in curvatures
        )
    n = len(curvatures)
    order_wins = wins["ordering/text/chain"] + wins["ordering/image/chain"]
    holds = (
        order_wins > n
    )  # AtMG orders better at more than half of the (curvature, chain kind) cells
    verdict = (
        f"{'holds' if holds else 'does not hold'}: AtMG orders chains better than MERU at "
        f"{wins['ordering/text/chain']}/{n} curvatures for text and {wins['ordering/image/chain']}/{n} for "
        f"crop->image, and has the higher zero-shot top-1 at {wins['zeroshot/top1']}/{n} "
        "(paper: AtMG better on both hierarchy orderings at every curvature)"
    )
    cols = [
        ("ZS top1", "zeroshot/top1", "pct"),
        ("text order", "ordering/text/chain", "pct"),
        ("text pairs", "ordering/text/pairs", "pct"),
        ("image order", "ordering/image/chain", "pct"),
        ("T2I R@1", "retrieval/t2i@1", "pct"),
        ("I2T R@1", "retrieval/i2t@1", "pct"),
    ]
    return {
        "name": "atmg-curvature",
        "claim": "The angle-based loss (AtMG) preserves text and image hierarchies "
        "(more specific further from the origin) better than MERU, across fixed curvatures 0.1-3 "
        "(seed 001, Tables 3-4).",
        "verdict": verdict,
        "holds": holds,
        "wins": wins,
        "rows": rows,
        "markdown": _table(rows, cols, "run"),
        "figures": figures,
    }


# --- proclip-product (seed 003, Table 1) --------------------------------------------------------


def study_proclip_product(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = False,
    notify: Notify = lambda m: None,
    part_dim: int = 32,
) -> dict[str, Any]:
    """ProCLIP's product H x E x S (``part_dim`` each) vs each single geometry at the same total
    dimension (3 x ``part_dim``): Recall@1 and @10 in both directions."""
    from curvalign.report import plots

    ctx = _Context(
        out,
        data or "synthetic:images=800,text_pairs=0",
        steps or 150,
        overrides,
        show_progress,
        notify,
    )
    total = 3 * part_dim
    settings = {
        "product H x E x S": (part_dim, part_dim, part_dim),
        "hyperbolic only": (total, 0, 0),
        "euclidean only": (0, total, 0),
        "sphere only": (0, 0, total),
    }
    rows = []
    for label, (h, e, s) in settings.items():
        run_dir = ctx.train(
            label.split()[0],
            Proclip.name,
            [f"hyperbolic_dim={h}", f"euclidean_dim={e}", f"sphere_dim={s}"],
        )
        _, ev = ctx.evaluate(run_dir)
        rows.append(
            {
                "label": label,
                "retrieval": ev["retrieval"],
                "zeroshot": ev.get("zeroshot"),
                "hierarchy": ev.get("hierarchy"),
            }
        )
    metrics = ("t2i@1", "t2i@10", "i2t@1", "i2t@10")
    product, singles = rows[0], rows[1:]
    best_single = {m: max(r["retrieval"][m] for r in singles) for m in metrics}
    wins = [m for m in metrics if product["retrieval"][m] > best_single[m]]
    holds = len(wins) == len(metrics)
    details = ", ".join(
        f"{m} {100 * product['retrieval'][m]:.1f} vs best single {100 * best_single[m]:.1f}"
        for m in metrics
    )
    verdict = (
        f"{'holds' if holds else ('mixed' if wins else 'does not hold')}: the product beats every single "
        f"geometry on {len(wins)}/{len(metrics)} of R@1/R@10 in both directions "
        f"({details}) "
        "(paper: product best in every direction and dimension)"
    )
    results = {r["label"]: r for r in rows}
    figures = [str(plots.retrieval_bars(results, out / "proclip_retrieval.png"))]
    cols = [
        ("T2I R@1", "retrieval/t2i@1", "pct"),
        ("T2I R@10", "retrieval/t2i@10", "pct"),
        ("I2T R@1", "retrieval/i2t@1", "pct"),
        ("I2T R@10", "retrieval/i2t@10", "pct"),
        ("ZS top1", "zeroshot/top1", "pct"),
    ]
    return {
        "name": "proclip-product",
        "claim": f"A mixed-curvature product H x E x S beats each single geometry "
        f"of the same total dimension on retrieval (seed 003, Table 1); here {part_dim} x 3 vs {total}.",
        "verdict": verdict,
        "holds": holds,
        "rows": rows,
        "markdown": _table(rows, cols, "geometry"),
        "figures": figures,
    }


# --- phyclip-factors (seed 002, Table 4, Fig. 4, App. D.2) --------------------------------------


def composition_precision(
    recipe: Any, store: FeatureStore, world: Any, top: int = 5, max_pairs: int = 200
) -> dict[str, float] | None:
    """Factor-wise max composition (seed 002, App. D.2) on the synthetic world's two-object images.

    For each distinct (main leaf a, second leaf b) pair among the test images, the class embeddings
    of a and b (the recipe's own protocol from the class prompts) are composed by keeping, per
    factor, the one further from the origin; the composed query ranks the test images with the
    recipe's score. Returns the mean share of the ``top`` retrieved images that contain both a and b,
    for the composed query and for the better single-concept query. None for recipes without
    factors or stores without the world's ground truth.
    """
    from curvalign.eval import embed, embed_text_part, score_matrix

    compose = getattr(recipe, "factor_max_compose", None)  # PHyCLIP's factor-wise max (App. D.2)
    if world is None or compose is None or not store.has_classes:
        return None
    test_ids = store.split_image_ids("test")
    is_test = torch.zeros(store.num_images, dtype=torch.bool)
    is_test[test_ids] = True
    leaves_of = [set() for _ in range(store.num_images)]
    for img, leaf in zip(world.object_image.tolist(), world.object_leaf.tolist(), strict=False):
        leaves_of[img].add(leaf)
    node_to_class = {int(n): c for c, n in enumerate(store.class_to_node.tolist())}
    pairs = []
    for img in test_ids.tolist():
        objs = world.object_leaf[world.object_image == img].tolist()
        if len(objs) >= 2 and (objs[0], objs[1]) not in pairs:
            pairs.append((objs[0], objs[1]))
    pairs = pairs[:max_pairs]
    if not pairs:
        return None
    with torch.no_grad():
        images = embed(recipe, store.image_features[test_ids].float(), "image")
        prompts = embed_text_part(
            recipe, store, "prompt", torch.arange(store.prompt_features.shape[0])
        )
        p2c = store.prompt_to_class.long()

        def class_emb(leaf: int) -> dict[str, torch.Tensor]:
            idx = torch.nonzero(p2c == node_to_class[leaf]).flatten()
            return recipe.class_embedding({k: v[idx] for k, v in prompts.items()})

        ea = [class_emb(a) for a, _ in pairs]
        eb = [class_emb(b) for _, b in pairs]
        a_pts = torch.cat([e["point"] for e in ea])
        b_pts = torch.cat([e["point"] for e in eb])
        composed = compose({"point": a_pts}, {"point": b_pts})
        contains = torch.tensor(
            [[a in leaves_of[i] and b in leaves_of[i] for i in test_ids.tolist()] for a, b in pairs]
        )

        def precision(query: dict[str, torch.Tensor]) -> torch.Tensor:
            s = score_matrix(recipe, query, images, query="text")
            idx = s.topk(min(top, s.shape[1]), dim=1).indices
            return contains.gather(1, idx).float().mean(dim=1)

        p_comp = precision(composed)
        p_single = torch.maximum(precision({"point": a_pts}), precision({"point": b_pts}))
    return {
        "composed": float(p_comp.mean()),
        "best_single": float(p_single.mean()),
        "pairs": len(pairs),
        "top": top,
    }


def study_phyclip_factors(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = False,
    notify: Notify = lambda m: None,
    total_dim: int = 64,
    factors: Sequence[int] = (1, 4, 16),
) -> dict[str, Any]:
    """PHyCLIP with k factors of d = total_dim / k dimensions: retrieval, zero-shot, hierarchy,
    hard negatives; factor activation per concept family; factor-wise max composition."""
    from curvalign.report import plots

    ctx = _Context(
        out,
        data or "synthetic:images=800,text_pairs=0",
        steps or 150,
        overrides,
        show_progress,
        notify,
    )
    rows, figures = [], []
    for k in factors:
        if total_dim % k:
            raise ConfigError(f"total_dim {total_dim} is not a multiple of k = {k}")
        run_dir = ctx.train(
            f"k{k}", Phyclip.name, [f"num_factors={k}", f"factor_dim={total_dim // k}"]
        )
        loaded, ev = ctx.evaluate(run_dir)
        factors_diag = lookup(ev, "diagnostics/factors") or {}
        comp = composition_precision(loaded.recipe, ctx.store, ctx.world)
        rows.append(
            {
                "label": f"k={k}, d={total_dim // k}",
                "k": k,
                "retrieval": ev["retrieval"],
                "zeroshot": ev.get("zeroshot"),
                "hierarchy": ev.get("hierarchy"),
                "compositional": ev.get("compositional"),
                "factors": {
                    key: factors_diag.get(key)
                    for key in (
                        "distinct_top_factors",
                        "num_families",
                        "mean_relative_contrast",
                        "top_factor",
                    )
                },
                "composition": comp,
            }
        )
        if k == max(factors) and factors_diag.get("activation") is not None:
            figures.append(
                str(
                    plots.heatmap(
                        factors_diag["activation"],
                        out / "phyclip_family_activation.png",
                        factors_diag["family_names"],
                        "factor",
                        f"PHyCLIP k={k}: mean factor distance to origin per family (prompts)",
                    )
                )
            )
    single, multi = rows[0], rows[1:]
    metric_paths = (
        "retrieval/t2i@1",
        "retrieval/i2t@1",
        "zeroshot/top1",
        "hierarchy/J",
        "compositional/overall",
    )
    better = {
        p: sum(_num(lookup(r, p)) > _num(lookup(single, p)) for r in multi) for p in metric_paths
    }
    largest = rows[-1]
    spec = largest["factors"]
    comp = largest["composition"]
    improves = sum(better.values()) > len(metric_paths) * len(multi) / 2
    separate = spec.get("distinct_top_factors") is not None and spec[
        "distinct_top_factors"
    ] == spec.get("num_families")
    composes = comp is not None and comp["composed"] > comp["best_single"]
    holds = improves and separate and composes
    verdict = (
        f"{'holds' if holds else ('mixed' if improves or separate or composes else 'does not hold')}: "
        f"k>1 beats k=1 on {sum(better.values())}/{len(metric_paths) * len(multi)} (metric, k) cells; "
        f"at k={largest['k']} the {spec.get('num_families')} families peak in {spec.get('distinct_top_factors')} "
        f"distinct factors (contrast {format_cell(spec.get('mean_relative_contrast'))}); factor-wise max "
        f"composition precision@{comp['top'] if comp else 5} "
        f"{format_cell(comp['composed'] if comp else None)} vs best single concept "
        f"{format_cell(comp['best_single'] if comp else None)} "
        "(paper: factorisation helps, families occupy distinct factors, max-composition retrieves both)"
    )
    cols = [
        ("T2I R@1", "retrieval/t2i@1", "pct"),
        ("I2T R@1", "retrieval/i2t@1", "pct"),
        ("ZS top1", "zeroshot/top1", "pct"),
        ("J", "hierarchy/J", "num"),
        ("HardNeg", "compositional/overall", "pct"),
        ("distinct top factors", "factors/distinct_top_factors", "num"),
        ("composed P@5", "composition/composed", "num"),
        ("single P@5", "composition/best_single", "num"),
    ]
    return {
        "name": "phyclip-factors",
        "claim": "At fixed k*d, more factors (k > 1) improve on k = 1; concept "
        "families activate distinct factors; the factor-wise max of two single-concept embeddings retrieves "
        "images with both (seed 002, Table 4, Fig. 4, App. D.2).",
        "verdict": verdict,
        "holds": holds,
        "rows": rows,
        "markdown": _table(rows, cols, "factors"),
        "figures": figures,
    }


# --- dualpath-forgetting (seed 004) -------------------------------------------------------------


def study_dualpath_forgetting(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = False,
    notify: Notify = lambda m: None,
    margin: float = 0.02,
) -> dict[str, Any]:
    """Text-text retrieval at the end of phase 1 (text pairs only) vs the end of phase 2 (mixed),
    and the image-text retrieval gained in phase 2. The claim holds when the text-text R@1 drops by
    at most ``margin`` (absolute)."""
    from curvalign.eval import embed_text_part, evaluate, score_matrix
    from curvalign.eval.retrieval import text_text_recall
    from curvalign.report import plots
    from curvalign.runs import load_run
    from curvalign.schedules import dualpath_switch_step

    ctx = _Context(
        out,
        data or "synthetic:images=800,text_pairs=1500",
        steps or 150,
        overrides,
        show_progress,
        notify,
    )
    test_ids = ctx.store.split_image_ids("test")
    in_test = torch.zeros(ctx.store.num_images, dtype=torch.bool)
    in_test[test_ids] = True
    text_ids = torch.nonzero(in_test[ctx.store.text_to_image.long()]).flatten()
    groups = ctx.store.text_to_image.long()[text_ids]

    def measure(run_dir: Path, label: str) -> dict[str, Any]:
        # the claim is about the state at the end of a phase, not the best validation step
        loaded = load_run(run_dir, weights="last")
        recipe = loaded.recipe
        with torch.no_grad():
            texts = embed_text_part(recipe, ctx.store, "text", text_ids)
            tt = text_text_recall(score_matrix(recipe, texts, texts, query="text"), groups)
        ev = evaluate(recipe, ctx.store, diagnostics=False)
        logged = recipe.log_values()
        gate = logged.get("dualpath_gate", logged.get("gate"))
        return {
            "label": label,
            "step": loaded.step,
            "text_text": tt,
            "retrieval": ev["retrieval"],
            "gate": gate,
        }

    from curvalign.config import resolve_config

    config = resolve_config(DualPath.name, ctx.spec, steps=ctx.steps, overrides=ctx.overrides)
    curriculum = getattr(config.recipe_config_object(), "curriculum", None)
    switch = (
        dualpath_switch_step(ctx.steps, curriculum) if curriculum is not None else ctx.steps // 2
    )
    switch = max(1, min(switch, ctx.steps - 1))
    run_dir = ctx.train(DualPath.name, DualPath.name, stop_at=switch)
    phase1 = measure(run_dir, f"end of phase 1 (step {switch})")
    run_dir = ctx.train(DualPath.name, DualPath.name, resume=True)
    phase2 = measure(run_dir, f"end of phase 2 (step {ctx.steps})")
    rows = [phase1, phase2]
    drop = phase1["text_text"]["t2t@1"] - phase2["text_text"]["t2t@1"]
    gain = phase2["retrieval"]["t2i@1"] - phase1["retrieval"]["t2i@1"]
    holds = drop <= margin and gain > 0
    verdict = (
        f"{'holds' if holds else 'does not hold'}: text-text R@1 {100 * phase1['text_text']['t2t@1']:.1f} after "
        f"phase 1 -> {100 * phase2['text_text']['t2t@1']:.1f} after phase 2 (change {-100 * drop:+.1f} points, "
        f"margin {100 * margin:.0f}); image-text T2I R@1 {100 * phase1['retrieval']['t2i@1']:.1f} -> "
        f"{100 * phase2['retrieval']['t2i@1']:.1f} (paper: text ability kept within a small margin while "
        "image-text is learnt)"
    )
    figures = [
        str(
            plots.line_plot(
                [0, 1],
                {
                    "text-text R@1": [r["text_text"]["t2t@1"] for r in rows],
                    "T2I R@1": [r["retrieval"]["t2i@1"] for r in rows],
                    "I2T R@1": [r["retrieval"]["i2t@1"] for r in rows],
                },
                out / "dualpath_phases.png",
                "phase end (0 = phase 1, 1 = phase 2)",
                "recall",
                "DualPath: forgetting check",
            )
        )
    ]
    cols = [
        ("step", "step", "num"),
        ("T2T R@1", "text_text/t2t@1", "pct"),
        ("T2T R@5", "text_text/t2t@5", "pct"),
        ("T2I R@1", "retrieval/t2i@1", "pct"),
        ("I2T R@1", "retrieval/i2t@1", "pct"),
        ("gate", "gate", "num"),
    ]
    return {
        "name": "dualpath-forgetting",
        "claim": "With the dual-path projection and its gate, text-text "
        "retrieval after phase 2 stays within a small margin of phase 1 while image-text retrieval is "
        "learnt (seed 004).",
        "verdict": verdict,
        "holds": holds,
        "switch_step": switch,
        "rows": rows,
        "markdown": _table(rows, cols, "checkpoint"),
        "figures": figures,
    }


STUDIES: dict[str, Callable[..., dict[str, Any]]] = {
    "agr-curriculum": study_agr_curriculum,
    "atmg-curvature": study_atmg_curvature,
    "proclip-product": study_proclip_product,
    "phyclip-factors": study_phyclip_factors,
    "dualpath-forgetting": study_dualpath_forgetting,
}


def _literal(value: Any) -> str:
    return (
        ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
        if isinstance(value, (tuple, list))
        else str(value)
    )


def parse_study_options(name: str, items: Sequence[str]) -> dict[str, Any]:
    """``["curvatures=0.1,1,3", "part_dim=16"]`` -> keyword options of study ``name``, checked
    against its signature (values are Python literals; a comma list becomes a tuple)."""
    import ast
    import inspect

    allowed = {
        p
        for p in inspect.signature(STUDIES[name]).parameters
        if p not in ("out", "steps", "data", "overrides", "show_progress", "notify")
    }
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"study option {item!r} is not NAME=VALUE")
        if key not in allowed:
            raise ConfigError(
                f"study {name} has no option {key!r}; options: {', '.join(sorted(allowed)) or 'none'}"
            )
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise ConfigError(f"study option {key}={raw!r}: expected a Python literal") from None
        out[key] = value
    return out


#: below this many steps per run no study's curriculum or training gets far enough for its
#: verdict to say anything about the claim (the studies' own defaults are 100-150)
MIN_STUDY_STEPS = 100


def short_run_verdict(verdict: str, steps: int | None) -> str:
    """``verdict`` as is, or marked inconclusive when ``steps`` is below ``MIN_STUDY_STEPS``."""
    if steps is None or steps >= MIN_STUDY_STEPS:
        return verdict
    return (
        f"inconclusive: {steps} steps per run are too short to test the claim (use at least "
        f"{MIN_STUDY_STEPS}, or the study's default); at this length: {verdict}"
    )


def run_study(
    name: str,
    out: str | Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    show_progress: bool = False,
    notify: Notify | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run study ``name`` and write ``study.json`` and ``study.md`` into ``out``."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    out = Path(out)
    result = STUDIES[name](
        out,
        steps=steps,
        data=data,
        overrides=list(overrides),
        show_progress=show_progress,
        notify=notify or (lambda m: None),
        **options,
    )
    result["verdict"] = short_run_verdict(result["verdict"], steps)
    result["command"] = (
        f"curvalign study {name} --out {out}"
        + (f" --steps {steps}" if steps else "")
        + (f" --data {data}" if data else "")
        + "".join(f" --set {k}={_literal(v)}" for k, v in options.items())
        + "".join(f" {o}" for o in overrides)
    )
    write_json(out / "study.json", result)
    md = [
        f"# Study {name}",
        "",
        f"Claim: {result['claim']}",
        "",
        f"Verdict: **{result['verdict']}**",
        "",
        result["markdown"],
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    md += [f"![{Path(f).stem}]({Path(f).name})" for f in result["figures"]]
    (out / "study.md").write_text("\n".join(md) + "\n")
    return result
