"""The tables of cross-dataset transfer (from the transfer stage's metrics/eval/<m>/transfer/<A>__<B>.json):

transfer_<method>  one per method and model: test AUROC (seed mean ± SE, question-bootstrap
                   interval) of detectors trained on the row's dataset and tested on the
                   column's; the diagonal is in-distribution (the method's own evaluation)
transfer_drop      per method: the mean off-diagonal drop, AUROC(B -> B) - AUROC(A -> B) over
                   the off-diagonal cells whose column has its diagonal; with the calibration
                   error and the best-F1 threshold's false-positive rate carried from A to B

Their captions name the seeds behind the cells and HaMI (SP)'s P_sem variant and λ, as the other
tables' do (cells.conventions), from the training dataset's evaluation of the detector.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from halludetect.methods import method as lookup_method
from halludetect.report.cells import conventions
from halludetect.report.tables import Cell, Row, Table


def load_transfer(directory: str | Path, pairs: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], dict]:
    """{(model, train, test): the pair's JSON} for every transfer stage (each model x grid.transfer's ordered pairs)."""
    out, missing = {}, []
    for model, train, test in pairs:
        path = Path(directory) / model / "transfer" / f"{train}__{test}.json"
        if path.exists():
            out[(model, train, test)] = json.loads(path.read_text())
        else:
            missing.append(str(path))
    if missing:
        raise FileNotFoundError(f"{len(missing)} transfer file(s) missing: {missing[:5]}; run the transfer stage")
    return out


def _datasets(pairs, model: str, order: list[str]) -> tuple[list[str], list[str]]:
    rows = [d for d in order if any(k[0] == model and k[1] == d for k in pairs)]
    cols = [d for d in order if any(k[0] == model and k[2] == d for k in pairs)]
    return rows, cols


def _auroc(m: dict, seeds_note: bool = False) -> Cell:
    a = m["test"]["auroc"]
    ci = m["test"].get("auroc_ci95")
    note = f"L{m['layer']}" + (f", {len(m['seeds'])} seeds" if seeds_note and m.get("seeds") else "")
    return Cell(a["mean"], err=a["stderr"], ci=tuple(ci) if ci else None, note=note, group=None)


def _entries(transfer: dict, methods: list[str], metrics: dict | None) -> dict[tuple, dict]:
    """{(model, train, test, method): the pair's figures of the method, with the `params` its
    detector was trained with (the training dataset's evaluation in `metrics`, where given)}: what
    cells.conventions reads for the caption's seeds and P_sem convention."""
    out = {}
    for (model, a, b), pair in transfer.items():
        for method in methods:
            if method in pair["methods"]:
                params = ((metrics or {}).get((model, a, method)) or {}).get("params")
                out[(model, a, b, method)] = {"method": method, **pair["methods"][method], "params": params}
    return out


def matrix_tables(transfer: dict, datasets: list[str], methods: list[str], metrics: dict | None = None) -> list[Table]:
    tables = []
    entries = _entries(transfer, methods, metrics)
    for model in sorted({k[0] for k in transfer}):
        rows_d, cols_d = _datasets(transfer, model, datasets)
        for method in methods:
            mine = [e for k, e in entries.items() if k[0] == model and k[3] == method]
            name = lookup_method(method).display
            caption, defs, per_cell = conventions(
                f"{name} across datasets ({model}): test AUROC, rows trained on, columns tested on", mine
            )
            rows = []
            for a in rows_d:
                cells = []
                for b in cols_d:
                    e = entries.get((model, a, b, method))
                    cells.append(_auroc(e, per_cell) if e else Cell())
                rows.append(Row(a, cells))
            tables.append(
                Table(
                    name=f"transfer_{method}" if len({k[0] for k in transfer}) == 1 else f"transfer_{model}_{method}",
                    caption=caption,
                    header="trained on",
                    groups=[("tested on", cols_d)],
                    rows=rows,
                    notes=[
                        *defs,
                        "The diagonal is in-distribution; off it, the layer, the seeds, the calibration and the "
                        "thresholds are chosen on the training dataset's validation split, and the test "
                        "dataset's questions that are among the training dataset's are left out.",
                        "Seed mean ± SE [95% question-bootstrap interval]; L: the layer chosen on validation.",
                    ],
                )
            )
    return tables


def drop_table(
    transfer: dict, methods: list[str], default_threshold: str = "fpr_0.05", metrics: dict | None = None
) -> Table | None:
    """The mean off-diagonal drop per method (and model), with what a bundle user lives with: the
    calibration, and the false-positive rate on B of the bundle's default flag (export.threshold,
    `default_threshold`) and of its best-F1 threshold, both chosen on A's validation."""
    rows = []
    models = sorted({k[0] for k in transfer})
    for model in models:
        for method in methods:
            drops, eces, fprs, diag_eces, default_fprs = [], [], [], [], []
            for (m, a, b), pair in transfer.items():
                if m != model or method not in pair["methods"]:
                    continue
                cell = pair["methods"][method]
                if a == b:
                    diag_eces.append(cell["calibration"]["ece"])
                    continue
                home = transfer.get((m, b, b))
                if home is None or method not in home["methods"]:
                    continue
                drops.append(home["methods"][method]["test"]["auroc"]["mean"] - cell["test"]["auroc"]["mean"])
                eces.append(cell["calibration"]["ece"])
                fprs.append(cell["thresholds"]["best_f1"]["fpr"] - cell["thresholds"]["best_f1"]["train_val_fpr"])
                if default_threshold in cell["thresholds"]:
                    default_fprs.append(cell["thresholds"][default_threshold]["fpr"])
            if not drops:
                continue
            label = lookup_method(method).display + (f" ({model})" if len(models) > 1 else "")
            rows.append(
                Row(
                    label,
                    [
                        Cell(float(np.mean(drops)), group=None),
                        Cell(float(np.max(drops)), group=None),
                        Cell(float(np.mean(diag_eces)) if diag_eces else None, group=None),
                        Cell(float(np.mean(eces)), group=None),
                        Cell(float(np.mean(default_fprs)) if default_fprs else None, group=None),
                        Cell(float(np.mean(fprs)), group=None),
                        Cell(len(drops), fmt="int", group=None),
                    ],
                )
            )
    if not rows:
        return None
    caption, defs, _ = conventions(
        "Cross-dataset transfer: the mean off-diagonal AUROC drop per method",
        list(_entries(transfer, methods, metrics).values()),
    )
    return Table(
        name="transfer_drop",
        caption=caption,
        header="method",
        groups=[
            (
                "",
                [
                    "mean drop",
                    "largest drop",
                    "ECE in-distribution",
                    "ECE transferred",
                    f"FPR on B of the {default_threshold} flag",
                    "best-F1 FPR shift",
                    "pairs",
                ],
            )
        ],
        rows=rows,
        notes=[
            "Drop: AUROC(B -> B) - AUROC(A -> B), the seed-mean test AUROC of B's own detector minus A's, "
            "over the ordered pairs A != B; positive means the detector lost ranking ability away from home.",
            "ECE: the calibration error (10 equal-width bins by default, transfer.ece_bins) on the test "
            "split of the Platt scaling fitted on the training dataset's validation split, as the bundle's.",
            f"FPR on B of the {default_threshold} flag: the false-positive rate on B's test split of the "
            f"threshold a bundle flags by default (export.threshold: {default_threshold}), chosen on A's "
            "validation split, where it flags the target share of correct answers.",
            "Best-F1 FPR shift: the false-positive rate on B's test split of A's best-F1 threshold minus its "
            "rate on A's validation split; every threshold of export.fpr_targets is in the pair's JSON.",
            *defs,
        ],
    )


def transfer_tables(
    transfer: dict,
    datasets: list[str],
    methods: list[str],
    default_threshold: str = "fpr_0.05",
    metrics: dict | None = None,
) -> list[Table]:
    """`metrics`: load_metrics' {(model, dataset, method): evaluation}, for the params of each
    training dataset's detectors (HaMI (SP)'s P_sem variant and λ in the captions)."""
    if not transfer:
        return []
    tables = matrix_tables(transfer, datasets, methods, metrics)
    if (drop := drop_table(transfer, methods, default_threshold, metrics)) is not None:
        tables.append(drop)
    return tables
