"""`halludetect serve` (halludetect/scoring/serve.py): the openai client's requests get every answer with
its detector's score, equal to `halludetect score`'s on the same question and answer; concurrent
requests are sampled together and a seeded answer does not depend on its batch-mates; and the hostile
cases: malformed JSON, wrong types, unknown and unimplemented fields, streaming, limits, a missing or
wrong key (never logged), a body over the limit, more requests than the server takes, a failing batch
(a 500, and the server goes on), a bundle whose method cannot score one answer, and the command itself
started and stopped as a user would."""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from openai import OpenAI
from serve_support import LONG, QUESTION, leave_after_first_chunk, send_raw, streamed, until_not_429
from support import ROOT

from halludetect.config import GenerateParams
from halludetect.scoring.scorer import OptionError, Scorer, score_answers
from halludetect.scoring.serve import Limits, Server, Service

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def served(bundle_path, tiny_model_dir):
    """One server on the miniature DAG's `max` bundle for the module, with a key and small limits."""
    os.environ["HALLUDETECT_TEST_SERVE_KEY"] = "s3cret-key-for-tests"
    logged: list[str] = []
    generate = GenerateParams(max_new_tokens=8, stop=[])
    scorer = Scorer(bundle_path, str(tiny_model_dir), device="cpu", generate=generate, batch_size=4)
    limits = Limits(max_tokens=16, max_n=6, max_batch=16, max_concurrency=32, max_request_bytes=4096)
    service = Service(scorer, name="tiny", limits=limits, log=logged.append)
    with Server(service, port=0, api_key="s3cret-key-for-tests", log=logged.append) as srv:
        yield srv, logged


def client(srv, key="s3cret-key-for-tests") -> OpenAI:
    return OpenAI(base_url=srv.url, api_key=key, max_retries=0)


def post(srv, path: str, body, key="s3cret-key-for-tests", raw: bytes | None = None) -> tuple[int, dict]:
    host, port = srv.http.server_address
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", path, body=data, headers=headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_served_scores_equal_the_offline_scorer(served, bundle_path, tiny_model_dir):
    srv, _ = served
    r = client(srv).completions.create(model="tiny", prompt=QUESTION, n=4, seed=3, max_tokens=8)
    assert len(r.choices) == 4 and r.object == "text_completion"
    assert r.detector["method"] == "max" and r.detector["threshold_name"] == "fpr_0.05"
    rows, served_scores = [], []
    for c in r.choices:
        h = c.hallucination
        assert set(h) >= {"score", "probability", "flag", "threshold", "in_distribution", "mean_logprob"}
        if h["score"] is None:
            assert h["reason"] in ("empty_answer", "too_short")
            continue
        assert h["flag"] == (h["score"] >= h["threshold"]) and 0 < h["probability"] < 1
        rows.append({"question": QUESTION, "answer": c.text, "answer_token_ids": c.token_ids})
        served_scores.append(h)
    assert rows, "the tiny model answered nothing scoreable"
    offline = score_answers(bundle_path, rows, model=str(tiny_model_dir), device="cpu")
    np.testing.assert_allclose([h["score"] for h in served_scores], offline["score"].to_numpy(), atol=1e-3)
    np.testing.assert_allclose([h["probability"] for h in served_scores], offline["probability"].to_numpy(), atol=1e-3)
    assert [h["in_distribution"] for h in served_scores] == offline["in_distribution"].to_list()
    for stat in ("mean_logprob", "min_logprob"):
        np.testing.assert_allclose([h[stat] for h in served_scores], offline[stat].to_numpy(), atol=1e-4)
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)


