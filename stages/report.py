"""Rebuild the paper's tables (Markdown and LaTeX, one file each), a summary and the headline figures
(the pipeline's only DVC metrics: one small file per method and baseline) from the metrics JSON."""

import json
from pathlib import Path

from halludetect.core.atomic_io import atomic_path, write_json, write_text
from halludetect.methods import trained
from halludetect.report import paper
from halludetect.report.cells import Grid
from halludetect.report.evidence_tables import evidence_tables, load_evidence
from halludetect.report.headline import headlines
from halludetect.report.leaks import flag_leaks, load_leaks
from halludetect.report.paper_tables import build_tables, load_analysis, load_metrics, load_per_cell, summary
from halludetect.report.tables import to_latex, to_markdown
from halludetect.report.transfer_tables import load_transfer, transfer_tables
from stages import common


def run(args, params):
    g = params.grid
    # The paper's figures belong to a model and a dataset, not to a preset name: match by hub id and loader.
    grid = Grid(
        g.models,
        g.datasets,
        {m: paper.model_key(params.model(m).path) for m in g.models},
        {d: paper.dataset_key(params.dataset(d).loader) for d in g.datasets},
    )
    metrics = load_metrics(args.metrics_dir, g.models, g.datasets, g.detectors)
    labels = load_per_cell(args.labels_dir, g.models, g.datasets)
    analysis = load_analysis(args.metrics_dir, g.models, g.datasets, g.analyze)
    out = Path(args.out_dir)
    tables = build_tables(metrics, grid, labels, analysis)
    tables += evidence_tables(load_evidence(args.evidence_dir, g.models, g.datasets), metrics)
    pairs = [(m, a, b) for m in g.models for a, b in g.transfer_pairs()]
    tables += transfer_tables(
        load_transfer(args.metrics_dir, pairs),
        g.datasets,
        trained(g.detectors),
        params.export.threshold,
        metrics,  # the params of each training dataset's detectors, for the captions
    )
    # A dataset whose prompt gives the answer away is marked in every table (report.leak_threshold).
    flag_leaks(tables, load_leaks(args.prepare_dir, g.datasets), params.report.leak_threshold, g.models)
    with_paper = {m: k for m, k in grid.model_keys.items() if k}
    common.log.info(
        "%d tables; paper figures for %s", len(tables), with_paper or "no cell (no paper model in the grid)"
    )
    for table in tables:
        write_text(out / f"{table.name}.md", to_markdown(table))
        write_text(out / f"{table.name}.tex", to_latex(table))
    write_json(args.summary, summary(metrics, analysis))
    # the whole directory at once, so a method dropped from the grid leaves no stale headline behind
    with atomic_path(args.headline_dir, is_dir=True) as tmp:
        for rel, figures in headlines(metrics, analysis).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(json.dumps(figures, indent=2, sort_keys=True, allow_nan=False) + "\n")
    print((out / "auroc.md").read_text())


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument(
        "--metrics-dir",
        required=True,
        help="directory of <model>/<dataset>/<method>.json (and the analyses, "
        "<model>/<dataset>/analysis/<method>.json, and the transfers, <model>/transfer/<train>__<test>.json)",
    )
    p.add_argument("--labels-dir", required=True, help="directory of <model>/<dataset>.json label metrics")
    p.add_argument("--evidence-dir", required=True, help="directory of <model>/<dataset>.json token evidence")
    p.add_argument(
        "--prepare-dir", required=True, help="directory of <dataset>.json prepare metrics (their leak check)"
    )
    p.add_argument("--out-dir", required=True, help="directory for the tables")
    p.add_argument("--summary", required=True, help="summary JSON")
    p.add_argument(
        "--headline-dir",
        required=True,
        help="directory of the headline figures, eval/<model>/<dataset>/<name>.json (the DVC metrics)",
    )
    common.main(run, p)
