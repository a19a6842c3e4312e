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


def save_figure(fig, path: str | Path, layout: bool = True) -> Path:
    """Write ``fig`` to ``path`` (its folder made), close it; ``layout``: tight layout first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_save = save_figure  # what this module's plots call (tests intercept it here)


def row_colors(n: int) -> list[Any]:
    """``n`` colours, all different: matplotlib's ten-colour cycle repeats from the 11th row
    (17 rows of a benchmark gave seven pairs of look-alike bars); tab20 up to 20, then evenly
    spaced hues."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    if n <= 20:
        cmap = plt.get_cmap("tab20")
        # dark shades first, then their light partners: neighbours stay far apart
        order = list(range(0, 20, 2)) + list(range(1, 20, 2))
        return [cmap(order[i]) for i in range(n)]
    cmap = plt.get_cmap("hsv")
    return [cmap(i / n) for i in range(n)]


def _grouped_bars(
    ax,
    names: Sequence[str],
    groups: Sequence[str],
    values: np.ndarray,
    errors: np.ndarray | None = None,
) -> None:
    """values [len(names), len(groups)] (errors: 95% half-widths, same shape, NaN = none); NaN
    bars are left empty and labelled n/a."""
    width = 0.8 / max(1, len(names))
    x = np.arange(len(groups))
    colors = row_colors(len(names))
    for i, name in enumerate(names):
        v = values[i]
        err = None if errors is None else np.nan_to_num(errors[i])
        bars = ax.bar(
            x + (i - (len(names) - 1) / 2) * width,
            np.nan_to_num(v),
            width,
            label=name,
            color=colors[i],
            yerr=err,
            capsize=1.5 if err is not None else 0,
            error_kw={"linewidth": 0.7},
        )
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


def _errors(
    names: Sequence[str],
    paths: Sequence[str],
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]] | None,
    scale: float = 1.0,
) -> np.ndarray | None:
    """95% half-widths [len(names), len(paths)] from a benchmark's ``stats`` (NaN where none)."""
    if not stats:
        return None
    out = np.full((len(names), len(paths)), np.nan)
    for i, name in enumerate(names):
        for j, path in enumerate(paths):
            st = (stats.get(name) or {}).get(path)
            if st and st.get("n", 1) >= 2 and st.get("low") is not None:
                out[i, j] = scale * (st["high"] - st["low"]) / 2
    return out


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


def retrieval_bars(
    results: Mapping[str, Mapping[str, Any]],
    path: str | Path,
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> Path:
    """Grouped bars: Recall@{1,5,10} in both directions (%), one colour per row (recipes and
    baselines), 95% intervals over seeds as error bars; the legend sits outside the axes so that
    it never covers a bar."""
    keys = ["t2i@1", "t2i@5", "t2i@10", "i2t@1", "i2t@5", "i2t@10"]
    paths = [f"retrieval/{k}" for k in keys]
    names = list(results)
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(keys)) + 2.2, 3.8))
    _grouped_bars(ax, names, keys, _values(results, paths, 100), _errors(names, paths, stats, 100))
    ax.set_ylabel("recall (%)")
    ax.set_title("Retrieval (mean ± 95% interval over seeds)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return _save(fig, path)


#: what the hierarchical metrics mean, printed under hierarchy.png
HIERARCHY_CAPTION = (
    "A(n) = ancestors of node n up to the root. TIE: tree edges between prediction and truth; "
    "LCA: edges from the prediction up to the lowest common ancestor (both lower is better). "
    "J = |A(pred) ∩ A(true)| / |A(pred) ∪ A(true)| (Jaccard); PH = |∩| / |A(pred)| "
    "(hierarchical precision); RH = |∩| / |A(true)| (hierarchical recall)."
)


def hierarchy_bars(
    results: Mapping[str, Mapping[str, Any]],
    path: str | Path,
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> Path:
    """One panel per hierarchical metric (TIE, LCA in tree edges, lower is better; J, PH, RH and
    zero-shot top-1 in %, higher is better), a caption that defines them, error bars over seeds."""
    panels = [
        ("hierarchy/TIE", "TIE, edges (lower better)", 1.0),
        ("hierarchy/LCA", "LCA, edges (lower better)", 1.0),
        ("hierarchy/J", "J: Jaccard (%)", 100.0),
        ("hierarchy/PH", "PH: hier. precision (%)", 100.0),
        ("hierarchy/RH", "RH: hier. recall (%)", 100.0),
        ("zeroshot/top1", "zero-shot top-1 (%)", 100.0),
    ]
    names = list(results)
    # horizontal bars, one row per name on a shared y axis: names are written once, level, one
    # per row (rotated x labels under six narrow panels overlapped with many rows)
    height = max(2.6, 0.24 * len(names) + 1.4)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(2.3 * len(panels) + 1.2, height + 0.9), sharey=True
    )
    colors = row_colors(len(names))
    rows = np.arange(len(names))
    for ax, (p, title, scale) in zip(axes, panels, strict=False):
        v = _values(results, [p], scale)[:, 0]
        err = _errors(names, [p], stats, scale)
        ax.barh(
            rows,
            np.nan_to_num(v),
            color=colors,
            xerr=None if err is None else np.nan_to_num(err[:, 0]),
            capsize=2,
        )
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].set_yticks(rows)
    axes[0].set_yticklabels(names, fontsize=7)
    axes[0].invert_yaxis()  # first row on top, as in the table
    fig.text(0.5, 0.01, HIERARCHY_CAPTION, ha="center", va="bottom", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.9 / (height + 0.9), 1, 1))
    return _save(fig, path, layout=False)


