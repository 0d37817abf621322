"""Sampling through a serving engine (halludetect/lm/completions.py) over real HTTP, against the fake vLLM
engine of halludetect/testing/fake_vllm.py serving the tests' tiny model on 127.0.0.1: the generations
table and its bookkeeping as hf writes it, the request each question sends (token-id prompt, n = K,
one seed, every sampling setting), vLLM's seeding of the K answers, stops, empty answers, replicas,
and the hostile cases: an engine that is down, slow, rate-limits, fails, cuts a body, returns too few
choices, ids outside the vocabulary, NaN or missing log-probs, no token ids, another tokenizer's text,
a key it echoes, more tokens than max_tokens, a slow /v1/models, usage counts as strings; a killed run
that re-sends only the requests in flight.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from support import ROOT, SECRET, base_params, write_params

from halludetect.config import GenerateParams, ModelPreset
from halludetect.core.endpoint import ApiError
from halludetect.lm.completions import REQUESTS_FILE, generate_completions, request_seed
from halludetect.lm.generation import GENERATIONS_SCHEMA, trim_answer
from halludetect.lm.hf_models import ModelError, load_config, load_generation_eos, load_tokenizer
from halludetect.lm.model_inputs import encode_prompt
from halludetect.testing.fake_openai import Fault
from halludetect.testing.fake_vllm import FakeVLLM, nan_logprobs

KEY = "HD_TEST_ENGINE_KEY"


def questions(n=6):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{'a' * i} born?" for i in range(n)],
            "split": ["train", "val", "test"] * (n // 3) + ["test"] * (n % 3),
        }
    )


def params(url, **kw) -> GenerateParams:
    endpoint = {"base_url": url, "concurrency": 4, "max_retries": 1, "timeout": 30} | kw.pop("endpoint", {})
    base = dict(n_samples=3, max_new_tokens=6, stop=["\n"], batch_size=2, temperature=1.0, backend="completions")
    return GenerateParams(**(base | kw), endpoint=endpoint)


def sample(model_dir: Path, p: GenerateParams, qs: pl.DataFrame | None = None, **kw):
    preset = ModelPreset(path=str(model_dir), dtype="float32")
    tok, config = load_tokenizer(preset), load_config(preset)
    eos = load_generation_eos(preset, config)
    return generate_completions(tok, config, questions() if qs is None else qs, p, model=str(model_dir), eos=eos, **kw)


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A tokenizer of the same size as the tiny model's, trained on another corpus: ids that mean other text."""
    from halludetect.world.kb import build_people, corpus
    from halludetect.world.tiny_llama import train_tokenizer

    docs = corpus(build_people(30, [1, 3], ["birth_city", "job"], seed=7), qa_fraction=0.5, seed=7)
    path = tmp_path_factory.mktemp("other_tokenizer")
    train_tokenizer(docs, vocab_size=400).save_pretrained(path)
    return path


# ------------------------------------------------------------------ the table and the requests
def test_completions_write_the_hf_table_with_raw_logprobs_and_are_reproducible(tiny_model_dir, tiny):
    model, tok = tiny
    with FakeVLLM(tiny_model_dir) as srv:
        p = params(srv.url)
        df, stats = sample(tiny_model_dir, p)
        again, _ = sample(tiny_model_dir, p)
    assert df.schema == pl.Schema(GENERATIONS_SCHEMA) and df.height == 18
    assert df["question_id"].to_list() == [f"q{i}" for i in range(6) for _ in range(3)]
    assert df["sample_index"].to_list() == [0, 1, 2] * 6
    assert again.drop("seconds").equals(df.drop("seconds"))  # the same seeds, the same answers
    assert stats["requests_sent"] == 6 and stats["replicas"] == 1  # one request per question (n = K)
    for r in df.to_dicts():
        assert len(r["token_ids"]) == len(r["token_logprobs"]) == r["n_tokens"]
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True).strip()
        assert tok.eos_token_id not in r["token_ids"] and "\n" not in r["text"]
    # The recorded log-probs are the raw model's: what the dump recomputes teacher-forced.
    for r in df.filter(pl.col("n_tokens") > 0).head(6).to_dicts():
        prompt = encode_prompt(tok, questions()["question"][int(r["question_id"][1:])], False)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + r["token_ids"]])).logits[0].float(), -1)
        want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r["token_ids"])]
        np.testing.assert_allclose(r["token_logprobs"], want, atol=1e-4)
    assert df.group_by("question_id").agg(pl.col("text").n_unique())["text"].max() > 1  # K different draws


