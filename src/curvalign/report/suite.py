"""A suite: one run (or several) evaluated on every feature store in a folder, one long table.

``curvalign eval RUN --suite DIR`` evaluates the run on each store directly under ``DIR`` (one
per dataset: a ``curvalign extract`` output, e.g. from a CLIP_benchmark webdataset root or a
SugarCrepe folder) and writes ``suite.csv`` and ``suite.md``: one row per (dataset, task,
metric) with the columns of a ``clip_benchmark build`` CSV, in long form::

    dataset, model, pretrained, task, language, metric, value, protocol, reported

and ``suite_wide.csv``, the same numbers in exactly ``clip_benchmark build``'s wide shape (one
row per dataset and task, one column per metric, plus ``model_fullname``), so a user can
concatenate it with their CLIP_benchmark results. Names follow CLIP_benchmark:

* dataset: the store's folder name; ``wds_NAME`` is written ``wds/NAME`` (CLIP_benchmark's
  spelling of its webdataset sets); SugarCrepe kinds are ``sugar_crepe/KIND``;
* tasks and metrics: ``zeroshot_retrieval`` (``image_retrieval_recall@K`` = text->image,
  ``text_retrieval_recall@K`` = image->text), ``zeroshot_classification`` (``acc1``,
  ``acc5``, ``mean_per_class_recall``), ``image_caption_selection`` (``acc``: the true
  caption beats the negative);
  curvalign's own tasks keep their names (``hierarchical_classification``: TIE, LCA, J, PH, RH,
  the prediction depths and sibling/cousin recall; ``multilabel_classification``: mAP;
  ``entailment``: AP and AUROC, dataset ``NAME/taxonomy`` or ``NAME/chains``).
* model: the recipe; pretrained: the run directory; language: ``en``.

Every number is ranked with the recipe's own score (``curvalign.eval.evaluate``), unlike
CLIP_benchmark, which ranks with cosine. ``reported`` marks the Recall@K the recipe's paper
shows (``Recipe.reported_recall_ks``); the Markdown table shows only those, the CSVs keep all.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from curvalign.data.protocols import PROTOCOLS, get_protocol, protocol_store
from curvalign.errors import CurvalignError
from curvalign.eval.result import EvaluationResult

if TYPE_CHECKING:
    from curvalign.data.features import FeatureStore
    from curvalign.recipes.base import Recipe

LONG_COLUMNS = (
    "dataset",
    "model",
    "pretrained",
    "task",
    "language",
    "metric",
    "value",
    "protocol",
    "reported",
)


@dataclass
class SuiteResult:
    rows: list[dict[str, Any]]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (dataset, reason)
    files: dict[str, Path] = field(default_factory=dict)
    #: dataset -> what its encoders were trained on (``data.encoders.disclosure_note``)
    disclosures: dict[str, str] = field(default_factory=dict)


class SuiteError(CurvalignError, ValueError):
    """A suite folder without stores, or a store that cannot be evaluated at all."""


def suite_stores(folder: str | Path) -> list[tuple[str, Path]]:
    """(dataset name, store path) of every feature store directly under ``folder``, by name."""
    root = Path(folder)
    if not root.is_dir():
        raise SuiteError(f"suite folder {root}: no such directory")
    stores = sorted(p for p in root.iterdir() if (p / "meta.json").is_file())
    if not stores:
        raise SuiteError(
            f"suite folder {root}: no feature store in it (expected one sub-folder per dataset, "
            "each written by `curvalign extract`)"
        )
    return [(dataset_name(p.name), p) for p in stores]


def suite_skipped_folders(folder: str | Path) -> list[tuple[str, str]]:
    """(sub-folder name, reason) of every sub-folder of ``folder`` that holds no feature store
    (``suite_stores`` passes them by): said in the suite's output, never skipped in silence."""
    root = Path(folder)
    skipped = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.name.startswith(".") or not path.is_dir() or (path / "meta.json").is_file():
            continue
        inside = "it is empty" if not any(path.iterdir()) else "it holds no meta.json"
        skipped.append(
            (path.name, f"not a feature store ({inside}; write one with `curvalign extract`)")
        )
    return skipped


def dataset_name(folder: str) -> str:
    """CLIP_benchmark's spelling: ``wds_cifar10`` -> ``wds/cifar10``."""
    return "wds/" + folder[4:] if folder.startswith("wds_") else folder


def _pick_split(store: FeatureStore, split: str) -> str:
    names = store.split_names
    if names is None or split in names:
        return split
    if len(names) == 1:
        return names[0]
    raise SuiteError(f"no split {split!r} (it has {', '.join(names)}); pass --split")


