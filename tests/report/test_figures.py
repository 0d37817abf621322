"""Figures (halludetect/report/figures.py): byte-stable PNGs written atomically with no software stamp,
the sensitivity figure's panels, the mean ROC and the per-layer plot data."""

import numpy as np
import polars as pl
from support import layers

from halludetect.report import figures


def test_sensitivity_figure_has_a_pair_of_panels_per_split(tmp_path):
    rng = np.random.default_rng(3)
    rows = pl.DataFrame(
        {
            "split": ["train"] * 40 + ["test"] * 40,
            "label": rng.integers(0, 2, 80),
            "p_sem": rng.random(80),
            "c_int": rng.normal(size=80),
        }
    )
    fig = figures.sensitivity(rows, "title")
    assert [ax.get_title() for ax in fig.axes] == [
        "C_B^int (train)",
        "P_sem C_B^int (train)",
        "C_B^int (test)",
        "P_sem C_B^int (test)",
    ]
    figures.save_png(fig, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_pngs_are_byte_stable_and_carry_no_software_stamp(tmp_path):
    for name in ("a.png", "b.png"):
        figures.save_png(figures.auroc_by_layer(layers(), {"hami": 3, "max": 0}, "title"), tmp_path / name)
    a, b = (tmp_path / "a.png").read_bytes(), (tmp_path / "b.png").read_bytes()
    assert a == b and a[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"Software" not in a and b"matplotlib" not in a
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png"]  # no temporary file left


def test_mean_roc_and_layers_data():
    y = np.array([0, 0, 1, 1])
    perfect = figures.mean_roc(y, [np.array([0.1, 0.2, 0.8, 0.9])])
    assert perfect[0] == 0 and (perfect[1:] == 1).all()
    seeds = [np.array([0.9, 0.1, 0.8, 0.2]), np.array([0.1, 0.9, 0.2, 0.8])]  # AUROC 0.5 each
    area = np.trapezoid(figures.mean_roc(y, seeds), figures.FPR_GRID)
    assert abs(area - 0.5) < 0.02
    d = figures.auroc_by_layer_data(layers())
    assert d.columns == ["layer", "series", "test_auroc", "val_auroc", "colour"] and d.height == 8
