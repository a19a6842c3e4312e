"""Side-by-side tables of evaluation results: terminal (rich), Markdown and JSON.

Input everywhere: ``results`` = {row name (recipe or setting): ``curvalign.eval.evaluate`` dict}.
Cells missing from a result (a metric the data does not support, an ordering that does not apply
to the geometry) print as "n/a", never as a number.

Units, everywhere a person reads them (terminal, Markdown, plots, ``curvalign eval``): every
quantity in [0, 1] (recalls, accuracies, J, PH, RH, hard negatives, ordering) in percent; TIE
and LCA in tree edges (lower is better). JSON keeps the fractions and says so ("units").
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

#: a two-row comparison for one column, (interval of a - b, whether it excludes 0, how it was
#: computed), or None where the caller has nothing better than the per-seed values
#: (``report.benchmark.ItemGaps.gap``: seeds and test items)
PairGap = Callable[[str, str, str], "tuple[Any, bool, str] | None"]

#: (column header, path into the result dict, format: "pct" (x100, 1 decimal) or "num" (3 decimals))
DEFAULT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("T2I R@1", "retrieval/t2i@1", "pct"),
    ("T2I R@5", "retrieval/t2i@5", "pct"),
    ("I2T R@1", "retrieval/i2t@1", "pct"),
    ("I2T R@5", "retrieval/i2t@5", "pct"),
    ("ZS top1", "zeroshot/top1", "pct"),
    ("ZS top5", "zeroshot/top5", "pct"),
    ("ZS mpc", "zeroshot/mean_per_class", "pct"),
    ("TIE↓", "hierarchy/TIE", "num"),
    ("LCA↓", "hierarchy/LCA", "num"),
    ("J", "hierarchy/J", "pct"),
    ("PH", "hierarchy/PH", "pct"),
    ("RH", "hierarchy/RH", "pct"),
    ("Depth=", "hierarchy/depth_match", "pct"),
    ("Leaf", "hierarchy/leaf_rate", "pct"),
    ("PredDepth", "hierarchy/pred_depth", "num"),
    ("Sib@5", "hierarchy/sibling@5", "pct"),
    ("Cous@5", "hierarchy/cousin@5", "pct"),
    ("Ent AP", "entailment/taxonomy/AP", "pct"),
    ("Ent AUC", "entailment/taxonomy/AUROC", "pct"),
    ("Chain AP", "entailment/chains/AP", "pct"),
    ("Chain AUC", "entailment/chains/AUROC", "pct"),
    ("mAP", "multilabel/mAP", "pct"),
    ("HardNeg", "compositional/overall", "pct"),
    ("Order txt", "ordering/text/chain", "pct"),
    ("Order img", "ordering/image/chain", "pct"),
)


#: the one-line statement of the units, for table headers
UNITS = (
    "rates in % (recall, accuracy, J, PH, RH, hard negatives, ordering); TIE and LCA in tree edges"
)
#: what results.json says about its numbers
JSON_UNITS = "fractions in [0, 1] for rates (tables print them in %); TIE and LCA in tree edges"
#: columns where lower is better
LOWER_IS_BETTER = ("hierarchy/TIE", "hierarchy/LCA")
#: numbers with no better direction, never given a "best" verdict (depths in tree edges and
#: counts print with decimals; the leaf rate, a share, in %)
UNRANKED = (
    "hierarchy/leaf_rate",  # right only as far as the truths are leaves
    "hierarchy/pred_depth",
    "hierarchy/true_depth",
    "entailment/taxonomy/positives",
    "entailment/taxonomy/negatives",
    "entailment/taxonomy/distinct_scores",
    "entailment/chains/positives",
    "entailment/chains/negatives",
    "entailment/chains/distinct_scores",
    "multilabel/classes",
)
#: the terminal table's columns, most wanted first: it shows as many as the terminal fits
TERMINAL_PRIORITY = (
    "retrieval/t2i@1",
    "retrieval/i2t@1",
    "zeroshot/top1",
    "hierarchy/TIE",
    "retrieval/t2i@5",
    "retrieval/i2t@5",
    "hierarchy/J",
    "compositional/overall",
    "zeroshot/top5",
    "hierarchy/LCA",
    "hierarchy/PH",
    "hierarchy/RH",
    "ordering/text/chain",
    "ordering/image/chain",
)


def lookup(result: Mapping[str, Any], path: str) -> Any:
    """``result["a"]["b"]`` for path "a/b"; None when any part is missing."""
    node: Any = result
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def format_cell(value: Any, kind: str = "num") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{100 * value:.1f}" if kind == "pct" else f"{value:.3f}"
    return str(value)


def present_columns(
    results: Mapping[str, Mapping[str, Any]],
    columns: Sequence[tuple[str, str, str]] = DEFAULT_COLUMNS,
) -> list[tuple[str, str, str]]:
    """The columns at least one row has a number for (keeps the table to what the data supports)."""
    return [col for col in columns if any(lookup(r, col[1]) is not None for r in results.values())]


def table_rows(
    results: Mapping[str, Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]
) -> list[list[str]]:
    return [
        [name] + [format_cell(lookup(r, path), kind) for _, path, kind in columns]
        for name, r in results.items()
    ]


def markdown_table(
    results: Mapping[str, Mapping[str, Any]],
    columns: Sequence[tuple[str, str, str]] | None = None,
    first: str = "recipe",
) -> str:
    """A GitHub Markdown table; percentages for recalls/accuracies, 3 decimals otherwise."""
    cols = present_columns(results) if columns is None else list(columns)
    header = [first] + [c[0] for c in cols]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(cols)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results, cols)]
    return "\n".join(lines) + "\n"


def rich_table(
    results: Mapping[str, Mapping[str, Any]],
    title: str | None = None,
    columns: Sequence[tuple[str, str, str]] | None = None,
    first: str = "recipe",
):
    """A ``rich.table.Table`` of the same content (print it with a rich Console)."""
    from rich.table import Table

    cols = present_columns(results) if columns is None else list(columns)
    table = Table(title=title)
    table.add_column(first, style="bold")
    for header, _, _ in cols:
        table.add_column(header, justify="right")
    for row in table_rows(results, cols):
        table.add_row(*row)
    return table


def metric_kind(path: str) -> str:
    """ "pct" for quantities in [0, 1], "num" for TIE/LCA (tree edges) and diagnostics."""
    if (
        path in LOWER_IS_BETTER
        or (path in UNRANKED and not path.endswith("leaf_rate"))
        or path.startswith(("diagnostics", "distance_to_origin", "spectrum"))
    ):
        return "num"
    return "pct"


def metrics_lines(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) lines of one evaluation, for ``curvalign eval`` without ``--json``: rates
    in %, TIE/LCA in tree edges (the module's units)."""
    out = []
    for group in ("retrieval", "zeroshot", "hierarchy", "multilabel", "compositional"):
        for key, value in (result.get(group) or {}).items():
            path = f"{group}/{key}"
            kind = metric_kind(path)
            out.append((path, format_cell(value, kind)))
    entailment = result.get("entailment") or {}
    for source in ("taxonomy", "chains"):
        for key in ("AP", "AUROC", "distinct_scores", "modal_fraction"):
            value = lookup(entailment, f"{source}/{key}")
            if value is not None:
                path = f"entailment/{source}/{key}"
                out.append((path, format_cell(value, metric_kind(path))))
    sensitivity = result.get("prompt_sensitivity") or {}
    for name, values in {
        **(sensitivity.get("templates") or {}),
        "ensemble": sensitivity.get("ensemble") or {},
    }.items():
        for key in ("top1", "mean_per_class"):
            if key in values:
                out.append((f"prompt_sensitivity/{name}/{key}", format_cell(values[key], "pct")))
    ordering = result.get("ordering")
    if ordering is not None:
        for side in ("text", "image"):
            for key in ("chain", "pairs"):
                out.append(
                    (
                        f"ordering/{side}/{key}",
                        format_cell(lookup(ordering, f"{side}/{key}"), "pct"),
                    )
                )
    diag = result.get("diagnostics") or {}
    for modality in ("image", "text"):
        out.append(
            (
                f"distance_to_origin/{modality}/mean",
                format_cell(lookup(diag, f"distance_to_origin/{modality}/mean"), "num"),
            )
        )
        out.append(
            (
                f"spectrum/{modality}/effective_rank",
                format_cell(lookup(diag, f"spectrum/{modality}/effective_rank"), "num"),
            )
        )
    return out


