"""The tables of cross-dataset transfer (from the transfer stage's metrics/eval/<m>/transfer/<A>__<B>.json):

transfer_<method>  one per method and model: test AUROC (seed mean ± SE, question-bootstrap
                   interval) of detectors trained on the row's dataset and tested on the
                   column's; the diagonal is in-distribution (the method's own evaluation)
transfer_drop      per method: the mean off-diagonal drop, AUROC(B -> B) - AUROC(A -> B) over
                   the off-diagonal cells whose column has its diagonal; with the calibration
                   error and the best-F1 threshold's false-positive rate carried from A to B
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from halludetect.methods import method as lookup_method
from halludetect.report.tables import Cell, Row, Table


def load_transfer(directory: str | Path, stages: dict[str, dict]) -> dict[tuple[str, str, str], dict]:
    """{(model, train, test): the pair's JSON} for every stage of grid.transfer_stages."""
    out, missing = {}, []
    for s in stages.values():
        path = Path(directory) / s["model"] / "transfer" / f"{s['train']}__{s['test']}.json"
        if path.exists():
            out[(s["model"], s["train"], s["test"])] = json.loads(path.read_text())
        else:
            missing.append(str(path))
    if missing:
        raise FileNotFoundError(f"{len(missing)} transfer file(s) missing: {missing[:5]}; run the transfer stage")
    return out


def _datasets(pairs, model: str, order: list[str]) -> tuple[list[str], list[str]]:
    rows = [d for d in order if any(k[0] == model and k[1] == d for k in pairs)]
    cols = [d for d in order if any(k[0] == model and k[2] == d for k in pairs)]
    return rows, cols


def _auroc(m: dict) -> Cell:
    a = m["test"]["auroc"]
    ci = m["test"].get("auroc_ci95")
    return Cell(a["mean"], err=a["stderr"], ci=tuple(ci) if ci else None, note=f"L{m['layer']}", group=None)


def matrix_tables(transfer: dict, datasets: list[str], methods: list[str]) -> list[Table]:
    tables = []
    for model in sorted({k[0] for k in transfer}):
        rows_d, cols_d = _datasets(transfer, model, datasets)
        for method in methods:
            rows = []
            for a in rows_d:
                cells = []
                for b in cols_d:
                    pair = transfer.get((model, a, b))
                    cells.append(_auroc(pair["methods"][method]) if pair and method in pair["methods"] else Cell())
                rows.append(Row(a, cells))
            name = lookup_method(method).display
            tables.append(
                Table(
                    name=f"transfer_{method}" if len({k[0] for k in transfer}) == 1 else f"transfer_{model}_{method}",
                    caption=f"{name} across datasets ({model}): test AUROC, rows trained on, columns tested on",
                    header="trained on",
                    groups=[("tested on", cols_d)],
                    rows=rows,
                    notes=[
                        "The diagonal is in-distribution; off it, the layer, the seeds, the calibration and the "
                        "thresholds are chosen on the training dataset's validation split, and the test "
                        "dataset's questions that are among the training dataset's are left out.",
                        "Seed mean ± SE [95% question-bootstrap interval]; L: the layer chosen on validation.",
                    ],
                )
            )
    return tables


def drop_table(transfer: dict, methods: list[str], default_threshold: str = "fpr_0.05") -> Table | None:
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
    return Table(
        name="transfer_drop",
        caption="Cross-dataset transfer: the mean off-diagonal AUROC drop per method",
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
        ],
    )


def transfer_tables(
    transfer: dict, datasets: list[str], methods: list[str], default_threshold: str = "fpr_0.05"
) -> list[Table]:
    if not transfer:
        return []
    tables = matrix_tables(transfer, datasets, methods)
    if (drop := drop_table(transfer, methods, default_threshold)) is not None:
        tables.append(drop)
    return tables