def test_chat_answers_the_same_question_with_evidence(served, bundle_path, tiny_model_dir):
    srv, _ = served
    c = client(srv)
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        seed=3,
        max_tokens=8,
        extra_body={"explain": True},
    )
    plain = c.completions.create(model="tiny", prompt=QUESTION, seed=3, max_tokens=8)
    # the same question in the same prompt and the same random stream: the same answer and score
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].token_ids == plain.choices[0].token_ids
    h = chat.choices[0].hallucination
    if h["score"] is not None:
        assert h["score"] == pytest.approx(plain.choices[0].hallucination["score"], abs=1e-5)
        # the tokens' contributions and the bias sum to the score, as `score --explain` writes them
        assert sum(h["contributions"]) + h["bias"] == pytest.approx(h["score"], abs=1e-4)
        assert len(h["tokens"]) == len(chat.choices[0].token_ids)
    assert "contributions" not in plain.choices[0].hallucination


def test_best_of_n_returns_the_lowest_score_of_the_same_answers_with_the_others_listed(served):
    """select best_of_n: the n answers the same seed gives without it, the one of the lowest score
    returned (the first among equal scores), every answer's score listed; chat chooses the same."""
    srv, _ = served
    c = client(srv)
    every = c.completions.create(model="tiny", prompt=QUESTION, n=5, seed=11, max_tokens=8)
    one = c.completions.create(
        model="tiny", prompt=QUESTION, n=5, seed=11, max_tokens=8, extra_body={"select": "best_of_n"}
    )
    scored = [(ch.hallucination["score"], ch.index) for ch in every.choices if ch.hallucination["score"] is not None]
    assert scored, "the tiny model answered nothing scoreable"
    chosen = min(scored)[1]
    assert len(one.choices) == 1 and one.choices[0].index == 0
    assert one.choices[0].text == every.choices[chosen].text
    assert one.choices[0].token_ids == every.choices[chosen].token_ids
    sel = one.choices[0].hallucination["selection"]
    assert sel["policy"] == "best_of_n" and sel["chosen"] == chosen
    listed = [a["score"] for a in sel["answers"]]
    np.testing.assert_allclose(
        [x if x is not None else np.nan for x in listed],
        [ch.hallucination["score"] if ch.hallucination["score"] is not None else np.nan for ch in every.choices],
        atol=1e-5,
    )
    assert one.usage.completion_tokens == every.usage.completion_tokens  # it costs the n answers
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        n=5,
        seed=11,
        max_tokens=8,
        extra_body={"select": "best_of_n"},
    )
    assert chat.choices[0].message.content == one.choices[0].text


def test_the_servers_select_is_the_default_a_request_turns_off_and_a_bad_one_is_refused_at_start(served, monkeypatch):
    srv, _ = served
    c = client(srv)
    monkeypatch.setattr(srv.service, "select", "best_of_n")  # as `halludetect serve --select best_of_n`
    assert len(c.completions.create(model="tiny", prompt=QUESTION, n=3, seed=2, max_tokens=8).choices) == 1
    off = c.completions.create(model="tiny", prompt=QUESTION, n=3, seed=2, max_tokens=8, extra_body={"select": "none"})
    assert len(off.choices) == 3
    with pytest.raises(OptionError, match="--select 'best': one of best_of_n, abstain"):
        Service(srv.service.scorer, select="best")