def to_jsonable(value: Any) -> Any:
    """Plain JSON types; NaN and infinities become None (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return to_jsonable(value.item())
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: str | Path, obj: object) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_jsonable(obj), indent=2) + "\n")
    tmp.replace(path)
    return path


# --- tables of several seeds: mean ± 95% interval, verdicts only where intervals separate -------


def stat_cell(stat: Mapping[str, Any] | None, kind: str) -> str:
    """``"48.2±1.3"`` (percent for "pct"), ``"48.2"`` for one seed, "n/a" when absent."""
    if not stat:
        return "n/a"
    scale = 100.0 if kind == "pct" else 1.0
    digits = 1 if kind == "pct" else 2
    mean = f"{scale * stat['mean']:.{digits}f}"
    low, high = stat.get("low"), stat.get("high")
    if stat.get("n", 1) < 2 or low is None or high is None or low != low:
        return mean
    return f"{mean}±{scale * (high - low) / 2:.{digits}f}"


def gap_interval(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[Any, bool, str]:
    """(interval of a - b, whether it excludes 0, how it was computed) for two rows' stats of one
    column: paired over seeds when both have the same seeds; against a constant (one-sample) when
    one side is a single deterministic value (frozen features, ridge, chance); else the two
    intervals must not overlap."""
    from curvalign.stats import Interval, mean_interval, paired_difference

    va, vb = list(a["values"]), list(b["values"])
    if len(va) == len(vb) and len(va) >= 2:
        diff = paired_difference(va, vb)
        return diff, diff.excludes_zero(), "paired over seeds"
    if len(va) >= 2 and len(vb) == 1:
        diff = mean_interval([x - vb[0] for x in va])
        return diff, diff.excludes_zero(), "against the single value"
    if len(vb) >= 2 and len(va) == 1:
        diff = mean_interval([va[0] - y for y in vb])
        return diff, diff.excludes_zero(), "against the single value"
    ia, ib = (Interval(s["mean"], s["low"], s["high"], s["n"]) for s in (a, b))
    return mean_interval([a["mean"] - b["mean"]]), ia.separates_from(ib), "intervals"


def resolvable_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """The minimal detectable effect of a paired comparison of two rows' per-seed values (80%
    power, 95% interval) at the SD of their per-seed differences; nan when not paired."""
    from curvalign.stats import minimal_detectable_effect, sample_sd

    va, vb = list(a["values"]), list(b["values"])
    if len(va) != len(vb) or len(va) < 2:
        return math.nan
    return minimal_detectable_effect(
        sample_sd([x - y for x, y in zip(va, vb, strict=True)]), len(va)
    )


#: the columns whose verdict is read beside the rows' leaf rate and predicted depth: a map that
#: predicts a leaf for few images (shallow predictions) scores the best LCA and PH
DEPTH_READ = ("hierarchy/LCA", "hierarchy/PH")
#: the columns where chance can beat every trained row (on a shallow tree most classes are
#: siblings or cousins of each other): marked, and no row is called best there, when it does
CHANCE_CHECKED = ("hierarchy/sibling@5", "hierarchy/cousin@5")
#: the row that holds chance's values
CHANCE_ROW = "chance"


def _stat_text(stat: Mapping[str, Any] | None, kind: str) -> str:
    """A stat's mean in the table's units, without interval ("n/a" when absent)."""
    if not stat:
        return "n/a"
    return f"{stat['mean'] * 100:.1f}" if kind == "pct" else f"{stat['mean']:.2f}"


def depth_note(stats: Mapping[str, Mapping[str, Mapping[str, Any]]], rows: Sequence[str]) -> str:
    """ "leaf rate / predicted depth: a 2.0% / 1.20, b 40.0% / 3.10; true depth 4.00": what
    an LCA or PH verdict must be read with; "" when no row has them."""
    parts = [
        f"{r} {_stat_text(stats[r].get('hierarchy/leaf_rate'), 'pct')}% / "
        f"{_stat_text(stats[r].get('hierarchy/pred_depth'), 'num')}"
        for r in rows
        if r in stats and stats[r].get("hierarchy/leaf_rate")
    ]
    if not parts:
        return ""
    true = next(
        (
            stats[r]["hierarchy/true_depth"]
            for r in rows
            if stats.get(r, {}).get("hierarchy/true_depth")
        ),
        None,
    )
    tail = f"; true depth {_stat_text(true, 'num')}" if true else ""
    return "leaf rate / predicted depth: " + ", ".join(parts) + tail


def chance_above(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]], path: str, trained: Sequence[str]
) -> bool:
    """Whether chance's mean is above every trained row's in column ``path`` (one of
    ``CHANCE_CHECKED``; False where chance or the trained rows have no number)."""
    chance = stats.get(CHANCE_ROW, {}).get(path)
    values = [stats[r][path]["mean"] for r in trained if stats.get(r, {}).get(path)]
    return bool(chance and values and chance["mean"] > max(values))


def column_verdicts(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    contenders: Sequence[str],
    columns: Sequence[tuple[str, str, str]],
    never_best: Collection[str] = (),
    gap: PairGap | None = None,
    trained: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per column path: {"best": row or None, "tied": [rows], "text": one line, "mde": float}.

    ``contenders`` are every row that competes, baselines included (frozen features or the ridge
    map, untrained heads): a trained row is "best" only when it beats each of them too. The leader
    (by mean; lower is better for TIE/LCA) is "best" only when its difference with the runner-up
    has a 95% interval that excludes zero (paired over seeds; against the value of a single-value
    baseline; else non-overlapping intervals), and never when it is in ``never_best`` (a row whose
    best weights are its step-0 weights); otherwise it and every contender not separated from it
    are "tied", and the line says when the difference is smaller than what the seeds can resolve
    (the minimal detectable effect at the SD of the paired differences).

    ``gap(a, b, path)``: a better comparison of two rows where the caller has one (the benchmark's
    two-level interval over seeds and test items, which counts a single-value baseline's own
    sampling noise); None falls back to the per-seed values. A verdict on LCA or PH carries the
    leader's and runner-up's leaf rate and predicted depth; on sibling/cousin recall, where
    chance's mean is above every ``trained`` row, no row is best and the line says so."""
    out: dict[str, dict[str, Any]] = {}

    def compare(x: str, y: str, path: str) -> tuple[Any, bool, str]:
        found = gap(x, y, path) if gap is not None else None
        return found if found is not None else gap_interval(stats[x][path], stats[y][path])

    for header, path, kind in columns:
        if path in UNRANKED:
            continue
        rows = [r for r in contenders if stats.get(r, {}).get(path)]
        if len(rows) < 2:
            continue
        sign = -1.0 if path in LOWER_IS_BETTER else 1.0
        ranked = sorted(rows, key=lambda r: -sign * stats[r][path]["mean"])
        leader, runner = ranked[0], ranked[1]
        a, b = stats[leader][path], stats[runner][path]
        depth = f" [{depth_note(stats, [leader, runner])}]" if path in DEPTH_READ else ""
        if path in CHANCE_CHECKED and chance_above(stats, path, trained or contenders):
            out[path] = {
                "best": None,
                "tied": [],
                "mde": math.nan,
                "chance_above": True,
                "text": f"{header}: no best: chance "
                f"({_stat_text(stats[CHANCE_ROW][path], kind)}) is above every trained row "
                f"(leader {leader} {_stat_text(a, kind)}); on this taxonomy a random ranking "
                "finds more relatives",
            }
            continue
        if max(len(a["values"]), len(b["values"])) < 2:
            out[path] = {
                "best": None,
                "tied": [],
                "mde": math.nan,
                "text": f"{header}: one seed, no verdict (leader {leader}); run --seeds 3 or more"
                + depth,
            }
            continue
        diff, separated, how = compare(leader, runner, path)
        scale = 100.0 if kind == "pct" else 1.0
        digits = 1 if kind == "pct" else 2
        gap_text = diff.format(scale=scale, digits=digits)
        mde = resolvable_difference(a, b)
        if separated and leader not in never_best:
            out[path] = {
                "best": leader,
                "tied": [],
                "mde": mde,
                "text": f"{header}: {leader} best ({'+' if sign > 0 else '-'}{gap_text.lstrip('-')} "
                f"over {runner}, {how})" + depth,
            }
            continue
        tied = [leader] + [r for r in ranked[1:] if not compare(leader, r, path)[1]]
        if separated:  # the leader is a step-0 row: it leads, but nothing was learned
            text = (
                f"{header}: no best: the leader {leader} is an untrained head (its best step "
                f"is 0 in at least one seed); {runner} follows ({gap_text} behind)"
            )
            tied = []
        else:
            text = (
                f"{header}: tied between {', '.join(tied)} (leader minus runner-up {gap_text}, "
                "interval includes 0"
            )
            if math.isfinite(mde) and abs(diff.mean) < mde:
                text += (
                    f"; smaller than what {len(a['values'])} seeds resolve at their SD: "
                    f"{mde * scale:.{digits}f}"
                )
            text += ")"
        out[path] = {"best": None, "tied": tied, "mde": mde, "text": text + depth}
    return out


