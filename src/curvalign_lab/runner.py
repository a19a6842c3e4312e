"""Studies: each paper's central claim as an experiment that can fail.

Every study

* quotes the claim as the paper states it (``paper``, with its equation / table) and, per claim,
  the paper's own effect on the study's metric with the seed-file section it comes from,
* trains *arms* with the same seeds (``seed_base`` .. ``seed_base + seeds - 1``): the method, the
  comparison the paper makes, the claim's obvious baseline, and a *calibrated positive control*
  (an arm handicapped by a known amount of the size the claim is about, e.g. a known share of
  train captions moved to another image) that the metric must separate with the study's seeds;
  trained-vs-untrained is a sanity row only,
* tests the claim's precondition (AGR's lambda_E > 2 lambda_H, DualPath's open gate, heads at
  least as good as the frozen features) and says "not reproduced in this regime" where the
  claim's mechanism is absent (encoder training),
* chooses each arm's learning rate on validation from one shared grid (``kit.LR_GRID``) and
  decides convergence by the shared noise-aware rule (``curvalign.stats.curve_converged``),
* reports paired effect sizes with 95% intervals over seeds and, where a claim is about a test
  metric, test items (``curvalign.stats``), plans its seeds on a pilot (``power``), and decides
  each claim by ``kit.decide`` (written into the output), Holm-corrected over the study's tested
  claims (``kit.apply_holm``): holds / does not hold / equivalent within ±delta / inconclusive /
  underpowered by plan / not reproduced in this regime.

Each study is one file under ``curvalign_lab/studies/`` defining ``STUDY``, a declared
``declare.Study`` (claims, arms, measure, control handicap as data; run by
``declare.run_declared``). ``run_study`` runs one and writes ``study.json`` and ``study.md`` into ``out``
(``power=True``: a pilot on a disjoint seed base plans the seeds; ``quick=True``: a smoke run on
a tiny store); ``run_all`` runs every study into ``out/NAME``; ``curvalign_lab.results`` turns
those JSON files into the results pages and compares two seed bases (``--stability``).

Study definitions name the recipes they study and set their options (configuration); what a
method computes (routing statistics, text-pair embeddings, factor-wise composition) is asked of
the recipe. The synthetic world is not the papers' data (no pixels, no real language, a small
known taxonomy): a claim that holds or fails here is evidence about the mechanism at this scale,
not a reproduction of the papers' tables.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from curvalign.errors import ConfigError
from curvalign.report.tables import write_json
from curvalign_lab import kit, page
from curvalign_lab.declare import (
    Study,
    configured,
    option_names,
    run_declared,
)
from curvalign_lab.records import StudyResult
from curvalign_lab.studies import registry

Notify = Callable[[str], None]

#: every study by name (``studies.registry()``: one file each)
STUDIES: dict[str, Study] = registry()

#: the order ``run_all`` runs them in (the page keeps ``STUDIES``' order): the studies whose
#: verdicts moved between seed bases or whose controls did not separate first, the ones whose
#: claims are not reproduced in this regime (atmg, wordnet) last, so that a run cut short by the
#: machine's budget still answers the open questions
RUN_ORDER = (
    "phyclip-factors",
    "dualpath-forgetting",
    "proclip-product",
    "agr-curriculum",
    "atmg-curvature",
    "wordnet-dimensions",
)


def _literal(value: Any) -> str:
    return (
        (",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "()")
        if isinstance(value, (tuple, list))
        else str(value)
    )


def study_options(name: str) -> set[str]:
    """The ``--set`` options study ``name`` takes (a declared study: ``lr_grid`` and its
    ``configure`` parameters, ``declare.option_names``)."""
    return option_names(STUDIES[name])


def parse_study_options(name: str, items: Sequence[str]) -> dict[str, Any]:
    """``["curvatures=0.1,1,3", "part_dim=16"]`` -> keyword options of study ``name``, checked
    against its signature (values are Python literals; a comma list becomes a tuple)."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    allowed = study_options(name)
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


