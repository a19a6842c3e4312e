"""The studies' results pages from the JSON outputs of ``curvalign study all --out DIR``.

    python -m curvalign_lab.results DIR [--figures PREFIX] [--copy-to docs/results]
        [--pages docs/results] [--keep-from docs/results.md "## Demo"]
        [--stability OTHER_DIR] [-o docs/results/studies.md]

The page is one short verdict table (``page.verdict_table``: no cell over 200 characters, the
long reasons in footnotes) with, after ``--stability``, the verdict across the two seed bases
and the stability table; ``--pages DIR`` writes one page per study to ``DIR/NAME/study.md``
(the page links them).

Every number in the page comes from ``DIR/*/study.json``; nothing is typed by hand. Figures are
linked as ``PREFIX + file name`` (default ``results/``). ``--copy-to docs/results`` copies every
``DIR/NAME/study.json`` to ``docs/results/NAME/study.json`` and every figure to
``docs/results/``, so the committed page can be regenerated from the committed JSON:
``python -m curvalign_lab.results docs/results > docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from curvalign.errors import InputError
from curvalign_lab import page
from curvalign_lab.kit import (
    LR_GRID,
    LR_START,
    MAX_STEPS_FACTOR,
    RULE,
    STUDY_LR_SCALE,
    UNDERPOWERED,
    UNSTABLE,
    Verdict,
    across_seed_bases,
    grid_interior,
    redecide,
)
from curvalign_lab.records import StudyResult
from curvalign_lab.runner import STUDIES

HEADER = """# Results: the papers' claims as studies that can fail

Generated from the studies' JSON outputs; do not edit by hand. To reproduce everything (hours
on two CPU cores):

    curvalign study all --power --out studies{seeds}
    curvalign study all --power --out studies-100 --seed-base 100
    python -m curvalign_lab.results studies --stability studies-100 --copy-to docs/results \\
        --pages docs/results --figures "../" -o docs/results/studies.md

or, from the committed JSON (`docs/results/NAME/study.json`) alone, the same last command with
`docs/results` in place of `studies` and no `--copy-to`. Each study's page gives the exact
command of its run (its `--out` was {out}); a page whose command sets `--steps`, `--quick` or
`--set lr_grid=...` comes from that smaller budget. A smoke run of one study (a tiny store, 2
seeds, a few steps; its verdicts mean nothing) is `curvalign study NAME --quick`. The studies
live outside the library, in the `curvalign_lab` package: each is one file under
`src/curvalign_lab/studies/` (its claims, arms, measure and control as data, `declare.Study`).

