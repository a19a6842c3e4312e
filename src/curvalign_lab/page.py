"""The studies' pages: one short verdict table (no cell over ``CELL_LIMIT`` characters, the long
reasons in footnotes) and one page per study.

Each reads the typed records (``records.StudyResult``, ``records.ClaimResult``).

``verdict_table(results)``  the index's table: study, claim, paper effect, planned n, effect with
                            its interval, control, verdict in a few words (and the verdict across
                            two seed bases where a stability check ran)
``study_body(result)``      one study's tables: its verdicts, the plan, the control's dose, the
                            arms' step-0 health where a warning fired, metrics, convergence
``study_page(result)``      a study's page: the paper's claim, setup, command, rule, body
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from curvalign_lab import kit
from curvalign_lab.records import ClaimResult, DoseChoice, PlanRecord, StudyResult

#: no cell of a verdict table is longer than this (characters); longer texts go to footnotes
CELL_LIMIT = 200

#: the verdict in a few words, per class (``kit.VERDICTS`` and ``kit.UNSTABLE``)
SHORT = {
    kit.HOLDS: "holds",
    kit.DOES_NOT_HOLD: "does not hold",
    kit.EQUIVALENT: "equivalent",
    kit.UNDERPOWERED: "underpowered by plan",
    kit.NOT_REPRODUCED: "not reproduced in this regime",
    kit.UNSTABLE: "unstable across seed bases",
}
_INCONCLUSIVE = {
    kit.TOO_SHORT: "inconclusive: too short",
    kit.UNDETECTABLE: "inconclusive: control did not separate",
    kit.NOT_SIGNIFICANT: "inconclusive after Holm",
    kit.INCONCLUSIVE: "inconclusive",
}


class Footnotes:
    """Collects the long texts of a table as numbered Markdown footnotes (``[^p-1]``)."""

    def __init__(self, prefix: str = "n") -> None:
        self.prefix = prefix
        self.notes: dict[str, str] = {}

    def ref(self, text: str) -> str:
        """A footnote marker for ``text`` (one per distinct text)."""
        for key, value in self.notes.items():
            if value == text:
                return f"[^{key}]"
        key = f"{self.prefix}{len(self.notes) + 1}"
        self.notes[key] = text
        return f"[^{key}]"

    def cell(self, text: str, limit: int = CELL_LIMIT) -> str:
        """``text`` as a table cell of at most ``limit`` characters: as it is when short
        enough, else cut at a clause boundary (or a word) with the whole text in a footnote."""
        text = " ".join(str(text).split()).replace("|", "/")
        if len(text) <= limit:
            return text
        marker = self.ref(text)
        room = limit - len(marker) - 2
        cut = text[:room]
        for sep in (" (", "; ", ": ", ", "):
            at = cut.find(sep, 16)
            if at > 0:
                cut = cut[:at]
                break
        else:
            cut = cut.rsplit(" ", 1)[0]
        return f"{cut.rstrip(' ,;:')}… {marker}"

    def markdown(self) -> str:
        if not self.notes:
            return ""
        return "\n".join(f"[^{k}]: {v}" for k, v in self.notes.items()) + "\n"


def short_verdict(kind: str, text: str) -> str:
    """The verdict in a few words (the full text goes to a footnote)."""
    if kind == kit.INCONCLUSIVE_KIND:
        return _INCONCLUSIVE.get(text, "inconclusive")
    if kind == kit.UNDERPOWERED and "by plan" not in text:
        return "underpowered (older rule: the run's own SD)"
    return SHORT.get(kind, kind)


def _num(value: float, scale: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * scale:.2f}"


def effect_cell(claim: ClaimResult) -> str:
    """ "mean [low, high], n=3" (x scale), and "seeds + items" where the interval counts the
    test items too."""
    iv = claim.effect
    scale = float(claim.inputs.scale)
    if iv.n == 0:
        return "n/a"
    text = f"{_num(iv.mean, scale)} [{_num(iv.low, scale)}, {_num(iv.high, scale)}], n={iv.n}"
    return text + (" (seeds + items)" if claim.two_level else "")


def control_cell(claim: ClaimResult) -> str:
    """ "separated: 2.1 [0.9, 3.3], claim size 2" (above 0, half-width below the size) or "did not separate: ..." or "none"."""
    iv = claim.control
    if iv is None:
        return "none"
    scale = float(claim.inputs.scale)
    verdict = "separated" if claim.control_ok else "did not separate"
    need = claim.control_min or 0.0
    return f"{verdict}: {_num(iv.mean, scale)} [{_num(iv.low, scale)}, {_num(iv.high, scale)}]" + (
        f", claim size {need * scale:.3g}" if need else ""
    )


def paper_cell(claim: ClaimResult, notes: Footnotes) -> str:
    effect = claim.paper_effect
    scale = float(claim.inputs.scale)
    source = claim.paper_source or ""
    text = "no number" if effect is None else f"{abs(effect) * scale:.3g} {claim.unit}"
    return text.strip() + (f" {notes.ref(source)}" if source else "")


def planned_cell(claim: ClaimResult) -> str:
    if claim.planned_n_text:
        return claim.planned_n_text
    return "no plan" if claim.holm_family is not None else "not tested"


def verdict_cells(
    claim: ClaimResult, notes: Footnotes, across: tuple[str, str] | None = None
) -> list[str]:
    """The cells of one claim's row (without the study column)."""
    text = claim.final_outcome
    verdict = short_verdict(claim.final_verdict, text)
    if text and text != verdict:
        verdict += f" {notes.ref(text)}"
    cells = [
        notes.cell(f"{claim.claim} ({claim.role})"),
        notes.cell(paper_cell(claim, notes)),
        notes.cell(planned_cell(claim)),
        notes.cell(effect_cell(claim)),
        notes.cell(control_cell(claim)),
        notes.cell(verdict),
    ]
    if across is not None:
        kind_b, text_b = across
        both = short_verdict(kind_b, text_b)
        cells.append(notes.cell(both + (f" {notes.ref(text_b)}" if text_b != both else "")))
    return cells