def test_a_question_sends_its_token_ids_n_k_one_seed_and_every_sampling_setting(tiny_model_dir, tiny):
    _, tok = tiny
    with FakeVLLM(tiny_model_dir) as srv:
        sample(tiny_model_dir, params(srv.url, top_k=7, top_p=0.9, repetition_penalty=1.1, seed=3), questions(2))
    first = srv.requests[0]
    assert first["prompt"] == encode_prompt(tok, questions(2)["question"][0], False)  # our tokenisation
    assert first["n"] == 3 and first["seed"] == request_seed(3, "q0", "all", 0) < 2**30
    want = {"temperature": 1.0, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 6, "stop": ["\n"]}
    assert {k: first[k] for k in want} == want
    # Neutral settings too, so an engine's generation-config defaults never apply.
    assert first["min_p"] == first["presence_penalty"] == first["frequency_penalty"] == 0.0
    assert first["logprobs"] == 1 and first["return_token_ids"] and first["return_tokens_as_token_ids"]
    with FakeVLLM(tiny_model_dir) as srv:
        sample(tiny_model_dir, params(srv.url), questions(1))
    assert srv.requests[0]["top_k"] == -1  # top_k 0 (off) is sent as vLLM's "off"


def test_answer_i_of_a_request_is_the_engines_draw_for_seed_plus_i(tiny_model_dir, tiny):
    """How K samples of one request stay reproducible: vLLM gives answer i its own generator seeded
    with seed + i, so a request with n = K equals K requests with n = 1 and seeds seed + i; the fake
    engine does the same."""
    with FakeVLLM(tiny_model_dir) as srv:
        together, _ = sample(tiny_model_dir, params(srv.url, empty_retries=0), questions(2))
        bodies = {tuple(b["prompt"]): b for b in srv.requests}
    _, tok = tiny
    with FakeVLLM(tiny_model_dir) as srv:
        for r in together.to_dicts():
            body = bodies[prompt_of(tok, r["question_id"])]
            alone = {**body, "n": 1, "seed": body["seed"] + r["sample_index"]}
            req = urllib.request.Request(
                f"{srv.url}/completions", data=json.dumps(alone).encode(), headers={"Content-Type": "application/json"}
            )
            ids = json.loads(urllib.request.urlopen(req).read())["choices"][0]["token_ids"]
            assert trim_answer(tok, ids, ["\n"], 6, [tok.eos_token_id]).token_ids == r["token_ids"]


def test_per_request_answer_sends_k_requests_each_with_its_answers_seed(tiny_model_dir):
    with FakeVLLM(tiny_model_dir) as srv:
        df, stats = sample(tiny_model_dir, params(srv.url, endpoint={"per_request": "answer"}), questions(2))
    first = [b for b in srv.requests if b["prompt"] == srv.requests[0]["prompt"]][:3]
    assert [b["n"] for b in first] == [1, 1, 1]
    assert sorted(b["seed"] for b in first) == sorted(request_seed(0, "q0", s, 0) for s in range(3))
    assert df.height == 6 and stats["requests_sent"] >= 6


def prompt_of(tok, question_id: str) -> tuple[int, ...]:
    return tuple(encode_prompt(tok, questions()["question"][int(question_id[1:])], False))


def test_the_engines_ids_are_cut_at_eos_and_stop_strings_as_hf_cuts_them(tiny_model_dir, tiny):
    _, tok = tiny
    raw = {}  # prompt -> the ids of each choice as the engine returned them

    def keep(response, body, n):
        raw[tuple(body["prompt"])] = [c["token_ids"] for c in response["choices"]]
        return response

    stop = ["a", "e", "i"]  # frequent: most answers stop at a stop string, some at EOS or the length
    with FakeVLLM(tiny_model_dir, mutate=keep) as srv:
        df, _ = sample(tiny_model_dir, params(srv.url, stop=stop, empty_retries=0, max_new_tokens=10))
    preset = ModelPreset(path=str(tiny_model_dir))
    eos = load_generation_eos(preset, load_config(preset))
    for r in df.to_dicts():
        ids = raw[prompt_of(tok, r["question_id"])][r["sample_index"]]
        t = trim_answer(tok, ids, stop, 10, eos)
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (t.token_ids, t.text, t.finish_reason)
        assert len(ids) > len(t.token_ids) or t.finish_reason == "length"  # EOS or the stop's token came back too
    assert "stop" in set(df["finish_reason"])


