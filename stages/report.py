"""Build the comparison tables (Markdown, LaTeX) and a summary from the metrics JSON alone."""

from pathlib import Path

from halludetect import cli
from halludetect.atomic_io import write_json, write_text
from halludetect.report import load_metrics, summary, table


def run(args, params):
    g = params.grid
    detectors = [*g.methods, *g.sp_methods]
    metrics = load_metrics(args.metrics_dir, g.models, g.datasets, detectors, args.baselines_dir, g.baselines)
    out = Path(args.out_dir)
    rows = {"auroc": [*detectors, *g.baselines], "margin": detectors, "throughput": detectors}
    for metric, methods in rows.items():
        write_text(out / f"{metric}.md", table(metrics, metric, g.models, g.datasets, methods))
        write_text(out / f"{metric}.tex", table(metrics, metric, g.models, g.datasets, methods, latex=True))
    write_json(args.summary, summary(metrics))
    print((out / "auroc.md").read_text())


if __name__ == "__main__":
    p = cli.parser(__doc__)
    p.add_argument("--metrics-dir", required=True, help="directory of <model>/<dataset>/<method>.json")
    p.add_argument("--baselines-dir", required=True, help="directory of <model>/<dataset>.json baseline metrics")
    p.add_argument("--out-dir", required=True, help="directory for the tables")
    p.add_argument("--summary", required=True, help="summary JSON")
    cli.main(run, p)
