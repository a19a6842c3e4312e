"""Health signals of a trained run: what users ask about after a run, read from its files.

- a learned curvature that sat at its clamp for the last 20% of training (the most reported
  failure of MERU-style models: the curvature collapses to its lower bound);
- validation that stopped improving early (best step in the first half of the run);
- a run that ended still improving: not converged, by the one rule the benchmark, tuning and
  studies share (``curvalign.stats.curve_converged``: best at the last validation, or a rise at
  the end of the curve beyond the curve's own noise). ``convergence_warning`` words it as one
  line: "still rising, train longer" only when the best lies in the curve's tail; a curve that
  fell after an early best and rises again below it is "not converged" without that advice.

``health`` and ``health_of_run`` return a ``RunHealth`` record: ``converged`` is True, False
(still improving) or None (too few validations to tell).
Curvature bounds come from the recipe contract (``Recipe.curvature_bounds()``), so no recipe
and no parameter is named here. The step-0 check's report, recorded in ``meta.json`` by the
trainer (``recipes/health.py``), is passed on: its warnings join the run's (``step0`` holds
the report).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from curvalign.errors import CurvalignError
from curvalign.recipes.health import META_KEY as STEP0_META_KEY
from curvalign.recipes.health import Step0Health, warning_line
from curvalign.runs import read_log
from curvalign.stats import curve_convergence

if TYPE_CHECKING:
    from curvalign.recipes.base import Recipe
    from curvalign.runs import LoadedRun

#: share of the run at its end that the curvature check looks at
TAIL = 0.2
#: a validation gain (mean R@1, in [0, 1]) below this counts as no gain
MIN_GAIN = 0.005


@dataclass(frozen=True)
class RunHealth:
    """A trained run's health (see the module docstring).

    converged  True, False (still improving at the end) or None (too few validations)
    warnings   one line per signal, the step-0 check's first (``recipes.health.warning_line``)
    step0      the step-0 check's report, None for a run written before the check (or for
               ``health`` on bare records)
    """

    converged: bool | None
    warnings: tuple[str, ...] = ()
    step0: Step0Health | None = None

    def to_json(self) -> dict[str, Any]:
        """{"converged", "warnings", "step0"}: what ``curvalign eval --json`` prints under
        "health" ("step0" as ``Step0Health.to_json()``, or None)."""
        return {
            "converged": self.converged,
            "warnings": list(self.warnings),
            "step0": None if self.step0 is None else self.step0.to_json(),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunHealth:
        """Inverse of ``to_json``."""
        step0 = raw.get("step0")
        converged = raw.get("converged")
        return cls(
            converged=None if converged is None else bool(converged),
            warnings=tuple(str(w) for w in raw.get("warnings") or ()),
            step0=Step0Health.from_json(step0) if isinstance(step0, Mapping) else None,
        )


def curvature_bounds(recipe: Recipe) -> set[float]:
    """Clamp bounds of the recipe's learned curvature (``Recipe.curvature_bounds()``; empty
    when it learns none)."""
    bounds = recipe.curvature_bounds()
    if bounds is None:
        return set()
    return {float(b) for b in bounds if 0 < b < math.inf}


def health(
    records: list[dict[str, Any]],
    val_history: list[tuple[int, float]],
    last_step: int,
    bounds: set[float],
) -> RunHealth:
    """The health (convergence and warnings; no step-0 report) from a run's log records, its
    validation history [(step, value)], its last step and its curvature clamp bounds."""
    warnings: list[str] = []
    tail_start = (1 - TAIL) * last_step
    tail = [
        r for r in records if isinstance(r.get("step"), (int, float)) and r["step"] > tail_start
    ]
    keys = sorted({k for r in records for k in r if k.split("/")[0] == "curvature"})
    for key in keys:
        values = [float(r[key]) for r in tail if isinstance(r.get(key), (int, float))]
        for bound in sorted(bounds):
            if values and all(abs(v - bound) <= 1e-4 * max(1.0, abs(bound)) for v in values):
                warnings.append(
                    f"the learned curvature ({key}) sat at its clamp {bound:g} for the last "
                    f"{round(100 * TAIL)}% of training: the geometry is pinned by the bound, not "
                    "learned (MERU-style collapse); consider a fixed curvature"
                )
                break
    # the one convergence rule (curvalign.stats.curve_converged), as in tuning and studies
    reading = curve_convergence(val_history, MIN_GAIN) if last_step > 0 else {"converged": None}
    line = convergence_warning(reading, val_history, last_step)
    if line:
        warnings.append(line)
    return RunHealth(reading["converged"], tuple(warnings))


def convergence_warning(
    reading: Mapping[str, Any], val_history: list[tuple[int, float]], last_step: int
) -> str | None:
    """The one end-of-run line on a validation curve, from ``curve_convergence``'s reading: at
    most one of three, so they never contradict each other.

    - still rising: not converged and the best validation lies in the curve's tail (its last
      third): "train longer" is the advice;
    - dipped and recovering: not converged because the tail rises, but the best came before the
      tail and the tail has not reached it: the curve is still moving, the best weights are kept,
      and "train longer" is not claimed to help (it might or might not pass them);
    - stopped early: converged with the best in the first half of the run.
    """
    converged = reading.get("converged")
    if converged is None:
        return None
    best_step, _ = max(val_history, key=lambda item: (item[1], -item[0]))
    if not converged and best_step >= reading["tail_start"]:
        return (
            f"validation was still rising at the end ({reading['why']}; best at step "
            f"{best_step} of {last_step}): not converged, train longer"
        )
    if not converged:
        return (
            f"validation fell after its best (step {best_step} of {last_step}) and was rising "
            f"again at the end without reaching it ({reading['why']}): not converged; the best "
            f"weights (step {best_step}) are kept, and a longer run may or may not pass them"
        )
    if best_step <= 0.5 * last_step:
        return (
            f"validation stopped improving early (best at step {best_step} of "
            f"{last_step}); the best weights are kept, later steps did not help"
        )
    return None


def health_of_run(run: LoadedRun) -> RunHealth:
    """``health`` of a ``LoadedRun`` (its log, validation history and recipe), with the
    step-0 check's report as ``step0`` (None for a run written before the check) and its
    warnings first among ``warnings``."""
    try:
        records = read_log(run.run_dir)
    except CurvalignError:  # a damaged log: no curvature signal, the rest still applies
        records = []
    out = health(records, list(run.val_history), int(run.last_step), curvature_bounds(run.recipe))
    report = (getattr(run, "meta", None) or {}).get(STEP0_META_KEY)
    if not isinstance(report, Mapping):
        return out
    step0 = Step0Health.from_json(report)
    lines = tuple(warning_line(w) for w in step0.warnings)
    return RunHealth(out.converged, lines + out.warnings, step0)


__all__ = [
    "MIN_GAIN",
    "TAIL",
    "RunHealth",
    "convergence_warning",
    "curvature_bounds",
    "health",
    "health_of_run",
]
