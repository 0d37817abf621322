"""The rule-based judge, the two-pass protocol, clustering and semantic probability."""

import math

import numpy as np
import polars as pl
import pytest

from halludetect.labels.judges import get_judge, label_distribution, two_pass
from halludetect.labels.judges.base import JudgeItem
from halludetect.labels.nli import cluster_question, cluster_responses, get_nli
from halludetect.labels.nli.clustering import semantic_probabilities
from halludetect.labels.text import contains, normalise


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
    with pytest.raises(KeyError, match="valid: exact, hf, openai"):
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
            from halludetect.labels.judges.base import Verdict

            return [Verdict("invalid", "garbled") for _ in items]

    questions, gens = _frames()
    df = two_pass(Broken(), questions, gens)
    assert df["label"].null_count() == df.height and not df["kept"].any()
    assert set(df["reason"]) == {"pass 1 invalid"}


def test_clustering_merges_duplicates_before_nli():
    calls = []

    class Counting:
        name = "counting"

        def relations(self, pairs):
            calls.extend(pairs)
            return get_nli("exact").relations(pairs)

    texts = ["Paris.", "paris", "Lyon.", "Paris!", "Nice"]
    ids, n = cluster_question(Counting(), "Where?", texts, "paper")
    assert ids == [0, 0, 1, 0, 2]
    u = 3  # unique normalised answers
    assert n == len(calls) <= u * (u - 1)


def test_equivalence_rules():
    class Fixed:
        name = "fixed"

        def relations(self, pairs):  # A->B entailment, B->A neutral
            return ["entailment", "neutral"] * (len(pairs) // 2)

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
    questions = pl.DataFrame({"id": ["q", "r"], "question": ["Where?", "Who?"]})
    gens = pl.DataFrame({
        "question_id": ["q"] * 3 + ["r"] * 2, "sample_index": [0, 1, 2, 0, 1], "split": ["test"] * 5,
        "text": ["Paris", "Lyon", "", "Bob", "bob."], "n_tokens": [2, 1, 0, 1, 1],
        "token_logprobs": [[-1.0, -1.0], [-1.5], [], [-0.1], [-0.2]],
    })
    df, timings = cluster_responses(get_nli("exact"), questions, gens, equivalence="paper")
    q = df.filter(pl.col("question_id") == "q")
    assert q.height == 2  # the empty answer is excluded
    mean_w, sum_w = np.exp([-1.0, -1.5]), np.exp([-2.0, -1.5])  # Paris is shorter on average, Lyon in total
    np.testing.assert_allclose(q["p_sem_mean"], mean_w / mean_w.sum())
    np.testing.assert_allclose(q["p_sem_sum"], sum_w / sum_w.sum())
    assert q["p_sem_count"].to_list() == [0.5, 0.5] and q["semantic_entropy_discrete"][0] == pytest.approx(math.log(2))
    assert q["nli_calls"].to_list() == [2, 2] and q["valid"].all()
    r = df.filter(pl.col("question_id") == "r")  # one unique answer after normalisation: no call
    assert r["p_sem_mean"].to_list() == [1.0, 1.0] and r["n_clusters"].to_list() == [1, 1]
    assert r["nli_calls"].to_list() == [0, 0] and r["semantic_entropy_mean"][0] == 0.0
    assert timings.select("question_id", "n_answers", "n_unique", "nli_calls").to_dicts() == [
        {"question_id": "q", "n_answers": 2, "n_unique": 2, "nli_calls": 2},
        {"question_id": "r", "n_answers": 2, "n_unique": 1, "nli_calls": 0},
    ]
    assert (timings["seconds"] >= 0).all()
