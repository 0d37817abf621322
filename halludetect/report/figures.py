"""Figures of a grid cell, as PNGs and as the data DVC plots draw (long-format CSVs).

  auroc_by_layer     test AUROC of every method by layer in one chart, the best layer (chosen
                     on validation) starred
  roc                ROC curves at each method's best layer (seed-mean TPR at a fixed FPR grid)
  scores             score distributions per class, one panel per method
  responses          answer length and P_sem by class, per split (the paper's appendix figures)
  sensitivity_<m>    C_B^int and P_sem C_B^int by class, per split, for an analysed HaMI detector
                     (drawn by the analyze stage)
  margins_by_epoch   the train and validation margins mean(y z) after every epoch at each
                     method's best layer, mean over seeds: the paper's Theorem 1 (training expands
                     them) and its claim that max pooling expands them faster than mean pooling
  selection          each method choosing among a question's n answers (the lowest score) and
                     abstaining on the questions its choice scores highest: accuracy of the
                     answered ones by coverage, beside one sample and the oracle
                     (evaluation/selection.py; `halludetect serve`'s select)

PNGs are drawn with matplotlib's object API on the Agg canvas (no display, no global pyplot
state) and written atomically without the Software/date metadata, so the same data gives the same
bytes. CSVs have a `series` column (a method or a class) and its `colour` for the DVC templates in
.dvc/plots/; a method, baseline or class has one colour in every PNG and on the plots page
(evaluation/plot_data.py's map).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from halludetect.core.atomic_io import atomic_path
from halludetect.evaluation.plot_data import (
    CLASS_COLOURS,
    CLASSES,
    bin_edges,
    method_colour,
    series_colour,
    with_colours,
)
from halludetect.metrics import roc_points

FPR_GRID = np.linspace(0.0, 1.0, 101)
DPI = 110


def save_png(fig: Figure, path: str | Path) -> None:
    """Atomically, without metadata that changes from run to run."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})


