"""Route a cell's clustering to the detectors of grid.detectors that read it, a directory per
family and detector, so that DVC re-runs only their stages when the clustering changes
(halludetect/labels/routing.py)."""

from halludetect.labels.routing import FILES, write_routes
from stages import common


def run(args, params):
    sources = {key: getattr(args, key) for key in FILES}  # --clusters, --timings, --latency, --cluster-metrics
    counts = write_routes(params.grid.detectors, sources, args.out)
    common.log.info(
        "%s: the clustering routed to %d detector(s), %d read none of it",
        args.out,
        counts["read_the_clustering"],
        counts["not"],
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--clusters", required=True, help="the cluster stage's clusters Parquet")
    p.add_argument("--timings", required=True, help="the cluster stage's cluster_timings Parquet")
    p.add_argument("--latency", required=True, help="the latency stage's metrics JSON")
    p.add_argument("--cluster-metrics", required=True, help="the cluster stage's metrics JSON")
    p.add_argument("--out", required=True, help="output directory: <family>/<detector>/ (reads.json, copies)")
    common.main(run, p)
