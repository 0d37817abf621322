"""The baselines without hidden states (halludetect/evaluation/baselines.py): fixed signs, never fitted
on test labels, what they cannot score counted, and a one-class split named."""

import polars as pl
import pytest
from sklearn.metrics import roc_auc_score
from support import world_like_tables

from halludetect.config import BaselinesParams
from halludetect.detectors.data import DataError
from halludetect.evaluation.baselines import baseline_scores, evaluate_baseline


def test_baselines_score_with_a_fixed_sign_and_count_what_they_cannot_score():
    labels, gens, clusters = world_like_tables()
    params = BaselinesParams()
    scores = baseline_scores("p_sem", gens, clusters, params)
    m = evaluate_baseline(scores, labels, bootstrap=50, seed=0)
    assert m["excluded"]["test"] == {"no_score": 2}  # test0's question did not cluster
    joined = labels.filter((pl.col("split") == "test") & (pl.col("question_id") != "test0")).join(
        clusters, on=["question_id", "sample_index"]
    )
    assert m["test"]["auroc"]["mean"] == pytest.approx(roc_auc_score(joined["label"], 1 - joined["p_sem_sum"]))
    mean = baseline_scores("p_sem", gens, clusters, BaselinesParams(p_sem="mean"))  # another variant: other scores
    assert evaluate_baseline(mean, labels, bootstrap=0, seed=0)["test"]["auroc"]["mean"] == pytest.approx(0.5)
    assert m["test"]["margin"] is None and m["best_layer"] is None
    for name in ("semantic_entropy", "logprob", "length"):
        assert (
            evaluate_baseline(baseline_scores(name, gens, clusters, params), labels, bootstrap=0, seed=0)["test"][
                "auroc"
            ]["mean"]
            > 0.9
        )
    with pytest.raises(KeyError, match="did you mean 'length'"):
        baseline_scores("lenght", gens, clusters, params)
    one_class = labels.with_columns(pl.when(pl.col("split") == "val").then(1).otherwise(pl.col("label")).alias("label"))
    with pytest.raises(DataError, match=r"split 'val' has one class only \(40 hallucinated of 40 kept\)"):
        evaluate_baseline(scores, one_class, bootstrap=0, seed=0)
