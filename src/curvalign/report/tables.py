"""Side-by-side tables of evaluation results: terminal (rich), Markdown and JSON.

Input everywhere: ``results`` = {row name (recipe or setting): ``curvalign.eval.evaluate`` dict}.
Cells missing from a result (a metric the data does not support, an ordering that does not apply
to the geometry) print as "n/a", never as a number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: (column header, path into the result dict, format: "pct" (x100, 1 decimal) or "num" (3 decimals))
DEFAULT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("T2I R@1", "retrieval/t2i@1", "pct"),
    ("T2I R@5", "retrieval/t2i@5", "pct"),
    ("I2T R@1", "retrieval/i2t@1", "pct"),
    ("I2T R@5", "retrieval/i2t@5", "pct"),
    ("ZS top1", "zeroshot/top1", "pct"),
    ("ZS top5", "zeroshot/top5", "pct"),
    ("TIE↓", "hierarchy/TIE", "num"),
    ("LCA↓", "hierarchy/LCA", "num"),
    ("J", "hierarchy/J", "num"),
    ("PH", "hierarchy/PH", "num"),
    ("RH", "hierarchy/RH", "num"),
    ("HardNeg", "compositional/overall", "pct"),
    ("Order txt", "ordering/text/chain", "pct"),
    ("Order img", "ordering/image/chain", "pct"),
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


def metrics_lines(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) lines of one evaluation, for ``curvalign eval`` without ``--json``."""
    out = []
    for group in ("retrieval", "zeroshot", "hierarchy", "compositional"):
        for key, value in (result.get(group) or {}).items():
            out.append((f"{group}/{key}", format_cell(value, "num")))
    ordering = result.get("ordering")
    if ordering is not None:
        for side in ("text", "image"):
            for key in ("chain", "pairs"):
                out.append(
                    (
                        f"ordering/{side}/{key}",
                        format_cell(lookup(ordering, f"{side}/{key}"), "num"),
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


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(to_jsonable(obj), indent=2) + "\n")
    tmp.replace(path)
    return path
