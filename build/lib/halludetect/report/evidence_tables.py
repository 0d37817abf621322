"""The tables of the token evidence (from the evidence stage's metrics/evidence/<m>/<d>.json):

evidence_sparsity  per grid cell and method: how many of a test answer's tokens carry 50% and
                   90% of its positive evidence (s50, s90) and what share of the answer that is,
                   for hallucinated and correct answers (median and quartiles, seeds pooled)
gradient_ratio     Theorem 2 as training measured it (mean and max networks, at the best epoch
                   of the best layer, mean over seeds): the median squared gradient-norm ratio
                   of max to mean pooling over positive training bags, against the medians of
                   (T/s)^2 for s = s90, s50 and the assumption's own s_B, how often the ratio
                   reaches (T/s90)^2, and their rank correlation

Their captions name the seeds behind the figures and, where HaMI (SP) is among the methods, its
P_sem variant and λ (cells.conventions, from the cell's evaluation of the method).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from halludetect.report.cells import conventions
from halludetect.report.tables import Cell, Row, Table

CLASSES = ("hallucinated", "correct")


def load_evidence(directory: str | Path, models: list[str], datasets: list[str]) -> dict:
    """{(m, d): the cell's evidence JSON}; every cell's file must exist."""
    out, missing = {}, []
    for m in models:
        for d in datasets:
            path = Path(directory) / m / f"{d}.json"
            if path.exists():
                out[(m, d)] = json.loads(path.read_text())
            else:
                missing.append(str(path))
    if missing:
        raise FileNotFoundError(f"{len(missing)} evidence file(s) missing: {missing[:5]}; run the evidence stage")
    return out


def _in_order(cell: dict) -> list[tuple[str, dict]]:
    """The cell's methods in the grid's order: (name, its figures)."""
    order = cell.get("order") or sorted(cell["methods"])
    return [(m, cell["methods"][m]) for m in order if m in cell["methods"]]


def _quartiles(stat: dict | None, fmt: str) -> Cell:
    if not stat or stat.get("median") is None:
        return Cell(None, group=None)
    return Cell(stat["median"], ci=(stat["q25"], stat["q75"]), fmt=fmt, group=None)


def _entry(cell: dict, key: tuple[str, str], method: str, metrics: dict | None) -> dict:
    """What conventions reads of one method of a cell: its seeds and the params it was trained with."""
    params = ((metrics or {}).get((*key, method)) or {}).get("params")
    return {"method": method, "seeds": cell.get("seeds"), "params": params}


def sparsity_table(evidence: dict, metrics: dict | None = None) -> Table | None:
    """`metrics`: load_metrics' {(model, dataset, method): evaluation}, for HaMI (SP)'s params."""
    rows, entries = [], []
    for k, ((m, d), cell) in enumerate(evidence.items()):
        for i, (method, e) in enumerate(_in_order(cell)):
            if not e.get("evidence"):
                continue
            entries.append(_entry(cell, (m, d), method, metrics))
            cells = []
            for cls in CLASSES:
                c = e["classes"][cls]
                cells += [
                    Cell(c["n_with_positive_evidence"], fmt="int", group=None),
                    Cell(c["median_T"], fmt=".0f", group=None),
                    _quartiles(c["s50"], ".1f"),
                    _quartiles(c["s90"], ".1f"),
                    _quartiles(c["s90_share"], ".2f"),
                ]
            rows.append(Row(f"{m} / {d}: {e['display']} (layer {e['layer']})", cells, rule_before=k > 0 and i == 0))
    if not rows:
        return None
    cols = ["answers x seeds", "T", "s50", "s90", "s90 share of T"]
    caption, defs, _ = conventions("How many tokens carry a test answer's positive evidence", entries)
    return Table(
        "evidence_sparsity",
        caption,
        "Cell: method (best layer)",
        [(cls, cols) for cls in CLASSES],
        rows,
        notes=[
            "s50, s90: the fewest tokens whose positive contributions to the bag logit reach 50% / 90% of the "
            "answer's positive evidence; T: the answer's tokens; median [quartiles] over test answers x seeds "
            "with any positive evidence (each seed's detector on its own); answers x seeds counts those",
            "contributions sum exactly to the logit minus a bias (detectors/evidence.py); for the raw and "
            "attention networks the bias is the answer's own (the MLP after pooling, linear on its active units)",
            *defs,
        ],
    )


RATIO_COLUMNS = [
    ("median_ratio", "ratio", "sig3"),
    ("median_t_over_s90_sq", "(T/s90)^2", "sig3"),
    ("median_t_over_s50_sq", "(T/s50)^2", "sig3"),
    ("median_t_over_s_paper_sq", "(T/s_B)^2", "sig3"),
    ("share_ratio_at_least_t_over_s90_sq", "share ratio ≥ (T/s90)^2", ".2f"),
    ("spearman_ratio_t_over_s90_sq", "Spearman rho", ".2f"),
]


def gradient_ratio_table(evidence: dict) -> Table | None:
    rows, entries = [], []
    for k, ((m, d), cell) in enumerate(evidence.items()):
        first = True
        for method, e in _in_order(cell):
            traced = e.get("gradient_ratio")
            if not traced:
                continue
            entries.append({"method": method, "seeds": list(traced)})
            cells = []
            for key, _, fmt in RATIO_COLUMNS:
                values = [t[key] for t in traced.values() if t.get(key) is not None]
                err = float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else None
                cells.append(Cell(float(np.mean(values)) if values else None, err=err, fmt=fmt, group=None))
            n = next(iter(traced.values()))["n_bags"]
            label = f"{m} / {d}: {e['display']} (layer {e['layer']}, {n} bags)"
            rows.append(Row(label, cells, rule_before=k > 0 and first))
            first = False
    if not rows:
        return None
    caption, _, _ = conventions(
        "Theorem 2 measured: squared gradient-norm ratio of max to mean pooling per positive training bag", entries
    )
    return Table(
        "gradient_ratio",
        caption,
        "Cell: network trained (best layer)",
        [("", [c for _, c, _ in RATIO_COLUMNS])],
        rows,
        notes=[
            "at the trained network's parameters (mean or max), its best epoch, on its positive training bags: "
            "ratio = ||grad z with max pooling||^2 / ||grad z with mean pooling||^2, every parameter, closed form; "
            "medians over bags, then the mean over seeds ± standard error",
            "s90, s50: the tokens carrying 90% / 50% of the bag's positive evidence under the trained network; "
            "s_B: the paper's assumption, the most tokens any feature is active on; Theorem 2 bounds the ratio "
            "below by a constant times (T/s)^2",
        ],
    )


def evidence_tables(evidence: dict, metrics: dict | None = None) -> list[Table]:
    return [t for t in (sparsity_table(evidence, metrics), gradient_ratio_table(evidence)) if t is not None]