**The rule** (`curvalign_lab.kit.decide`, the decision rules in `curvalign_lab.rules`). Each
study quotes its paper's claim and the paper's effect (with the seed file's section), trains
every arm with the same seeds and decides each claim on its paired per-seed effect, with an
interval over seeds and, where the claim is about a test metric, the test items too (two-level
bootstrap, `curvalign.stats.two_level_difference`): *not reproduced in this regime* where the
mechanism is absent or the precondition is not met; *holds* / *does not hold* when the test
rejects (Holm over the study's tested claims; precondition and regime claims are outside the
family) and the **calibrated control** (its dose chosen on the pilot so that its effect is the
claim's size) separated: its interval above 0, its half-width below that size; *equivalent*
when the interval at the claim's level lies inside the margin (TOST at the level of the claims'
own tests: the 95% interval, or 1 - 0.05/m in a Holm family of m); *underpowered by plan* when a **pilot** on a
disjoint seed base (`--power`: base + 1000) needs more seeds than the cap for an exact
noncentral-t MDE (80% power, at the level of Holm's first step, 0.05/m for the study's m tested
claims; where the interval counts test items, their standard error too, which no number of
seeds shrinks) at the paper's effect, or at the distance from it to the margin for
non-inferiority and equivalence, never from the run's own SD, or when its control did not
separate and the control's own plan (its pilot SD near the chosen dose, for an effect of the
claim's size) needs more seeds than the cap; the run takes the most seeds any claim or control
needs, at least 3; *does not hold* too when a powered
plan's interval excludes the paper's effect; *inconclusive* otherwise. A claim decided
differently on two seed bases is *unstable across seed bases*, whatever the two labels. The
page decides every run by this rule from what it recorded (`kit.redecide`). Arms
train until their validation curve is flat (`curvalign.stats.curve_converged`), up to
{max_factor:g}x the budget; each arm's learning rate is chosen on validation from one grid
({lr_grid}, walked from {lr_start:g}; {lr_scale:g}x the paper rate without a grid).

The synthetic world is not the papers' data: a verdict here is evidence about the mechanism at
this scale (and, for the WordNet study, on one real taxonomy), not a reproduction of the papers'
tables. Timings were taken on a shared 2-core machine under load.
"""


def load_result(path: Path) -> StudyResult:
    """One study.json (``StudyResult.from_json``); a file that is not one is one ``InputError``
    naming it."""
    try:
        return StudyResult.from_json(json.loads(Path(path).read_text()))
    except (InputError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: {err}") from None


def load_results(out: Path) -> list[StudyResult]:
    """The study.json files under ``out``, a run recorded under an earlier rule decided again by
    this one (``kit.redecide``, from its recorded effects, controls and inputs), in the order of
    ``STUDIES``, each listed under its
    folder's name: ``study all`` writes ``OUT/NAME``, and a second run of one study (on other
    data: ``curvalign study proclip-regime --data ... --out OUT/proclip-regime-coco``) is a row
    and a page of its own, after the study's own run, instead of replacing it."""
    found: dict[str, StudyResult] = {}
    for path in sorted(Path(out).glob("*/study.json")):
        result = load_result(path)
        folder = path.parent.name
        if result.rule != RULE:
            # a run recorded under an earlier rule: decided by this one from what it recorded
            result = redecide(result)
        found[folder] = result if folder == result.name else replace(result, name=folder)
    if not found:
        raise FileNotFoundError(
            f"no */study.json under {out}: run `curvalign study all --out {out}`"
        )
    rank = {name: i for i, name in enumerate(STUDIES)}

    def position(folder: str) -> tuple[int, str]:
        study = next((n for n in STUDIES if folder == n or folder.startswith(f"{n}-")), None)
        return (rank[study] if study is not None else len(rank), folder)

    return [found[folder] for folder in sorted(found, key=position)]


def is_current(result: StudyResult) -> bool:
    """Whether a study.json comes from the current studies (its claims name their paper source,
    ``kit.claim_record``), not from an earlier version. Every record read has one (its
    ``paper_source`` is required): kept for callers."""
    return all(c.paper_source is not None for c in result.claims)


def lr_table(result: StudyResult) -> str:
    """Per arm: the learning rate chosen on validation, whether it lies inside the study's grid
    (``kit.grid_interior``) and the validation value of every rate tried (x100)."""
    choice, grid = result.lr_choice, result.lr_grid
    if not choice:
        return ""
    lines = [
        f"Learning rate per arm (grid {', '.join(f'{v:g}' for v in grid)}; best validation x100 "
        "of each rate tried):",
        "",
        "| arm | chosen | inside the grid | validation per rate |",
        "|---|---:|---|---|",
    ]
    for arm, c in choice.items():
        excluded = c.excluded or {}
        tried = ", ".join(
            f"{lr:g}: {100 * v:.1f}"
            + (f" (excluded: {excluded[f'{lr:g}']})" if f"{lr:g}" in excluded else "")
            for lr, v in c.grid
        )
        inside = "yes" if grid_interior(grid, c.chosen) else "**no (edge)**"
        lines.append(f"| {arm} | {c.chosen:g} | {inside} | {tried} |")
    edge = sum(not grid_interior(grid, c.chosen) for c in choice.values())
    lines += ["", f"{len(choice) - edge} of {len(choice)} arms chose a rate inside the grid.", ""]
    return "\n".join(lines)


