"""The machinery every study shares: the verdict rule, seeded arms, validation and convergence.

A study (``curvalign.report.studies``) states one claim of a paper, trains *arms* (the method, the
comparison the paper makes, and a *control* arm where the claimed mechanism is removed or the
claim is made false on purpose) with the same seeds, and decides with ``decide``.

The verdict rule (``decide``; written out again in every study's output)
    effect   paired per-seed difference of the claim's metric, oriented so that the paper's
             claim says ``effect > threshold`` (``threshold`` 0 for "better than"; ``-margin`` for
             a non-inferiority claim such as "stays within a small margin")
    control  paired per-seed difference showing that the metric registers the failure the claim
             is about: the control arm (mechanism removed, or the claim made false on purpose)
             against the arm it perturbs; "the control moved the metric" means its 95% interval
             excludes 0
    1. the study's budget is below what it needs       -> "too short to test the claim"
    2. the control's 95% interval contains 0           -> "inconclusive: the metric cannot
                                                          detect it" (never "holds")
    3. the effect's 95% interval lies above threshold  -> "holds"
    4. the effect's 95% interval lies below threshold  -> "does not hold"
    5. otherwise (the interval contains the threshold) -> "inconclusive: the interval contains
                                                          the threshold"
    With one seed there is no interval (``curvalign.stats``): the verdict is inconclusive.

Validation and convergence: every arm trains in segments of ``val_every`` steps
(``train(..., stop_at=...)`` then resume); after each segment the mean of t2i@1 and i2t@1 on a
seeded validation hold-out of the training images (a "val" split carved out of "train", never
trained on) is recorded and the best weights are kept. An arm *converged* by the rule the
benchmark and tuning share (``curvalign.stats.curve_converged``): its best validation is not its
last, and the last third of its curve rises by no more than the curve's own noise (or
``plateau_tol``). An arm that has not converged at its budget trains on, one segment at
a time (the run extended: its cosine stretched over the new total), until it converges or reaches
``max_steps`` (``MAX_STEPS_FACTOR`` times the budget); the output says which arms converged and
at which step each stopped. The study then evaluates the best weights on "test".

The study learning rate (``STUDY_LR_SCALE``): every arm trains at ``STUDY_LR_SCALE`` times its
recipe's paper learning rate (``train_defaults["lr"]``), a stated departure from the papers
(``STUDY_LR_REASON``), unless the study's overrides set ``lr=`` themselves.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from curvalign.data.features import FeatureStore
from curvalign.stats import Interval, mean_interval, paired_difference

Notify = Callable[[str], None]

#: the study's own best-validation weights (not the trainer's checksummed best.safetensors)
STUDY_BEST = "study_best.safetensors"

HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
INCONCLUSIVE = "inconclusive: the interval contains the threshold"
UNDETECTABLE = "inconclusive: the metric cannot detect it"
TOO_SHORT = "too short to test the claim"
OUTCOMES = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, UNDETECTABLE, TOO_SHORT)

RULE = (
    "too short to test the claim if the budget is below the study's need; else inconclusive "
    "(the metric cannot detect it) unless the control's 95% interval excludes 0; else holds "
    "if the effect's 95% interval lies above the threshold, does not hold if it lies below, "
    "inconclusive otherwise"
)

#: the studies' learning rate as a multiple of each recipe's paper default (``train_defaults``)
STUDY_LR_SCALE = 10.0
STUDY_LR_REASON = (
    "the papers' learning rates (1e-4 to 5e-4) were set for runs of 100K-500K steps at batch "
    "sizes in the thousands; at a study's few hundred steps of batch 64 they leave most arms "
    "still climbing at the end of the budget (at the paper rates 25 of the 69 (arm, seed) runs of "
    "the five synthetic studies had plateaued), so a verdict would compare unfinished runs. Every arm "
    "of a study gets the same multiple of its own paper rate, so the comparisons stay paired"
)
#: an arm that has not plateaued at its budget trains on up to this multiple of the budget
MAX_STEPS_FACTOR = 1.5

#: every study run: batch 64 and no TensorBoard, so a study finishes in minutes on two CPU cores
COMMON_OVERRIDES = (
    "batch_size=64",
    "pair_batch_size=32",
    "tensorboard=false",
    "checkpoint_every=0",
    "log_every=5",
    "val_every=0",  # the study validates itself (Bench.train), on its own segments
)


def decide(
    effect: Interval,
    control: Interval | None,
    *,
    threshold: float = 0.0,
    budget_ok: bool = True,
) -> str:
    """The verdict of one claim (rule in the module docstring). ``effect`` and ``control`` are
    oriented so that the claim says ``effect > threshold``; ``control=None`` means the study has
    no control for this claim, which makes the verdict inconclusive."""
    if not budget_ok:
        return TOO_SHORT
    if control is None or not control.excludes_zero():
        return UNDETECTABLE
    if effect.low > threshold:
        return HOLDS
    if effect.high < threshold:
        return DOES_NOT_HOLD
    return INCONCLUSIVE


def claim_record(
    what: str,
    effect: Interval,
    control: Interval | None,
    control_what: str,
    *,
    threshold: float = 0.0,
    budget_ok: bool = True,
    scale: float = 100.0,
    unit: str = "points",
) -> dict[str, Any]:
    """One decided claim, JSON-ready: the outcome and both intervals."""
    outcome = decide(effect, control, threshold=threshold, budget_ok=budget_ok)
    return {
        "claim": what,
        "outcome": outcome,
        "effect": effect.as_dict(),
        "effect_text": f"{effect.format(scale, 2)} {unit} (95% [{effect.low * scale:.2f}, "
        f"{effect.high * scale:.2f}], n={effect.n})",
        "threshold": threshold,
        "control": control.as_dict() if control is not None else None,
        "control_what": control_what,
        "control_text": (
            f"{control.format(scale, 2)} {unit} (95% [{control.low * scale:.2f}, "
            f"{control.high * scale:.2f}], n={control.n})"
            if control is not None
            else "no control"
        ),
    }


def per_seed(values: dict[int, float]) -> list[float]:
    return [values[s] for s in sorted(values)]


def difference(a: dict[int, float], b: dict[int, float], sign: float = 1.0) -> Interval:
    """Paired interval of ``sign * (a - b)`` over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    return paired_difference([sign * a[s] for s in seeds], [sign * b[s] for s in seeds])


