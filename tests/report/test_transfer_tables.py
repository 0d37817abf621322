"""The transfer tables (halludetect/report/transfer_tables.py): one matrix per method, rows trained
on and columns tested on, the diagonal in-distribution; the mean off-diagonal drop per method; both
rendered to Markdown and LaTeX (compiled where pdflatex is installed)."""

import json
import shutil

import pytest
from support import pdflatex

from halludetect.report.tables import to_latex, to_markdown
from halludetect.report.transfer_tables import load_transfer, transfer_tables

AUROC = {("a", "a"): 0.9, ("a", "b"): 0.6, ("b", "a"): 0.7, ("b", "b"): 0.8}


def cell(auroc: float) -> dict:
    return {
        "layer": 2,
        "test": {"auroc": {"mean": auroc, "stderr": 0.01}, "auroc_ci95": [auroc - 0.05, auroc + 0.05]},
        "calibration": {"ece": 0.1 if auroc > 0.75 else 0.3},
        "thresholds": {"best_f1": {"fpr": 0.4, "train_val_fpr": 0.1}, "fpr_0.05": {"fpr": 0.15, "train_val_fpr": 0.05}},
    }


def write(tmp_path):
    pairs = []
    for (a, b), v in AUROC.items():
        path = tmp_path / "m" / "transfer" / f"{a}__{b}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"methods": {"max": cell(v)}}))
        pairs.append(("m", a, b))
    return pairs


def test_matrix_and_mean_off_diagonal_drop(tmp_path):
    stages = write(tmp_path)
    matrix, drop = transfer_tables(load_transfer(tmp_path, stages), ["a", "b"], ["max"])
    assert [r.label for r in matrix.rows] == ["a", "b"] and matrix.groups == [("tested on", ["a", "b"])]
    assert [[c.value for c in r.cells] for r in matrix.rows] == [[0.9, 0.6], [0.7, 0.8]]
    md = to_markdown(matrix)
    assert "| a | 0.900 ± 0.010 [0.850, 0.950] L2 | 0.600 ± 0.010 [0.550, 0.650] L2 |" in md
    # drop: (0.8 - 0.6) for a -> b and (0.9 - 0.7) for b -> a; largest 0.2; ECE; the default flag's FPR
    # on B (fpr_0.05: 0.15 where A's validation gave 0.05); best-F1 FPR shift
    values = [c.value for c in drop.rows[0].cells]
    assert values == pytest.approx([0.2, 0.2, 0.1, 0.3, 0.15, 0.3, 2])
    assert "FPR on B of the fpr_0.05 flag" in to_markdown(drop)
    assert "Max pooling" in to_markdown(drop)
    if shutil.which("pdflatex"):
        res = pdflatex([matrix, drop], tmp_path)
        assert res.returncode == 0, res.stdout[-2000:]
    else:
        assert "\\begin{tabular}" in to_latex(drop)


def test_a_missing_pair_file_names_the_transfer_stage(tmp_path):
    stages = write(tmp_path)
    (tmp_path / "m" / "transfer" / "a__b.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"1 transfer file\(s\) missing.*run the transfer stage"):
        load_transfer(tmp_path, stages)


def test_no_transfer_no_table():
    assert transfer_tables({}, ["a"], ["max"]) == []


def test_the_captions_name_the_seeds_and_the_hami_sp_variant(tmp_path):
    """As the other tables: the seeds behind the cells, and HaMI (SP)'s P_sem variant and λ, those of
    the training dataset's detectors (its evaluation records their params)."""
    stages = []
    for a, b in AUROC:
        path = tmp_path / "m" / "transfer" / f"{a}__{b}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        methods = {m: cell(AUROC[(a, b)]) | {"method": m, "seeds": [0, 1]} for m in ("max", "hami_sp")}
        path.write_text(json.dumps({"methods": methods}))
        stages.append(("m", a, b))
    metrics = {("m", d, "hami_sp"): {"method": "hami_sp", "params": {"p_sem": "mean", "lam": 2.0}} for d in "ab"}
    by_name = {
        t.name: t
        for t in transfer_tables(load_transfer(tmp_path, stages), ["a", "b"], ["max", "hami_sp"], metrics=metrics)
    }
    sp = "HaMI (SP) scales by (1 + λ P_sem), λ = 2, P_sem length-normalised"
    assert by_name["transfer_hami_sp"].caption.endswith(f"(ours over 2 seeds per cell; {sp})")
    assert by_name["transfer_max"].caption.endswith("(ours over 2 seeds per cell)")
    assert by_name["transfer_drop"].caption.endswith(f"(ours over 2 seeds per cell; {sp})")
    assert any(n.startswith("P_sem length-normalised: ") for n in by_name["transfer_hami_sp"].notes)