def render(
    out: Path,
    figures: str = "results/",
    across: dict[tuple[str, str], tuple[str, str]] | None = None,
    pages: str = "",
    sections: bool = True,
) -> str:
    """The page from ``out``'s study.json files: the header, one short verdict table and then,
    with ``sections``, each study's section (``page.study_page``). ``across`` ((study, claim)
    -> (class, text) of the verdict across two seed bases, ``stability``): an extra column.
    ``pages``: per-study page links as ``pages.format(name=...)`` (e.g. "{name}/study.md")."""
    results = load_results(out)
    seeds = sorted({len(r.seeds) for r in results})
    lines = [
        HEADER.format(
            max_factor=MAX_STEPS_FACTOR,
            lr_scale=STUDY_LR_SCALE,
            lr_grid=", ".join(f"{v:g}" for v in LR_GRID),
            lr_start=LR_START,
            out=", ".join(
                f"`{d}/NAME`"
                for d in dict.fromkeys(
                    str(Path(_command(r).split("--out ")[1].split()[0]).parent) for r in results
                )
            ),
            seeds=f" --seeds {seeds[0]}" if len(seeds) == 1 and seeds[0] != 3 else "",
        ),
        f"Wall time of the {len(results)} studies: "
        f"{sum(r.wall_s for r in results) / 60:.1f} min in all"
        + (
            f" (`study all`: {wall['wall_s'] / 60:.1f} min"
            + ("" if wall.get("complete", True) else f", cut short after {len(wall['studies'])}")
            + ")."
            if (wall := _wall(out))
            else "."
        ),
        "",
        *(
            [
                "Studies not run for this page: "
                + ", ".join(f"`{n}`" for n in missing)
                + "; each runs with `curvalign study NAME --out DIR/NAME`.",
                "",
            ]
            if (missing := [n for n in STUDIES if n not in {r.name for r in results}])
            else []
        ),
        *(
            [
                "Studies run under an earlier rule (no power plan on a pilot of a disjoint seed "
                "base; their 'underpowered' came from the run's own SD), kept until re-run: "
                + ", ".join(f"`{n}`" for n in older)
                + ".",
                "",
            ]
            if (older := [r.name for r in results if not is_planned(r)])
            else []
        ),
        "## Verdicts",
        "",
        page.verdict_table(results, across=across, link=pages),
        "Multiplicity: each study's tested claims are one family, Holm-corrected at family-wise "
        "alpha 0.05 (precondition and regime claims are decided outside it); the verdict column "
        "is the Holm-adjusted verdict"
        + (
            " of this seed base, and 'across seed bases' the verdict of the claim on both "
            f"(`kit.across_seed_bases`: the shared verdict, '{UNSTABLE}' wherever the two "
            "differ, whatever the labels)."
            if across
            else "."
        ),
        "",
    ]
    if sections:
        for r in results:
            lines.append(study_section(r, figures))
    return "\n".join(lines)


def _command(result: StudyResult) -> str:
    if result.command is None:
        raise InputError(f"study.json of {result.name!r} has no 'command' (run_study writes it)")
    return result.command


def study_section(result: StudyResult, figures: str = "results/", heading: str = "##") -> str:
    """One study's page or section: ``page.study_page`` and its learning-rate table."""
    text = page.study_page(result, heading=heading, figure_dir=figures)
    return text + ("\n" + lr_table(result) if is_current(result) else "")


def is_planned(result: StudyResult) -> bool:
    """Whether a study.json was decided under the planned-power rule (a declared study, or one
    whose claims carry a plan or that ran without --power under the current rule)."""
    return bool(result.declared or result.starts is not None)