def test_abstain_refuses_where_every_answer_is_flagged_and_answers_where_one_is_not(served, monkeypatch):
    """select abstain: at a threshold every answer reaches, a refusal (no text, content_filter, the
    scores it refused on; chat: content None and the refusal's reason); at one none reaches, the
    best-of-n answer, not abstained."""
    srv, _ = served
    scorer = srv.service.scorer
    c = client(srv)
    body = {"model": "tiny", "n": 3, "seed": 5, "max_tokens": 8, "extra_body": {"select": "abstain"}}
    monkeypatch.setattr(scorer, "threshold", -1e9)
    refused = c.completions.create(prompt=QUESTION, **body)
    h = refused.choices[0].hallucination
    assert refused.choices[0].text == "" and refused.choices[0].finish_reason == "content_filter"
    assert h["abstained"] is True and "flagged" in h["reason"] and len(h["selection"]["answers"]) == 3
    chat = c.chat.completions.create(messages=[{"role": "user", "content": QUESTION}], **body)
    assert chat.choices[0].message.content is None and "flagged" in chat.choices[0].message.refusal
    monkeypatch.setattr(scorer, "threshold", 1e9)
    kept = c.completions.create(prompt=QUESTION, **body)
    assert kept.choices[0].hallucination["abstained"] is False and kept.choices[0].finish_reason != "content_filter"
    best = c.completions.create(prompt=QUESTION, **{**body, "extra_body": {"select": "best_of_n"}})
    assert kept.choices[0].text == best.choices[0].text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_streamed_answer_is_the_unstreamed_one_with_a_running_score_and_its_score_last(served, chat):
    """stream=True through the openai client: each choice's chunks concatenate to the answer the same
    seed gives without stream (text and token ids), every chunk before the last carries the running
    score (the detector on the answer so far), and the last one the answer's `hallucination`."""
    srv, _ = served
    c = client(srv)
    ask = {"model": "tiny", "n": 3, "seed": 7, "max_tokens": 12}
    if chat:
        messages = [{"role": "user", "content": QUESTION}]
        whole = c.chat.completions.create(messages=messages, **ask)
        chunks = list(c.chat.completions.create(messages=messages, stream=True, **ask))
        answers = [ch.message.content for ch in whole.choices]
    else:
        whole = c.completions.create(prompt=QUESTION, **ask)
        chunks = list(c.completions.create(prompt=QUESTION, stream=True, **ask))
        answers = [ch.text for ch in whole.choices]
    got = streamed(chunks)
    assert sorted(got) == [0, 1, 2]
    running_seen = 0
    for i, w in enumerate(whole.choices):
        g = got[i]
        assert g["text"] == answers[i] and g["ids"] == w.token_ids
        last = g["last"]
        assert last.finish_reason == w.finish_reason
        h, final = w.hallucination, last.hallucination
        assert set(final) == set(h) and final["flag"] == h["flag"]
        if h["score"] is None:
            assert final["score"] is None and final["reason"] == h["reason"]
            continue
        assert final["score"] == pytest.approx(h["score"], abs=1e-5)
        scored = [z for z in g["running"] if z is not None]
        running_seen += len(scored)
        if scored and not last.token_ids:  # nothing after the last running score: it scored the whole answer
            assert scored[-1] == pytest.approx(final["score"], abs=1e-4)
    assert running_seen, "no running score in any chunk"


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_its_row_stops(bundle_path, tiny_model_dir, monkeypatch):
    """One slot: a streamed request whose client reads a chunk and closes the connection; the next
    request gets the slot (not a 429), and the left row stopped well before its 90 tokens (each step
    of the model is slowed, so that the client leaves early in its answer)."""

    generate = GenerateParams(max_new_tokens=90, stop=[])  # the tiny model's context: 128 tokens
    scorer = Scorer(bundle_path, str(tiny_model_dir), device="cpu", generate=generate, batch_size=4)
    limits = Limits(max_tokens=90, max_n=2, max_batch=4, max_concurrency=1)
    service = Service(scorer, name="tiny", limits=limits, log=lambda *_: None)
    with Server(service, port=0, log=lambda *_: None) as srv:
        model = scorer.model
        forward = model.forward
        steps = []

        def slow(*a, **kw):
            steps.append(1)
            time.sleep(0.02)
            return forward(*a, **kw)

        monkeypatch.setattr(model, "forward", slow)
        seen = leave_after_first_chunk(srv, LONG | {"stream": True})
        assert b"HTTP/1.1 200" in seen and b"text/event-stream" in seen
        code, out = until_not_429(
            lambda: post_plain(srv, {"model": "tiny", "prompt": QUESTION, "max_tokens": 2, "seed": 2})
        )
        assert code == 200, out
        assert len(steps) < 60, f"the left request's row ran {len(steps)} steps of its 90"


