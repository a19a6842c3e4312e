"""The studies' pages: one short verdict table (no cell over ``CELL_LIMIT`` characters, the long
reasons in footnotes) and one page per study.

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
from typing import Any

from curvalign_lab import kit

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


def effect_cell(claim: Mapping[str, Any]) -> str:
    """ "mean [low, high], n=3" (x scale), and "seeds + items" where the interval counts the
    test items too."""
    iv = claim["effect"]
    scale = float(claim.get("inputs", {}).get("scale", 100.0))
    if not iv or iv.get("n", 0) == 0:
        return "n/a"
    text = (
        f"{_num(iv['mean'], scale)} [{_num(iv['low'], scale)}, {_num(iv['high'], scale)}], "
        f"n={iv['n']}"
    )
    return text + (" (seeds + items)" if claim.get("two_level") else "")


def control_cell(claim: Mapping[str, Any]) -> str:
    """ "separated: 5.1 [2.0, 8.2] >= 2" or "did not separate: ..." or "none"."""
    iv = claim.get("control")
    if not iv:
        return "none"
    scale = float(claim.get("inputs", {}).get("scale", 100.0))
    verdict = "separated" if claim.get("control_ok") else "did not separate"
    need = claim.get("control_min") or 0.0
    return (
        f"{verdict}: {_num(iv['mean'], scale)} [{_num(iv['low'], scale)}, "
        f"{_num(iv['high'], scale)}]" + (f", needs >= {need * scale:.3g}" if need else "")
    )


def paper_cell(claim: Mapping[str, Any], notes: Footnotes) -> str:
    effect = claim.get("paper_effect")
    scale = float(claim.get("inputs", {}).get("scale", 100.0))
    source = claim.get("paper_source") or ""
    text = "no number" if effect is None else f"{abs(effect) * scale:.3g} {claim.get('unit', '')}"
    return text.strip() + (f" {notes.ref(source)}" if source else "")


def planned_cell(claim: Mapping[str, Any]) -> str:
    if claim.get("planned_n_text"):
        return str(claim["planned_n_text"])
    return "no plan" if claim.get("holm_family") is not None else "not tested"


def verdict_cells(
    claim: Mapping[str, Any], notes: Footnotes, across: tuple[str, str] | None = None
) -> list[str]:
    """The cells of one claim's row (without the study column)."""
    kind = claim.get("holm_verdict", claim.get("verdict", ""))
    text = claim.get("holm_outcome", claim.get("outcome", ""))
    verdict = short_verdict(kind, text)
    if text and text != verdict:
        verdict += f" {notes.ref(text)}"
    cells = [
        notes.cell(claim["claim"] + f" ({claim.get('role', 'primary')})"),
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
    results: Sequence[Mapping[str, Any]],
    across: Mapping[tuple[str, str], tuple[str, str]] | None = None,
    notes: Footnotes | None = None,
    link: str = "",
) -> str:
    """One short table over ``results`` (the studies' JSON); ``across``: (study, claim) ->
    (class, text) of the verdict across two seed bases; ``link``: per-study page links as
    ``link.format(name=...)`` (empty: no links). The footnotes follow the table."""
    notes = notes or Footnotes()
    head = ["study", "claim", "paper's effect", "planned n", "effect (95%)", "control", "verdict"]
    if across is not None:
        head.append("across seed bases")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        name = f"[{r['name']}]({link.format(name=r['name'])})" if link else r["name"]
        for c in r["claims"]:
            both = None
            if across is not None:
                both = across.get((r["name"], c["claim"]), ("not run on both", "not run on both"))
            lines.append("| " + " | ".join([name, *verdict_cells(c, notes, both)]) + " |")
    return "\n".join(lines) + "\n\n" + notes.markdown()


