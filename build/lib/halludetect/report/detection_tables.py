"""The detection tables: every method's AUROC (and PRR, FPR at 95% TPR) per cell, the standard
deviations over seeds, throughput and cost per response, P_sem as a detector, the label
distribution and the training time (the paper's tab:performance_comparison, tab:raw_vs_reduced,
tab:pooling_auc, tab:std, tab:throughput_comparison, tab:pooling_speed, tab:se_sp_auc,
tab:label_dist)."""

from __future__ import annotations

from halludetect.report import paper
from halludetect.report.cells import (
    NAMES,
    Grid,
    conventions,
    cost_rows,
    family,
    p_sem_phrase,
    paper_figure,
    runs_beside,
    stat_cell,
    test_stat,
)
from halludetect.report.tables import Cell, Row, Table, rank


def method_table(
    name: str,
    caption: str,
    metrics: dict,
    grid: Grid,
    rows: list[tuple],
    key: str,
    published: dict,
    *,
    with_ci=False,
    notes=(),
) -> Table | None:
    """Methods as rows (method, ranking group, rule before[, label]), grid cells as columns. A row
    with its own label (a block of the field's baselines or of plugins) shows each cell's cost
    per response beside the best layer."""
    present = [r for r in rows if any((m, d, r[0]) in metrics for m, d in grid.cells)]
    if not present:
        return None
    entries = [e for m, d in grid.cells for r in present if (e := metrics.get((m, d, r[0])))]
    caption, notes, per_cell = conventions(caption, entries, notes)
    out = []
    for method, group, rule, *label in present:
        cells = [
            stat_cell(
                metrics.get((m, d, method)),
                key,
                paper_figure(published.get(method, {}), grid, m, d),
                with_ci=with_ci,
                group=group,
                cost=bool(label) and family(method) != "paper",
                seeds_note=per_cell,
            )
            for m, d in grid.cells
        ]
        out.append(Row(label[0] if label else NAMES.get(method, method), cells, rule))
    return rank(Table(name, caption, "Method", grid.groups(), out, paper.PAPER_TABLES.get(name), list(notes)))


def sd_table(
    name: str, caption: str, metrics: dict, grid: Grid, key: str, published: dict, last_epoch: bool = False
) -> Table | None:
    rows, entries = [], []
    for method in ("hami", "hami_sp", "mean", "max"):
        if not any((m, d, method) in metrics for m, d in grid.cells):
            continue
        cells = []
        for m, d in grid.cells:
            e = metrics.get((m, d, method))
            entries += [e] if e else []
            stat = test_stat(e, key, last_epoch)
            cells.append(
                Cell(
                    None if stat is None else stat.get("sd"),
                    paper=runs_beside(paper_figure(published.get(method, {}), grid, m, d), e),
                    group=None,
                )
            )
        rows.append(Row(NAMES[method], cells, method == "mean"))
    if not rows:
        return None
    caption, notes, _ = conventions(
        caption,
        entries,
        [
            "standard deviation of one seed's figure over the seeds (the paper's appendix; its main "
            "tables' captions call them standard errors)"
        ],
    )
    return Table(name, caption, "Method", grid.groups(), rows, paper.PAPER_TABLES[name], notes)


def throughput_table(
    name: str, caption: str, metrics: dict, grid: Grid, methods: list[str], published: dict, others: list[str] = ()
) -> Table | None:
    rows = []
    for method in methods:
        if not any((m, d, method) in metrics for m, d in grid.cells):
            continue
        variants = (
            [("", None)]
            if method != "hami_sp"
            else [
                (" with sampling and NLI, amortised", "samples_per_s_with_sampling_and_nli"),
                (" with sampling and NLI, sequential", "sequential_samples_per_s"),
            ]
        )
        for suffix, cost_key in variants:
            cells = []
            for m, d in grid.cells:
                e = metrics.get((m, d, method))
                pub = paper_figure(published.get(method, {}), grid, m, d)
                if method == "hami_sp" and cost_key != "sequential_samples_per_s":
                    pub = None  # the paper's HaMI (SP) figure is a one-response-at-a-time cost
                if e is None:
                    cells.append(Cell(paper=pub, fmt="rate"))
                    continue
                t = e["throughput"]
                value = t["preloaded_samples_per_s"] if cost_key is None else e.get("cost", {}).get(cost_key)
                note = t.get("device", "")
                cells.append(Cell(value, note=note, paper=pub, fmt="rate"))
            rows.append(Row(NAMES[method] + suffix, cells, method in ("mean", "attention")))
    if others and (more := cost_rows(metrics, grid, list(others))):
        rows += more
    if not rows:
        return None
    notes = [
        "samples/s of the first seed's detector on the best layer's test responses (preloaded tensors); the "
        "paper's figures are one A100's. HaMI (SP) adds K - 1 more samples and the NLI calls per response: "
        "amortised over batched rounds, or paid one response at a time (sequential)",
        *(
            [
                "the field's baselines and your detectors: responses/s with all each needs [in brackets], "
                "amortised: its own scoring plus the K - 1 more samples, NLI calls or forward pass it needs"
            ]
            if others
            else []
        ),
    ]
    p_sem, defs = p_sem_phrase([e for m, d in grid.cells for x in methods if (e := metrics.get((m, d, x)))])
    caption = caption if not p_sem else f"{caption} ({p_sem})"
    return rank(Table(name, caption, "Method", grid.groups(), rows, paper.PAPER_TABLES.get(name), notes + defs))


