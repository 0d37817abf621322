"""Score val and test with every trained layer; pick the best layer on validation only."""

import json
from pathlib import Path

import polars as pl

from halludetect import cli
from halludetect.artifacts import read_parquet
from halludetect.atomic_io import write_json
from halludetect.detector_data import DataError, p_sem_for
from halludetect.detectors import trained_params
from halludetect.evaluation import evaluate_detector, hami_sp_cost
from halludetect.label_tables import read_judgments


def run(args, params):
    ep = params.evaluate
    method_params = trained_params(args.detectors, args.method)  # e.g. hami_sp's lam and P_sem variant
    p_sem = p_sem_for(args.method, args.clusters, method_params)
    judgments = read_judgments(args.judgments)
    metrics = {"model": args.model, "dataset": args.dataset, "method": args.method, "family": "detector",
               "seeds": params.train.seeds}
    metrics |= evaluate_detector(args.method, args.activations, args.detectors, judgments, params.train.seeds,
                                 bootstrap=ep.bootstrap, seed=ep.seed, repeats=ep.throughput_repeats, p_sem=p_sem)
    if p_sem is not None:
        if not (args.timings and args.generation_metrics):
            raise DataError(f"{args.method}: pass --timings and --generation-metrics to charge its sampling and NLI")
        test_questions = judgments.filter(pl.col("split") == "test")["question_id"].unique().to_list()
        metrics["cost"] = hami_sp_cost(json.loads(Path(args.generation_metrics).read_text()),
                                       read_parquet(args.timings, "cluster", "cluster timings table"),
                                       test_questions,
                                       metrics["throughput"]["preloaded_samples_per_s"])
    write_json(args.out, metrics)
    write_json(args.plot, metrics["layers"])
    cli.log.info("%s: best layer %d, test AUROC %.3f", args.method, metrics["best_layer"],
                 metrics["test"]["auroc"]["mean"])


if __name__ == "__main__":
    p = cli.parser(__doc__)
    for flag, text in [("--model", "model preset name"), ("--dataset", "dataset preset name"),
                       ("--method", "detector method"), ("--activations", "directory of layer files"),
                       ("--judgments", "judgments Parquet"), ("--detectors", "trained detector directory"),
                       ("--out", "metrics JSON"), ("--plot", "per-layer AUROC JSON (DVC plot)")]:
        p.add_argument(flag, required=True, help=text)
    p.add_argument("--clusters", help="clusters Parquet (P_sem), for hami_sp only")
    p.add_argument("--timings", help="cluster_timings Parquet, for hami_sp's cost")
    p.add_argument("--generation-metrics", help="generate metrics JSON (seconds_per_sample), for hami_sp's cost")
    cli.main(run, p)
