"""docs/results.md from the JSON outputs of ``curvalign study all --out DIR``.

    python -m curvalign_lab.results DIR [--figures PREFIX] [--copy-to docs/results]
        [--keep-from docs/results.md "## Demo"] [--stability OTHER_DIR] [-o docs/results.md]

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
from pathlib import Path
from typing import Any

from curvalign_lab.kit import (
    LR_GRID,
    LR_START,
    MAX_STEPS_FACTOR,
    STUDY_LR_SCALE,
    UNDERPOWERED,
    UNSTABLE,
    Verdict,
    across_seed_bases,
    grid_interior,
)
from curvalign_lab.runner import STUDIES, study_markdown

HEADER = """# Results: the papers' claims as studies that can fail

Generated from the studies' JSON outputs; do not edit by hand. To reproduce everything:

    curvalign study all --out studies{seeds}
    python -m curvalign_lab.results studies --copy-to docs/results \\
        --keep-from docs/results.md "## Demo" -o docs/results.md

or, from the committed JSON (`docs/results/NAME/study.json`) alone, the same second command with
`docs/results` in place of `studies` and no `--copy-to`. Each section gives the exact command of
its run (its `--out` was {out}); where that command sets `--steps` or `--set lr_grid=...`,
the page's numbers come from that smaller budget, not from `study all`'s defaults. The sections from "Demo" on are kept verbatim from the
previous page (`--keep-from`): they come from the benchmark commands they show.

