"""Baseline scores that need no hidden states: one number per response, higher = more
likely hallucinated. Signs are fixed by definition, never fitted on the test labels.

  p_sem             1 - P_sem (the response's semantic cluster probability)
  semantic_entropy  the question's semantic entropy (Farquhar et al.)
  logprob           minus the mean token log-probability of the response
  length            the number of answer tokens

The last-token linear probe is trained on hidden states, so it is a detector (`probe`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

from halludetect.config import BASELINES, BaselinesParams
from halludetect.core.lookup import lookup, registrar
from halludetect.metrics import check_two_classes, question_groups, split_metrics
from halludetect.qa.responses import response_ids

BASELINE_SCORES: dict[str, Callable[[pl.DataFrame, pl.DataFrame, BaselinesParams], pl.DataFrame]] = {}
register = registrar(BASELINE_SCORES)


def _by_response(df: pl.DataFrame, score: pl.Expr) -> pl.DataFrame:
    return df.select(response_ids(df).alias("rid"), score.cast(pl.Float64).alias("score"))


@register("p_sem")
def _p_sem(generations, clusters, p):
    ok = clusters.filter(pl.col("valid"))
    return _by_response(ok, 1 - pl.col(f"p_sem_{p.p_sem}"))


@register("semantic_entropy")
def _semantic_entropy(generations, clusters, p):
    ok = clusters.filter(pl.col("valid"))
    return _by_response(ok, pl.col(f"semantic_entropy_{p.semantic_entropy}"))


@register("logprob")
def _logprob(generations, clusters, p):
    return _by_response(generations.filter(pl.col("n_tokens") > 0), -pl.col("token_logprobs").list.mean())


@register("length")
def _length(generations, clusters, p):
    return _by_response(generations, pl.col("n_tokens"))


assert set(BASELINE_SCORES) == set(BASELINES), "config.BASELINES must name every registered baseline"


def baseline_scores(
    name: str, generations: pl.DataFrame, clusters: pl.DataFrame, params: BaselinesParams
) -> pl.DataFrame:
    """Columns rid, score for every response the baseline can score."""
    return lookup("baseline", name, BASELINE_SCORES)(generations, clusters, params)


def evaluate_baseline(scores: pl.DataFrame, judgments: pl.DataFrame, *, bootstrap: int, seed: int) -> dict:
    """A baseline's val/test figures from its per-response scores (columns rid, score)."""
    labels = judgments.filter(pl.col("kept")).select(
        response_ids(judgments).alias("rid"), "question_id", "split", "label"
    )
    joined = labels.join(scores, on="rid", how="left")
    out = {"best_layer": None, "layers": [], "excluded": {}}
    for split in ("val", "test"):
        part = joined.filter(pl.col("split") == split)
        ok = part.filter(pl.col("score").is_not_null() & pl.col("score").is_finite())
        out["excluded"][split] = {"no_score": part.height - ok.height}
        y = ok["label"].to_numpy().astype(np.int64)
        check_two_classes(y, split)
        out[split] = split_metrics(
            y,
            [ok["score"].to_numpy()],
            bootstrap=bootstrap if split == "test" else 0,
            seed=seed,
            logits=False,
            groups=question_groups(ok["question_id"].to_list()),
        )
    return out