def save_csv(frame: pl.DataFrame, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        frame.write_csv(tmp, float_precision=6)


def _grid(n: int, cols: int, size=(4.2, 3.2)) -> tuple[Figure, list]:
    rows = -(-n // cols)
    cols = min(cols, n)
    fig = Figure(figsize=(size[0] * cols, size[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, list(axes[:n])


# ----------------------------------------------------------------------------- AUROC by layer
def auroc_by_layer_data(layers: dict[str, list[dict]]) -> pl.DataFrame:
    """{method: evaluate's `layers` list} -> long frame: layer, series, test_auroc, val_auroc, colour."""
    return with_colours(
        pl.DataFrame(
            [
                {"layer": r["layer"], "series": m, "test_auroc": r["test_auroc"], "val_auroc": r["val_auroc"]}
                for m, rows in layers.items()
                for r in rows
            ]
        )
    )


def auroc_by_layer(layers: dict[str, list[dict]], best: dict[str, int], title: str) -> Figure:
    fig = Figure(figsize=(7.5, 4.6), layout="constrained")
    ax = fig.subplots()
    for method, rows in layers.items():
        color = method_colour(method)
        x = [r["layer"] for r in rows]
        y = [r["test_auroc"] for r in rows]
        ax.plot(x, y, marker="o", ms=4, lw=1.6, color=color, label=method)
        if method in best:
            b = next(r for r in rows if r["layer"] == best[method])
            ax.plot([b["layer"]], [b["test_auroc"]], marker="*", ms=14, color=color, mec="black", mew=0.6)
    ax.set(xlabel="layer (0 = embeddings)", ylabel="test AUROC", title=title)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(
        title="★ best layer on validation",
        fontsize=8,
        title_fontsize=8,
        loc="center left",
        bbox_to_anchor=(1.01, 0.5),
        frameon=False,
    )
    return fig


# ------------------------------------------------------------------------------------ ROC
def mean_roc(y: np.ndarray, scores: list[np.ndarray]) -> np.ndarray:
    """TPR at FPR_GRID, averaged over seeds (vertical averaging)."""
    tprs = []
    for s in scores:
        fpr, tpr = roc_points(y, s)
        tprs.append(np.interp(FPR_GRID, np.r_[0.0, fpr], np.r_[0.0, tpr]))  # the curve starts at (0, 0)
    out = np.mean(tprs, 0)
    out[0] = 0.0
    return out


def roc_data(curves: dict[str, tuple[np.ndarray, list[np.ndarray]]]) -> pl.DataFrame:
    """{method: (y, per-seed scores)} -> long frame: fpr, series, tpr, colour."""
    return with_colours(
        pl.concat([pl.DataFrame({"fpr": FPR_GRID, "series": m, "tpr": mean_roc(y, s)}) for m, (y, s) in curves.items()])
    )


def roc(curves: dict[str, tuple[np.ndarray, list[np.ndarray]]], aurocs: dict[str, str], title: str) -> Figure:
    fig = Figure(figsize=(6.6, 5.4), layout="constrained")
    ax = fig.subplots()
    for method, (y, scores) in curves.items():
        label = f"{method} ({aurocs.get(method, '')})"
        ax.plot(FPR_GRID, mean_roc(y, scores), lw=1.6, color=method_colour(method), label=label)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
    ax.set(
        xlabel="false-positive rate (correct answers flagged)",
        ylabel="true-positive rate (hallucinations caught)",
        title=title,
        xlim=(0, 1),
        ylim=(0, 1.01),
        aspect="equal",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right", title="test AUROC, mean over seeds", title_fontsize=7.5)
    return fig


# ----------------------------------------------------------------------------- choosing by the score
def selection_data(curves: dict[str, np.ndarray], coverages: np.ndarray) -> pl.DataFrame:
    """{method: accuracy at each coverage} -> long frame: coverage, series, accuracy, colour."""
    if not curves:
        schema = {"coverage": pl.Float64, "series": pl.String, "accuracy": pl.Float64}
        return with_colours(pl.DataFrame(schema=schema))
    return with_colours(
        pl.concat([pl.DataFrame({"coverage": coverages, "series": m, "accuracy": acc}) for m, acc in curves.items()])
    )


def selection(
    curves: dict[str, np.ndarray], coverages: np.ndarray, one: float, oracle: float, n: int, title: str
) -> Figure:
    fig = Figure(figsize=(8.6, 5.0), layout="constrained")
    ax = fig.subplots()
    for method, acc in curves.items():
        ax.plot(coverages, acc, lw=1.6, color=method_colour(method), label=method)
    ax.axhline(one, color="black", lw=1.0, ls="--", label=f"one sample ({one:.3f})")
    ax.axhline(oracle, color="grey", lw=1.0, ls=":", label=f"oracle: any of the {n} right ({oracle:.3f})")
    ax.set(
        xlabel="coverage (share of questions answered, lowest-scored first)",
        ylabel=f"accuracy of the answered (best of {n} by the score)",
        title=title,
        xlim=(0, 1.0),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside: the curves fill the axes
    return fig


# ----------------------------------------------------------------------------- per class
def class_panels(
    panels: dict[str, tuple[np.ndarray, np.ndarray]],
    title: str,
    xlabel: dict[str, str] | None = None,
    cols: int = 3,
    bins: int = 40,
    discrete: tuple[str, ...] = (),
    counted: str = "n",
) -> Figure:
    """One histogram panel per entry {panel title: (values, labels)}, both classes overlaid, with
    each class's mean as a dashed line (the paper's E_neg and E_pos). `counted` names what the
    legend counts (e.g. responses x seeds where seeds are pooled)."""
    fig, axes = _grid(len(panels), cols)
    for ax, (name, (values, y)) in zip(axes, panels.items()):
        edges = bin_edges(values, bins, name in discrete)
        for cls, label in CLASSES:
            color = CLASS_COLOURS[label]
            sel = y == label
            if not sel.any():
                continue
            ax.hist(
                values[sel],
                bins=edges,
                density=True,
                alpha=0.45,
                color=color,
                label=f"{cls}, {counted} {int(sel.sum()):,}, mean {np.mean(values[sel]):.3g}",
            )
            ax.axvline(np.mean(values[sel]), color=color, ls="--", lw=1.2)
        ax.set(title=name, xlabel=(xlabel or {}).get(name, "value"), ylabel="density")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig


def sensitivity(rows: pl.DataFrame, title: str) -> Figure:
    """C_B^int and P_sem C_B^int per class, one pair of panels per split (train, then test):
    the paper's appendix figures. `rows`: the analysis rows of one layer (all seeds pooled)."""
    panels = {}
    for split in rows["split"].unique().sort(descending=True).to_list():  # train, then test
        r = rows.filter(pl.col("split") == split)
        y = r["label"].to_numpy()
        panels[f"C_B^int ({split})"] = (r["c_int"].to_numpy(), y)
        panels[f"P_sem C_B^int ({split})"] = ((r["p_sem"] * r["c_int"]).to_numpy(), y)
    return class_panels(panels, title, {k: k.split(" (")[0] for k in panels}, cols=2, counted="responses x seeds")


# ------------------------------------------------------------------------- margins by epoch
# Panels of methods whose logits share a scale (the paper compares margins within a family only).
MARGIN_FAMILIES = (("embedding-based", ("mean", "max")), ("instance-based", ("hami", "hami_sp")))


def margins_by_epoch_data(curves: dict[str, dict[str, list[float]]]) -> pl.DataFrame:
    """{method: {"train": [...], "val": [...]}} (evaluate's margin_by_epoch) -> long frame:
    epoch, series (method, split), margin, colour (the method's; lightened for validation)."""
    return with_colours(
        pl.DataFrame(
            [
                {"epoch": i + 1, "series": f"{m} ({split})", "margin": v}
                for m, by in curves.items()
                for split, values in by.items()
                for i, v in enumerate(values)
            ],
            schema={"epoch": pl.Int64, "series": pl.String, "margin": pl.Float64},
        )
    )


def margins_by_epoch(curves: dict[str, dict[str, list[float]]], best: dict[str, int], title: str) -> Figure:
    """One panel per family present, per method the train margin solid in its colour and the
    validation margin dashed in its colour lightened (the plots page's colours of both series)."""
    panels = [(name, [m for m in methods if m in curves]) for name, methods in MARGIN_FAMILIES]
    panels = [(name, ms) for name, ms in panels if ms]
    if not panels:  # the file is a declared output: say why it is empty
        fig = Figure(figsize=(6, 2), layout="constrained")
        fig.subplots().text(0.5, 0.5, "no mean, max, hami or hami_sp in the grid", ha="center", va="center")
        fig.suptitle(title)
        return fig
    fig, axes = _grid(len(panels), 2, size=(5.2, 3.8))
    for ax, (name, methods) in zip(axes, panels):
        for m in methods:
            for split, ls in (("train", "-"), ("val", "--")):
                y = curves[m][split]
                label = f"{m} (layer {best[m]}), {split}: {y[0]:.2f} → {y[-1]:.2f}"
                ax.plot(range(1, len(y) + 1), y, ls=ls, lw=1.5, color=series_colour(f"{m} ({split})"), label=label)
        ax.set(title=name, xlabel="epoch", ylabel="margin mean(y z), logit space")
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    return fig