Each study quotes its paper's claim and the paper's own effect size (with the seed file's
section), trains every arm with the same seeds, compares arms by paired per-seed differences with
95% Student-t intervals (`curvalign.stats`), and decides each claim by one rule
(`curvalign_lab.kit.decide`, written out in each section): *not reproduced in this
regime* where the claim's mechanism is absent here or its precondition is not met; *holds* /
*does not hold* when the paired t test rejects (Holm-corrected over the study's claims in the
"Holm" column) and a **calibrated positive control** (an arm handicapped by a known amount of the
size the claim is about: a known share of train captions moved to another image, or forgetting
made true on purpose) separated from its clean arm with the right sign and at least its expected
size; *equivalent within ±delta* when the 90% interval lies inside ±delta (TOST); *underpowered
at n seeds (MDE x vs claimed y)* when the minimal detectable effect at the run's own seed SD
(paired t, alpha 0.05, 80% power) exceeds the paper's effect; *inconclusive* otherwise.
Trained-vs-untrained differences are shown as sanity rows only. *converged* counts the (arm,
seed) runs whose validation curve had stopped rising by the rule the benchmark and tuning share
(`curvalign.stats.curve_converged`: the best is not the last validation and the tail rises by no
more than the curve's own noise); an arm not converged at its budget trains on, one validation
segment at a time, up to {max_factor:g}x the budget.

**Stability check** (a verdict that changes with the seeds is no verdict): run the same
studies on a second, disjoint seed base and compare; every claim not marked underpowered must
keep its verdict (exit status 1 otherwise, and the table says which claim moved):

    curvalign study all --out studies --seed-base 0
    curvalign study all --out studies-100 --seed-base 100
    python -m curvalign_lab.results studies --stability studies-100

**Learning rate.** Each arm's learning rate is chosen on validation from one grid shared by
every arm ({lr_grid}; a tuning seed no reported run uses; `curvalign_lab.kit.LR_GRID`),
walked from {lr_start:g} until the best rate has a worse one on each side
(`kit.climb_grid`), each rate trained for the same budget; each study's learning-rate table
lists the choice, whether it lies inside the grid (a choice at the grid's edge is marked) and the
validation value of every rate tried. Studies run without a grid fall back to {lr_scale:g}x the
paper rate.

The synthetic world is not the papers' data: a verdict here is evidence about the mechanism at
this scale (and, for the WordNet study, on one real taxonomy), not a reproduction of the papers'
tables. Timings were taken on a shared 2-core machine under load.
"""


def load_results(out: Path) -> list[dict[str, Any]]:
    """The study.json files under ``out``, in the order of ``STUDIES``."""
    found = {}
    for path in sorted(Path(out).glob("*/study.json")):
        result = json.loads(path.read_text())
        found[result["name"]] = (result, path.parent)
    if not found:
        raise FileNotFoundError(
            f"no */study.json under {out}: run `curvalign study all --out {out}`"
        )
    order = [n for n in STUDIES if n in found] + sorted(set(found) - set(STUDIES))
    return [found[n][0] | {"_dir": str(found[n][1])} for n in order]


def is_current(result: dict[str, Any]) -> bool:
    """Whether a study.json comes from the current studies (its claims name their paper source,
    ``kit.claim_record``), not from an earlier version."""
    return all("paper_source" in c for c in result.get("claims", []))


def lr_table(result: dict[str, Any]) -> str:
    """Per arm: the learning rate chosen on validation, whether it lies inside the study's grid
    (``kit.grid_interior``) and the validation value of every rate tried (x100)."""
    choice, grid = result.get("lr_choice") or {}, result.get("lr_grid") or []
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
        tried = ", ".join(f"{lr:g}: {100 * v:.1f}" for lr, v in c["grid"])
        inside = "yes" if grid_interior(grid, c["chosen"]) else "**no (edge)**"
        lines.append(f"| {arm} | {c['chosen']:g} | {inside} | {tried} |")
    edge = sum(not grid_interior(grid, c["chosen"]) for c in choice.values())
    lines += ["", f"{len(choice) - edge} of {len(choice)} arms chose a rate inside the grid.", ""]
    return "\n".join(lines)


def render(
    out: Path, figures: str = "results/", across: dict[tuple[str, str], str] | None = None
) -> str:
    """The page from ``out``'s study.json files; ``across`` ((study, claim) -> the verdict
    across two seed bases, ``stability``): an extra column of the verdicts table."""
    results = load_results(out)
    seeds = sorted({len(r["seeds"]) for r in results})
    lines = [
        HEADER.format(
            max_factor=MAX_STEPS_FACTOR,
            lr_scale=STUDY_LR_SCALE,
            lr_grid=", ".join(f"{v:g}" for v in LR_GRID),
            lr_start=LR_START,
            out=", ".join(
                f"`{d}/NAME`"
                for d in dict.fromkeys(
                    str(Path(r["command"].split("--out ")[1].split()[0]).parent) for r in results
                )
            ),
            seeds=f" --seeds {seeds[0]}" if len(seeds) == 1 and seeds[0] != 3 else "",
        ),
        f"Wall time of the {len(results)} studies: "
        f"{sum(r['wall_s'] for r in results) / 60:.1f} min in all"
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
                "Studies not run for this page (their sections are absent, not carried over from "
                "an older rule): "
                + ", ".join(f"`{n}`" for n in missing)
                + "; each runs with `curvalign study NAME --out DIR/NAME`.",
                "",
            ]
            if (missing := [n for n in STUDIES if n not in {r["name"] for r in results}])
            else []
        ),
        *(
            [
                "Sections from an earlier version of the studies (their learning rates come from "
                "the former grid, with no interior check; kept until re-run, each with its own "
                "command): " + ", ".join(f"`{n}`" for n in older) + ".",
                "",
            ]
            if (older := [r["name"] for r in results if not is_current(r)])
            else []
        ),
        "## Verdicts",
        "",
        "| study | claim | paper's effect | MDE at the seeds used | effect (95% interval) | "
        "calibrated control | verdict | Holm-adjusted | "
        + ("across both seed bases | " if across else "")
        + "converged | wall time |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if across else "") + "---:|---:|",
    ]
    for r in results:
        conv = r.get("convergence") or {}
        done = sum(c["converged"] for c in conv.values())
        total = sum(c["seeds"] for c in conv.values())
        for c in r["claims"]:
            ok = "separated" if c.get("control_ok") else "did not separate"
            lines.append(
                f"| {r['name']} | {c['claim']} ({c.get('role', 'primary')}) | "
                f"{c.get('paper_effect_text', 'n/a')} | {c.get('mde_text', 'n/a')} | "
                f"{c['effect_text']} | {c['control_what']}: {c['control_text']} ({ok}) | "
                f"{c['outcome']} | **{c.get('holm_outcome', c['outcome'])}** | "
                + (
                    f"**{across.get((r['name'], c['claim']), 'not run on both')}** | "
                    if across
                    else ""
                )
                + f"{done}/{total} | {r['wall_s']:.0f} s |"
            )
    lines.append("")
    lines.append(
        "Multiplicity: each study's claims are one family, Holm-corrected at family-wise alpha "
        "0.05 (claims not testable in this regime are outside it); the Holm-adjusted column is "
        "the verdict"
        + (
            " of this seed base, and 'across both seed bases' the verdict of the claim "
            "(`kit.across_seed_bases`: the shared verdict, underpowered where either base "
            f"is, '{UNSTABLE}' where the two disagree)."
            if across
            else "."
        )
    )
    lines.append("")
    for r in results:
        lines.append(study_markdown(r, heading="##", figure_dir=figures))
        if is_current(r):
            lines.append(lr_table(r))
    return "\n".join(lines)


def _wall(out: Path) -> dict[str, Any] | None:
    path = Path(out) / "wall.json"
    return json.loads(path.read_text()) if path.exists() else None


def stability(a: Path, b: Path) -> tuple[list[dict[str, Any]], bool]:
    """The stability check: the verdicts of the same studies run on two seed bases (``curvalign
    study all --seed-base 0`` into ``a`` and ``--seed-base 100`` into ``b``). One row per claim:
    both Holm-adjusted verdicts, whether either run marks it underpowered (those may differ), and
    whether they agree. ``ok``: every claim agrees; a claim decided differently on the two bases
    is "unstable across seed bases", whatever the two labels (``kit.across_seed_bases``)."""
    left = {r["name"]: r for r in load_results(a)}
    right = {r["name"]: r for r in load_results(b)}
    rows = []
    for name in [n for n in left if n in right]:
        for ca, cb in zip(left[name]["claims"], right[name]["claims"], strict=False):
            va = Verdict(
                ca.get("holm_verdict", ca.get("verdict")), ca.get("holm_outcome", ca["outcome"])
            )
            vb = Verdict(
                cb.get("holm_verdict", cb.get("verdict")), cb.get("holm_outcome", cb["outcome"])
            )
            both = across_seed_bases(
                va, vb, min(len(left[name]["seeds"]), len(right[name]["seeds"]))
            )
            rows.append(
                {
                    "study": name,
                    "claim": ca["claim"],
                    "a": va.text,
                    "b": vb.text,
                    "seeds": (left[name]["seeds"], right[name]["seeds"]),
                    "underpowered": UNDERPOWERED in (va.kind, vb.kind),
                    "agree": va.kind == vb.kind,
                    "across": both.text,
                    "across_kind": both.kind,
                }
            )
    ok = all(r["agree"] for r in rows)
    return rows, ok


def stability_markdown(rows: list[dict[str, Any]], ok: bool, other: str = "") -> str:
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
            f"| {r['study']} | {r['claim']} | {sa[0]}-{sa[-1]} | {r['a']} | {sb[0]}-{sb[-1]} | "
            f"{r['b']} | {flag} | {r.get('across', '')} |"
        )
    unstable = sum(r.get("across_kind") == UNSTABLE for r in rows)
    lines.append("")
    lines.append(
        f"{len(rows)} claims on both bases: {sum(r['agree'] for r in rows)} agree, {unstable} "
        f"flip between bases (marked '{UNSTABLE}' by `kit.across_seed_bases`, whatever the "
        "two labels)."
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
    args = parser.parse_args(argv)
    stable = True
    try:
        rows: list[dict[str, Any]] = []
        if args.stability:
            rows, stable = stability(args.out, args.stability)
        across = {(r["study"], r["claim"]): r["across"] for r in rows} or None
        text = render(args.out, args.figures, across)
        if args.stability:
            text = (
                text.rstrip("\n") + "\n\n" + stability_markdown(rows, stable, str(args.stability))
            )
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.copy_to:
        copy_outputs(args.out, args.copy_to)
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
