"""The margin tables: mean(y z) in logit space after training (the paper's tab:margin_comparison
and tab:std_margin), its growth over the epochs (Theorem 1), and the margins by answer length."""

from __future__ import annotations

import numpy as np

from halludetect.report import paper
from halludetect.report.cells import (
    NAMES,
    Grid,
    conventions,
    paper_figure,
    runs_beside,
    stat_cell,
    test_stat,
)
from halludetect.report.paper import Figure
from halludetect.report.tables import Cell, Row, Table, rank

# ------------------------------------------------------------------------------- margins
MARGIN_FAMILIES = (("hami", "instance"), ("hami_sp", "instance"), ("mean", "embedding"), ("max", "embedding"))


MARGIN_GAINS = (("HaMI (SP) over HaMI", "hami_sp", "hami"), ("Max over mean", "max", "mean"))


def _gain(a: float | None, b: float | None) -> float | None:
    """Relative change of margin a over margin b, in %."""
    return None if a is None or b is None or b == 0 else 100.0 * (a - b) / abs(b)


def margin_table(metrics: dict, grid: Grid) -> Table | None:
    """The paper's margin table: the test margin mean(y z) after the last epoch (the paper's
    reading, its figures beside), the same at the best validation epoch (the weights every other
    table uses), and the relative gains the paper quotes (HaMI (SP) over HaMI, max over mean)."""
    present = [(x, fam) for x, fam in MARGIN_FAMILIES if any((m, d, x) in metrics for m, d in grid.cells)]
    if not present:
        return None
    entries = [e for m, d in grid.cells for x, _ in present if (e := metrics.get((m, d, x)))]
    epochs = sorted({e["last_epoch"]["epoch"] for e in entries if e.get("last_epoch")})
    last = f"after epoch {epochs[0]}" if len(epochs) == 1 else "after the last epoch"
    caption, notes, per_cell = conventions(
        "Test margin mean(y z) in logit space at the best layer, mean ± standard error",
        entries,
        [
            f"{last}: the paper's reading (its margins are after its 100 epochs), its figures beside; at the best "
            "validation epoch: the weights every AUROC table uses",
            "ranked within each family and reading: instance-based (HaMI) and embedding-based logits are on "
            "different scales",
            "gains: the relative change of the seed-mean margins, in %; the paper's computed from its table (its "
            "text: HaMI (SP) 30-60%, 144.0% on LLaMA-3.1-8B SQuAD; max over mean 10-20%, 20.9% on LLaMA-3.1-8B NQ)",
        ],
    )
    blocks = ((last, True), ("at the best validation epoch", False))
    rows = []
    for block, at_last in blocks:
        for i, (method, family) in enumerate(present):
            cells = []
            for m, d in grid.cells:
                e = metrics.get((m, d, method))
                pub = paper_figure(paper.MARGIN.get(method, {}), grid, m, d) if at_last else None
                stat = test_stat(e, "margin", at_last)
                if e is not None and stat is None:  # evaluated before the last epoch was recorded
                    cells.append(Cell(paper=runs_beside(pub, e), group=None))
                else:
                    cells.append(stat_cell(e, "margin", pub, group=f"{block}:{family}", seeds_note=per_cell, stat=stat))
            rows.append(Row(f"{NAMES[method]}, {block}", cells, (i == 0 and bool(rows)) or method == "mean"))
    for block, at_last in blocks:
        for j, (label, num, den) in enumerate(MARGIN_GAINS):
            cells, seen = [], False
            for m, d in grid.cells:
                a, b = (test_stat(metrics.get((m, d, x)), "margin", at_last) for x in (num, den))
                seen |= (m, d, num) in metrics and (m, d, den) in metrics
                ours = _gain(a and a["mean"], b and b["mean"])
                pub = None
                if at_last:
                    pa, pb = (paper_figure(paper.MARGIN.get(x, {}), grid, m, d) for x in (num, den))
                    g = _gain(pa and pa.value, pb and pb.value)
                    pub = None if g is None else Figure(g, f"{g:.1f}")
                cells.append(Cell(ours, fmt=".1f", paper=pub, group=None))
            if seen:
                rows.append(Row(f"{label}, % ({block})", cells, j == 0))
    return rank(Table("margin", caption, "Method", grid.groups(), rows, paper.PAPER_TABLES["margin"], notes))


def margin_growth_table(metrics: dict, grid: Grid) -> Table | None:
    """How training moved the training margin at the best layer: first to last epoch (mean over
    seeds), the share of epochs that raised it, and max's gain over mean's (Theorem 1: logistic-
    loss updates expand the margin; the paper: max pooling expands it faster than mean pooling)."""
    rows, entries, gains = [], [], {}
    for method, _ in MARGIN_FAMILIES:
        cells, seen = [], False
        for m, d in grid.cells:
            e = metrics.get((m, d, method))
            curve = ((e or {}).get("margin_by_epoch") or {}).get("train")
            if not curve:
                cells.append(Cell(group=None))
                continue
            seen = True
            entries.append(e)
            up = 100.0 * float(np.mean(np.diff(curve) > 0)) if len(curve) > 1 else 0.0
            gains[(m, d, method)] = curve[-1] - curve[0]
            cells.append(
                Cell(
                    curve[-1] - curve[0],
                    fmt="sig3",
                    note=f"{curve[0]:.3g} → {curve[-1]:.3g}, rose in {up:.0f}% of epochs",
                    group=None,
                )
            )
        if seen:
            rows.append(Row(NAMES[method], cells, method == "mean"))
    if not rows:
        return None
    ratio = [
        Cell(
            gains[(m, d, "max")] / gains[(m, d, "mean")]
            if (m, d, "max") in gains and gains.get((m, d, "mean"))
            else None,
            fmt=".2f",
            group=None,
        )
        for m, d in grid.cells
    ]
    if any(c.value is not None for c in ratio):
        rows.append(Row("Max gain / mean gain", ratio, True))
    caption, notes, _ = conventions(
        "Growth of the training margin mean(y z) from the first to the last epoch at the best layer, mean over "
        "seeds (Theorem 1: training expands it; the paper: faster for max than mean)",
        entries,
        ["each epoch's margin is measured in eval mode on the whole training set after the epoch (curves.json)"],
    )
    return Table("margin_growth", caption, "Method", grid.groups(), rows, None, notes)


def length_table(metrics: dict, grid: Grid, methods: list[str]) -> Table | None:
    rows = []
    for method in methods:
        for bucket in ("<=5", "6-30", ">30"):
            cells, seen = [], False
            for m, d in grid.cells:
                b = ((metrics.get((m, d, method)) or {}).get("test", {}).get("margin_by_length") or {}).get(bucket)
                seen |= b is not None
                if b is None or b["margin"] is None:
                    cells.append(Cell(group=None))
                else:
                    cells.append(Cell(b["margin"]["mean"], b["margin"]["stderr"], note=f"n={b['n']}", group=None))
            if seen:
                rows.append(Row(f"{NAMES.get(method, method)}, {bucket} tokens", cells, bucket == "<=5" and bool(rows)))
    if not rows:
        return None
    caption, notes, _ = conventions(
        "Test margin mean(y z) by answer length, at the best validation epoch",
        [e for m, d in grid.cells for x in methods if (e := metrics.get((m, d, x)))],
        ["answer tokens (the bag length); mean ± standard error over seeds; n = responses in the bucket"],
    )
    return Table("margin_by_length", caption, "Method, length", grid.groups(), rows, None, notes)
