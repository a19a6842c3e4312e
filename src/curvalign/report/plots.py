"""PNG plots of evaluation results and training logs (matplotlib, Agg backend: no display needed).

Every function takes plain data (result dicts, arrays, log rows), writes one PNG and returns its
path; none of them trains or evaluates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from curvalign.report.tables import lookup  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grouped_bars(ax, names: Sequence[str], groups: Sequence[str], values: np.ndarray) -> None:
    """values [len(names), len(groups)]; NaN bars are left empty and labelled n/a."""
    width = 0.8 / max(1, len(names))
    x = np.arange(len(groups))
    for i, name in enumerate(names):
        v = values[i]
        bars = ax.bar(x + (i - (len(names) - 1) / 2) * width, np.nan_to_num(v), width, label=name)
        for bar, value in zip(bars, v, strict=False):
            if np.isnan(value):
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    0,
                    "n/a",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                )
    ax.set_xticks(x)
    ax.set_xticklabels(groups)


def _values(
    results: Mapping[str, Mapping[str, Any]], paths: Sequence[str], scale: float = 1.0
) -> np.ndarray:
    return np.array(
        [
            [np.nan if lookup(r, p) is None else scale * float(lookup(r, p)) for p in paths]
            for r in results.values()
        ],
        dtype=float,
    )


def retrieval_bars(results: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Grouped bars: Recall@{1,5,10} in both directions, one colour per recipe."""
    keys = ["t2i@1", "t2i@5", "t2i@10", "i2t@1", "i2t@5", "i2t@10"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 3.8))
    _grouped_bars(ax, list(results), keys, _values(results, [f"retrieval/{k}" for k in keys], 100))
    ax.set_ylabel("recall (%)")
    ax.set_title("Retrieval")
    ax.legend(fontsize=7, ncol=4)
    return _save(fig, path)


def hierarchy_bars(results: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """One panel per hierarchical metric (TIE, LCA lower is better; J, PH, RH higher), plus zero-shot."""
    panels = [
        ("hierarchy/TIE", "TIE (lower better)"),
        ("hierarchy/LCA", "LCA (lower better)"),
        ("hierarchy/J", "J"),
        ("hierarchy/PH", "PH"),
        ("hierarchy/RH", "RH"),
        ("zeroshot/top1", "zero-shot top-1"),
    ]
    names = list(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(2.4 * len(panels), 3.4))
    for ax, (p, title) in zip(axes, panels, strict=False):
        v = _values(results, [p])[:, 0]
        ax.bar(range(len(names)), np.nan_to_num(v), color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=60, fontsize=7)
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


def distance_histograms(
    distances: Mapping[str, Mapping[str, np.ndarray] | None], path: str | Path
) -> Path:
    """Distance to the origin per modality, one panel per recipe (recipes without an origin say n/a)."""
    names = list(distances)
    fig, axes = plt.subplots(
        1, max(1, len(names)), figsize=(3 * max(1, len(names)), 2.8), squeeze=False
    )
    for ax, name in zip(axes[0], names, strict=False):
        d = distances[name]
        if d is None:
            ax.text(0.5, 0.5, "n/a\n(no origin)", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            for modality, color in (("image", "C0"), ("text", "C1")):
                ax.hist(np.asarray(d[modality]), bins=30, alpha=0.6, color=color, label=modality)
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("distance to origin", fontsize=8)
    return _save(fig, path)


def spectra(spectra_by_name: Mapping[str, Mapping[str, np.ndarray]], path: str | Path) -> Path:
    """Log eigenvalue curves of each modality's embeddings (seed 001, Fig. 7)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, modality in zip(axes, ("image", "text"), strict=False):
        for i, (name, s) in enumerate(spectra_by_name.items()):
            values = np.asarray(s[modality], dtype=float)
            ax.plot(np.log10(np.maximum(values, 1e-12)), label=name, color=f"C{i}")
        ax.set_title(f"{modality} embedding spectrum")
        ax.set_xlabel("eigenvalue index")
        ax.set_ylabel("log10 eigenvalue")
    axes[1].legend(fontsize=7)
    return _save(fig, path)


def log_curves(
    logs: Mapping[str, list[dict[str, Any]]],
    keys: Sequence[str],
    path: str | Path,
    title: str | None = None,
    marks: Mapping[str, float] | None = None,
) -> Path:
    """One panel per logged key (e.g. curvature, routing weight, gate), one line per run.
    ``marks``: vertical lines {label: step} (e.g. the end of AGR's warm-up)."""
    ncols = min(4, max(1, len(keys)))
    nrows = max(1, -(-len(keys) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.8 * nrows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys, strict=False):
        for i, (name, rows) in enumerate(logs.items()):
            pts = [
                (r.get("step", j), r[key])
                for j, r in enumerate(rows)
                if isinstance(r.get(key), (int, float))
            ]
            if pts:
                ax.plot(*zip(*pts, strict=False), label=name, color=f"C{i}")
        for label, step in (marks or {}).items():
            ax.axvline(step, color="grey", linestyle="--", linewidth=0.8)
            ax.text(step, ax.get_ylim()[1], label, fontsize=6, rotation=90, va="top")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def line_plot(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> Path:
    """Simple lines: {label: values over x} (study sweeps)."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for i, (label, ys) in enumerate(series.items()):
        ax.plot(
            list(x),
            [np.nan if y is None else y for y in ys],
            marker="o",
            label=label,
            color=f"C{i}",
        )
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def heatmap(
    matrix: np.ndarray, path: str | Path, row_labels: Sequence[str], xlabel: str, title: str
) -> Path:
    """A rows x columns heat map (PHyCLIP factor activation per concept family)."""
    matrix = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(
        figsize=(max(4, 0.25 * matrix.shape[1] + 2), 0.4 * matrix.shape[0] + 1.5)
    )
    im = ax.imshow(matrix, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(row_labels)))
    ax.set_yticklabels(row_labels, fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax)
    return _save(fig, path)
