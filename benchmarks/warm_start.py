"""How close each recipe's step 0 ranks to the data's linear alignment (docs/methods.md, "The
warm start"), and what an intercept would add to the alignment.

For each recipe that trains on the store's pairs, the run's step 0 is built as the trainer
builds it (the trainer's validation hold-out, then ``runs.build_started_recipe``: data-aware
scales, the warm start) and scored on that hold-out with the recipe's own scores, by the
protocol of the alignment's ``val_r1`` (mean of T2I and I2T R@1, ``data.alignment.mean_r1``).
Printed per recipe: the alignment's val mean R@1, the step-0 val mean R@1, the gap, and the
recipe's own line on its start.

``--intercept`` prints instead, for ridge image->text with and without an intercept at each
strength of ``data.alignment.ALPHAS``, the val mean R@1 of the cosine ranking of the mapped
features (the hold-out as above), and the best of each.

    python benchmarks/warm_start.py                              # --data synthetic, defaults
    python benchmarks/warm_start.py --intercept
    python benchmarks/warm_start.py --data wordnet:mammal.n.01 --intercept
"""

from __future__ import annotations

import argparse


def _hold_out(store, config):  # noqa: ANN001, ANN202
    """The store the trainer trains ``config`` on: its validation hold-out labelled "val"."""
    from curvalign.train.validation import validation_store

    cfg = config.train
    if not cfg.validates:
        return store
    held, _ = validation_store(store, cfg.val_fraction, cfg.seed, config.data, cfg.val_max_images)
    return held


def step0_rows(data: str, recipes: list[str] | None, overrides: list[str]) -> list[dict]:
    import torch

    from curvalign.config import resolve_config
    from curvalign.data import load_store
    from curvalign.data.alignment import MAX_VAL_IMAGES, mean_r1, split_pairs
    from curvalign.recipes import get_recipe, recipe_names
    from curvalign.runs import build_started_recipe, recipe_input_dims

    store, spec = load_store(data)
    rows = []
    for name in recipes or recipe_names():
        cls = get_recipe(name)
        missing = [need for need in sorted(cls.requires) if not getattr(store, f"has_{need}")]
        if missing:
            rows.append({"recipe": name, "skipped": f"the store has no {', '.join(missing)}"})
            continue
        config = resolve_config(name, spec, overrides=overrides)
        if not cls.uses_alignment(config.recipe_config_object()):
            rows.append({"recipe": name, "skipped": "no warm start with this config"})
            continue
        held = _hold_out(store, config)
        started = build_started_recipe(config, held, recipe_input_dims(config, store))
        model = started.recipe.eval()
        images, texts, owner, _ = split_pairs(held, "val", max_rows=MAX_VAL_IMAGES)
        with torch.no_grad():
            emb_i, emb_t = model.embed_images(images.float()), model.embed_texts(texts.float())
            step0 = mean_r1(
                model.scores(emb_t, emb_i, "text").float(),
                owner,
                model.scores(emb_t, emb_i, "image").float(),
            )
        align = started.warm_start["val_r1"]
        rows.append(
            {
                "recipe": name,
                "alignment": align,
                "step0": step0,
                "gap": align - step0,
                "start": started.warm_start["start"],
            }
        )
    return rows


def intercept_rows(data: str, seed: int) -> list[dict]:
    from curvalign.config import resolve_config
    from curvalign.data import load_store
    from curvalign.data.alignment import (
        ALPHAS,
        MAX_FIT_PAIRS,
        MAX_VAL_IMAGES,
        cosine_mean_r1,
        solve_ridge,
        split_pairs,
    )

    store, spec = load_store(data)
    held = _hold_out(store, resolve_config("clip", spec, overrides=[f"seed={seed}"]))
    _, texts, _, x = split_pairs(held, "train", max_rows=MAX_FIT_PAIRS)
    images, val_texts, owner, _ = split_pairs(held, "val", max_rows=MAX_VAL_IMAGES)
    rows = []
    for intercept in (False, True):
        for alpha in ALPHAS:
            w, b = solve_ridge(x, texts, alpha, intercept=intercept)
            r1 = cosine_mean_r1(images @ w + b, val_texts, owner)
            rows.append({"intercept": intercept, "alpha": alpha, "val_r1": r1})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="synthetic", help="a data spec (default synthetic)")
    parser.add_argument("--recipes", nargs="*", help="recipe names (default: every registered)")
    parser.add_argument("--intercept", action="store_true", help="ridge with vs without intercept")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (hold-out, init)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    if args.intercept:
        rows = intercept_rows(args.data, args.seed)
        print(f"data {args.data}: ridge image->text, val mean R@1 of the cosine ranking")
        print(f"{'alpha':>8} {'no intercept':>13} {'intercept':>10}")
        for alpha in sorted({r["alpha"] for r in rows}):
            cells = {r["intercept"]: r["val_r1"] for r in rows if r["alpha"] == alpha}
            print(f"{alpha:>8g} {cells[False]:>13.1f} {cells[True]:>10.1f}")
        for intercept in (False, True):
            best = max((r for r in rows if r["intercept"] == intercept), key=lambda r: r["val_r1"])
            label = "with" if intercept else "without"
            print(f"best {label} intercept: {best['val_r1']:.1f} (alpha {best['alpha']:g})")
        return
    overrides = [f"seed={args.seed}", *args.overrides]
    print(f"data {args.data}: val mean R@1 (T2I and I2T), alignment vs the run's step 0")
    print(f"{'recipe':<10} {'alignment':>9} {'step 0':>7} {'gap':>6}  start")
    for row in step0_rows(args.data, args.recipes, overrides):
        if "skipped" in row:
            print(f"{row['recipe']:<10} skipped: {row['skipped']}")
            continue
        print(
            f"{row['recipe']:<10} {row['alignment']:>9.1f} {row['step0']:>7.1f} "
            f"{row['gap']:>6.1f}  {row['start']}"
        )


if __name__ == "__main__":
    main()
