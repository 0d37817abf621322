"""The `openai` judge and NLI backends against a real local HTTP server, and the `hf` NLI backend.

The server (`halludetect.testing.fake_openai`) speaks the chat-completions API on 127.0.0.1 and is
scripted per test; the real `openai` client talks to it, so retries, Retry-After, timeouts,
malformed bodies, the call cache and strict parsing are all exercised over real HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from halludetect.config import ChatParams, ParamsError, Price, parse_params
from halludetect.labels.call_cache import CallCache
from halludetect.labels.chat_client import ApiError, ChatRunner
from halludetect.labels.judges import get_judge, two_pass
from halludetect.labels.nli import cluster_responses, get_nli
from halludetect.labels.text import RELATIONS, YES_NO, parse_choice
from halludetect.testing.fake_openai import FakeOpenAI, Fault, rule_responder

KEY = "HD_TEST_API_KEY"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("HALLUDETECT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(KEY, "sk-test-not-a-real-key")


def runner(srv, **kw) -> ChatRunner:
    params = {"model": "judge-model", "base_url": srv.url, "api_key_env": KEY, "max_retries": 3, "timeout": 10} | kw
    return ChatRunner(ChatParams(**params), where="judge.openai")


yes_no = lambda t: parse_choice(t, YES_NO)
always_yes = lambda body, n: "yes"


# ------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("reply, want", [
    ("yes", "yes"), ("No", "no"), ("YES.", "yes"), ("**No**", "no"), ("Yes, the answer is correct.", "yes"),
    ("no - it was Lyon", "no"), ("The answer is no.", None), ("Yes... actually no", None), ("maybe", None),
    ("", None), (None, None), ("yesterday", None),
])
def test_yes_no_replies_parse_strictly(reply, want):
    assert parse_choice(reply, YES_NO) == want


@pytest.mark.parametrize("reply, want", [
    ("entailment", "entailment"), ("Entailment.", "entailment"), ("NEUTRAL", "neutral"),
    ("contradiction: they differ", "contradiction"), ("Answer A does not entail answer B", None),
    ("entailment,contradiction, or neutral", None), ("Entails", "entailment"),
])
def test_relation_replies_parse_strictly(reply, want):
    assert parse_choice(reply, RELATIONS) == want


# ------------------------------------------------------------------------ bad input
def test_missing_key_fails_before_any_call(monkeypatch):
    monkeypatch.delenv(KEY)
    with FakeOpenAI(always_yes) as srv:
        with pytest.raises(ApiError, match=f"{KEY} is not set"):
            get_judge("openai", model="m", base_url=srv.url, api_key_env=KEY)
        assert srv.count == 0


def test_reasoning_model_params_are_checked_and_sent():
    with pytest.raises(ParamsError, match="reasoning models reject a temperature"):
        data = yaml.safe_load((REPO / "params.yaml").read_text())
        data["judge"]["openai"]["temperature"] = 0.5
        data["judge"]["openai"]["reasoning_effort"] = "low"
        parse_params(data)
    with FakeOpenAI(always_yes) as srv:
        runner(srv, reasoning_effort="low").run(["Q?"], yes_no)
        body = srv.requests[0]
        assert body["reasoning_effort"] == "low" and "temperature" not in body and "max_completion_tokens" not in body


def test_endpoint_down_is_a_clear_error():
    with FakeOpenAI(always_yes) as srv:
        url = srv.url  # the port is closed once the server is gone
    r = ChatRunner(ChatParams(model="m", base_url=url, api_key_env=KEY, max_retries=1), where="judge.openai")
    with pytest.raises(ApiError, match=r"cannot reach http://127\.0\.0\.1.*is the server up"):
        r.run(["Q?"], yes_no)


def test_rejected_model_name_fails_after_one_request():
    with FakeOpenAI(always_yes, models=("gpt-5-mini",)) as srv:
        with pytest.raises(ApiError, match="has no model 'gpt-6-mini'.*check judge.openai.model"):
            runner(srv, model="gpt-6-mini", concurrency=8).run([f"Q{i}?" for i in range(50)], yes_no)
        assert srv.count == 1  # the first uncached request goes alone


# ------------------------------------------------------------------- fault injection
def test_retries_429_with_retry_after_500_and_malformed_bodies():
    faults = {0: Fault(429, {"Retry-After": "0.4"}), 1: Fault(500), 2: Fault(200, body="{not json"),
              3: Fault(200, body=json.dumps({"id": "x", "object": "chat.completion", "choices": []}))}
    with FakeOpenAI(lambda body, n: faults.get(n, "Yes.")) as srv:
        r = runner(srv, concurrency=1)
        t0 = time.perf_counter()
        out = r.run(["Is it Paris?"], yes_no)
        assert time.perf_counter() - t0 >= 0.4  # Retry-After was honoured
        assert out[0].value == "yes" and srv.count == 5
        assert r.usage.calls == 1 and r.usage.cache_hits == 0


def test_persistent_5xx_stops_with_progress_saved_and_resumes_without_paying_twice():
    state = {"broken_after": 6}
    respond = lambda body, n: Fault(503) if n >= state["broken_after"] else "no"
    prompts = [f"Question {i}?" for i in range(30)]
    with FakeOpenAI(respond) as srv:
        with pytest.raises(ApiError, match=r"HTTP 503 after 1 retries.*re-run to resume"):
            runner(srv, max_retries=1, concurrency=4).run(prompts, yes_no)
        saved = len(CallCache(Path(os.environ["HALLUDETECT_CACHE"]) / "api_calls.sqlite"))
        assert saved == 6
        state["broken_after"] = 10**9
        before = srv.count
        r = runner(srv, concurrency=4)
        assert [x.value for x in r.run(prompts, yes_no)] == ["no"] * 30
        assert srv.count - before == 30 - saved and r.usage.cache_hits == saved
        # a third run asks nothing
        before = srv.count
        assert runner(srv).run(prompts, yes_no)[0].value == "no" and srv.count == before


def test_slow_replies_time_out_then_fail_clearly():
    slow = lambda body, n: Fault(200, delay=1.0) if body["messages"][0]["content"] == "slow" else "yes"
    with FakeOpenAI(slow) as srv:
        assert runner(srv, timeout=2).run(["fast"], yes_no)[0].value == "yes"
        with pytest.raises(ApiError, match=r"timed out 2 times \(0.3 s each\); raise judge.openai.timeout"):
            runner(srv, timeout=0.3, max_retries=1).run(["slow"], yes_no)


def test_unparseable_replies_are_asked_again_then_counted_invalid_never_labels():
    def respond(body, n):
        prompt = body["messages"][0]["content"]
        if "Mary" in prompt:
            return "I cannot tell."  # never parseable
        if "Smith, John" in prompt and not srv.requests[:n].count(body):
            return "The proposed answer is plausible."  # first ask only
        return rule_responder({"Who?": ["John Smith"]})(body, n)

    questions = pl.DataFrame({"id": ["q1"], "question": ["Who?"], "answers": [["John Smith"]]})
    gens = pl.DataFrame({"question_id": ["q1"] * 3, "sample_index": [0, 1, 2], "split": ["test"] * 3,
                         "text": ["It was John Smith.", "Mary Jones.", "Smith, John"]})
    with FakeOpenAI(respond) as srv:
        judge = get_judge("openai", model="m", base_url=srv.url, api_key_env=KEY, parse_retries=2)
        df = two_pass(judge, questions, gens)
    got = {r["sample_index"]: r for r in df.to_dicts()}
    assert got[0]["label"] == 0 and got[0]["reason"] == "correct"
    assert got[1]["pass1_verdict"] == "invalid" and got[1]["label"] is None and not got[1]["kept"]
    assert got[1]["pass1_raw"] == "I cannot tell."
    assert got[2]["pass1_verdict"] == "no"  # "Smith, John" is not contiguous "John Smith" ...
    assert got[2]["pass2_verdict"] == "yes" and got[2]["reason"] == "inconsistent"  # ... asked twice in pass 2
    assert judge.usage.invalid == 1 and judge.usage.unparseable == 3 + 2  # Mary 3 times, Smith once per pass


def test_openai_judge_matches_the_offline_judge_and_pass_2_has_no_references():
    questions = pl.DataFrame({"id": ["q1", "q2"], "question": ["Who?", "Where?"],
                              "answers": [["John Smith", "J. Smith"], ["Paris"]]})
    gens = pl.DataFrame({"question_id": ["q1", "q1", "q1", "q2"], "sample_index": [0, 1, 2, 0],
                         "split": ["val", "val", "val", "test"],
                         "text": ["It was John Smith.", "Smith.", "Mary Jones.", "Paris."]})
    offline = two_pass(get_judge("match"), questions, gens)
    with FakeOpenAI(rule_responder({"Who?": ["John Smith", "J. Smith"], "Where?": ["Paris"]})) as srv:
        judge = get_judge("openai", model="m", base_url=srv.url, api_key_env=KEY)
        online = two_pass(judge, questions, gens)
        prompts = [b["messages"][0]["content"] for b in srv.requests]
    cols = ["question_id", "sample_index", "pass1_verdict", "pass2_verdict", "label", "kept", "reason"]
    assert online.select(cols).equals(offline.select(cols))
    pass1, pass2 = prompts[:4], prompts[4:]
    assert len(pass2) == 2  # only the answers wrong in pass 1 go to pass 2
    who = [p for p in pass1 if "question: Who?" in p]
    assert len(who) == 3 and all("expected answers to this question: John Smith; J. Smith." in p for p in who)
    assert all("expected" not in p and "own knowledge" in p for p in pass2)


def test_usage_and_cost_accounting():
    prices = {"m": Price(input=1.0, output=10.0)}
    with FakeOpenAI(always_yes) as srv:
        r = runner(srv, model="m")
        r.run(["one two three", "four five"], yes_no)
        first = r.usage.report(prices)
        assert first["calls"] == 2 and first["prompt_tokens"] == 5 and first["completion_tokens"] == 2
        assert first["cost_usd"] == pytest.approx((5 * 1.0 + 2 * 10.0) / 1e6)
        r2 = runner(srv, model="m")
        r2.run(["one two three", "four five"], yes_no)
        again = r2.usage.report(prices)
        assert again["calls"] == 0 and again["cache_hits"] == 2 and again["cost_usd"] == 0
        assert again["cost_usd_all"] == first["cost_usd"]
        assert runner(srv, model="other").usage.report(prices)["cost_usd"] is None


def test_cache_key_covers_sampling_params_and_never_the_key():
    with FakeOpenAI(always_yes) as srv:
        runner(srv, temperature=0.0).run(["Q?"], yes_no)
        runner(srv, temperature=0.0).run(["Q?"], yes_no)
        runner(srv, temperature=0.7).run(["Q?"], yes_no)
        assert srv.count == 2
    db = sqlite3.connect(Path(os.environ["HALLUDETECT_CACHE"]) / "api_calls.sqlite")
    dump = "\n".join(map(str, db.execute("SELECT * FROM calls").fetchall()))
    assert os.environ[KEY] not in dump


# -------------------------------------------------------------------------- NLI
def test_openai_nli_clusters_like_exact_and_marks_failed_questions_invalid():
    questions = pl.DataFrame({"id": ["q", "r"], "question": ["Where?", "Who?"]})
    gens = pl.DataFrame({
        "question_id": ["q"] * 4 + ["r"] * 2, "sample_index": [0, 1, 2, 3, 0, 1], "split": ["test"] * 6,
        "text": ["Paris.", "Lyon", "paris", "Nice", "Bob", "Alice"], "n_tokens": [1] * 6,
        "token_logprobs": [[-0.5]] * 6,
    })
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
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                        id2label={0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"},
                        label2id={"CONTRADICTION": 0, "NEUTRAL": 1, "ENTAILMENT": 2})
    path = tmp_path_factory.mktemp("nli") / "model"
    BertForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_hf_nli_batches_distinct_pairs_and_matches_one_by_one(tiny_nli_dir):
    import torch

    pairs = [("Where?", "Paris is the city.", "It was Lyon."), ("Where?", "It was Lyon.", "Paris is the city."),
             ("Where?", "Paris is the city.", "It was Lyon."), ("Who?", "A pianist.", "A pianist from Nice.")]
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


# --------------------------------------------------------- stages over real processes
def _stage_inputs(tmp_path: Path, srv_url: str, n_questions: int = 40) -> tuple[Path, list[str]]:
    questions = pl.DataFrame({"id": [f"q{i}" for i in range(n_questions)],
                              "question": [f"Where was person {i} born?" for i in range(n_questions)],
                              "answers": [[f"City{i}"] for i in range(n_questions)],
                              "context": [""] * n_questions, "split": ["test"] * n_questions})
    rows = [{"question_id": f"q{i}", "sample_index": k, "split": "test", "n_tokens": 3,
             "text": f"Born in City{i if k % 2 == 0 else i + k}.", "token_logprobs": [-0.5, -0.5, -0.5]}
            for i in range(n_questions) for k in range(5)]
    questions.write_parquet(tmp_path / "questions.parquet")
    pl.DataFrame(rows).write_parquet(tmp_path / "generations.parquet")
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    for section in ("judge", "cluster"):
        data[section]["backend"] = "openai"
        data[section]["openai"].update(base_url=srv_url, api_key_env=KEY, concurrency=4)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    args = ["--params", str(tmp_path / "params.yaml"), "--questions", str(tmp_path / "questions.parquet"),
            "--generations", str(tmp_path / "generations.parquet")]
    return tmp_path, args


def test_judge_stage_reruns_without_calls_and_sigint_loses_no_paid_reply(tmp_path):
    with FakeOpenAI(rule_responder(), latency=0.05) as srv:
        d, args = _stage_inputs(tmp_path, srv.url)
        cmd = [sys.executable, "-m", "stages.judge", *args, "--out", str(d / "j.parquet"),
               "--metrics", str(d / "m.json")]
        proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while srv.count < 12 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted by SIGINT" in err and "re-run to resume" in err
        assert not (d / "j.parquet").exists()
        answered = srv.count
        assert len(CallCache(Path(os.environ["HALLUDETECT_CACHE"]) / "api_calls.sqlite")) == answered  # none lost
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        bodies = [json.dumps(b, sort_keys=True) for b in srv.requests]
        assert len(bodies) == len(set(bodies))  # no request was sent twice
        first = (d / "j.parquet").read_bytes()
        metrics = json.loads((d / "m.json").read_text())
        assert metrics["api"]["calls"] == srv.count - answered and metrics["api"]["cache_hits"] == answered
        assert metrics["splits"]["test"]["judged"] == 200
        before = srv.count
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        assert srv.count == before and (d / "j.parquet").read_bytes() == first
        assert json.loads((d / "m.json").read_text())["api"]["calls"] == 0


def test_cluster_stage_over_openai_and_missing_key_message(tmp_path, monkeypatch):
    with FakeOpenAI(rule_responder()) as srv:
        d, args = _stage_inputs(tmp_path, srv.url, n_questions=6)
        cmd = [sys.executable, "-m", "stages.cluster", *args, "--out", str(d / "c.parquet"),
               "--timings", str(d / "t.parquet"), "--metrics", str(d / "m.json")]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        m = json.loads((d / "m.json").read_text())
        # per question: 5 answers, 3 unique (City i, City i+1, City i+3) -> 2 + 4 calls, all neutral
        assert m["nli_calls_per_question"] == 6 and m["mean_clusters"] == 3 and m["api"]["calls"] == 36
        env = {k: v for k, v in os.environ.items() if k != KEY}
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        assert res.returncode == 2 and f"error: cluster.openai: the API key variable {KEY} is not set" in res.stderr
