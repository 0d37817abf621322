"""The evaluate stage of a score with nothing to train (halludetect/methods/scores.py), handed over by
stages/evaluate.py as stages/train_score.py is by the train stage: its val/test figures and the cost
of one more response (--out: a trained detector's shape, best_layer null and no layers), its
per-layer plot (--plot: no points) and its bundle for `halludetect score` (thresholds and
calibration from validation: halludetect/scoring/score_bundle.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json
from halludetect.core.errors import DataError
from halludetect.evaluation.baselines import evaluate_baseline
from halludetect.evaluation.costs import cost_per_response, sampling_seconds
from halludetect.labels.readers import read_judgments
from halludetect.labels.routing import take_routed
from halludetect.methods import SCORES
from halludetect.scoring.score_bundle import export_score_bundle
from stages import common
from stages.export import sampling_input
from stages.train_score import ANSWERS, TIMING


def _extra_cost(spec, args, judgments: pl.DataFrame, generation_metrics: dict) -> tuple[float, str]:
    """The seconds one more response costs beyond the score's own: the K - 1 more samples it reads, and
    the question's clustering for those that read it (its NLI seconds on the test questions)."""
    if not ({"sampling", "sampling + NLI"} & set(spec.needs)):
        return 0.0, ""
    k, sampling = sampling_seconds(generation_metrics)
    extra, what = sampling, f"{k:g} - 1 more samples (generate's seconds per sample)"
    if spec.reads_clusters:
        if not args.timings:
            raise DataError(f"{args.method} reads the clustering: pass --routed (its cluster timings)")
        timings = read_parquet(args.timings, "cluster", "cluster timings table")
        test = judgments.filter(pl.col("split") == "test")["question_id"].unique().to_list()
        nli = timings.filter(pl.col("question_id").is_in(test))["seconds"].mean()
        extra, what = extra + float(nli or 0.0), what + " + the question's clustering (cluster_timings, test questions)"
    return extra, what


def run(args, params) -> None:
    spec, p, ep = SCORES[args.method], getattr(params.detectors, args.method), params.evaluate
    take_routed(args, "evaluate")  # the cluster timings, for the cost of those that read the clustering
    for flag in ("generation_metrics", "manifest", "bundle"):
        if not getattr(args, flag):
            raise DataError(f"{args.method}: pass --{flag.replace('_', '-')} (the evaluate stage's)")
    answers = read_parquet(
        Path(args.scores) / ANSWERS, f"train@{args.model}-{args.dataset}-{args.method}", "score table"
    )
    try:
        timing = json.loads(Path(args.timing).read_text())[TIMING]
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise DataError(f"{args.timing}: not the train stage's timing file of a score ({e!r}); re-run train") from None
    out = {
        "model": args.model,
        "dataset": args.dataset,
        "method": args.method,
        "family": "baseline",  # nothing trained: the report's rows of scores
        "seeds": None,
        "params": p.model_dump(),
    }
    judgments = read_judgments(args.judgments)
    scored = answers.select(pl.col("response_id").alias("rid"), "score").drop_nulls("score")
    out |= evaluate_baseline(scored, judgments, bootstrap=ep.bootstrap, seed=ep.seed)
    if "left_out" in timing:  # before scoring: empty answers, prompts longer than the context
        out["left_out"] = timing["left_out"]
    gen = json.loads(Path(args.generation_metrics).read_text())
    extra, what = _extra_cost(spec, args, judgments, gen)
    out["cost_per_response"] = cost_per_response(
        spec.needs, timing["samples_per_s"], extra_seconds=extra, extra_what=what
    )
    if "device" in timing:
        out["cost_per_response"]["device"] = timing["device"]
    write_json(args.out, out)
    write_json(args.plot, [])  # no layers
    # K, which the score's P_sem or sets read, and the clustering for those that read it
    clusters = json.loads(Path(args.cluster_metrics).read_text()) if spec.reads_clusters else None
    summary = export_score_bundle(
        args.bundle,
        score=args.method,
        params=p.model_dump(),
        answers=answers,
        manifest=json.loads(Path(args.manifest).read_text()),
        export=params.export,
        model=args.model,
        dataset=args.dataset,
        generation=sampling_input(gen, clusters),
    )
    t = summary["threshold"]
    common.log.info(
        "%s: test AUROC %.3f; bundle: default threshold %s = %.4g (validation FPR %.3f, TPR %.3f)",
        args.method,
        out["test"]["auroc"]["mean"],
        summary["default_threshold"],
        t["threshold"],
        t["val_fpr"],
        t["val_tpr"],
    )