def stats_table_rows(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    columns: Sequence[tuple[str, str, str]],
    verdicts: Mapping[str, Mapping[str, Any]] | None = None,
    bold: tuple[str, str] = ("**", "**"),
) -> list[list[str]]:
    rows = []
    for name, row in stats.items():
        cells = [name]
        for _, path, kind in columns:
            cell = stat_cell(row.get(path), kind)
            if verdicts and verdicts.get(path, {}).get("best") == name:
                cell = f"{bold[0]}{cell}{bold[1]}"
            cells.append(cell)
        rows.append(cells)
    return rows


def stats_columns(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    columns: Sequence[tuple[str, str, str]] = DEFAULT_COLUMNS,
) -> list[tuple[str, str, str]]:
    """The columns some row has a number for."""
    return [c for c in columns if any(c[1] in row for row in stats.values())]


def markdown_stats_table(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    verdicts: Mapping[str, Mapping[str, Any]] | None = None,
    extra: Mapping[str, Sequence[tuple[str, str]]] | None = None,
    first: str = "row",
) -> str:
    """Every column, mean ± 95% interval, best in bold; ``extra`` = {header: [(row, cell)]}."""
    cols = stats_columns(stats)
    extra = extra or {}
    header = [first] + [c[0] for c in cols] + list(extra)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(cols) + ["---"] * len(extra)) + "|",
    ]
    for cells in stats_table_rows(stats, cols, verdicts):
        name = cells[0]
        more = [dict(values).get(name, "") for values in extra.values()]
        lines.append("| " + " | ".join(cells + more) + " |")
    return "\n".join(lines) + "\n"


