"""Route a cell's clustering to the detectors of grid.detectors that read it, the generations to the
scores with nothing to train, and the questions and model preset to those that ask the model again,
a directory per family and detector, so that DVC re-runs only their stages when one of those
changes (halludetect/labels/routing.py)."""

from halludetect.labels.routing import FILES, MODEL, write_routes
from stages import common


def run(args, params):
    sources = {key: getattr(args, key) for key in FILES if key != MODEL}  # --clusters, ..., --questions
    preset = params.model(args.model).model_dump(mode="json")
    counts = write_routes(params.grid.detectors, sources, args.out, model=preset)
    common.log.info(
        "%s: the clustering routed to %d detector(s), %d read none of it",
        args.out,
        counts["read_the_clustering"],
        counts["not"],
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--model", required=True, help="the cell's model preset name (models.<name>)")
    p.add_argument("--clusters", required=True, help="the cluster stage's clusters Parquet")
    p.add_argument("--timings", required=True, help="the cluster stage's cluster_timings Parquet")
    p.add_argument("--latency", required=True, help="the latency stage's metrics JSON")
    p.add_argument("--cluster-metrics", required=True, help="the cluster stage's metrics JSON")
    p.add_argument("--generations", required=True, help="the generate stage's Parquet, for the scores' train stages")
    p.add_argument("--questions", required=True, help="the prepare stage's questions Parquet, for p_true's prompt")
    p.add_argument("--out", required=True, help="output directory: <family>/<detector>/ (reads.json, copies)")
    common.main(run, p)
