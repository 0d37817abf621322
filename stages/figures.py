"""Figures of one grid cell (PNGs in metrics/figures, and their data as DVC plots): AUROC by layer
of every method, ROC curves and score distributions at the best layer, answer length and P_sem by
class (halludetect/report/cell_figures.py)."""

from halludetect.report.cell_figures import draw_cell
from stages import common


def run(args, params):
    draw_cell(
        args.model,
        args.dataset,
        params.grid,
        params.train.seeds,
        params.detectors.p_sem.variant,
        eval_dir=args.eval_dir,
        scores_dir=args.scores_dir,
        judgments=args.judgments,
        clusters=args.clusters,
        generations=args.generations,
        figures_dir=args.figures,
        plots_dir=args.plots,
        log=common.log.info,
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--model", "model preset name"),
        ("--dataset", "dataset preset name"),
        ("--eval-dir", "directory of the cell's <method>.json evaluate metrics"),
        ("--scores-dir", "directory of <method>/layer_LL.parquet per-response scores"),
        ("--judgments", "judgments Parquet"),
        ("--clusters", "clusters Parquet"),
        ("--generations", "generations Parquet"),
        ("--figures", "directory of the PNGs"),
        ("--plots", "root of the plot data (layers/, roc/, epochs/, scores/, responses/)"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