def distance_histograms(
    distances: Mapping[str, Mapping[str, np.ndarray] | None], path: str | Path, ncols: int = 4
) -> Path:
    """Distance to the origin per modality, one panel per recipe in a grid of at most ``ncols``
    columns (readable when scaled down); recipes without an origin say n/a."""
    names = list(distances)
    n = max(1, len(names))
    cols = min(ncols, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names, strict=False):
        d = distances[name]
        if d is None:
            ax.text(0.5, 0.5, "n/a\n(no origin)", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            # shared bins, light fills under full outlines: neither modality hides the other
            # (filled bars drawn text-last covered the image histogram wherever they overlapped)
            both = np.concatenate([np.asarray(d["image"]), np.asarray(d["text"])])
            bins = np.histogram_bin_edges(both[np.isfinite(both)], bins=30)
            for modality, color in (("image", "C0"), ("text", "C1")):
                values = np.asarray(d[modality])
                ax.hist(values, bins=bins, color=color, alpha=0.2, histtype="stepfilled")
                ax.hist(values, bins=bins, color=color, histtype="step", linewidth=1.4,
                        label=modality, zorder=3)  # fmt: skip
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("distance to origin", fontsize=8)
    return _save(fig, path)


def spectra(spectra_by_name: Mapping[str, Mapping[str, np.ndarray]], path: str | Path) -> Path:
    """Log eigenvalue curves of each modality's embeddings (seed 001, Fig. 7).

    Eigenvalues below ``SPECTRUM_FLOOR`` times a curve's largest are numerical zeros (an
    embedding of rank r in d > r dimensions): they are not drawn and the x axis ends at the
    last eigenvalue above the floor, so the axis shows the spectrum, not a flat line of zeros."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colors = row_colors(len(spectra_by_name))
    for ax, modality in zip(axes, ("image", "text"), strict=False):
        last, dims = 1, 0
        for i, (name, s) in enumerate(spectra_by_name.items()):
            values = np.sort(np.asarray(s[modality], dtype=float))[::-1]
            dims = max(dims, len(values))
            top = values.max(initial=0.0)
            kept = values[values > SPECTRUM_FLOOR * top] if top > 0 else values[:0]
            last = max(last, len(kept))
            ax.plot(np.arange(1, len(kept) + 1), np.log10(kept), label=name, color=colors[i])
        ax.set_xlim(0.5, last + 0.5)
        cut = f" ({dims - last} of {dims} below the floor)" if dims > last else ""
        ax.set_title(f"{modality} embedding spectrum{cut}", fontsize=9)
        ax.set_xlabel("eigenvalue rank")
        ax.set_ylabel("log10 eigenvalue")
    axes[1].legend(fontsize=7)
    return _save(fig, path)


#: eigenvalues below this fraction of a spectrum's largest are numerical zeros (not drawn)
SPECTRUM_FLOOR = 1e-7


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
        for (name, rows), color in zip(logs.items(), row_colors(len(logs)), strict=True):
            pts = [
                (r.get("step", j), r[key])
                for j, r in enumerate(rows)
                if isinstance(r.get(key), (int, float))
            ]
            if pts:
                ax.plot(*zip(*pts, strict=False), label=name, color=color)
        for label, step in (marks or {}).items():
            ax.axvline(step, color="grey", linestyle="--", linewidth=0.8)
            # in axes-height coordinates, left of the line, inside the panel: never clipped
            ax.text(
                step,
                0.97,
                label,
                transform=ax.get_xaxis_transform(),
                fontsize=6,
                rotation=90,
                va="top",
                ha="right",
            )
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if ax.get_legend_handles_labels()[0]:  # every panel names its lines
            ax.legend(fontsize=6)
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