def test_a_client_that_leaves_before_its_first_chunk_frees_its_slot_while_it_waits(
    bundle_path, tiny_model_dir, monkeypatch
):
    """A streamed request waits behind a long round (each step of the model slowed) and its client goes
    before any chunk is written: the server notices without writing (the closed connection is readable)
    and frees the slot while that round still runs, not once the request's first chunk fails to send."""
    import threading

    generate = GenerateParams(max_new_tokens=90, stop=[])
    scorer = Scorer(bundle_path, str(tiny_model_dir), device="cpu", generate=generate, batch_size=4)
    limits = Limits(max_tokens=90, max_n=2, max_batch=4, max_concurrency=2)
    service = Service(scorer, name="tiny", limits=limits, log=lambda *_: None)
    with Server(service, port=0, log=lambda *_: None) as srv:
        model, steps = scorer.model, []
        forward = model.forward

        def slow(*a, **kw):
            steps.append(1)
            time.sleep(0.05)
            return forward(*a, **kw)

        monkeypatch.setattr(model, "forward", slow)
        first = threading.Thread(target=post_plain, args=(srv, LONG))
        first.start()
        while not steps:  # the long round has started
            time.sleep(0.01)
        sock = send_raw(srv, LONG | {"seed": 2, "stream": True})
        deadline = time.monotonic() + 30
        while service._jobs.qsize() == 0 and time.monotonic() < deadline:  # the streamed request is queued
            time.sleep(0.01)
        sock.close()  # the client goes before any chunk
        while service._slots._value < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        freed_at = len(steps)
        first.join(60)
    assert service._slots._value == 2
    # not a count of steps after the leaving (a loaded machine may be slow to look): before the round ends
    assert freed_at < 85, f"the slot was freed only after the long round ({freed_at} of its 90 steps)"


def post_plain(srv, body) -> tuple[int, dict]:
    return post(srv, "/v1/completions", body, key=None)


def test_concurrent_requests_share_passes_and_keep_their_answers(served):
    srv, _ = served
    c = client(srv)
    alone = c.completions.create(model="tiny", prompt=QUESTION, n=2, seed=11, max_tokens=8)
    before = dict(srv.service.stats)
    questions = [f"Where was {name} born?" for name in ("Tavo Mir", "Sergi Poboum", "Ana Vel", "Jorn Kas")] * 4

    def ask(k):
        q = questions[k]
        return q, c.completions.create(model="tiny", prompt=q, n=2, seed=11, max_tokens=8)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(len(questions))))
    stats = srv.service.stats
    assert stats["requests"] - before["requests"] == 16 and stats["answers"] - before["answers"] == 32
    assert stats["batches"] - before["batches"] <= 16
    for q, r in results:  # each request's answers come from its own streams, whatever shared its pass
        assert len(r.choices) == 2
        if q == QUESTION:
            assert [ch.token_ids for ch in r.choices] == [ch.token_ids for ch in alone.choices]


def test_a_round_of_queued_requests_is_one_sampling_pass(served, monkeypatch):
    """Requests waiting while the model is busy are sampled together in the next round, in one pass
    (the scorer's own batch size, 4 here, does not cut a round of 15 answers)."""
    import halludetect.activations.sampled_states as sampled_states

    srv, _ = served
    service, passes = srv.service, []
    release, entered = threading.Event(), threading.Event()
    original, sample = service._run, sampled_states.sample_with_states

    def held(group):
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return original(group)

    def counted(model, tokenizer, prompts, *a, **kw):
        passes.append(len(prompts))
        return sample(model, tokenizer, prompts, *a, **kw)

    monkeypatch.setattr(service, "_run", held)
    monkeypatch.setattr(sampled_states, "sample_with_states", counted)
    body = {"model": "tiny", "prompt": QUESTION, "max_tokens": 4, "n": 5}
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, srv, "/v1/completions", {**body, "n": 1})
        assert entered.wait(30)
        rest = [pool.submit(post, srv, "/v1/completions", {**body, "seed": k}) for k in range(3)]
        while service._jobs.qsize() < 3:  # all three wait behind the first
            time.sleep(0.01)
        release.set()
        assert first.result()[0] == 200 and all(r.result()[0] == 200 for r in rest)
    assert passes == [1, 15]


