"""The data DVC plots draw: long-format frames with a `series` column (a class or a method),
for the `series` template in .dvc/plots/series.json. No plotting library needed here, so the
stages that only write plot data never import matplotlib."""

from __future__ import annotations

import numpy as np
import polars as pl

# The classes as every figure and plot names them (the paper's neg = correct, pos = hallucinated).
CLASSES = (("correct (neg)", 0), ("hallucinated (pos)", 1))


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
