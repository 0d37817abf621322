"""The baselines without hidden states (halludetect/evaluation/baselines.py): fixed signs, never fitted
on test labels, what they cannot score counted, and a one-class split named."""

import polars as pl
import pytest
from sklearn.metrics import roc_auc_score
from support import world_like_tables

from halludetect.detectors.data import DataError
from halludetect.evaluation.baselines import baseline_scores, evaluate_baseline
from halludetect.methods import SCORES


def section(name, **values):
    """The score's own params section (detectors.<name>)."""
    return SCORES[name].params(**values)


def test_baselines_score_with_a_fixed_sign_and_count_what_they_cannot_score():
    labels, gens, clusters = world_like_tables()
    scores = baseline_scores("p_sem", gens, clusters, section("p_sem"))
    m = evaluate_baseline(scores, labels, bootstrap=50, seed=0)
    assert m["excluded"]["test"] == {"no_score": 2}  # test0's question did not cluster
    joined = labels.filter((pl.col("split") == "test") & (pl.col("question_id") != "test0")).join(
        clusters, on=["question_id", "sample_index"]
    )
    assert m["test"]["auroc"]["mean"] == pytest.approx(roc_auc_score(joined["label"], 1 - joined["p_sem_sum"]))
    mean = baseline_scores("p_sem", gens, clusters, section("p_sem", variant="mean"))  # another variant: other scores
    assert evaluate_baseline(mean, labels, bootstrap=0, seed=0)["test"]["auroc"]["mean"] == pytest.approx(0.5)
    assert m["test"]["margin"] is None and m["best_layer"] is None
    for name in ("semantic_entropy", "logprob", "length"):
        assert (
            evaluate_baseline(baseline_scores(name, gens, clusters, section(name)), labels, bootstrap=0, seed=0)[
                "test"
            ]["auroc"]["mean"]
            > 0.9
        )
    with pytest.raises(KeyError, match="did you mean 'length'"):
        baseline_scores("lenght", gens, clusters, section("length"))
    one_class = labels.with_columns(pl.when(pl.col("split") == "val").then(1).otherwise(pl.col("label")).alias("label"))
    with pytest.raises(DataError, match=r"split 'val' has one class only \(40 hallucinated of 40 kept\)"):
        evaluate_baseline(scores, one_class, bootstrap=0, seed=0)


def test_lexical_similarity_is_one_minus_the_mean_pairwise_rouge_l_by_hand():
    """Answers "The cat sat." / "the cats sat" / "A dog ran": pairs (1, 2) ROUGE-L F 1 (lower case,
    punctuation dropped, "cats" stemmed to "cat"), (1, 3) and (2, 3) 0; score 1 - 1/3. A question
    with one non-empty answer is left out (lm-polygraph needs two samples)."""
    from halludetect.evaluation.baselines import lexical_dissimilarity, rouge_l

    assert rouge_l("The cat sat.", "the cats sat") == 1.0
    assert rouge_l("the cat sat on the mat", "the cat") == pytest.approx(2 * 1.0 * (2 / 6) / (1.0 + 2 / 6))
    assert lexical_dissimilarity(["The cat sat.", "the cats sat", "A dog ran"]) == pytest.approx(2 / 3)
    gens = pl.DataFrame(
        {
            "question_id": ["a", "a", "a", "b", "b"],
            "sample_index": [0, 1, 2, 0, 1],
            "text": ["The cat sat.", "the cats sat", "A dog ran", "yes", ""],
            "n_tokens": [3, 3, 3, 1, 0],
        }
    ).with_columns(pl.col("sample_index").cast(pl.Int32))
    got = baseline_scores("lexical_similarity", gens, None, section("lexical_similarity")).sort("rid")
    assert got["rid"].to_list() == ["a/0", "a/1", "a/2"]  # b has one non-empty answer: no score
    assert got["score"].to_list() == pytest.approx([2 / 3] * 3)


def test_the_number_of_semantic_sets_is_the_questions_cluster_count():
    """Question a: answers in clusters 0, 0, 1 (two sets); question b: did not cluster (no score)."""
    clusters = pl.DataFrame(
        {
            "question_id": ["a", "a", "a", "b", "b"],
            "sample_index": [0, 1, 2, 0, 1],
            "valid": [True, True, True, False, False],
            "semantic_id": [0, 0, 1, None, None],
            "n_clusters": [2, 2, 2, None, None],
        }
    ).with_columns(pl.col("sample_index").cast(pl.Int32))
    got = baseline_scores("semantic_sets", None, clusters, section("semantic_sets")).sort("rid")
    assert got["rid"].to_list() == ["a/0", "a/1", "a/2"] and got["score"].to_list() == [2.0, 2.0, 2.0]


def test_semantic_entropy_in_lm_polygraphs_convention_does_not_normalise():
    """variant polygraph is lm-polygraph's SemanticEntropy as it ships: -mean over the answers of log sum
    exp(summed token log-probs) over the answer's cluster, the likelihoods not normalised over the K
    answers; the default (mean) is the entropy of normalised cluster probabilities. Both are stated."""
    import math

    gens = pl.DataFrame(
        {
            "question_id": ["q"] * 3,
            "sample_index": [0, 1, 2],
            "token_logprobs": [[-0.5, -0.5], [-2.0], [-1.0, -2.0]],  # summed: -1, -2, -3
        }
    )
    clusters = pl.DataFrame(
        {"question_id": ["q"] * 3, "sample_index": [0, 1, 2], "valid": [True] * 3, "semantic_id": [0, 0, 1]}
    )
    got = baseline_scores("semantic_entropy", gens, clusters, section("semantic_entropy", variant="polygraph"))
    c0, c1 = math.log(math.exp(-1) + math.exp(-2)), -3.0
    assert got["score"].to_list() == pytest.approx([-(2 * c0 + c1) / 3] * 3)
    # normalised, the same clusters give an entropy of at most log 2: another number, another convention
    p0 = (math.exp(-1) + math.exp(-2)) / (math.exp(-1) + math.exp(-2) + math.exp(-3))
    assert -(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0)) < -(2 * c0 + c1) / 3