def test_empty_answers_are_resampled_one_request_each_with_a_fresh_seed(tiny_model_dir):
    with FakeVLLM(tiny_model_dir) as srv:
        p = params(srv.url, stop=["a", "e", "i", "o", "u"], empty_retries=2)
        df, _ = sample(tiny_model_dir, p)
    assert (df["attempts"] > 1).any() and df["attempts"].max() <= 3
    assert (df.filter(pl.col("n_tokens") == 0)["attempts"] == 3).all()  # only given up after every retry
    retries = [b for b in srv.requests if b["n"] == 1]
    assert retries and all(
        b["seed"] in {request_seed(0, f"q{q}", s, a) for q in range(6) for s in range(3) for a in (1, 2)}
        for b in retries
    )


def test_replicas_share_the_requests_with_at_most_concurrency_in_flight_each(tiny_model_dir):
    with FakeVLLM(tiny_model_dir, latency=0.05) as a, FakeVLLM(tiny_model_dir, latency=0.05) as b:
        df, stats = sample(tiny_model_dir, params([a.url, b.url], endpoint={"concurrency": 2}), questions(12))
    assert stats["replicas"] == 2 and df.height == 36
    assert a.count > 0 and b.count > 0 and a.count + b.count == 12
    assert a.max_in_flight <= 2 and b.max_in_flight <= 2


# ------------------------------------------------------------------ hostile input
@pytest.mark.hostile
def test_an_engine_that_is_down_is_a_clear_error_before_any_sampling(tiny_model_dir):
    with FakeVLLM(tiny_model_dir) as srv:
        url = srv.url  # closed once the server is gone
    with pytest.raises(ApiError, match=r"generate.endpoint: cannot reach http://127\.0\.0\.1.*is the server up"):
        sample(tiny_model_dir, params(url))


@pytest.mark.hostile
def test_an_engine_slow_to_list_its_models_is_a_timeout_naming_the_key_not_unreachable(tiny_model_dir):
    with FakeVLLM(tiny_model_dir, models_latency=3) as srv:  # still loading its model, say
        with pytest.raises(ApiError) as e:
            sample(tiny_model_dir, params(srv.url, endpoint={"timeout": 0.3}))
        assert srv.count == 0
    msg = str(e.value)
    assert msg.startswith(
        f"generate.endpoint: {srv.url}/models did not answer within 0.3 s (generate.endpoint.timeout): the server "
        "is slow (still loading the model, or overloaded)"
    )
    assert "cannot reach" not in msg and "()" not in msg


@pytest.mark.hostile
def test_an_engine_that_ignores_max_tokens_is_refused_at_generate_naming_it(tiny_model_dir, tiny):
    """400 tokens for max_tokens 6: refused at the first reply, with the engine's URL and both
    counts, not kept for the dump to blame the prompt."""
    _, tok = tiny
    word = tok.encode(" Paris", add_special_tokens=False)[0]

    def ramble(response, body, n):
        c = response["choices"][1]
        more = 400 - len(c["token_ids"])
        c["token_ids"] += [word] * more
        c["logprobs"]["tokens"] += [f"token_id:{word}"] * more
        c["logprobs"]["token_logprobs"] += [-0.5] * more
        c["finish_reason"] = "length"
        return response

    with FakeVLLM(tiny_model_dir, mutate=ramble) as srv:
        with pytest.raises(ApiError) as e:
            sample(tiny_model_dir, params(srv.url), questions(2))
        assert srv.count == 1 and srv.requests[0]["max_tokens"] == 6
    seed = request_seed(0, "q0", "all", 0)
    assert str(e.value).startswith(
        f"generate.endpoint: the reply to the request (question 'q0', n = 3, seed {seed}) from {srv.url} has 400 "
        "tokens in choice 1, for max_tokens 6 asked (generate.max_new_tokens): the engine ignores max_tokens"
    )


