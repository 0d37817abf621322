"""Semantic clustering of the K answers per question; semantic probability and entropy."""

import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json, write_parquet
from halludetect.core.errors import UserError
from halludetect.labels.nli import cluster_responses, nli_from, unusable_clustering
from halludetect.qa.questions import read_questions
from stages import common


def run(args, params):
    cp = params.cluster
    # Built first: a missing API key or classifier fails here, before any file is read.
    nli = nli_from(cp)
    gens = read_parquet(args.generations, "generate", "generations table")
    df, timings = cluster_responses(nli, read_questions(args.questions), gens, equivalence=cp.equivalence)
    write_parquet(args.out, df)
    write_parquet(args.timings, timings)
    per_q = df.unique("question_id", keep="first").sort("question_id")
    valid = per_q.filter(pl.col("valid"))
    metrics = {
        "backend": cp.backend,
        "equivalence": cp.equivalence,
        "answers": df.height,
        "excluded_empty_answers": int((gens["n_tokens"] == 0).sum()),
        "questions": per_q.height,
        "invalid_questions": per_q.height - valid.height,  # the NLI backend failed: no P_sem for their answers
        "single_answer_questions": int((per_q["n_unique"] == 1).sum()),  # one unique answer: no NLI call
        "mean_unique_answers": float(per_q["n_unique"].mean()) if per_q.height else None,
        "mean_clusters": float(valid["n_clusters"].mean()) if valid.height else None,
        "nli_calls": int(timings["nli_calls"].sum()),
        "nli_calls_per_question": float(timings["nli_calls"].mean()) if timings.height else None,
        "mean_semantic_entropy": float(valid["semantic_entropy_mean"].mean()) if valid.height else None,
        "seconds_total": round(float(timings["seconds"].sum()), 3),
        "seconds_per_question": float(timings["seconds"].mean()) if timings.height else None,
    }
    if hasattr(nli, "usage"):
        metrics["api"] = nli.usage.report(params.prices)
    write_json(args.metrics, metrics)
    common.log.info("cluster: %s", {k: v for k, v in metrics.items() if k != "api"})
    # Written first, so they can be inspected; then a clustering nothing can use fails the stage.
    if unusable := unusable_clustering(df):
        where = (
            f"; the raw replies are in the call cache {nli.runner.cache.path} (table calls)"
            if hasattr(nli, "runner")
            else ""
        )
        raise UserError(
            "cluster: no usable clustering:\n  "
            + "\n  ".join(unusable)
            + f"\nInvalid questions are the rows with valid = false in {args.out}, counted in "
            f"{args.metrics}{where}. Check cluster.{cp.backend} (model, endpoint); replies are cached per "
            "request, so re-running unchanged asks nothing new"
        )
    if metrics["invalid_questions"]:
        common.log.warning("cluster: %d questions invalid (no P_sem for their answers)", metrics["invalid_questions"])


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--questions", required=True, help="questions Parquet")
    p.add_argument("--generations", required=True, help="generations Parquet")
    p.add_argument("--out", required=True, help="clusters Parquet (one row per answer)")
    p.add_argument("--timings", required=True, help="per-question clustering cost Parquet (NLI calls, seconds)")
    p.add_argument("--metrics", required=True, help="clustering summary JSON")
    common.main(run, p)
