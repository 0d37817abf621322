"""Entailment and clustering (halludetect/labels/nli/): duplicates merged before any NLI call, the
equivalence rules, semantic probability and entropy, the `openai` backend against a local fake
endpoint (failed questions marked invalid), the `hf` backend on a tiny classifier, the cluster
stage over OpenAI; and the hostile case of the cluster stage, which fails when no reply is usable."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from support import KEY, _stage_inputs, label_inputs, stage
from support import ROOT as REPO

from halludetect.labels.nli import cluster_question, cluster_responses, get_nli
from halludetect.labels.nli.clustering import semantic_probabilities
from halludetect.testing.fake_openai import FakeOpenAI, rule_responder


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
    gens = pl.DataFrame(
        {
            "question_id": ["q"] * 3 + ["r"] * 2,
            "sample_index": [0, 1, 2, 0, 1],
            "split": ["test"] * 5,
            "text": ["Paris", "Lyon", "", "Bob", "bob."],
            "n_tokens": [2, 1, 0, 1, 1],
            "token_logprobs": [[-1.0, -1.0], [-1.5], [], [-0.1], [-0.2]],
        }
    )
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


# ------------------------------------------------------------------ the openai and hf backends
def test_openai_nli_clusters_like_exact_and_marks_failed_questions_invalid():
    questions = pl.DataFrame({"id": ["q", "r"], "question": ["Where?", "Who?"]})
    gens = pl.DataFrame(
        {
            "question_id": ["q"] * 4 + ["r"] * 2,
            "sample_index": [0, 1, 2, 3, 0, 1],
            "split": ["test"] * 6,
            "text": ["Paris.", "Lyon", "paris", "Nice", "Bob", "Alice"],
            "n_tokens": [1] * 6,
            "token_logprobs": [[-0.5]] * 6,
        }
    )
    exact, _ = cluster_responses(get_nli("exact"), questions, gens, equivalence="paper")
    rules = rule_responder()
    respond = lambda body, n: "no idea" if "Who?" in body["messages"][0]["content"] else rules(body, n)
    with FakeOpenAI(respond) as srv:
        nli = get_nli("openai", model="nli", base_url=srv.url, api_key_env=KEY, parse_retries=1)
        online, timings = cluster_responses(nli, questions, gens, equivalence="paper")
    q, r = online.filter(pl.col("question_id") == "q"), online.filter(pl.col("question_id") == "r")
    assert q.equals(exact.filter(pl.col("question_id") == "q"))
    assert q["semantic_id"].to_list() == [0, 1, 0, 2] and q["nli_calls"][0] == 6  # 3 unique: 2 + 4 calls
    assert not r["valid"].any() and r["p_sem_mean"].null_count() == 2 and r["semantic_id"].null_count() == 2
    assert nli.usage.invalid == 2 and timings["nli_calls"].to_list() == [6, 2]  # both directions failed


@pytest.fixture(scope="module")
def tiny_nli_dir(tmp_path_factory, tiny_model_dir):
    """A randomly initialised BERT MNLI classifier with the world tokenizer, saved locally."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        id2label={0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"},
        label2id={"CONTRADICTION": 0, "NEUTRAL": 1, "ENTAILMENT": 2},
    )
    path = tmp_path_factory.mktemp("nli") / "model"
    BertForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_hf_nli_batches_distinct_pairs_and_matches_one_by_one(tiny_nli_dir):
    import torch

    pairs = [
        ("Where?", "Paris is the city.", "It was Lyon."),
        ("Where?", "It was Lyon.", "Paris is the city."),
        ("Where?", "Paris is the city.", "It was Lyon."),
        ("Who?", "A pianist.", "A pianist from Nice."),
    ]
    nli = get_nli("hf", path=str(tiny_nli_dir), device="cpu", batch_size=2)
    seen = []
    forward = nli.model.forward
    nli.model.forward = lambda **kw: seen.append(kw["input_ids"].shape[0]) or forward(**kw)
    got = nli.relations(pairs)
    assert sum(seen) == 3  # the repeated pair is classified once
    want = []
    for _, a, b in pairs:
        enc = nli.tokenizer(a, b, return_tensors="pt")
        with torch.inference_mode():
            want.append(nli.labels[int(forward(**enc).logits.argmax(-1))])
    assert got == want and set(got) <= {"entailment", "neutral", "contradiction"}
    # question conditioning changes what the classifier sees
    cond = get_nli("hf", path=str(tiny_nli_dir), device="cpu", condition_on_question=True)
    inputs = []
    cond.tokenizer = (lambda tok: lambda a, b, **kw: inputs.append((a, b)) or tok(a, b, **kw))(cond.tokenizer)
    cond.relations(pairs[:1])
    assert inputs == [(["Where? Paris is the city."], ["Where? It was Lyon."])]


def test_hf_nli_refuses_a_classifier_without_nli_labels(tmp_path, tiny_nli_dir):
    from transformers import AutoConfig

    from halludetect.lm.hf_models import ModelError

    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(tiny_nli_dir, bad)
    config = AutoConfig.from_pretrained(bad)
    config.id2label = {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    config.save_pretrained(bad)
    with pytest.raises(ModelError, match="does not name entailment, neutral and contradiction"):
        get_nli("hf", path=str(bad), device="cpu")
    with pytest.raises(ModelError, match="cannot load the NLI classifier"):
        get_nli("hf", path=str(tmp_path / "missing"), device="cpu")


# ------------------------------------------------------------------ the cluster stage
def test_cluster_stage_over_openai_and_missing_key_message(tmp_path, monkeypatch):
    with FakeOpenAI(rule_responder()) as srv:
        d, args = _stage_inputs(tmp_path, srv.url, n_questions=6)
        cmd = [
            sys.executable,
            "-m",
            "stages.cluster",
            *args,
            "--out",
            str(d / "c.parquet"),
            "--timings",
            str(d / "t.parquet"),
            "--metrics",
            str(d / "m.json"),
        ]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        m = json.loads((d / "m.json").read_text())
        # per question: 5 answers, 3 unique (City i, City i+1, City i+3) -> 2 + 4 calls, all neutral
        assert m["nli_calls_per_question"] == 6 and m["mean_clusters"] == 3 and m["api"]["calls"] == 36
        env = {k: v for k, v in os.environ.items() if k != KEY}
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        assert res.returncode == 2 and f"error: cluster.openai: the API key variable {KEY} is not set" in res.stderr


@pytest.mark.hostile
def test_cluster_stage_fails_when_every_reply_is_invalid_with_counts_and_where_to_look(tmp_path):
    with FakeOpenAI(lambda body, n: "no idea") as srv:
        args = label_inputs(tmp_path, srv.url)
        out = tmp_path / "c.parquet"
        res = stage(
            "stages.cluster",
            *args,
            "--out",
            str(out),
            "--timings",
            str(tmp_path / "t.parquet"),
            "--metrics",
            str(tmp_path / "m.json"),
        )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "error: cluster: no usable clustering:\n  every one of the 8 questions that needed the NLI backend is "
        "invalid (no usable relation came back)\n  train: 6 answers, none with a valid clustering (no P_sem)"
    ) in res.stderr
    assert f"Invalid questions are the rows with valid = false in {out}" in res.stderr
    assert f"the raw replies are in the call cache {tmp_path / 'cache' / 'api_calls.sqlite'}" in res.stderr