@pytest.mark.hostile
def test_usage_counts_sent_as_strings_are_read_as_numbers(tiny_model_dir):
    def as_text(response, body, n):
        response["usage"] = {k: str(v) for k, v in response["usage"].items()}
        return response

    with FakeVLLM(tiny_model_dir, mutate=as_text) as srv:
        df, stats = sample(tiny_model_dir, params(srv.url), questions(2))
    assert stats["prompt_tokens"] == sum(len(b["prompt"]) for b in srv.requests)
    assert stats["completion_tokens"] >= df["n_tokens"].sum() > 0


@pytest.mark.hostile
def test_a_model_the_engine_does_not_serve_is_named_with_the_served_one(tiny_model_dir):
    with FakeVLLM(tiny_model_dir, "tiny-llama") as srv:
        with pytest.raises(ApiError, match=r"does not serve '.*model' \(it serves tiny-llama\).*--served-model-name"):
            sample(tiny_model_dir, params(srv.url))
        assert srv.count == 0  # found by /v1/models, before any completion


@pytest.mark.hostile
def test_an_engine_context_shorter_than_prompt_plus_max_new_tokens_is_refused_before_sampling(tiny_model_dir):
    with FakeVLLM(tiny_model_dir) as srv:
        srv.engine.get()
        srv.engine.max_len = 30  # as `vllm serve --max-model-len 30`
        with pytest.raises(ModelError, match=r"max_model_len 30, but the longest prompt .* --max-model-len"):
            sample(tiny_model_dir, params(srv.url))
        assert srv.count == 0


@pytest.mark.hostile
def test_429_and_5xx_are_retried_honouring_retry_after_and_persistent_5xx_stops_with_progress_kept(tiny_model_dir):
    faults = {0: Fault(429, {"Retry-After": "0.3"}), 1: Fault(503)}
    with FakeVLLM(tiny_model_dir, fault=lambda body, n: faults.get(n)) as srv:
        t0 = time.monotonic()
        df, _ = sample(tiny_model_dir, params(srv.url, endpoint={"max_retries": 2}), questions(2))
        assert time.monotonic() - t0 >= 0.3 and df.height == 6 and srv.count == 4
    failing = FakeVLLM(tiny_model_dir, fault=lambda body, n: Fault(500) if n >= 2 else None)
    with failing as srv, pytest.raises(ApiError, match=r"HTTP 500 after 1 retries.*units done; every reply received"):
        sample(tiny_model_dir, params(srv.url, endpoint={"concurrency": 1}))


@pytest.mark.hostile
def test_a_cut_body_is_asked_again_and_one_cut_every_time_is_a_clear_error(tiny_model_dir):
    with FakeVLLM(tiny_model_dir, fault=lambda body, n: Fault(200, cut=40) if n == 0 else None) as srv:
        df, _ = sample(tiny_model_dir, params(srv.url), questions(1))
        assert df.height == 3 and srv.count == 2
    cutting = FakeVLLM(tiny_model_dir, fault=lambda body, n: Fault(200, cut=40))
    with cutting as srv, pytest.raises(ApiError, match=r"cut its reply off 2 times: .*received 40 of"):
        sample(tiny_model_dir, params(srv.url), questions(1))


@pytest.mark.hostile
@pytest.mark.parametrize("keep", [2, 0], ids=["fewer_choices", "empty_choice_list"])
def test_fewer_choices_than_k_are_asked_again_then_a_clear_error_naming_the_request(tiny_model_dir, keep):
    def drop(response, body, n):
        response["choices"] = response["choices"][:keep]
        return response

    with FakeVLLM(tiny_model_dir, mutate=drop) as srv:
        with pytest.raises(ApiError) as e:
            sample(tiny_model_dir, params(srv.url), questions(1))
        assert srv.count == 2  # asked once more, then given up
    seed = request_seed(0, "q0", "all", 0)
    assert f"the reply to the request (question 'q0', n = 3, seed {seed}) has {keep} choices for n = 3" in str(e.value)


def _mutate_first_choice(**changes):
    def mutate(response, body, n):
        c = response["choices"][0]
        for k, v in changes.items():
            if k == "token_logprobs":
                c["logprobs"][k] = v(c["logprobs"][k])
            else:
                c[k] = v(c.get(k)) if callable(v) else v
        return response

    return mutate


