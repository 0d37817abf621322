"""Evaluate the baselines that need no hidden states (P_sem, semantic entropy, log-prob, length)."""

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json
from halludetect.evaluation.baselines import baseline_scores, evaluate_baseline
from halludetect.labels.readers import read_clusters, read_judgments
from stages import common


def run(args, params):
    ep, bp = params.evaluate, params.baselines
    judgments = read_judgments(args.judgments)
    generations = read_parquet(args.generations, "generate", "generations table")
    clusters = read_clusters(args.clusters)
    out = {}
    for name in params.grid.baselines:
        out[name] = {
            "model": args.model,
            "dataset": args.dataset,
            "method": name,
            "family": "baseline",
            "seeds": None,
            "params": bp.model_dump(),
        }
        out[name] |= evaluate_baseline(
            baseline_scores(name, generations, clusters, bp), judgments, bootstrap=ep.bootstrap, seed=ep.seed
        )
        common.log.info("%s: test AUROC %.3f", name, out[name]["test"]["auroc"]["mean"])
    write_json(args.out, out)


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--model", "model preset name"),
        ("--dataset", "dataset preset name"),
        ("--generations", "generations Parquet"),
        ("--judgments", "judgments Parquet"),
        ("--clusters", "clusters Parquet"),
        ("--out", "metrics JSON of every baseline"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