def _cell_width(text: str) -> int:
    return len(text)


def terminal_stats_table(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    width: int,
    verdicts: Mapping[str, Mapping[str, Any]] | None = None,
    extra: Mapping[str, Sequence[tuple[str, str]]] | None = None,
    title: str | None = None,
    columns: Sequence[tuple[str, str, str]] | None = None,
    lead: Mapping[str, Sequence[tuple[str, str]]] | None = None,
):
    """A ``rich.table.Table`` that fits ``width`` columns without cutting a cell: the row names,
    ``lead`` columns (e.g. the gains), ``extra`` columns (e.g. converged), then as many metric
    columns as fit, in ``TERMINAL_PRIORITY`` order, or in the order of ``columns`` when given
    (only those). Returns (table, shown columns, left-out columns)."""
    from rich import box
    from rich.table import Table

    if columns is None:
        available = {c[1]: c for c in stats_columns(stats)}
        priority = [available[p] for p in TERMINAL_PRIORITY if p in available]
        priority += [c for p, c in available.items() if c not in priority]
    else:
        available = {c[1]: c for c in columns}
        priority = list(columns)
    extra = extra or {}
    lead = lead or {}
    name_width = max([len("row")] + [len(n) for n in stats])

    def col_width(col: tuple[str, str, str]) -> int:
        cells = [stat_cell(row.get(col[1]), col[2]) for row in stats.values()]
        return max([len(col[0])] + [len(c) for c in cells])

    # SIMPLE_HEAD box: one space of padding each side and one separator column per column
    used = name_width + 2
    for header, values in {**lead, **extra}.items():
        used += max([len(header)] + [len(v) for _, v in values]) + 3
    shown: list[tuple[str, str, str]] = []
    for col in priority:
        need = col_width(col) + 3
        if used + need <= width:
            shown.append(col)
            used += need
    order = [c for c in available.values() if c in shown]
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=False)
    table.add_column("row", no_wrap=True, style="bold")
    for header in lead:
        table.add_column(header, justify="right", no_wrap=True)
    for header, _, _ in order:
        table.add_column(header, justify="right", no_wrap=True)
    for header in extra:
        table.add_column(header, no_wrap=True)
    for cells in stats_table_rows(stats, order, verdicts, bold=("[bold green]", "[/]")):
        name = cells[0]
        table.add_row(
            name,
            *[dict(values).get(name, "") for values in lead.values()],
            *cells[1:],
            *[dict(values).get(name, "") for values in extra.values()],
        )
    left_out = [c for c in available.values() if c not in shown]
    return table, order, left_out


