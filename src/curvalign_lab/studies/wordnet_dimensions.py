"""wordnet-dimensions: low-dimensional hyperbolic embeddings of WordNet (the claim seed 002
cites from Nickel & Kiela)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from curvalign.recipes.proclip import Proclip
from curvalign_lab import kit
from curvalign_lab.common import (
    CONTROL_NOISE,
    Notify,
    finite_difference,
    frozen_baseline,
    frozen_text,
    l2_normalised,
    load_study_data,
    make_bench,
    metric_table,
    noisy_store,
    reconstruction,
    study_result,
)
from curvalign_lab.declare import QUICK_WORLD, Scripted

# --- wordnet-dimensions (real data; the claim seed 002 cites from Nickel & Kiela) ----------------

WORDNET_PAPER = (
    "PHyCLIP (seed 002, Sec. 1): 'Euclidean geometry struggles to faithfully represent such trees, "
    "whereas hyperbolic geometry aligns well with this growth', citing Nickel & Kiela (2017), "
    "whose Table 1 measures it as WordNet reconstruction (mean rank and MAP of the taxonomy's "
    "edges ranked by embedding distance) at low dimension. Tested here with that metric on "
    "wordnet:mammal.n.01: the heads' embeddings of all synset names, hyperbolic vs Euclidean vs "
    "spherical at equal degrees of freedom."
)
#: Nickel & Kiela 2017, Table 1 (WordNet nouns reconstruction, d = 5): MAP 0.823 (Poincaré) vs
#: 0.024 (Euclidean), as remembered: not a seed file (seed 002 Sec. 1 cites the paper, not the
#: numbers), and no reachable copy of the table was found to check them against. A published
#: reproduction ("Comparing Euclidean and Hyperbolic Embeddings on the WordNet Nouns Hypernymy
#: Graph") does not confirm the original's Euclidean numbers: it finds Euclidean embeddings as
#: good as Poincaré ones from d = 50 on, so the hyperbolic advantage is a low-dimension claim
#: (the study's d = 2 to 10), not one "at every d"
WORDNET_EFFECT = 0.8
WORDNET_SOURCE = (
    "Nickel & Kiela 2017, Table 1, cited by seed 002 Sec. 1: reconstruction MAP at d=5, "
    "Poincaré 0.823 vs Euclidean 0.024; quoted from memory, unverified; a published "
    "reproduction finds Euclidean as good from d=50 on, so the claim is a low-dimension one"
)
WORDNET_NOTES = (
    "Reconstruction as Nickel & Kiela measure it: every synset's name (view A) is embedded by the "
    "head; for every pair (u, v) of the taxonomy's transitive closure, v is ranked among the "
    "synsets not related to u by the recipe's own score; mean rank and mean average precision "
    "over u. Dimensions count degrees of freedom: a d-dimensional hyperbolic or Euclidean factor "
    "has d, a sphere in R^(d+1) has d (sphere_dim = d + 1). The heads are trained for name <-> "
    "gloss alignment (not for reconstruction, as in the paper): geometries are compared only "
    "where both arms are at least as good as the frozen features ranked by cosine "
    "(precondition), otherwise the claim is 'not reproduced in this regime'."
)


def study_wordnet_dimensions(
    out: Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    seeds: int = 3,
    seed_base: int = 0,
    lr_grid: Sequence[float] | None = kit.LR_GRID,
    lr_cache: Path | None = None,
    show_progress: bool = False,
    notify: Notify = lambda m: None,
    dims: Sequence[int] = (2, 4, 8, 16),
    low_dims: Sequence[int] = (2, 4),
    control_noise: float = CONTROL_NOISE,
) -> dict[str, Any]:
    """Single-geometry ProCLIP heads (hyperbolic / Euclidean / spherical, one factor with d
    degrees of freedom) on WordNet mammals, per d: graph reconstruction MAP and mean rank
    (``reconstruction``) and mean R@1 (name <-> gloss).

    Claims: at d in ``low_dims`` (mean), hyperbolic beats Euclidean and beats spherical on
    reconstruction MAP; precondition: both arms' MAP at least the frozen features' (cosine on
    the input features); paper effect (Euclidean): ``WORDNET_EFFECT``. Calibrated control:
    hyperbolic at the smallest d with ``control_noise`` of its train captions moved to another
    synset (clean - noisy > 0 on MAP). Sanity row: hyperbolic at the smallest d, trained -
    untrained.
    """
    from curvalign.report import plots

    timer = kit.Timer()
    seed_list = list(range(seed_base, seed_base + seeds))
    steps = steps or 150
    data = data or "wordnet:mammal.n.01"
    store, _ = load_study_data(data)
    bench = make_bench(
        out,
        l2_normalised(store),
        data,
        steps,
        overrides,
        notify,
        show_progress,
        lr_grid=lr_grid,
        lr_cache=lr_cache,
    )
    geometries = {
        "hyperbolic": "hyperbolic_dim",
        "euclidean": "euclidean_dim",
        "sphere": "sphere_dim",
    }

    def extra_for(g: str, d: int) -> list[str]:
        ambient = d + 1 if g == "sphere" else d  # d degrees of freedom
        return [f"{k}={ambient if k == geometries[g] else 0}" for k in geometries.values()]

    rec_map: dict[tuple[str, int], dict[int, float]] = {}
    rec_rank: dict[tuple[str, int], dict[int, float]] = {}
    r1: dict[tuple[str, int], dict[int, float]] = {}
    noisy: dict[int, float] = {}
    untrained: dict[int, float] = {}
    conv = {}
    small = min(dims)

    def measure(key: tuple[str, int], seed: int, model: Any) -> None:
        rec = reconstruction(model, bench.store) or {"map": math.nan, "mean_rank": math.nan}
        rec_map.setdefault(key, {})[seed] = rec["map"]
        rec_rank.setdefault(key, {})[seed] = rec["mean_rank"]
        r1.setdefault(key, {})[seed] = kit.mean_r1(bench.evaluate(model))

    for d in dims:
        for g in geometries:
            runs = {}
            for seed in seed_list:
                runs[seed] = bench.train(f"{g}-d{d}", Proclip.name, extra_for(g, d), seed)
                measure((g, d), seed, runs[seed].recipe)
                if g == "hyperbolic" and d == small:
                    model = bench.untrained(Proclip.name, extra_for(g, d), seed)
                    untrained[seed] = (reconstruction(model, bench.store) or {}).get(
                        "map", math.nan
                    )
            conv[f"{g} d={d}"] = kit.convergence_record(runs)
    runs = {}
    for seed in seed_list:
        runs[seed] = bench.train(
            f"control-hyperbolic-d{small}",
            Proclip.name,
            extra_for("hyperbolic", small),
            seed,
            store_from=noisy_store(bench, control_noise),
        )
        noisy[seed] = (reconstruction(runs[seed].recipe, bench.store) or {}).get("map", math.nan)
    conv[f"control: hyperbolic d={small}, {control_noise:.0%} label noise"] = (
        kit.convergence_record(runs)
    )
    lows = [d for d in low_dims if d in dims] or [small]

    def low_avg(g: str) -> dict[int, float]:
        return {s: sum(rec_map[(g, d)][s] for d in lows) / len(lows) for s in seed_list}

    frozen = frozen_baseline(bench)
    frozen_map = frozen.get("reconstruction MAP", math.nan)

    def precondition(g: str) -> str | None:
        below = [
            f"{name} {100 * sum(kit.per_seed(low_avg(name))) / seeds:.1f}"
            for name in ("hyperbolic", g)
            if not sum(kit.per_seed(low_avg(name))) / seeds >= frozen_map
        ]
        if not math.isfinite(frozen_map):
            return None
        return (
            None
            if not below
            else f"arms below the frozen features' reconstruction MAP {100 * frozen_map:.1f} "
            f"(x100) at d in {lows}: " + ", ".join(below)
        )

    ctrl = finite_difference(rec_map[("hyperbolic", small)], noisy)
    claims = [
        kit.claim_record(
            f"hyperbolic beats {name} at d in {lows} (reconstruction MAP)",
            finite_difference(low_avg("hyperbolic"), low_avg(other)),
            ctrl,
            f"hyperbolic d={small} clean - {control_noise:.0%} label noise (MAP)",
            budget_ok=steps >= 50,
            paper_effect=WORDNET_EFFECT if other == "euclidean" else None,
            paper_source=WORDNET_SOURCE
            if other == "euclidean"
            else "Nickel & Kiela 2017 compare no spherical embedding",
            precondition=precondition(other),
            sanity=finite_difference(rec_map[("hyperbolic", small)], untrained),
            sanity_what=f"hyperbolic d={small} trained - untrained (MAP)",
        )
        for name, other in (("Euclidean", "euclidean"), ("spherical", "sphere"))
    ]
    rows = {f"{g} d={d}: reconstruction MAP": rec_map[(g, d)] for d in dims for g in geometries}
    rows |= {
        f"{g} d={d}: reconstruction mean rank (count)": rec_rank[(g, d)]
        for d in dims
        for g in geometries
    }
    rows |= {f"{g} d={d}: mean R@1": r1[(g, d)] for d in dims for g in geometries}
    rows[f"hyperbolic d={small} untrained: reconstruction MAP"] = untrained
    rows[f"hyperbolic d={small} {control_noise:.0%} label noise: reconstruction MAP"] = noisy
    figures = [
        plots.line_plot(
            list(dims),
            {g: [sum(kit.per_seed(rec_map[(g, d)])) / seeds for d in dims] for g in geometries},
            out / "wordnet_dims.png",
            "degrees of freedom d",
            "reconstruction MAP",
            "WordNet mammals: geometry vs dimension",
            logx=True,
        )
    ]
    setup = (
        f"{data}, {steps} steps per run, ProCLIP heads with one geometry of d degrees of freedom, "
        f"d in {list(dims)}, L2-normalised MiniLM inputs; weights selected on validation mean R@1; "
        "reconstruction over all synsets."
    )
    return study_result(
        "wordnet-dimensions",
        WORDNET_PAPER,
        claims,
        setup=setup,
        bench=bench,
        seeds=seed_list,
        timer=timer,
        tables=metric_table("head (x100)", rows) + "\n" + frozen_text(frozen),
        convergence=conv,
        figures=figures,
        notes=WORDNET_NOTES,
        frozen=frozen,
    )


#: the study as its runner sees it (``runner.run_study``); ``quick``: the smoke run's options
STUDY = Scripted(
    "wordnet-dimensions",
    study_wordnet_dimensions,
    quick={"dims": (2, 4)},
    quick_data=QUICK_WORLD,
    quick_steps=4,
)
