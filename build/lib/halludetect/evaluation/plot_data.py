"""The data DVC plots draw: long-format frames with a `series` column (a class or a method) and
its `colour`, for the templates in .dvc/plots/. No plotting library needed here, so the stages
that only write plot data never import matplotlib.

One colour per method, baseline and class, in one place: the PNGs (report/figures.py,
report/evidence_figures.py) draw with these maps, and so does the plots page. The method series'
plot data carry their colour in a `colour` column, which the `series` templates of .dvc/plots/
take as the colour scale's range (`"range": {"field": "colour"}`), so the page and the PNGs agree
whatever subset of methods a grid has; a series' colour must be unique within a chart (the page
pairs the distinct series with the distinct colours): a method's validation curve is its colour
lightened. The class panels (`panels` template, faceted: a data-driven range conflicts across
facets) name the two classes' colours in the template, checked against CLASS_COLOURS by
tests/test_plots_page.py.
"""

from __future__ import annotations

import hashlib

import numpy as np
import polars as pl

# The classes as every figure and plot names them (the paper's neg = correct, pos = hallucinated).
CLASSES = (("correct (neg)", 0), ("hallucinated (pos)", 1))
CLASS_COLOURS = {0: "#1f77b4", 1: "#d62728"}  # correct blue, hallucinated red

# Detectors in strong colours (tab10 and tab20b's dark shades), baselines in dark, grey or pale
# ones; every registered method and baseline has one (tests/evaluation/test_plot_data.py).
METHOD_COLOURS = {
    "hami": "#1f77b4",
    "hami_sp": "#d62728",
    "mean": "#ff7f0e",
    "max": "#2ca02c",
    "raw_mean": "#8c6d31",
    "raw_max": "#637939",
    "attention": "#9467bd",
    "gated_attention": "#e377c2",
    "eigenscore": "#8c564b",
    "probe": "#17becf",
    "saplma": "#bcbd22",
    "sep_tbg": "#393b79",
    "sep_slt": "#7b4173",
    "p_sem": "#7f7f7f",
    "semantic_entropy": "#843c39",
    "logprob": "#000000",
    "length": "#bdbdbd",
    "lexical_similarity": "#9c9ede",
    "semantic_sets": "#e7969c",
    "p_true": "#b5cf6b",
}
SPLIT_TINT = {"train": 0.0, "val": 0.55}  # a curve's split: how far its method's colour goes toward white


def _tint(colour: str, amount: float) -> str:
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(v + (255 - v) * amount):02x}" for v in rgb)


# Colours for the methods METHOD_COLOURS does not list (a user's plugin): none of the listed ones,
# each picked by a stable digest of the method's name, so a plugin has the same colour in every
# figure, on the page and in every run (Python's own hash() changes between processes).
PLUGIN_COLOURS = ("#5254a3", "#6b6ecf", "#8ca252", "#bd9e39", "#e7ba52", "#ad494a", "#a55194", "#ce6dbd", "#de9ed6")


def method_colour(method: str) -> str:
    if method in METHOD_COLOURS:
        return METHOD_COLOURS[method]
    digest = int(hashlib.sha256(method.encode()).hexdigest(), 16)
    return PLUGIN_COLOURS[digest % len(PLUGIN_COLOURS)]


def series_colour(series: str) -> str:
    """The colour of a plot series: a class name, a method or baseline, or `<method> (<split>)`."""
    for name, label in CLASSES:
        if series == name:
            return CLASS_COLOURS[label]
    method, _, split = series.partition(" (")
    if split[:-1] in SPLIT_TINT and split.endswith(")"):
        return _tint(method_colour(method), SPLIT_TINT[split[:-1]])
    return method_colour(series)


def with_colours(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with each row's series colour in a `colour` column (the page's colour scale reads it)."""
    colours = {s: series_colour(s) for s in frame["series"].unique().to_list()}
    return frame.with_columns(pl.col("series").replace_strict(colours, return_dtype=pl.String).alias("colour"))


def bin_edges(values: np.ndarray, bins: int = 40, discrete: bool = False) -> np.ndarray:
    if discrete:  # counts (answer tokens): one bin per integer
        lo, hi = int(np.min(values)), int(np.max(values))
        return np.arange(lo, hi + 2) - 0.5
    return np.histogram_bin_edges(values, bins=bins)


def class_histogram_data(values: np.ndarray, y: np.ndarray, bins: int = 40, discrete: bool = False) -> pl.DataFrame:
    """Density per class on shared bins -> long frame: value (bin centre), series, density."""
    values, y = np.asarray(values), np.asarray(y)
    edges = bin_edges(values, bins, discrete)
    centres = (edges[:-1] + edges[1:]) / 2
    parts = []
    for name, label in CLASSES:
        sel = y == label
        density = np.histogram(values[sel], bins=edges, density=True)[0] if sel.any() else np.zeros(len(centres))
        parts.append(pl.DataFrame({"value": centres, "series": name, "density": density}))
    return pl.concat(parts)
