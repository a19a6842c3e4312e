"""docs/results.md from the JSON outputs of ``curvalign study all --out DIR``.

    python -m curvalign.report.results DIR [--figures PREFIX] [--copy-to docs/results]
        [--keep-from docs/results.md "## Demo"] [-o docs/results.md]

Every number in the page comes from ``DIR/*/study.json``; nothing is typed by hand. Figures are
linked as ``PREFIX + file name`` (default ``results/``). ``--copy-to docs/results`` copies every
``DIR/NAME/study.json`` to ``docs/results/NAME/study.json`` and every figure to
``docs/results/``, so the committed page can be regenerated from the committed JSON:
``python -m curvalign.report.results docs/results > docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from curvalign.report.studies import STUDIES, study_markdown
from curvalign.report.studykit import MAX_STEPS_FACTOR, STUDY_LR_REASON, STUDY_LR_SCALE

HEADER = """# Results: the papers' claims as studies that can fail

Generated from the studies' JSON outputs; do not edit by hand. To reproduce everything:

    curvalign study all --out studies{seeds}
    python -m curvalign.report.results studies --copy-to docs/results \\
        --keep-from docs/results.md "## Demo" -o docs/results.md

or, from the committed JSON (`docs/results/NAME/study.json`) alone, the same second command with
`docs/results` in place of `studies` and no `--copy-to`. Each section gives the exact command of
its run (its `--out` was `{out}/NAME`). The sections from "Demo" on are kept verbatim from the
previous page (`--keep-from`): they come from the benchmark commands they show.

Each study quotes its paper's claim, trains every arm with the same seeds, compares arms by
paired per-seed differences with 95% Student-t intervals (`curvalign.stats`), and decides each
claim by one rule (`curvalign.report.studykit.decide`): *too short to test the claim* when the
budget is below the study's need; *inconclusive: the metric cannot detect it* unless a control
arm (the mechanism removed, or the claim made false on purpose) moved the metric (its interval
excludes 0); otherwise *holds* / *does not hold* when the effect's interval lies wholly above /
below the claim's threshold, *inconclusive* when it contains it. "Inconclusive" and "does not
hold" are results, not failures of the pipeline. *converged* counts the (arm, seed) runs of the
study whose validation curve had plateaued (its last third improved the best by at most 0.01):
an arm not flat at its study's step budget trains on, one validation segment at a time, until it
is flat or reaches {max_factor:g}x the budget (each study's convergence table gives the step each
run stopped at); a verdict over arms that had not converged is a verdict at that budget, not at
the plateau.

**Learning rate: a departure from the papers.** Every arm trains at {lr_scale:g}x its recipe's
paper learning rate (`curvalign.report.studykit.STUDY_LR_SCALE`; each study's "Training" line
lists the rates): {lr_reason}. The papers' schedule shape (warm-up, cosine) is kept.

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


def render(out: Path, figures: str = "results/") -> str:
    results = load_results(out)
    seeds = sorted({len(r["seeds"]) for r in results})
    lines = [
        HEADER.format(
            max_factor=MAX_STEPS_FACTOR,
            lr_scale=STUDY_LR_SCALE,
            lr_reason=STUDY_LR_REASON,
            out=Path(results[0]["command"].split("--out ")[1].split()[0]).parent,
            seeds=f" --seeds {seeds[0]}" if len(seeds) == 1 and seeds[0] != 3 else "",
        ),
        f"Wall time of the {len(results)} studies: "
        f"{sum(r['wall_s'] for r in results) / 60:.1f} min in all.",
        "",
        "## Verdicts",
        "",
        "| study | claim | verdict | effect (95% interval) | control | converged | wall time |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for r in results:
        conv = r.get("convergence") or {}
        done = sum(c["converged"] for c in conv.values())
        total = sum(c["seeds"] for c in conv.values())
        for c in r["claims"]:
            lines.append(
                f"| {r['name']} | {c['claim']} | **{c['outcome']}** | {c['effect_text']} | "
                f"{c['control_what']}: {c['control_text']} | {done}/{total} | "
                f"{r['wall_s']:.0f} s |"
            )
    lines.append("")
    for r in results:
        lines.append(study_markdown(r, heading="##", figure_dir=figures))
    return "\n".join(lines)


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
    args = parser.parse_args(argv)
    try:
        text = render(args.out, args.figures)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