def write_pages(out: Path, dest: Path, figures: str = "../") -> list[Path]:
    """One page per study: ``dest/NAME/study.md`` from ``out/NAME/study.json``."""
    written = []
    for r in load_results(out):
        path = dest / r.name / "study.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(study_section(r, figures, heading="#"))
        written.append(path)
    return written


def _wall(out: Path) -> dict[str, Any] | None:
    path = Path(out) / "wall.json"
    return json.loads(path.read_text()) if path.exists() else None


def stability(a: Path, b: Path) -> tuple[list[dict[str, Any]], bool]:
    """The stability check: the verdicts of the same studies run on two seed bases (``curvalign
    study all --seed-base 0`` into ``a`` and ``--seed-base 100`` into ``b``). One row per claim:
    both Holm-adjusted verdicts, whether either run marks it underpowered (those may differ), and
    whether they agree. ``ok``: every claim agrees; a claim decided differently on the two bases
    is "unstable across seed bases", whatever the two labels (``kit.across_seed_bases``)."""
    left = {r.name: r for r in load_results(a)}
    right = {r.name: r for r in load_results(b)}
    rows = []
    for name in [n for n in left if n in right]:
        for ca, cb in zip(left[name].claims, right[name].claims, strict=False):
            va = Verdict(ca.final_verdict, ca.final_outcome)
            vb = Verdict(cb.final_verdict, cb.final_outcome)
            both = across_seed_bases(va, vb, min(len(left[name].seeds), len(right[name].seeds)))
            rows.append(
                {
                    "study": name,
                    "claim": ca.claim,
                    "a_kind": va.kind,
                    "b_kind": vb.kind,
                    "a": va.text,
                    "b": vb.text,
                    "seeds": (left[name].seeds, right[name].seeds),
                    "underpowered": UNDERPOWERED in (va.kind, vb.kind),
                    "agree": va.kind == vb.kind,
                    "across": both.text,
                    "across_kind": both.kind,
                }
            )
    ok = all(r["agree"] for r in rows)
    return rows, ok