def step0_cells(rows: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(row, marker) for the "step 0" column: the codes of the step-0 health check's
    warnings (``recipes/health.py``) among a trained row's "warnings" and on how many of its
    seeds they fired, e.g. "! flat_logits (3/3)"; "ok" where the check was silent."""
    from curvalign.recipes.health import step0_codes

    out = []
    for name, row in rows.items():
        if row.get("kind") != "trained" or row.get("status") == "failed":
            continue
        lines = [str(w) for w in row.get("warnings", [])]
        codes = step0_codes(lines)
        if not codes:
            out.append((name, "ok"))
            continue
        seeds = {line.split(":", 1)[0] for line in lines if step0_codes([line])}
        out.append((name, f"! {', '.join(codes)} ({len(seeds)}/{len(row.get('seeds', []))})"))
    return out


#: where a benchmark's stats keep the per-template zero-shot numbers (``evaluate``'s
#: ``prompt_sensitivity``)
PROMPT_PREFIX = "prompt_sensitivity/templates/"


def prompt_sensitivity_markdown(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]], metric: str = "top1"
) -> str:
    """The prompt-sensitivity table: one row per benchmark row, one column per template (zero-shot
    ``metric`` with that template alone) and the ensemble, mean ± 95% interval in %; "" when no
    row has per-template numbers (the store has one template)."""
    names: list[str] = []
    for row in stats.values():
        for path in row:
            if path.startswith(PROMPT_PREFIX) and path.endswith(f"/{metric}"):
                name = path[len(PROMPT_PREFIX) : -len(metric) - 1]
                if name not in names:
                    names.append(name)
    if not names:
        return ""
    cols = [(name, f"{PROMPT_PREFIX}{name}/{metric}", "pct") for name in names]
    cols.append(("ensemble", f"prompt_sensitivity/ensemble/{metric}", "pct"))
    shown = {r: v for r, v in stats.items() if any(c[1] in v for c in cols)}
    lines = [
        "| row | " + " | ".join(c[0] for c in cols) + " |",
        "|" + "|".join(["---"] + ["---:"] * len(cols)) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in stats_table_rows(shown, cols)]
    return "\n".join(lines) + "\n"


# --- the headline table: the few metrics that apply to the data and differ between rows ------

#: the headline table's width (``curvalign demo`` and ``benchmark`` without ``--columns all``)
HEADLINE_WIDTH = 120
#: at most this many metric columns in a headline table (beside the gains)
HEADLINE_METRICS = 6
#: the headline's metrics, most wanted first; a column is shown only where it differs between rows
HEADLINE_PRIORITY = (
    "retrieval/t2i@1",
    "retrieval/i2t@1",
    "zeroshot/top1",
    "multilabel/mAP",
    "hierarchy/TIE",
    "compositional/overall",
    "hierarchy/J",
    "hierarchy/LCA",
    "hierarchy/PH",
    "hierarchy/sibling@5",
    "hierarchy/cousin@5",
    "entailment/taxonomy/AP",
    "ordering/text/chain",
    "ordering/image/chain",
    "retrieval/t2i@5",
    "retrieval/i2t@5",
    "zeroshot/top5",
    "zeroshot/mean_per_class",
    "hierarchy/RH",
    "entailment/taxonomy/AUROC",
    "entailment/chains/AP",
    "entailment/chains/AUROC",
)
#: shown beside LCA / PH in a headline table (never ranked themselves)
DEPTH_COLUMNS = ("hierarchy/leaf_rate", "hierarchy/pred_depth")


def column_split(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    rows: Sequence[str] | None = None,
    columns: Sequence[tuple[str, str, str]] | None = None,
) -> tuple[list[tuple[str, str, str]], list[tuple[tuple[str, str, str], str]]]:
    """(columns whose means differ between ``rows`` at the table's precision, [(column, its one
    value)] of those where every row with a number shows the same one). ``rows`` default every
    row but chance (a baseline that differs from everything); columns no row has are in
    neither list."""
    rows = [r for r in stats if r != CHANCE_ROW] if rows is None else list(rows)
    differ, constant = [], []
    for col in stats_columns(stats) if columns is None else columns:
        cells = {_stat_text(stats[r].get(col[1]), col[2]) for r in rows if r in stats}
        cells.discard("n/a")
        if len(cells) > 1:
            differ.append(col)
        elif cells:
            constant.append((col, cells.pop()))
    return differ, constant


def headline_columns(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    rows: Sequence[str] | None = None,
    limit: int = HEADLINE_METRICS,
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]], list[tuple[tuple, str]]]:
    """(headline columns, the other differing columns, [(constant column, value)]).

    The headline holds up to ``limit`` differing columns in ``HEADLINE_PRIORITY`` order, never
    a diagnostic one (leaf rate, depths, counts); where it holds LCA or PH, the leaf rate and
    predicted depth follow them when those differ (a verdict on LCA/PH is read with them)."""
    differ, constant = column_split(stats, rows)
    by_path = {c[1]: c for c in differ}
    ranked = [by_path[p] for p in HEADLINE_PRIORITY if p in by_path]
    shown = ranked[:limit]
    if any(c[1] in DEPTH_READ for c in shown):
        after = max(i for i, c in enumerate(shown) if c[1] in DEPTH_READ)
        shown[after + 1 : after + 1] = [by_path[p] for p in DEPTH_COLUMNS if p in by_path]
    more = [c for c in differ if c not in shown]
    return shown, more, constant


def constant_line(constant: Sequence[tuple[tuple[str, str, str], str]]) -> str:
    """ "constant for every row: Leaf 100.0, PredDepth 4.00" ("" when none)."""
    if not constant:
        return ""
    return "constant for every row: " + ", ".join(f"{c[0]} {v}" for c, v in constant)


def gain_cell(gain: Mapping[str, Any] | None) -> str:
    """ "+3.2±2.1 ▲" (percentage points, ▲ / ▼ where the interval excludes 0 in the row's favour
    / against it, = where it does not); "+3.2" without an interval (one seed); "" when absent."""
    if not gain:
        return ""
    mean = f"{100 * gain['mean']:+.1f}"
    low, high = gain.get("low"), gain.get("high")
    if low is None or high is None or not math.isfinite(low) or not math.isfinite(high):
        return mean
    mark = {True: "▲", False: "▼", None: "="}[gain.get("better")]
    return f"{mean}±{100 * (high - low) / 2:.1f} {mark}"


def gain_columns(
    gains: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> dict[str, list[tuple[str, str]]]:
    """{header: [(row, cell)]}: each trained row's mean R@1 gain over the alignment row and over
    its own step-0 row (``report.benchmark.gains_of``)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for header, key in (("ΔR@1 align", "alignment"), ("ΔR@1 step0", "step 0")):
        cells = [(row, gain_cell(g.get(key))) for row, g in gains.items() if g.get(key)]
        if cells:
            out[header] = cells
    return out