def plan_text(result: Mapping[str, Any]) -> str:
    """The power plan in a few lines: pilot base and seeds, each claim's SD, n and cap."""
    plan = result.get("power_plan")
    if not plan:
        return (
            "**Power.** No pilot ran (`--power` plans each claim's seeds on a pilot of a disjoint "
            "seed base): no claim is called underpowered.\n"
        )
    lines = [
        f"**Power, planned on a pilot** of {plan.get('pilot_seeds')} seeds"
        + (f" (seed base {plan['pilot_seed_base']})" if "pilot_seed_base" in plan else "")
        + f"; seeds used: {plan['seeds']}, cap {plan['max_seeds']}.",
        "",
        "| claim | kind | pilot SD | target | planned n | MDE at n | underpowered by plan |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for claim, p in plan.get("per_claim", {}).items():
        if not isinstance(p, Mapping):  # an older study.json: seeds only
            lines.append(f"| {claim} | | | | {p} | | |")
            continue
        lines.append(
            f"| {claim} | {p.get('kind', '')} | {100 * p['pilot_sd']:.3g} | "
            f"{100 * p['target']:.3g} | {p['n']} | {100 * p['mde']:.3g} | "
            f"{'yes' if p['underpowered'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def control_text(result: Mapping[str, Any]) -> str:
    control = result.get("control")
    if not isinstance(control, Mapping) or not control.get("what"):
        return ""
    choice = control.get("choice")
    line = f"**Control.** {control['what'].format(dose=control['dose'])}"
    if choice:
        scan = ", ".join(f"{d}: {100 * m:.2f}" for d, m in choice["scan"].items())
        line += (
            f"; dose chosen on the pilot's scan (dose: effect x100: {scan}) for the claim's size "
            f"{100 * choice['target']:.3g}"
            + ("" if choice["calibrated"] else ": no dose reached it, the control cannot calibrate")
        )
    else:
        line += " (the declared dose: no pilot scan ran)"
    return line + ".\n"


def starts_text(result: Mapping[str, Any]) -> str:
    """The arms' step-0 health: which warnings fired (or that none did)."""
    if "starts" not in result:
        return ""
    fired = result.get("starts_fired") or []
    if not fired:
        return (
            "**Step-0 health.** Every arm's step-0 check passed on every seed (the resolved start "
            "of each run is in study.json, `starts`).\n"
        )
    return (
        "**Step-0 health: warnings that fired** (`curvalign.recipes.health`; each run's "
        "resolved start is in study.json, `starts`):\n\n" + "".join(f"- {f}\n" for f in fired)
    )


def arms_table(result: Mapping[str, Any]) -> str:
    arms = result.get("arms")
    if not arms:
        return ""
    metric = result.get("arms_metric", "test mean R@1")
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


def study_body(result: Mapping[str, Any]) -> str:
    """One study's tables (``study_page`` adds the claim, setup and command)."""
    family = [c for c in result["claims"] if c.get("holm_family") is not None]
    parts = [
        verdict_table([result], notes=Footnotes(f"{result['name']}-")),
        f"Holm family: {len(family)} of the {len(result['claims'])} claims (precondition and "
        f"regime claims are decided outside it), family-wise alpha {kit.ALPHA:g}.\n",
        plan_text(result),
        control_text(result),
        starts_text(result),
        *(
            [f"**Measured notes.** {c['claim']}: {c['note']}\n" for c in result["claims"]]
            if any(c.get("note") for c in result["claims"])
            else []
        ),
        arms_table(result),
        # an older study.json has no separate tables: its whole former section stands here
        str(result.get("tables", result.get("markdown", ""))),
    ]
    return "\n".join(p for p in parts if p)


def study_page(result: Mapping[str, Any], heading: str = "#", figure_dir: str = "") -> str:
    """A study's page: the paper's claim, setup, command, rule, then ``study_body``."""
    md = [
        f"{heading} {result['name']}",
        "",
        f"**The paper's claim.** {result['paper']}",
        "",
        f"**Setup.** {result['setup']} Seeds: {', '.join(map(str, result['seeds']))} (paired). "
        f"Wall time: {result['wall_s']:.0f} s.",
        "",
    ]
    if result.get("command"):
        md += [f"**Command.** `{result['command']}`", ""]
    if result.get("preconditions"):
        md += ["**Preconditions.** " + "; ".join(result["preconditions"]) + ".", ""]
    md += [f"**Verdict rule.** {result['rule']}.", ""]
    if result.get("notes"):
        md += [f"**What the measure means.** {result['notes']}", ""]
    md.append(study_body(result))
    for f in result.get("figures", []):
        md.append(f"![{Path(f).stem}]({figure_dir}{Path(f).name})")
    return "\n".join(md) + "\n"


__all__ = [
    "CELL_LIMIT",
    "Footnotes",
    "control_cell",
    "effect_cell",
    "short_verdict",
    "study_body",
    "study_page",
    "verdict_cells",
    "verdict_table",
]