def result_rows(
    result: EvaluationResult,
    dataset: str,
    model: str,
    pretrained: str,
    reported_ks: Sequence[int],
    tasks: Sequence[str] | None = None,
    protocol: str = "",
) -> list[dict[str, Any]]:
    """Long rows of one ``evaluate`` result; ``tasks`` limits them (None: every task present)."""
    rows: list[dict[str, Any]] = []

    def add(task: str, metric: str, value: Any, name: str = dataset, reported: bool = True):
        if tasks is not None and task not in tasks:
            return
        rows.append(
            {
                "dataset": name,
                "model": model,
                "pretrained": pretrained,
                "task": task,
                "language": "en",
                "metric": metric,
                "value": float(value),
                "protocol": protocol,
                "reported": reported,
            }
        )

    for key, value in result.retrieval.items():
        direction, k = key.split("@")
        metric = "image_retrieval_recall" if direction == "t2i" else "text_retrieval_recall"
        add("zeroshot_retrieval", f"{metric}@{k}", value, reported=int(k) in reported_ks)
    if result.zeroshot is not None:
        add("zeroshot_classification", "acc1", result.zeroshot.top1)
        add("zeroshot_classification", "acc5", result.zeroshot.top5)
        add("zeroshot_classification", "mean_per_class_recall", result.zeroshot.mean_per_class)
    for metric, value in (result.hierarchy or {}).items():
        add("hierarchical_classification", metric, value)
    if result.multilabel is not None and "mAP" in result.multilabel:
        add("multilabel_classification", "mAP", result.multilabel["mAP"])
    entailment = result.entailment
    sources = (
        {} if entailment is None else {"taxonomy": entailment.taxonomy, "chains": entailment.chains}
    )
    for source, metrics in sources.items():
        if metrics is not None:
            for metric in ("AP", "AUROC"):
                add("entailment", metric, metrics[metric], name=f"{dataset}/{source}")
    for kind, value in (result.compositional or {}).items():
        name = dataset if kind == "overall" else f"{dataset}/{kind}"
        add("image_caption_selection", "acc", value, name=name)
    return rows


def _store_protocol(store: FeatureStore, wanted: str | None) -> str | None:
    name = wanted or store.meta.get("protocol")
    if name is not None and name not in PROTOCOLS:
        raise SuiteError(f"unknown retrieval protocol {name!r}; known: {', '.join(PROTOCOLS)}")
    return name


def evaluate_on_suite(
    recipe: Recipe,
    folder: str | Path,
    model: str,
    pretrained: str,
    split: str = "test",
    batch_size: int = 1024,
    notify: Callable[[str], None] | None = None,
) -> SuiteResult:
    """Rows for ``recipe`` on every store of ``folder``; a store that cannot be evaluated
    (dimensions of another encoder, no such split) is a listed skip, not the end of the suite."""
    from curvalign.data.features import FeatureStore
    from curvalign.eval import evaluate
    from curvalign.eval.pipeline import check_inputs

    notify = notify or (lambda message: None)
    out = SuiteResult(rows=[])
    stores = suite_stores(folder)
    for name, reason in suite_skipped_folders(folder):
        out.skipped.append((name, reason))
        notify(f"suite: skipped {name}: {reason}")
    for dataset, path in stores:
        try:
            store = FeatureStore.load(path, mmap=True)
            check_inputs(recipe, store)  # another encoder's features (or no tokens): a skip
            protocol = _store_protocol(store, None)
            used = _pick_split(store, split)
            if protocol is not None:
                store = protocol_store(store, get_protocol(protocol), used)
                used = "test"
            notify(f"suite: {dataset} ({store.num_images} images, split {used})")
            result = evaluate(recipe, store, split=used, batch_size=batch_size, diagnostics=False)
        except CurvalignError as exc:
            out.skipped.append((dataset, str(exc)))
            notify(f"suite: skipped {dataset}: {exc}")
            continue
        tasks = store.meta.get("tasks")
        rows = result_rows(
            result,
            dataset,
            model,
            pretrained,
            getattr(recipe, "reported_recall_ks", (1, 5, 10)),
            tasks=tasks,
            protocol=PROTOCOLS[protocol].title if protocol else "",
        )
        _disclose(out, dataset, store.meta, rows)
        out.rows.extend(rows)
    return out