@pytest.mark.hostile
@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "tiny", "prompt": QUESTION, "stream": "yes"}, 400, "stream"),
        ({"model": "tiny", "prompt": QUESTION, "stream": True, "select": "best_of_n"}, 400, "stream"),
        ({"model": "tiny", "prompt": QUESTION, "n": 7}, 400, "n"),
        ({"model": "tiny", "prompt": QUESTION, "n": True}, 400, "n"),
        ({"model": "tiny", "prompt": QUESTION, "n": "2"}, 400, "n"),
        ({"model": "tiny", "prompt": QUESTION, "max_tokens": 17}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": QUESTION, "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": QUESTION, "top_p": 0}, 400, "top_p"),
        ({"model": "tiny", "prompt": QUESTION, "seed": 1.5}, 400, "seed"),
        ({"model": "tiny", "prompt": QUESTION, "temperature": float("nan")}, 400, "temperature"),
        ({"model": "tiny", "prompt": QUESTION, "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
        ({"model": "tiny", "prompt": QUESTION, "stop": [" "]}, 400, "stop"),
        ({"model": "tiny", "prompt": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "tiny", "prompt": QUESTION, "explain": "yes"}, 400, "explain"),
        ({"model": "tiny", "prompt": QUESTION, "logprobs": 3}, 400, "logprobs"),
        ({"model": "tiny", "prompt": QUESTION, "presence_penalty": 1}, 400, "presence_penalty"),
        ({"model": "tiny", "prompt": QUESTION, "temprature": 1}, 400, "temprature"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "tiny", "prompt": [1, 2, 3]}, 400, "prompt"),
        ({"model": "tiny", "prompt": ["a?", "b?"]}, 400, "prompt"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "other", "prompt": QUESTION}, 404, "model"),
        ({"model": "tiny", "prompt": QUESTION, "select": "best_of_3"}, 400, "select"),
        ({"model": "tiny", "prompt": QUESTION, "select": ["abstain"]}, 400, "select"),
        ([1, 2], 400, None),
    ],
)
def test_a_malformed_completion_request_is_a_400_naming_the_field(served, body, status, param):
    srv, logged = served
    code, out = post(srv, "/v1/completions", body)
    assert code == status and out["error"]["param"] == param and out["error"]["code"] == status
    assert out["error"]["message"]


@pytest.mark.hostile
@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        [{"role": "assistant", "content": QUESTION}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "Where?",
    ],
)
def test_a_chat_request_that_is_not_one_question_is_refused(served, messages):
    srv, _ = served
    code, out = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": messages})
    assert code == 400 and out["error"]["param"] == "messages"


@pytest.mark.hostile
def test_a_question_too_long_for_the_context_is_refused_before_sampling(served):
    srv, _ = served
    before = srv.service.stats["batches"]
    code, out = post(srv, "/v1/completions", {"model": "tiny", "prompt": "Where was " + "Tavo Mir " * 60 + "born?"})
    assert code == 400 and "context of 128" in out["error"]["message"]
    assert srv.service.stats["batches"] == before


@pytest.mark.hostile
def test_bad_bodies_keys_and_routes_get_json_errors_and_the_key_is_never_logged(served):
    srv, logged = served
    assert post(srv, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(srv, "/v1/completions", None, raw=b"\xff\xfe")[0] == 400
    code, out = post(srv, "/v1/completions", None, raw=json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode())
    assert code == 413 and "4096" in out["error"]["message"]
    for key in (None, "wrong"):
        code, out = post(srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION}, key=key)
        assert code == 401 and out["error"]["type"] == "authentication_error"
    assert post(srv, "/v1/embeddings", {"model": "tiny"})[0] == 404
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].detector["layer"] >= 0
    assert logged and not any("s3cret" in line for line in logged)
    assert all(line.split()[0] in ("GET", "POST") for line in logged)  # one line per request, no headers


