"""HaMI (SP) one response at a time (halludetect/evaluation/latency.py): real sampling of K - 1 answers
with the model, and the NLI calls of one question made one by one, counted and timed."""

import polars as pl
import pytest

from halludetect.config import GenerateParams
from halludetect.evaluation.latency import OneCallAtATime, sequential_cost
from halludetect.labels.nli import get_nli


def test_one_call_at_a_time_counts_every_directed_pair():
    nli = OneCallAtATime(get_nli("exact"))
    rel = nli.relations([("q", "a", "a"), ("q", "a", "b"), ("q", "b", "a")])
    assert rel == ["entailment", "neutral", "neutral"] and nli.calls == 3


def test_sequential_cost_times_sampling_and_nli_per_question(tiny):
    model, tok = tiny
    questions = pl.DataFrame(
        {"id": ["q1", "q2"], "question": ["Where was Ada born?", "What is Bo's job?"], "split": ["test", "test"]}
    )
    # q1: three distinct answers (clustering needs NLI calls), q2: one answer repeated (none)
    gens = pl.DataFrame(
        {
            "question_id": ["q1"] * 3 + ["q2"] * 3,
            "sample_index": [0, 1, 2] * 2,
            "text": ["Paris.", "Rome.", "Oslo.", "Cook.", "Cook.", "Cook."],
            "n_tokens": [2] * 6,
        }
    )
    params = GenerateParams(n_samples=3, max_new_tokens=4)
    out = sequential_cost(model, tok, get_nli("exact"), questions, gens, params, "paper")
    assert out["questions"] == 2 and out["extra_samples"] == 2 and out["nli_backend"] == "exact"
    assert out["nli_calls_per_question"] == pytest.approx((6 + 0) / 2)  # 3 unique: pairs (1,0), (2,0), (2,1)
    assert out["seconds_extra_samples_per_question"] > 0 and out["nli_seconds_per_question"] >= 0
    assert out["seconds_per_question"] == pytest.approx(
        out["seconds_extra_samples_per_question"] + out["nli_seconds_per_question"]
    )
    one = sequential_cost(
        model,
        tok,
        get_nli("exact"),
        questions,
        gens.filter(gens["sample_index"] == 0),
        GenerateParams(n_samples=1),
        "paper",
    )  # K = 1: nothing more to sample or compare
    assert one["extra_samples"] == 0 and one["seconds_extra_samples_per_question"] == 0
    assert one["nli_calls_per_question"] == 0
