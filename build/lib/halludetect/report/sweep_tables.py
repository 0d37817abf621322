"""A sweep's table: one row per value of a swept parameter, with the paper's figure where it has
one (its tab:dim_max_* for the max network's dim)."""

from __future__ import annotations

from halludetect.report import paper
from halludetect.report.cells import Grid, conventions, seeds_phrase, stat_cell
from halludetect.report.paper import Figure
from halludetect.report.tables import Cell, Row, Table, rank

# The paper's figures for a swept feature dimension: its D tables for max pooling; for mean
# pooling only its main table's, at the paper's D = 256.
DIM_PARAMS = {"detectors.max.dim": "max", "detectors.mean.dim": "mean"}


def _sweep_paper_figure(param: str, value, key: tuple[str, str] | None) -> Figure | None:
    if key is None or param not in DIM_PARAMS:
        return None
    if DIM_PARAMS[param] == "max":
        return paper.DIM_SWEEP.get(key[0], {}).get(value, {}).get(key[1])
    return paper.AUROC["mean"].get(key) if value == 256 else None


def sweep_table(
    param: str,
    results: dict[tuple[str, str], dict],
    grid: Grid,
    metric: str = "auroc",
    name: str | None = None,
    marks: dict | None = None,
) -> Table:
    """A sweep of one parameter (e.g. `detectors.max.dim`): {(model, dataset): {value: metrics JSON}}.
    Rows are the swept values, columns the grid cells; for the D sweeps the paper's figures stand
    beside ours: its D tables for `detectors.max.dim`, its mean-pooling AUROC (main table, D = 256)
    for `detectors.mean.dim`. `marks` ({value: "failed", ...}): values with no results, shown as
    rows with the mark in every cell rather than left out."""
    marks = marks or {}
    values = sorted(
        {v for per_cell in results.values() for v in per_cell} | set(marks), key=lambda v: (str(type(v)), v)
    )
    entries = [e for per_cell in results.values() for e in per_cell.values()]
    _, per_cell = seeds_phrase(entries)
    rows = []
    for v in values:
        cells = []
        for m, d in grid.cells:
            e = results.get((m, d), {}).get(v)
            pub = _sweep_paper_figure(param, v, grid.paper_cell(m, d))
            if e:
                cells.append(stat_cell(e, metric, pub, group="all", seeds_note=per_cell))
            else:
                cells.append(Cell(paper=pub, text=marks.get(v), group=None if v in marks else "all"))
        rows.append(Row(str(v), cells))
    label, notes = None, ["mean ± standard error over seeds, best layer on validation"]
    if param == "detectors.max.dim":
        label = "tab:dim_max_llama8b, tab:dim_max_mistral12b, tab:dim_max_llama70b"
    elif param == "detectors.mean.dim":
        label = "tab:performance_comparison"
        notes.append("the paper sweeps D for max pooling only: its mean-pooling figure is its main table's, at D = 256")
    caption, notes, _ = conventions(f"Test {metric.upper()} by {param}", entries, notes)
    return rank(Table(name or f"sweep_{param.replace('.', '_')}", caption, param, grid.groups(), rows, label, notes))
