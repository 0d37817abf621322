"""Semantic clustering of the K answers per question; semantic probability and entropy."""

import polars as pl

from halludetect import cli
from halludetect.datasets import read_questions
from halludetect.io import write_json, write_parquet
from halludetect.nli import cluster_responses, get_nli


def run(args, params):
    cp = params.cluster
    gens = pl.read_parquet(args.generations)
    df = cluster_responses(get_nli(cp.backend), read_questions(args.questions), gens,
                           equivalence=cp.equivalence, likelihood=cp.likelihood)
    write_parquet(args.out, df)
    per_q = df.unique("question_id")
    metrics = {
        "backend": cp.backend, "equivalence": cp.equivalence, "likelihood": cp.likelihood,
        "answers": df.height, "excluded_empty_answers": int((gens["n_tokens"] == 0).sum()),
        "questions": per_q.height, "mean_clusters": float(per_q["n_clusters"].mean()),
        "nli_calls_per_question": float(per_q["nli_calls"].mean()),
        "mean_semantic_entropy": float(per_q["semantic_entropy"].mean()),
    }
    write_json(args.metrics, metrics)
    cli.log.info("cluster: %s", metrics)


if __name__ == "__main__":
    p = cli.parser(__doc__)
    p.add_argument("--questions", required=True, help="questions Parquet")
    p.add_argument("--generations", required=True, help="generations Parquet")
    p.add_argument("--out", required=True, help="clusters Parquet")
    p.add_argument("--metrics", required=True, help="clustering summary JSON")
    cli.main(run, p)