def run_study(
    name: str,
    out: str | Path,
    *,
    steps: int | None = None,
    data: str | None = None,
    overrides: Sequence[str] = (),
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
    lr_cache: str | Path | None = None,
    quick: bool = False,
    show_progress: bool = False,
    notify: Notify | None = None,
    **options: Any,
) -> StudyResult:
    """Run study ``name`` with seeds ``seed_base .. seed_base + seeds - 1``, write
    ``study.json`` (``StudyResult.to_json``) and ``study.md`` into ``out`` and return the
    result.

    ``power``: first a pilot of ``seeds`` seeds on the disjoint base ``seed_base +
    PILOT_OFFSET``; from its per-seed SDs each claim is
    planned (exact noncentral-t MDE at the paper's effect, or at the distance to the margin,
    capped at ``max_seeds``), the study runs with the seeds the powered claims need, and each
    claim is decided with its plan: "underpowered" only where the plan needs more than the
    cap (``power_plan`` in the output holds the pilot's SDs, planned n and cap).
    ``quick``: a smoke run (the study's tiny store, 2 seeds, a few steps, no learning-rate grid,
    no pilot)."""
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; studies: {', '.join(STUDIES)}")
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    if power and max_seeds < 2:
        raise ConfigError(f"max_seeds must be >= 2 with power, got {max_seeds}")
    if power and seeds < 2:
        raise ConfigError(f"a pilot needs at least 2 seeds for an SD, got {seeds}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notify = notify or (lambda m: None)
    study = STUDIES[name]
    result = run_declared(
        configured(study, options, quick),
        out,
        steps=steps,
        data=data,
        overrides=overrides,
        seeds=seeds,
        seed_base=seed_base,
        power=power,
        max_seeds=max_seeds,
        lr_grid=options.get("lr_grid", kit.LR_GRID),
        lr_cache=Path(lr_cache) if lr_cache else None,
        quick=quick,
        show_progress=show_progress,
        notify=notify,
    )
    command = (
        f"curvalign study {name} --out {out}"
        + (" --quick" if quick else f" --seeds {seeds}")
        + (f" --seed-base {seed_base}" if seed_base else "")
        + (f" --power --max-seeds {max_seeds}" if power else "")
        + (f" --steps {steps}" if steps and not quick else "")
        + (f" --data {data}" if data and not quick else "")
        + "".join(f" --set {k}={_literal(v)}" for k, v in options.items())
        + "".join(f" {o}" for o in overrides)
    )
    result = dataclasses.replace(result, seed_base=seed_base, command=command)
    write_json(out / "study.json", result.to_json())
    (out / "study.md").write_text(page.study_page(result, heading="#"))
    return result


def study_markdown(result: StudyResult, heading: str = "##", figure_dir: str = "") -> str:
    """One study's section (``page.study_page``)."""
    return page.study_page(result, heading=heading, figure_dir=figure_dir)


def run_all(
    out: str | Path,
    *,
    names: Sequence[str] | None = None,
    steps: int | None = None,
    seeds: int = 3,
    seed_base: int = 0,
    power: bool = False,
    max_seeds: int = 10,
    quick: bool = False,
    overrides: Sequence[str] = (),
    lr_cache: str | Path | None = None,
    show_progress: bool = False,
    notify: Notify | None = None,
) -> dict[str, StudyResult]:
    """Every study (or ``names``) into ``out/NAME``; ``steps`` (if given) for each. The wall
    time of the whole run is written to ``out/wall.json``."""
    out = Path(out)
    notify = notify or (lambda m: None)
    timer = kit.Timer()
    results: dict[str, StudyResult] = {}
    order = list(names or [*RUN_ORDER, *(n for n in STUDIES if n not in RUN_ORDER)])
    for name in order:
        notify(f"study {name}")
        results[name] = run_study(
            name,
            out / name,
            steps=steps,
            seeds=seeds,
            seed_base=seed_base,
            power=power,
            max_seeds=max_seeds,
            quick=quick,
            overrides=overrides,
            lr_cache=lr_cache,
            show_progress=show_progress,
            notify=notify,
        )
        # after each study, so that a run cut short still says how long its part took
        done = len(results) == len(order)
        write_json(
            out / "wall.json",
            {"wall_s": timer.seconds(), "studies": list(results), "complete": done},
        )
    notify(f"study all: {timer.seconds():.0f} s")
    return results
