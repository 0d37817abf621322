"""DVC plot data (halludetect/evaluation/plot_data.py): class histograms are densities on bins shared
by the classes, with one bin per value for discrete data such as token counts."""

import numpy as np
import polars as pl

from halludetect.evaluation.plot_data import class_histogram_data


def test_class_histograms_are_densities_on_shared_bins():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 500)
    v = rng.normal(size=500) + 2 * y
    data = class_histogram_data(v, y, bins=20)
    assert data.columns == ["value", "series", "density"] and data.height == 40
    for series in data["series"].unique():
        part = data.filter(pl.col("series") == series)
        width = np.diff(part["value"].to_numpy()).mean()
        assert abs(np.sum(part["density"].to_numpy()) * width - 1) < 1e-6
    counts = class_histogram_data(np.array([1, 2, 2, 5]), np.array([0, 1, 1, 0]), discrete=True)
    assert counts["value"].unique().sort().to_list() == [1.0, 2.0, 3.0, 4.0, 5.0]  # one bin per token count
