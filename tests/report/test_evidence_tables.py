"""The token-evidence tables (halludetect/report/evidence_tables.py) from the evidence stage's JSON:
the sparsity of every cell's methods by class, Theorem 2's figures over seeds, a missing cell named,
and both tables accepted by pdflatex where it is installed."""

import json
import shutil

import pytest
from support import pdflatex

from halludetect.report.evidence_tables import evidence_tables, load_evidence
from halludetect.report.tables import to_markdown


def quartiles(median, q25, q75):
    return {"median": median, "q25": q25, "q75": q75}


def cls(n, s50, s90):
    return {
        "n": n,
        "n_with_positive_evidence": n - 1,
        "median_T": 12.0,
        "s50": quartiles(s50, s50 - 1, s50 + 1),
        "s90": quartiles(s90, s90 - 1, s90 + 2),
        "s50_share": quartiles(s50 / 12, 0.05, 0.2),
        "s90_share": quartiles(s90 / 12, 0.1, 0.5),
    }


def cell(ratio_seeds=(40.0, 60.0)):
    at_best = [
        {
            "n_bags": 37,
            "median_ratio": r,
            "median_t_over_s90_sq": 9.0,
            "median_t_over_s50_sq": 36.0,
            "median_t_over_s_paper_sq": 1.0,
            "share_ratio_at_least_t_over_s90_sq": 0.75,
            "spearman_ratio_t_over_s90_sq": 0.4,
        }
        for r in ratio_seeds
    ]
    return {
        "methods": {
            "max": {
                "display": "Max pooling",
                "layer": 3,
                "evidence": "each feature's term ...",
                "classes": {"hallucinated": cls(60, 2.0, 5.0), "correct": cls(90, 3.0, 7.0)},
                "gradient_ratio": {f"seed_{k}": v for k, v in enumerate(at_best)},
            },
            "hami": {
                "display": "HaMI",
                "layer": 2,
                "evidence": "top-k ...",
                "classes": {"hallucinated": cls(60, 1.0, 2.0), "correct": cls(90, 1.0, 2.0)},
            },
            "odd": {"layer": 1, "evidence": None, "why": "no token evidence"},
        }
    }


def write_cells(tmp_path):
    for m, d in (("world", "world"), ("world", "small_world")):
        (tmp_path / m).mkdir(exist_ok=True)
        (tmp_path / m / f"{d}.json").write_text(json.dumps(cell()))
    return load_evidence(tmp_path, ["world"], ["world", "small_world"])


def test_the_sparsity_and_gradient_ratio_tables(tmp_path):
    sparsity, ratio = evidence_tables(write_cells(tmp_path))
    md = to_markdown(sparsity)
    assert (
        "| world / world: Max pooling (layer 3) | 59 | 12 | 2.0 [1.0, 3.0] | 5.0 [4.0, 7.0] | 0.42 [0.10, 0.50] |" in md
    )
    assert "world / small_world: HaMI (layer 2)" in md and "odd" not in md
    r = to_markdown(ratio)
    assert "| world / world: Max pooling (layer 3, 37 bags) | 50.0 ± 10.0 | 9.00 ± 0.00 | 36.0 ± 0.00 |" in r
    assert len(ratio.rows) == 2  # one per cell: only max was traced


def test_a_missing_cell_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"world/nope.json.*run the evidence stage"):
        load_evidence(tmp_path, ["world"], ["nope"])


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (Debian: texlive-latex-base)")
def test_the_tables_compile_with_latex(tmp_path):
    tables = evidence_tables(write_cells(tmp_path))
    res = pdflatex(tables, tmp_path)
    assert res.returncode == 0, res.stdout[-2000:]


def test_the_captions_name_the_seeds_and_the_hami_sp_variant():
    """As the other tables: the seeds behind the figures, and HaMI (SP)'s P_sem variant and λ
    (the cell's evaluation of the method records its params)."""
    c = cell()
    c["seeds"] = [0, 1, 2]
    c["methods"]["hami_sp"] = c["methods"]["hami"] | {"display": "HaMI (SP)"}
    metrics = {("m", "d", "hami_sp"): {"method": "hami_sp", "params": {"p_sem": "count", "lam": 0.5}}}
    sparsity, ratio = evidence_tables({("m", "d"): c}, metrics)
    assert "(ours over 3 seeds per cell; HaMI (SP) scales by (1 + λ P_sem), λ = 0.5, P_sem count)" in sparsity.caption
    assert any(n.startswith("P_sem count: ") for n in sparsity.notes)
    assert ratio.caption.endswith("(ours over 2 seeds per cell)")  # the traced seeds