def verdict_table(
    results: Sequence[StudyResult],
    across: Mapping[tuple[str, str], tuple[str, str]] | None = None,
    notes: Footnotes | None = None,
    link: str = "",
) -> str:
    """One short table over ``results``; ``across``: (study, claim) -> (class, text) of the
    verdict across two seed bases; ``link``: per-study page links as ``link.format(name=...)``
    (empty: no links). The footnotes follow the table."""
    notes = notes or Footnotes()
    head = ["study", "claim", "paper's effect", "planned n", "effect (95%)", "control", "verdict"]
    if across is not None:
        head.append("across seed bases")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        name = f"[{r.name}]({link.format(name=r.name)})" if link else r.name
        for c in r.claims:
            both = None
            if across is not None:
                both = across.get((r.name, c.claim), ("not run on both", "not run on both"))
            lines.append("| " + " | ".join([name, *verdict_cells(c, notes, both)]) + " |")
    return "\n".join(lines) + "\n\n" + notes.markdown()


def plan_text(result: StudyResult) -> str:
    """The power plan in a few lines: pilot base and seeds, each claim's SD, n and cap."""
    plan = result.power_plan
    if plan is None:
        return (
            "**Power.** No pilot ran (`--power` plans each claim's seeds on a pilot of a disjoint "
            "seed base): no claim is called underpowered.\n"
        )
    lines = [
        f"**Power, planned on a pilot** of {plan.pilot_seeds} seeds"
        + (f" (seed base {plan.pilot_seed_base})" if plan.pilot_seed_base is not None else "")
        + f"; seeds used: {plan.seeds}, cap {plan.max_seeds}.",
        "",
    ]
    # the test items' SE, where a plan counted it (a record from before plans did has none)
    items = any(isinstance(p, PlanRecord) and p.item_se > 0 for p in plan.per_claim.values())
    if items:
        lines += [
            "| claim | kind | pilot SD | test items' SE | target | planned n | MDE at n "
            "| underpowered by plan |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
    else:
        lines += [
            "| claim | kind | pilot SD | target | planned n | MDE at n | underpowered by plan |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
    for claim, p in plan.per_claim.items():
        if not isinstance(p, PlanRecord):  # an older study.json: seeds only
            lines.append(f"| {claim} | | | | {p} | | |")
            continue
        item_cell = f" {100 * p.item_se:.3g} |" if items else ""
        lines.append(
            f"| {claim} | {p.kind or ''} | {100 * p.pilot_sd:.3g} |{item_cell} "
            f"{100 * p.target:.3g} | {p.n} | {100 * p.mde:.3g} | "
            f"{'yes' if p.underpowered else 'no'} |"
        )
    families = {p.family for p in plan.per_claim.values() if isinstance(p, PlanRecord)}
    for claim, p in plan.controls.items():
        # the control's target is the claim's size: it separates when narrower than that
        upper = f" (planned at {100 * p.planned_sd:.3g})" if math.isfinite(p.planned_sd) else ""
        lines.append(
            f"| control of {claim} | control | {100 * p.pilot_sd:.3g}{upper} |"
            + (" |" if items else "")
            + f" {100 * p.target:.3g} | {p.n} | {100 * p.mde:.3g} | "
            f"{'yes' if p.underpowered else 'no'} |"
        )
    if plan.controls:
        older = not all(math.isfinite(p.planned_sd) for p in plan.controls.values())
        lines.append(
            "\nThe controls' seeds are planned at their pilot SD itself (a record from before "
            "controls were planned at its upper confidence limit): a pilot SD on a few degrees "
            "of freedom falls below the true one more often than not."
            if older
            else "\nThe controls' seeds are planned at the 80% upper confidence limit of their "
            "pilot SD (in brackets), which lies above the true SD in 80% of pilots."
        )
    if max(families, default=1) > 1:
        m = max(families)
        lines.append(
            f"\nThe claims' plans are made at the level of Holm's first step for the study's {m} "
            f"tested claims (alpha 0.05/{m}); the controls' at 0.05 (they are not in the family)."
        )
    elif len(families) == 1 and len(plan.per_claim) > 1:
        lines.append(
            "\nThese plans were made at the unadjusted level 0.05 (a record from before plans "
            "took the level of Holm's first step): a claim planned here may need more seeds "
            "to be decided after Holm's correction."
        )
    if not items and any(c.two_level and c.plan is not None for c in result.claims):
        lines.append(
            "\nThese plans count the seeds only (a record from before plans counted the test "
            "items' standard error, which more seeds do not shrink): a claim whose interval "
            "counts its test items may need more seeds than planned, or a larger test set."
        )
    return "\n".join(lines) + "\n"


def _scan_text(choice: DoseChoice) -> str:
    return ", ".join(f"{d}: {100 * m:.2f}" for d, m in choice.scan.items())


def control_text(result: StudyResult) -> str:
    control = result.control
    if control is None or not control.what:
        return ""
    choice = control.choice
    line = f"**Control.** {control.what.format(dose=control.dose)}"
    if choice:
        line += (
            f"; dose chosen on the pilot's scan (dose: effect x100: {_scan_text(choice)}) for the "
            f"claim's size {100 * choice.target:.3g}"
            + ("" if choice.calibrated else ": no dose reached it, the control cannot calibrate")
        )
    else:
        line += " (the declared dose: no pilot scan ran)"
    return line + ".\n"


def measured_controls_text(result: StudyResult) -> str:
    """The controls applied when measuring (``declare.MeasuredControl``): what, for which
    claims, the dose and the pilot's scan."""
    lines = []
    for mc in result.measured_controls or ():
        line = f"**Control of {', '.join(mc.claims)} (applied when measuring).** " + mc.what.format(
            dose=f"{mc.dose:.3g}"
        )
        choice = mc.choice
        if choice:
            line += (
                f"; dose chosen on the pilot's scan (dose: effect x100: {_scan_text(choice)}) for "
                f"the claim's size {100 * choice.target:.3g}"
                + ("" if choice.calibrated else ": no dose reached it, it cannot calibrate")
            )
        else:
            line += " (the declared dose: no pilot scan ran)"
        lines.append(line + ".\n")
    return "\n".join(lines)


def starts_text(result: StudyResult) -> str:
    """The arms' step-0 health: which warnings fired (or that none did)."""
    if result.starts is None:
        return ""
    fired = result.starts_fired or ()
    if not fired:
        return (
            "**Step-0 health.** Every arm's step-0 check passed on every seed (the resolved start "
            "of each run is in study.json, `starts`).\n"
        )
    return (
        "**Step-0 health: warnings that fired** (`curvalign.recipes.health`; each run's "
        "resolved start is in study.json, `starts`):\n\n" + "".join(f"- {f}\n" for f in fired)
    )


def arms_table(result: StudyResult) -> str:
    arms = result.arms
    if not arms:
        return ""
    metric = result.arms_metric or "test mean R@1"
    lines = [f"| arm | {metric} x100, mean ± 95% | per seed |", "|---|---:|---|"]
    from curvalign.stats import mean_interval

    for arm, values in arms.items():
        vals = [float(v) for v in values.values() if v is not None and math.isfinite(float(v))]
        if not vals:
            lines.append(f"| {arm} | n/a | |")
            continue
        lines.append(
            f"| {arm} | {mean_interval(vals).format(100.0, 1)} | "
            + ", ".join(f"{100 * v:.1f}" for v in vals)
            + " |"
        )
    return "\n".join(lines) + "\n"


def study_body(result: StudyResult) -> str:
    """One study's tables (``study_page`` adds the claim, setup and command)."""
    family = [c for c in result.claims if c.holm_family is not None]
    parts = [
        verdict_table([result], notes=Footnotes(f"{result.name}-")),
        f"Holm family: {len(family)} of the {len(result.claims)} claims (precondition and "
        f"regime claims are decided outside it), family-wise alpha {kit.ALPHA:g}.\n",
        plan_text(result),
        control_text(result),
        measured_controls_text(result),
        starts_text(result),
        *(f"**Measured notes.** {c.claim}: {c.note}\n" for c in result.claims if c.note),
        arms_table(result),
        # an older study.json has no separate tables: its whole former section stands here
        result.tables if result.tables is not None else result.markdown,
    ]
    return "\n".join(p for p in parts if p)


def study_page(result: StudyResult, heading: str = "#", figure_dir: str = "") -> str:
    """A study's page: the paper's claim, setup, command, rule, then ``study_body``."""
    md = [
        f"{heading} {result.name}",
        "",
        f"**The paper's claim.** {result.paper}",
        "",
        f"**Setup.** {result.setup} Seeds: {', '.join(map(str, result.seeds))} (paired). "
        f"Wall time: {result.wall_s:.0f} s.",
        "",
    ]
    if result.command:
        md += [f"**Command.** `{result.command}`", ""]
    if result.preconditions:
        md += ["**Preconditions.** " + "; ".join(result.preconditions) + ".", ""]
    md += [f"**Verdict rule.** {result.rule}.", ""]
    if result.notes:
        md += [f"**What the measure means.** {result.notes}", ""]
    md.append(study_body(result))
    for f in result.figures:
        md.append(f"![{Path(f).stem}]({figure_dir}{Path(f).name})")
    return "\n".join(md) + "\n"


__all__ = [
    "CELL_LIMIT",
    "Footnotes",
    "control_cell",
    "effect_cell",
    "measured_controls_text",
    "short_verdict",
    "study_body",
    "study_page",
    "verdict_cells",
    "verdict_table",
]