def p_sem_table(metrics: dict, grid: Grid) -> Table | None:
    """The paper's layout: datasets as rows, models as columns."""
    if not any((m, d, "p_sem") in metrics for m, d in grid.cells):
        return None
    rows = []
    for d in grid.datasets:
        cells = [
            stat_cell(
                metrics.get((m, d, "p_sem")),
                "auroc",
                paper_figure(paper.P_SEM_AUROC, grid, m, d),
                with_ci=True,
                group=None,
                layer=False,
            )
            for m in grid.models
        ]
        rows.append(Row(d, cells))
    p_sem, defs = p_sem_phrase([e for m, d in grid.cells if (e := metrics.get((m, d, "p_sem")))])
    return Table(
        "p_sem_auroc",
        f"Test AUROC of the semantic probability as a discriminator ({p_sem or '1 - P_sem'})",
        "Dataset",
        [("", list(grid.models))],
        rows,
        paper.PAPER_TABLES["p_sem_auroc"],
        ["[bootstrap 95% interval]", *defs],
    )


def label_table(labels: dict, grid: Grid) -> Table | None:
    """Positives (hallucinated), negatives (correct) and |S_neg| / |S_pos| per cell and split."""
    rows = []
    for m, d in grid.cells:
        found = labels.get((m, d))
        if not found:
            continue
        key = grid.paper_cell(m, d)
        for split in ("train", "test"):
            s = found["splits"].get(split)
            if s is None:
                continue
            pub = paper.LABELS.get(key, {}).get(split) if key else None
            pos, neg = s["hallucinated"], s["correct"]
            rows.append(
                Row(
                    f"{m} / {d} / {split}",
                    [
                        Cell(pos, fmt="int", paper=pub[0] if pub else None, group=None),
                        Cell(neg, fmt="int", paper=pub[1] if pub else None, group=None),
                        Cell(neg / pos if pos else None, fmt=".2f", paper=pub[2] if pub else None, group=None),
                    ],
                    split == "train" and bool(rows),
                )
            )
    if not rows:
        return None
    return Table(
        "label_distribution",
        "Number of positive (hallucinated) and negative (correct) responses and the class ratio |S_neg| / |S_pos|",
        "Model / dataset / split",
        [("", ["Pos.", "Neg.", "Ratio (neg/pos)"])],
        rows,
        paper.PAPER_TABLES["label_distribution"],
        ["kept responses after the two-pass judge (metrics/labels)"],
    )


def training_time_table(metrics: dict, grid: Grid, methods: list[str]) -> Table | None:
    """Seconds to train one seed at the best layer, and every grid layer's together (the paper's
    appendix gives one total per model)."""
    rows, entries = [], []
    for method in methods:
        cells, seen = [], False
        for m, d in grid.cells:
            e = metrics.get((m, d, method))
            t = (e or {}).get("training_time")
            if t is None:
                cells.append(Cell(group=None))
                continue
            seen = True
            entries.append(e)
            note = f"L{t['layer']}; all {t['layers']} layers {t['all_layers_mean_seconds_per_seed']:,.0f} s"
            cells.append(Cell(t["mean_seconds_per_seed"], fmt=".1f", note=note, group=None))
        if seen:
            rows.append(Row(NAMES.get(method, method), cells))
    if not rows:
        return None
    setups = sorted(
        {(e["train"]["recipe"], e["train"]["epochs"], e["train"]["batch_size"]) for e in entries if e.get("train")}
    )
    where = sorted(
        {f"{e['training_time']['device']}, {e['training_time']['parallel_workers']} seeds at once" for e in entries}
    )
    paper_total = ", ".join(f"{paper.MODELS[k].label} {v} s" for k, v in paper.TRAINING_SECONDS.items())
    caption, notes, _ = conventions(
        "Training time of one seed at the best layer, seconds ("
        + "; ".join(f"recipe {r}, {ep} epochs, batch {bs}" for r, ep, bs in setups)
        + ")",
        entries,
        [
            "each seed's wall time: its epochs with their per-epoch evaluations, on "
            + "; ".join(where)
            + " (seeds side by side share the cores)",
            f"the paper's appendix: about {paper_total} of training on one A100, excluding generation and "
            "labelling, not broken down by method or layer",
        ],
    )
    return Table("training_time", caption, "Method", grid.groups(), rows, None, notes)