@pytest.mark.hostile
def test_more_requests_than_the_limit_get_429_and_a_failed_batch_a_500(served, monkeypatch):
    srv, _ = served
    service = srv.service
    release, entered = threading.Event(), threading.Event()
    original = service._run

    def held(group):
        entered.set()
        release.wait(30)
        return original(group)

    monkeypatch.setattr(service, "_run", held)
    monkeypatch.setattr(service, "_slots", threading.BoundedSemaphore(1))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION, "max_tokens": 4})
        assert entered.wait(30)
        code, out = post(srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION})
        assert code == 429 and out["error"]["type"] == "rate_limit_error"
        release.set()
        assert first.result()[0] == 200

    def broken(group):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(service, "_run", broken)
    code, out = post(srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION})
    assert code == 500 and "out of memory" in out["error"]["message"]
    monkeypatch.setattr(service, "_run", original)
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION, "max_tokens": 4})[0] == 200


@pytest.mark.hostile
def test_a_bundle_whose_method_reads_several_answers_is_refused_at_start(bundle_path, tiny_model_dir, tmp_path):
    from test_scorer import sp_bundle

    b = sp_bundle(bundle_path, tmp_path / "sp.safetensors")
    scorer = Scorer(b, str(tiny_model_dir), device="cpu")
    with pytest.raises(Exception, match="P_sem"):
        Service(scorer)
    with pytest.raises(Exception, match="generate=GenerateParams"):
        Service(Scorer(bundle_path, str(tiny_model_dir), device="cpu"))


def listening_url(proc: subprocess.Popen) -> str:
    """The URL a `halludetect serve` process says it listens on (its stderr, read up to that line)."""
    logged, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        logged.append(line)
        if " on http://" in line:
            return line.rsplit(" on ", 1)[1].strip()
    raise AssertionError("the server never said where it listens:\n" + "".join(logged))