def markdown_headline_table(
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    columns: Sequence[tuple[str, str, str]],
    verdicts: Mapping[str, Mapping[str, Any]] | None = None,
    lead: Mapping[str, Sequence[tuple[str, str]]] | None = None,
    first: str = "row",
) -> str:
    """The headline columns as Markdown, ``lead`` columns (the gains) after the row name."""
    lead = lead or {}
    header = [first] + list(lead) + [c[0] for c in columns]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(lead) + len(columns))) + "|",
    ]
    for cells in stats_table_rows(stats, columns, verdicts):
        name = cells[0]
        more = [dict(values).get(name, "") for values in lead.values()]
        lines.append("| " + " | ".join([name] + more + cells[1:]) + " |")
    return "\n".join(lines) + "\n"


def mark_chance_columns(
    columns: Sequence[tuple[str, str, str]],
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    trained: Sequence[str],
) -> tuple[list[tuple[str, str, str]], str]:
    """``columns`` with "†" on the sibling/cousin recall headers where chance is above every
    trained row, and the note that says so ("" when none is)."""
    out, marked = [], []
    for header, path, kind in columns:
        if path in CHANCE_CHECKED and chance_above(stats, path, trained):
            marked.append(f"{header} {_stat_text(stats[CHANCE_ROW][path], kind)}")
            header += "†"
        out.append((header, path, kind))
    note = (
        "† chance is above every trained row (" + ", ".join(marked) + "): a random ranking "
        "finds more relatives on this taxonomy"
        if marked
        else ""
    )
    return out, note