def summary(values: dict[int, float]) -> dict[str, Any]:
    finite = [v for v in per_seed(values) if v is not None and math.isfinite(v)]
    if not finite:
        return {"per_seed": per_seed(values), "mean": None}
    iv = mean_interval(finite)
    return {"per_seed": per_seed(values), **iv.as_dict(), "text": iv.format(100.0, 1)}


def with_val_split(store: FeatureStore, fraction: float = 0.1, seed: int = 0) -> FeatureStore:
    """A copy of ``store`` whose "train" images lose a seeded ``fraction`` to a new "val" split."""
    if store.image_split is None or store.split_names is None or "val" in store.split_names:
        return store
    train_ids = store.split_image_ids("train")
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    n_val = max(8, int(round(fraction * len(train_ids))))
    chosen = train_ids[torch.randperm(len(train_ids), generator=gen)[:n_val]]
    split = store.image_split.clone()
    split[chosen] = len(store.split_names)
    return dataclasses.replace(store, image_split=split, split_names=[*store.split_names, "val"])


def val_score(recipe: Any, store: FeatureStore, split: str = "val") -> float:
    """mean(t2i@1, i2t@1) on ``split`` with the recipe's own score."""
    from curvalign.eval import evaluate

    r = evaluate(recipe, store, split=split, diagnostics=False)["retrieval"]
    return 0.5 * (r["t2i@1"] + r["i2t@1"])


def converged(history: Sequence[tuple[int, float]], tol: float) -> bool | None:
    """Whether a validation curve has plateaued: ``curvalign.stats.curve_converged`` (the rule
    the benchmark and tuning use too) with ``tol`` as the smallest gain that counts. None with
    fewer than three points."""
    from curvalign.stats import curve_converged

    return curve_converged(history, min_gain=tol)


