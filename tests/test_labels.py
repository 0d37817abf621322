"""The rule-based judge, the two-pass protocol, clustering and semantic probability."""

import math

import numpy as np
import polars as pl
import pytest

from halludetect.judges import get_judge, label_distribution, two_pass
from halludetect.judges.base import JudgeItem
from halludetect.nli import cluster_question, cluster_responses, get_nli
from halludetect.nli.clustering import semantic_probabilities
from halludetect.text import contains, normalise


def test_normalise_and_contains():
    assert normalise("The  Eiffel-Tower!") == "eiffeltower"
    assert contains("He was born in New York City.", "new york")
    assert not contains("He was born in Newark.", "new york")
    assert not contains("anything", "")


def test_match_judge_passes():
    judge = get_judge("match", lenient_recall=0.5)
    items = [JudgeItem("Q", "Smith did it.", ("John Smith",)), JudgeItem("Q", "John Smith did.", ("John Smith",))]
    strict = judge.judge(items, with_reference=True)
    lenient = judge.judge(items, with_reference=False)
    assert [v.verdict for v in strict] == ["no", "yes"]
    assert lenient[0].verdict == "yes"  # a near miss: the protocol will drop it


def test_unknown_backend_did_you_mean():
    with pytest.raises(KeyError, match="did you mean 'match'"):
        get_judge("mach")
    with pytest.raises(KeyError, match="valid: exact"):
        get_nli("deberta")


def _frames():
    questions = pl.DataFrame({"id": ["q1", "q2"], "question": ["Who?", "Where?"],
                              "answers": [["John Smith"], ["Paris"]]})
    gens = pl.DataFrame({
        "question_id": ["q1", "q1", "q1", "q2"], "sample_index": [0, 1, 2, 0],
        "split": ["val", "val", "val", "test"],
        "text": ["It was John Smith.", "Smith.", "Mary Jones.", "Paris."],
    })
    return questions, gens


def test_two_pass_protocol_labels_and_drops():
    questions, gens = _frames()
    df = two_pass(get_judge("match"), questions, gens)
    got = {(r["question_id"], r["sample_index"]): (r["label"], r["kept"], r["reason"]) for r in df.to_dicts()}
    assert got[("q1", 0)] == (0, True, "correct")
    assert got[("q1", 1)] == (None, False, "inconsistent")  # wrong in pass 1, right in pass 2
    assert got[("q1", 2)] == (1, True, "hallucination")
    assert got[("q2", 0)] == (0, True, "correct")
    dist = label_distribution(df)
    assert dist["val"] == {"judged": 3, "kept": 2, "correct": 1, "hallucinated": 1, "hallucination_rate": 0.5,
                           "dropped": {"inconsistent": 1}}


def test_invalid_verdicts_never_become_labels():
    class Broken:
        name = "broken"

        def judge(self, items, with_reference):
            from halludetect.judges.base import Verdict

            return [Verdict("invalid", "garbled") for _ in items]

    questions, gens = _frames()
    df = two_pass(Broken(), questions, gens)
    assert df["label"].null_count() == df.height and not df["kept"].any()
    assert set(df["reason"]) == {"pass 1 invalid"}


def test_clustering_merges_duplicates_before_nli():
    calls = []

    class Counting:
        name = "counting"

        def relations(self, question, pairs):
            calls.extend(pairs)
            return get_nli("exact").relations(question, pairs)

    texts = ["Paris.", "paris", "Lyon.", "Paris!", "Nice"]
    ids, n = cluster_question(Counting(), "Where?", texts, "paper")
    assert ids == [0, 0, 1, 0, 2]
    u = 3  # unique normalised answers
    assert n == len(calls) <= u * (u - 1)


def test_equivalence_rules():
    class Fixed:
        name = "fixed"

        def relations(self, question, pairs):  # A->B entailment, B->A neutral
            return ["entailment", "neutral"]

    assert cluster_question(Fixed(), "q", ["a", "b"], "paper")[0] == [0, 0]
    assert cluster_question(Fixed(), "q", ["a", "b"], "strict")[0] == [0, 1]


def test_semantic_probability_formula():
    ids = [0, 0, 1]
    logliks = [math.log(0.5), math.log(0.3), math.log(0.2)]
    p_sem, p_cnt, se, se_d = semantic_probabilities(ids, logliks)
    np.testing.assert_allclose(p_sem, [0.8, 0.8, 0.2])
    np.testing.assert_allclose(p_cnt, [2 / 3, 2 / 3, 1 / 3])
    assert se == pytest.approx(-(0.8 * math.log(0.8) + 0.2 * math.log(0.2)))
    assert se_d == pytest.approx(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)))
    # huge negative log-likelihoods stay finite (computed relative to the max)
    p, *_ = semantic_probabilities([0, 1], [-2000.0, -2001.0])
    assert np.isfinite(p).all() and p[0] > p[1]


def test_cluster_responses_mean_vs_sum_and_empty_answers():
    questions = pl.DataFrame({"id": ["q"], "question": ["Where?"]})
    gens = pl.DataFrame({
        "question_id": ["q"] * 3, "sample_index": [0, 1, 2], "split": ["test"] * 3,
        "text": ["Paris", "Paris", ""], "n_tokens": [2, 1, 0],
        "token_logprobs": [[-1.0, -1.0], [-1.0], []],
    })
    mean = cluster_responses(get_nli("exact"), questions, gens, equivalence="paper", likelihood="mean")
    assert mean.height == 2 and mean["p_sem"].to_list() == [1.0, 1.0]  # the empty answer is excluded
    assert mean["n_clusters"].to_list() == [1, 1]