def stability_markdown(rows: list[dict[str, Any]], ok: bool, other: str = "") -> str:
    """The stability table: each claim's verdict on both seed bases and across them, every
    cell at most ``page.CELL_LIMIT`` characters (a longer verdict is cut at a clause, its whole
    text in a footnote under the table)."""
    from curvalign_lab.page import Footnotes

    notes = Footnotes("s")
    lines = [
        "## Stability across seed bases",
        "",
        "Same studies, two disjoint seed sets; every claim must get the same verdict class from "
        f"both (a label that differs is a flip, whatever the labels). Result: "
        f"**{'stable' if ok else 'NOT stable'}**."
        + (
            f" Seed set B: the study.json files under `{other}` (each names its command, the "
            "same as A's with `--seed-base 100`)."
            if other
            else ""
        ),
        "",
        "| study | claim | seeds A | verdict A | seeds B | verdict B | agree | "
        "verdict across both |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sa, sb = r["seeds"]
        flag = "yes" if r["agree"] else "**no**"
        lines.append(
            f"| {r['study']} | {r['claim']} | {sa[0]}-{sa[-1]} | {notes.cell(r['a'])} | "
            f"{sb[0]}-{sb[-1]} | {notes.cell(r['b'])} | {flag} | "
            f"{notes.cell(r.get('across', ''))} |"
        )
    unstable = sum(r.get("across_kind") == UNSTABLE for r in rows)
    lines.append("")
    lines.append(
        f"{len(rows)} claims on both bases: {sum(r['agree'] for r in rows)} agree, {unstable} "
        f"flip between bases (marked '{UNSTABLE}' by `kit.across_seed_bases`, whatever the "
        "two labels)."
    )
    if notes.notes:
        lines += ["", notes.markdown().rstrip("\n")]
    return "\n".join(lines) + "\n"


def across_table(rows: list[dict[str, Any]]) -> str:
    """The stability rows as one short table (``stability``): each claim's verdict in a few
    words (``page.short_verdict``) on each seed base and across both; the reasons are on the
    studies page."""
    from curvalign_lab.page import Footnotes, short_verdict

    cell = Footnotes().cell
    lines = [
        "| study | claim | first base | second base | across both |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        sa, sb = r["seeds"]
        lines.append(
            f"| {r['study']} | {cell(r['claim'], 120)} | "
            f"{short_verdict(r['a_kind'], r['a'])} ({sa[0]}-{sa[-1]}) | "
            f"{short_verdict(r['b_kind'], r['b'])} ({sb[0]}-{sb[-1]}) | "
            f"{short_verdict(r['across_kind'], r['across'])} |"
        )
    return "\n".join(lines) + "\n"


def copy_outputs(out: Path, dest: Path) -> None:
    """study.json files to ``dest/NAME/``, figures to ``dest/``."""
    dest.mkdir(parents=True, exist_ok=True)
    studies = [p.parent for p in Path(out).glob("*/study.json")]
    for study in studies:
        if study.resolve() == (dest / study.name).resolve():
            continue
        (dest / study.name).mkdir(exist_ok=True)
        shutil.copyfile(study / "study.json", dest / study.name / "study.json")
        for png in study.glob("*.png"):
            shutil.copyfile(png, dest / png.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the --out directory of `curvalign study all`")
    parser.add_argument("--figures", default="results/", help="prefix of figure links")
    parser.add_argument(
        "--copy-to", type=Path, help="copy the study.json files and PNGs into this directory"
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="write the page here (default: standard output)"
    )
    parser.add_argument(
        "--keep-from",
        nargs=2,
        metavar=("FILE", "HEADING"),
        help="append FILE's sections from the line HEADING on (e.g. docs/results.md '## Demo': "
        "the benchmark sections another command writes), verbatim",
    )
    parser.add_argument(
        "--stability",
        type=Path,
        metavar="OTHER",
        help="the --out of the same studies on another seed base: add the stability table "
        "(exit status 1 when a claim not marked underpowered changes its verdict)",
    )
    parser.add_argument(
        "--pages",
        type=Path,
        metavar="DIR",
        help="write one page per study to DIR/NAME/study.md and link them from the table "
        "(instead of one long page with every study's section)",
    )
    parser.add_argument(
        "--across",
        action="store_true",
        help="with --stability: print only the short table of each claim's verdict on both "
        "bases (seeds in brackets) and across them",
    )
    args = parser.parse_args(argv)
    if args.across and not args.stability:
        parser.error("--across needs --stability OTHER (the second seed base's --out)")
    stable = True
    try:
        rows: list[dict[str, Any]] = []
        if args.stability:
            rows, stable = stability(args.out, args.stability)
        if args.across:
            sys.stdout.write(across_table(rows))
            return 0 if stable else 1
        across = {(r["study"], r["claim"]): (r["across_kind"], r["across"]) for r in rows} or None
        link = "{name}/study.md" if args.pages else ""
        text = render(args.out, args.figures, across, pages=link, sections=not args.pages)
        if args.stability:
            text = (
                text.rstrip("\n") + "\n\n" + stability_markdown(rows, stable, str(args.stability))
            )
    except (FileNotFoundError, InputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.copy_to:
        copy_outputs(args.out, args.copy_to)
    if args.pages:
        write_pages(args.out, args.pages)
    if args.keep_from:
        path, heading = Path(args.keep_from[0]), args.keep_from[1]
        lines = path.read_text().splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == heading]
        if not starts:
            print(f"error: {path} has no line {heading!r}", file=sys.stderr)
            return 2
        text = text.rstrip("\n") + "\n\n" + "".join(lines[starts[0] :])
    if args.output:
        args.output.write_text(text)  # after reading --keep-from, which may be the same file
    else:
        sys.stdout.write(text)
    return 0 if stable else 1


if __name__ == "__main__":
    raise SystemExit(main())