def _ids_outside_the_vocabulary(response, body, n):
    c = response["choices"][0]
    c["token_ids"] = [*c["token_ids"][:-1], 5000]
    c["logprobs"]["tokens"] = [*c["logprobs"]["tokens"][:-1], "token_id:5000"]
    return response


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_ids_outside_the_vocabulary, r"token id 5000 in choice 0, outside the preset tokenizer's vocabulary of"),
        (nan_logprobs, r"has log-prob nan at token 0 of choice 0: not a finite number <= 0"),
        (_mutate_first_choice(token_logprobs=lambda lps: [0.5] * len(lps)), r"log-prob 0.5 at token 0 of choice 0"),
        (_mutate_first_choice(token_logprobs=lambda lps: lps[:-1]), r"log-probs for the \d+ tokens of choice 0"),
        (_mutate_first_choice(logprobs=None), r"no log-probs for the tokens of choice 0 .*use vLLM or SGLang"),
        (_mutate_first_choice(text="Paris, of course"), r"text that does not decode from its ids in choice 0"),
        (_mutate_first_choice(prompt_token_ids=lambda p: [1, *p]), r"other prompt ids than were sent .*added a BOS"),
    ],
    ids=[
        "ids_outside_the_vocabulary",
        "nan_logprobs",
        "positive_logprobs",
        "logprobs_missing_for_a_token",
        "logprobs_missing",
        "text_that_does_not_decode",
        "prompt_changed",
    ],
)
def test_a_reply_with_invented_content_is_a_clear_error_naming_the_request_never_a_row(tiny_model_dir, mutate, message):
    with FakeVLLM(tiny_model_dir, mutate=mutate) as srv:
        with pytest.raises(ApiError, match=message) as e:
            sample(tiny_model_dir, params(srv.url), questions(2))
        assert srv.count == 1  # the first question went alone; nothing after
    assert "generate.endpoint: the reply to the request (question 'q0', n = 3, seed" in str(e.value)


@pytest.mark.hostile
def test_an_engine_that_returns_no_token_ids_is_refused_naming_the_option(tiny_model_dir):
    with FakeVLLM(tiny_model_dir, token_ids="none") as srv:
        with pytest.raises(ApiError, match=r"has no token ids.*--return-tokens-as-token-ids"):
            sample(tiny_model_dir, params(srv.url))
        assert srv.count == 1
    # Either of vLLM's two options is enough, and both give the same table.
    tables = []
    for mode in ("return_token_ids", "tokens_as_ids"):
        with FakeVLLM(tiny_model_dir, token_ids=mode) as srv:
            tables.append(sample(tiny_model_dir, params(srv.url), questions(2))[0].drop("seconds"))
    assert tables[0].equals(tables[1])


@pytest.mark.hostile
def test_an_engine_serving_another_tokenizer_is_refused_at_the_first_reply(tiny_model_dir, other_tokenizer):
    engine = FakeVLLM(tiny_model_dir, tokenizer_dir=other_tokenizer)
    with engine as srv, pytest.raises(ApiError, match=r"does not decode from its ids.*serves another tokenizer"):
        sample(tiny_model_dir, params(srv.url))