class Bench:
    """Trains and evaluates a study's arms on one store (with its "val" split) in ``out/runs``."""

    def __init__(
        self,
        out: Path,
        store: FeatureStore,
        spec: str,
        steps: int,
        overrides: Sequence[str],
        *,
        val_every: int,
        plateau_tol: float = 0.01,
        lr_scale: float = STUDY_LR_SCALE,
        max_steps: int | None = None,
        show_progress: bool = False,
        notify: Notify = lambda m: None,
    ) -> None:
        self.out, self.steps, self.spec = out, steps, spec
        self.lr_scale = lr_scale
        self.max_steps = max(steps, max_steps or int(round(steps * MAX_STEPS_FACTOR)))
        #: recipe -> (paper lr, study lr), filled as arms train (for the study's output)
        self.learning_rates: dict[str, tuple[float, float]] = {}
        self.store = with_val_split(store)
        self.overrides = list(COMMON_OVERRIDES) + list(overrides)
        self.val_every = max(1, val_every)
        self.plateau_tol = plateau_tol
        self.show_progress, self.notify = show_progress, notify
        out.mkdir(parents=True, exist_ok=True)

    def run_dir(self, label: str, seed: int) -> Path:
        slug = "".join(ch if ch.isalnum() or ch in ".-" else "-" for ch in label)
        return self.out / "runs" / f"{slug}-s{seed}"

    def lr_override(self, recipe: str, extra: Sequence[str]) -> list[str]:
        """``["lr=..."]``: ``lr_scale`` times the recipe's paper rate, unless an override sets it."""
        from curvalign.config import recipe_class, recipe_train_defaults

        if any(o.split("=", 1)[0].strip() == "lr" for o in [*self.overrides, *extra]):
            return []
        paper = float(recipe_train_defaults(recipe_class(recipe)).get("lr", 0.0) or 0.0)
        if not paper or self.lr_scale == 1.0:
            return []
        study = float(f"{paper * self.lr_scale:.4g}")  # 1.2e-3, not 1.2000000000000001e-3
        self.learning_rates[recipe] = (paper, study)
        return [f"lr={study:g}"]

    def lr_text(self) -> str:
        """One line for the study's output: each recipe's paper and study learning rate."""
        if not self.learning_rates:
            return "learning rates: the recipes' paper defaults"
        rates = ", ".join(
            f"{name} {study:g} (paper {paper:g})"
            for name, (paper, study) in sorted(self.learning_rates.items())
        )
        return f"learning rate {self.lr_scale:g}x the paper's: {rates}, because {STUDY_LR_REASON}"

    def train_segment(
        self,
        label: str,
        recipe: str,
        extra: Iterable[str],
        seed: int,
        stop_at: int | None,
        resume: bool,
        steps: int,
        store: FeatureStore | None = None,
    ) -> Path:
        from curvalign.train.trainer import train

        return train(
            recipe,
            store if store is not None else self.store,
            self.run_dir(label, seed),
            steps=steps,
            overrides=[*self.overrides, *extra, f"seed={seed}"],
            overwrite=not resume,
            resume=resume,
            show_progress=self.show_progress,
            stop_at=stop_at,
        )

    def train(
        self,
        label: str,
        recipe: str,
        extra: Iterable[str],
        seed: int,
        *,
        steps: int | None = None,
        select_best: bool = True,
        marks: Sequence[int] = (),
        on_mark: Callable[[int, Any], None] | None = None,
        val_fn: Callable[[Any], float] | None = None,
        store_from: Callable[[int], FeatureStore | None] | None = None,
    ) -> dict[str, Any]:
        """Train one arm with one seed, validating every ``val_every`` steps.

        ``marks``: extra steps where training pauses and ``on_mark(step, recipe)`` measures the
        model there (e.g. the end of a warm-up). ``val_fn(recipe)``: the validation value
        (default: mean R@1 on the "val" split). ``store_from(step)``: the store the segment that
        starts at ``step`` trains on (a control arm that changes its data mid-run). At the
        budget ``steps``, a curve that is not flat (``converged`` False, or None with fewer than
        three validations) trains on in segments of ``val_every`` steps up to ``max_steps``
        (scaled with ``steps``); a mark at or past the budget is measured at the last step.
        Returns {run_dir, recipe (best weights when ``select_best``), last_step, best_step,
        best_val, val_history, converged, budget, max_steps}."""
        from curvalign.runs import load_run

        steps = steps or self.steps
        max_steps = max(steps, int(round(steps * self.max_steps / self.steps)))
        extra = [*self.lr_override(recipe, list(extra)), *extra]
        val_fn = val_fn or (lambda r: val_score(r, self.store))
        # a mark at the budget's end means "the end of training", wherever that ends up
        end_marks = {m for m in marks if m >= steps}
        stops = sorted(
            {*range(self.val_every, steps, self.val_every), *(m for m in marks if 0 < m < steps)}
            | {steps}
        )
        self.notify(f"{label} seed {seed}: {recipe}, {steps} steps (up to {max_steps})")
        run_dir, history, best, previous, target = None, [], (-math.inf, 0), 0, steps
        loaded = None
        while stops:
            step = stops.pop(0)
            run_dir = self.train_segment(
                label,
                recipe,
                extra,
                seed,
                stop_at=step if step < target else None,
                resume=previous > 0,
                steps=target,
                store=store_from(previous) if store_from else None,
            )
            previous = step
            loaded = load_run(run_dir, weights="last")
            value = val_fn(loaded.recipe)
            history.append((step, value))
            if value > best[0]:
                best = (value, step)
                shutil.copyfile(run_dir / "model.safetensors", run_dir / STUDY_BEST)
            if step == target and not converged(history, self.plateau_tol) and target < max_steps:
                target = min(max_steps, target + self.val_every)  # not flat yet: train on
                stops.append(target)
            if on_mark is not None and step in marks and step not in end_marks:
                on_mark(step, loaded.recipe)
        if on_mark is not None and end_marks and loaded is not None:
            on_mark(max(end_marks), loaded.recipe)
        loaded = load_run(run_dir, weights="last")
        if select_best:
            from safetensors.torch import load_file

            loaded.recipe.load_state_dict(load_file(str(run_dir / STUDY_BEST)))
        return {
            "run_dir": run_dir,
            "recipe": loaded.recipe,
            "last_step": loaded.step,
            "best_step": best[1],
            "best_val": best[0],
            "val_history": history,
            "converged": converged(history, self.plateau_tol),
            "budget": steps,
            "max_steps": max_steps,
        }

    def untrained(self, recipe: str, extra: Iterable[str], seed: int) -> Any:
        """The recipe as initialised with ``seed`` (the untrained-head baseline), in eval mode."""
        from curvalign.config import resolve_config
        from curvalign.runs import build_recipe

        config = resolve_config(
            recipe, self.spec, steps=self.steps, overrides=[*self.overrides, *extra, f"seed={seed}"]
        )
        torch.manual_seed(seed)
        model = build_recipe(
            config, self.store.image_features.shape[-1], self.store.text_features.shape[-1]
        )
        model.eval()
        return model

    def evaluate(self, recipe: Any, diagnostics: bool = False) -> dict[str, Any]:
        from curvalign.eval import evaluate

        return evaluate(recipe, self.store, split="test", diagnostics=diagnostics)


def convergence_record(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per arm: how many seeds converged, best steps and the validation curves."""
    flags = [r["converged"] for r in runs.values()]
    return {
        "converged": sum(bool(f) for f in flags),
        "seeds": len(flags),
        "best_steps": [r["best_step"] for r in runs.values()],
        "last_steps": [r["last_step"] for r in runs.values()],
        "val_history": {str(s): r["val_history"] for s, r in runs.items()},
    }


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return round(time.perf_counter() - self.start, 1)


def mean_r1(ev: dict[str, Any]) -> float:
    r = ev["retrieval"]
    return 0.5 * (r["t2i@1"] + r["i2t@1"])