def _disclose(out: SuiteResult, dataset: str, meta: dict[str, Any], rows: list[dict]) -> None:
    """Mark ``rows`` whose store's encoders saw its data or classes in training (not zero-shot,
    MTEB's disclosure) and keep the store's one-line disclosure for the table's notes."""
    from curvalign.data.encoders import disclosure_note

    seen = bool((meta.get("seen_in_training") or {}).get("any"))
    for row in rows:
        row["seen_in_training"] = seen
    note = disclosure_note(meta)
    if note:
        out.disclosures[dataset] = note


def evaluate_runs_on_suite(
    run_dirs: Sequence[str | Path],
    folder: str | Path,
    split: str = "test",
    batch_size: int = 1024,
    notify: Callable[[str], None] | None = None,
) -> SuiteResult:
    """``evaluate_on_suite`` for each run (its best weights; model = its recipe, pretrained = its
    folder), one table; a skip is named with the run's recipe."""
    from curvalign.runs import load_run

    total = SuiteResult(rows=[])
    for run_dir in run_dirs:
        run = load_run(run_dir)
        part = evaluate_on_suite(
            run.recipe,
            folder,
            model=run.config.recipe,
            pretrained=str(run_dir),
            split=split,
            batch_size=batch_size,
            notify=notify,
        )
        total.rows += part.rows
        total.skipped += [(f"{d} ({run.config.recipe})", r) for d, r in part.skipped]
    return total


def write_suite(result: SuiteResult, out_dir: str | Path) -> dict[str, Path]:
    """``suite.csv`` (long), ``suite_wide.csv`` (clip_benchmark build shape), ``suite.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    long_path, wide_path, md_path = out / "suite.csv", out / "suite_wide.csv", out / "suite.md"
    _write_csv(long_path, list(LONG_COLUMNS), result.rows)
    wide: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    metrics: list[str] = []
    for row in result.rows:
        key = (row["dataset"], row["model"], row["pretrained"], row["task"])
        entry = wide.setdefault(
            key,
            {
                "dataset": row["dataset"],
                "model": row["model"],
                "pretrained": row["pretrained"],
                "task": row["task"],
                "language": row["language"],
                "model_fullname": f"{row['model']} {row['pretrained']}",
            },
        )
        entry[row["metric"]] = row["value"]
        if row["metric"] not in metrics:
            metrics.append(row["metric"])
    head = ["dataset", "model", "pretrained", "task", "language", "model_fullname"]
    _write_csv(wide_path, head + metrics, list(wide.values()))
    md_path.write_text(suite_markdown(result))
    result.files = {"csv": long_path, "wide_csv": wide_path, "markdown": md_path}
    return result.files


def _write_csv(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    tmp.replace(path)


def suite_markdown(result: SuiteResult) -> str:
    """The reported rows as a Markdown table (each value with its unit: % for fractions, tree
    edges for TIE/LCA), then the skipped stores and sub-folders with their reasons."""
    lines = [
        "| dataset | model | task | metric | value | unit | protocol |",
        "| --- | --- | --- | --- | ---: | --- | --- |",
    ]
    for row in result.rows:
        if not row["reported"]:
            continue
        value, unit = metric_value_and_unit(row["metric"], row["value"])
        dataset = f"{row['dataset']} †" if row.get("seen_in_training") else row["dataset"]
        lines.append(
            f"| {dataset} | {row['model']} | {row['task']} | {row['metric']} | "
            f"{value} | {unit} | {row['protocol'] or '-'} |"
        )
    if result.disclosures:
        lines += ["", "Encoders († = not zero-shot: they saw the data or its classes):", ""]
        lines += [f"- {d}: {note}" for d, note in result.disclosures.items()]
    if result.skipped:
        lines += ["", "Skipped:", ""] + [f"- {d}: {reason}" for d, reason in result.skipped]
    return "\n".join(lines) + "\n"


def metric_value_and_unit(metric: str, value: float) -> tuple[str, str]:
    """A suite value as printed and its unit: fractions in %, TIE/LCA in tree edges."""
    if _is_fraction(metric):
        return f"{100 * value:.1f}", "%"
    return f"{value:.3f}", "tree edges"


def _is_fraction(metric: str) -> bool:
    # hierarchical TIE/LCA are distances, not fractions
    return not re.fullmatch(r"TIE|LCA|pred_depth|true_depth", metric)


__all__ = [
    "LONG_COLUMNS",
    "SuiteError",
    "SuiteResult",
    "dataset_name",
    "evaluate_on_suite",
    "evaluate_runs_on_suite",
    "result_rows",
    "metric_value_and_unit",
    "suite_markdown",
    "suite_skipped_folders",
    "suite_stores",
    "write_suite",
]