@pytest.mark.hostile
def test_the_engines_key_never_appears_in_an_error(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(KEY, SECRET)

    def echo(body, n):  # an engine that echoes the Authorization header in its error
        auth = srv.headers[n]["authorization"]
        return Fault(401, body=json.dumps({"error": {"message": f"bad key {auth}", "type": "AuthenticationError"}}))

    with FakeVLLM(tiny_model_dir, fault=echo) as srv:
        with pytest.raises(ApiError) as e:
            sample(tiny_model_dir, params(srv.url, endpoint={"api_key_env": KEY}))
        assert SECRET in srv.headers[0]["authorization"]  # the engine did get, and echo, the key
    assert SECRET not in str(e.value) and f"bad key Bearer [{KEY} redacted]" in str(e.value)
    monkeypatch.delenv(KEY)
    with pytest.raises(ApiError, match=f"the API key variable {KEY} is not set"):
        sample(tiny_model_dir, params("http://127.0.0.1:9/v1", endpoint={"api_key_env": KEY}))


@pytest.mark.hostile
def test_a_damaged_request_store_is_discarded_with_a_warning_and_its_requests_sent_again(
    tiny_model_dir, tmp_path, caplog
):
    from halludetect.core.unit_store import UnitStore

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
    (tmp_path / "progress" / REQUESTS_FILE).write_bytes(b"not a database at all, but 100 bytes of junk" * 3)
    with FakeVLLM(tiny_model_dir) as srv, caplog.at_level(logging.WARNING, logger="halludetect"):
        df, _ = sample(tiny_model_dir, params(srv.url), questions(2), store=store)
    assert (
        df.height == 6
        and f"discarding the damaged request store {tmp_path / 'progress' / REQUESTS_FILE}" in caplog.text
    )


def stage_inputs(tmp_path: Path, model_dir: Path, url: str, n: int) -> list[str]:
    qs = questions(n).with_columns(answers=pl.lit(["x"]), context=pl.lit(None, dtype=pl.String))
    qs.select("id", "question", "answers", "context", "split").write_parquet(tmp_path / "questions.parquet")
    (tmp_path / "manifest.json").write_text("{}")
    data = base_params()
    data["models"]["tiny"] = {"path": str(model_dir), "dtype": "float32"}
    data["generate"].update(n_samples=3, max_new_tokens=6, batch_size=2, backend="completions")
    data["generate"]["endpoint"].update(base_url=url, model=str(model_dir), concurrency=2, max_retries=1)
    return [
        "--params",
        str(write_params(tmp_path / "params.yaml", data)),
        "--model",
        "tiny",
        "--questions",
        str(tmp_path / "questions.parquet"),
        "--manifest",
        str(tmp_path / "manifest.json"),
        "--progress",
        str(tmp_path / "progress"),
        "--out",
        str(tmp_path / "gen.parquet"),
        "--metrics",
        str(tmp_path / "gen.json"),
    ]


@pytest.mark.hostile
def test_a_killed_generate_resends_only_the_requests_that_were_in_flight(tiny_model_dir, tmp_path):
    """SIGKILL while the engine holds two requests (the concurrency): every reply received before is
    kept in the progress directory, the resumed run sends those two again and nothing else, and
    writes what an uninterrupted run writes."""
    release, held = threading.Event(), []

    def hold(body, n):
        if n >= 5:  # from the sixth request on, held until the kill
            held.append(json.dumps(body, sort_keys=True))
            release.wait(120)
        return None

    with FakeVLLM(tiny_model_dir, fault=hold) as srv:
        args = stage_inputs(tmp_path, tiny_model_dir, srv.url, n=10)
        proc = subprocess.Popen([sys.executable, "-m", "stages.generate", *args], cwd=ROOT, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while len(held) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        release.set()
        before = [json.dumps(b, sort_keys=True) for b in srv.requests]
        assert not (tmp_path / "gen.parquet").exists() and (tmp_path / "progress" / REQUESTS_FILE).exists()
        srv.fault = None
        res = subprocess.run([sys.executable, "-m", "stages.generate", *args], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        after = [json.dumps(b, sort_keys=True) for b in srv.requests[len(before) :]]
        assert "replies kept from an interrupted run" in res.stderr
        assert sorted(b for b in after if b in before) == sorted(held)  # only the two in flight, again
        assert len(set(before + after)) == len(before + after) - 2
        metrics = json.loads((tmp_path / "gen.json").read_text())
        assert metrics["backend"] == "completions" and metrics["endpoint"]["requests_sent"] == len(after)
        p = GenerateParams(
            n_samples=3, max_new_tokens=6, batch_size=2, backend="completions", endpoint={"base_url": srv.url}
        )
        clean, _ = sample(tiny_model_dir, p, questions(10))
    assert pl.read_parquet(tmp_path / "gen.parquet").equals(clean.drop("seconds"))
    assert not (tmp_path / "progress").exists()


@pytest.mark.hostile
def test_a_stop_awaits_the_request_in_flight_beside_a_question_that_stopped(tiny_model_dir, tmp_path):
    """The race behind the next test's failures under load: of a unit's two questions, one is in
    flight when the run is interrupted and the other, waiting for a slot, stops. The unit must wait
    for the one in flight and keep its reply (it is paid for), not end and leave it to be cut off
    as the run closes. Made certain here: unit 1's q2 is slow, and unit 0's q1 interrupts."""
    from halludetect.core.unit_store import UnitStore

    # q0 goes alone; then q1 (unit 0) and q2 (unit 1) take the two slots, and q3 (unit 1) waits for one
    seed_of = {request_seed(GenerateParams().seed, q, "all", 0): q for q in ("q1", "q2")}

    def fault(body, n):
        if seed_of.get(body["seed"]) == "q1":
            os.kill(os.getpid(), signal.SIGINT)
            return Fault(200, delay=0.2)  # its reply frees a slot: q3 takes it and stops
        if seed_of.get(body["seed"]) == "q2":
            return Fault(200, delay=1.5)  # still in flight when q3 stops
        return None

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
    with FakeVLLM(tiny_model_dir, fault=fault) as srv:
        p = params(srv.url, endpoint={"concurrency": 2})
        with pytest.raises(KeyboardInterrupt, match="interrupted by SIGINT"):
            sample(tiny_model_dir, p, questions(6), store=store)
        first = [json.dumps(b, sort_keys=True) for b in srv.requests]
        assert {seed_of.get(json.loads(b)["seed"]) for b in first} >= {"q1", "q2"}
        srv.fault = None
        sample(tiny_model_dir, p, questions(6), store=store)
        again = [json.dumps(b, sort_keys=True) for b in srv.requests[len(first) :]]
    assert not set(first) & set(again), "the re-run asked again for a reply the interrupted run was sent"
    assert len(first) + len(again) == 6


@pytest.mark.hostile
def test_a_stop_sends_no_retry_of_a_request_that_failed_after_it(tiny_model_dir, tmp_path):
    """A retry is a request started after the stop: the request that failed (a 500) as the run was
    interrupted is not sent again by that run, but by the next one, once."""
    from halludetect.core.unit_store import UnitStore

    q1 = request_seed(GenerateParams().seed, "q1", "all", 0)
    failed = []

    def fault(body, n):
        if body["seed"] == q1 and not failed:
            failed.append(n)
            os.kill(os.getpid(), signal.SIGINT)
            return Fault(500)  # retried after a backoff, unless the run is stopping
        return None

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
    with FakeVLLM(tiny_model_dir, fault=fault) as srv:
        p = params(srv.url, endpoint={"concurrency": 2, "max_retries": 3})
        with pytest.raises(KeyboardInterrupt, match="interrupted by SIGINT"):
            sample(tiny_model_dir, p, questions(6), store=store)
        first = [b["seed"] for b in srv.requests]
        sample(tiny_model_dir, p, questions(6), store=store)
        again = [b["seed"] for b in srv.requests[len(first) :]]
    assert first.count(q1) == 1, "the interrupted run retried a request after the stop"
    assert again.count(q1) == 1 and len(set(first) - {q1}) + len(again) == 6


@pytest.mark.hostile
def test_sigint_stops_sending_keeps_every_reply_and_a_rerun_asks_only_the_rest(tiny_model_dir, tmp_path):
    """Ctrl-C on `dvc repro`: no request is started after it, the ones in flight are awaited and kept,
    and the re-run sends only what was never answered."""
    from halludetect.core.unit_store import UnitStore

    def interrupt(body, n):
        if n == 3:
            os.kill(os.getpid(), signal.SIGINT)  # handled by the sampler's loop: it stops starting requests
        return None

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
    with FakeVLLM(tiny_model_dir, fault=interrupt) as srv:
        with pytest.raises(KeyboardInterrupt, match=r"interrupted by SIGINT \(\d+ of 5 units done; every reply"):
            sample(tiny_model_dir, params(srv.url, endpoint={"concurrency": 2}), questions(10), store=store)
        answered = srv.count
        assert answered < 10
        srv.fault = None
        df, stats = sample(tiny_model_dir, params(srv.url, endpoint={"concurrency": 2}), questions(10), store=store)
    bodies = [json.dumps(b, sort_keys=True) for b in srv.requests]
    first, second = bodies[:answered], bodies[answered:]
    # Which run asked twice, when one did. Under load (two `make test` runs, 2026-11-27) the re-run
    # asked again for one reply: the race the test above makes certain, fixed by endpoint.settled.
    twice = {
        "within the interrupted run": len(first) - len(set(first)),
        "within the re-run": len(second) - len(set(second)),
        "asked again by the re-run": len(set(first) & set(second)),
    }
    assert len(set(bodies)) == len(bodies) == 10, twice  # nothing asked twice
    assert df.height == 30 and stats["requests_sent"] == 10 - answered