def test_the_command_serves_until_sigterm_and_needs_its_key_variable(bundle_path, tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HALLUDETECT_SERVE_KEY_UNSET", None)
    cmd = [sys.executable, "-m", "halludetect.cli", "serve", "--bundle", str(bundle_path)]
    cmd += ["--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-new-tokens", "6"]
    missing = subprocess.run(
        [*cmd, "--api-key-env", "HALLUDETECT_SERVE_KEY_UNSET"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert missing.returncode == 2 and "HALLUDETECT_SERVE_KEY_UNSET" in missing.stderr
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        url = listening_url(proc)
        r = OpenAI(base_url=url, api_key="-", max_retries=0).completions.create(
            model=str(tiny_model_dir), prompt=QUESTION, seed=1
        )
        assert r.choices[0].hallucination["threshold"] is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.mark.hostile
def test_a_client_that_stops_sending_is_dropped_and_the_server_goes_on(served, monkeypatch):
    """A body announced and never sent (or a connection left idle) holds no thread forever: the socket
    times out (the handler's `timeout`, 30 s; 0.5 here) and the connection is closed."""
    import socket

    srv, _ = served
    monkeypatch.setattr(srv.http.RequestHandlerClass, "timeout", 0.5)
    host, port = srv.http.server_address
    with socket.create_connection((host, port), timeout=10) as s:
        auth = b"Authorization: Bearer s3cret-key-for-tests\r\n"
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        reply = b""
        while chunk := s.recv(4096):  # a 408 naming the wait, then the server closes the connection
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply
        assert time.monotonic() - t0 < 8
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION, "max_tokens": 4})[0] == 200


@pytest.mark.hostile
def test_a_port_in_use_is_one_line_naming_it(served):
    srv, _ = served
    host, port = srv.http.server_address
    with pytest.raises(Exception, match=f"cannot listen on {host}:{port} .*pass another --host or --port"):
        Server(srv.service, host, port)


@pytest.mark.hostile
def test_a_refused_request_whose_body_was_not_read_closes_its_connection(served):
    """A 401 or 404 answered before the body is read says `Connection: close` (the unread body would be
    read as the next request): the client's next request goes on a new connection and is answered."""
    srv, _ = served
    host, port = srv.http.server_address
    conn = http.client.HTTPConnection(host, port, timeout=60)
    body = json.dumps({"model": "tiny", "prompt": QUESTION, "max_tokens": 4})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 401 and r.getheader("Connection") == "close"
    r.read()
    auth = {"Content-Type": "application/json", "Authorization": "Bearer s3cret-key-for-tests"}
    conn.request("POST", "/v1/completions", body=body, headers=auth)  # http.client reconnects
    assert conn.getresponse().status == 200
    conn.close()


@pytest.mark.hostile
def test_control_tokens_lone_surrogates_and_deep_nesting_are_400s_naming_the_field(served):
    """A question holding the model's own special tokens was tokenized as control tokens and scored
    `in_distribution: true`; a lone surrogate and a `stop` nested deeper than the JSON parser's recursion
    were 500s (TypeError, RecursionError)."""
    srv, _ = served
    specials = srv.service._control_tokens()
    assert "</s>" in specials and "<pad>" in specials, specials
    for question in ("Where was Tavo Mir born?</s>", "<s><pad><pad> Where was Tavo Mir born?"):
        for chat in (False, True):
            body = {"model": "tiny", "max_tokens": 4}
            body |= {"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question}
            code, out = post(srv, "/v1/chat/completions" if chat else "/v1/completions", body)
            assert code == 400 and "control token" in out["error"]["message"], out
            assert out["error"]["param"] == ("messages" if chat else "prompt")
    raw = b'{"model": "tiny", "max_tokens": 4, "prompt": "Where was \\ud800 born?"}'
    code, out = post(srv, "/v1/completions", None, raw=raw)
    assert code == 400 and "lone surrogate" in out["error"]["message"] and out["error"]["param"] == "prompt"
    raw = b'{"model": "tiny", "max_tokens": 4, "prompt": "Where?", "stop": ["\\udfff"]}'
    code, out = post(srv, "/v1/completions", None, raw=raw)
    assert code == 400 and "lone surrogate" in out["error"]["message"] and out["error"]["param"] == "stop"
    deep = 2000  # past the JSON parser's recursion limit, inside the fixture's 4,096-byte body limit
    raw = b'{"model": "tiny", "prompt": "Where?", "stop": ' + b"[" * deep + b"]" * deep + b"}"
    code, out = post(srv, "/v1/completions", None, raw=raw)
    assert code == 400 and "too deep" in out["error"]["message"], out
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": QUESTION, "max_tokens": 4})[0] == 200


@pytest.mark.hostile
def test_sigterm_mid_batch_answers_every_request_and_exits_0(bundle_path, tiny_model_dir):
    """SIGTERM while 24 clients are in flight: the running round finishes and is answered, the requests
    still waiting get a 503, no client is cut off (before: 7 of 24 RemoteDisconnected and the process
    aborted, exit -6, `terminate called without an active exception`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "halludetect.cli", "serve", "--bundle", str(bundle_path), "--model"]
    cmd += [str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-new-tokens", "64", "--max-batch", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        url = listening_url(proc)
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        first = threading.Event()

        def ask(seed: int):
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            body = {"model": str(tiny_model_dir), "prompt": QUESTION, "seed": seed, "max_tokens": 64, "stop": None}
            try:
                conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
                r = conn.getresponse()
                status, data = r.status, json.loads(r.read())
            except OSError as e:  # RemoteDisconnected, a reset: what a stop must never do
                return type(e).__name__, None
            finally:
                conn.close()
                first.set()
            return status, data

        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(ask, s) for s in range(24)]
            assert first.wait(120)
            proc.send_signal(signal.SIGTERM)  # mid-batch: the others are running or waiting
            got = [f.result() for f in futures]
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
        assert "terminate called" not in rest, rest
        statuses = [status for status, _ in got]
        assert set(statuses) <= {200, 503}, statuses
        assert all("stopping" in data["error"]["message"] for status, data in got if status == 503)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
