"""Evaluate the baselines that need no hidden states (P_sem, semantic entropy, log-prob, length,
lexical similarity, number of semantic sets), each with its cost per response."""

import json
from pathlib import Path

import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json
from halludetect.evaluation.baselines import baseline, evaluate_baseline, timed_scores
from halludetect.evaluation.costs import cost_per_response, sampling_seconds
from halludetect.labels.readers import read_clusters, read_judgments
from stages import common


def run(args, params):
    ep, bp = params.evaluate, params.baselines
    judgments = read_judgments(args.judgments)
    generations = read_parquet(args.generations, "generate", "generations table")
    clusters = read_clusters(args.clusters)
    k, sampling = sampling_seconds(json.loads(Path(args.generation_metrics).read_text()))
    test_questions = judgments.filter(pl.col("split") == "test")["question_id"].unique().to_list()
    timings = read_parquet(args.timings, "cluster", "cluster timings table")
    nli = float(timings.filter(pl.col("question_id").is_in(test_questions))["seconds"].mean() or 0.0)
    out = {}
    for name in params.grid.baselines:
        spec = baseline(name)
        scores, seconds = timed_scores(name, generations, clusters, bp)
        out[name] = {
            "model": args.model,
            "dataset": args.dataset,
            "method": name,
            "family": "baseline",
            "seeds": None,
            "params": bp.model_dump(),
        }
        out[name] |= evaluate_baseline(scores, judgments, bootstrap=ep.bootstrap, seed=ep.seed)
        extra, what = 0.0, ""
        if "sampling" in spec.needs or "sampling + NLI" in spec.needs:
            extra, what = sampling, f"{k:g} - 1 more samples (generate's seconds per sample)"
        if "sampling + NLI" in spec.needs:
            extra, what = extra + nli, what + " + the question's clustering (cluster_timings, test questions)"
        out[name]["cost_per_response"] = cost_per_response(
            spec.needs, max(scores.height, 1) / max(seconds, 1e-9), extra_seconds=extra, extra_what=what
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
        ("--timings", "cluster_timings Parquet (the NLI seconds of the baselines that cluster)"),
        ("--generation-metrics", "generate metrics JSON (seconds per sample, for the sampling baselines' cost)"),
        ("--out", "metrics JSON of every baseline"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
