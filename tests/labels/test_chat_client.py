"""The OpenAI-compatible chat client (halludetect/labels/chat_client.py) against a real local HTTP server.

The server (`halludetect.testing.fake_openai`) speaks the chat-completions API on 127.0.0.1 and is
scripted per test; the real `openai` client talks to it, so retries, Retry-After, timeouts,
malformed bodies, the call cache, usage and cost, and a SIGINT that loses no paid reply are all
exercised over real HTTP. The hostile cases: the key redacted from every error, a key pasted as
api_key_env or credentials in OPENAI_BASE_URL refused without being repeated, usage counts sent as
strings, a per-request deadline that cuts off a trickling server, a Retry-After beyond the patience.
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

import pytest
import yaml
from support import KEY, SECRET, _stage_inputs, label_inputs, stage, yes_no
from support import ROOT as REPO

from halludetect.config import ChatParams, ParamsError, Price, parse_params
from halludetect.core.call_cache import CallCache
from halludetect.labels.chat_client import ApiError, ChatRunner
from halludetect.labels.judges import get_judge
from halludetect.testing.fake_openai import FakeOpenAI, Fault, completion, rule_responder


def runner(srv, **kw) -> ChatRunner:
    params = {"model": "judge-model", "base_url": srv.url, "api_key_env": KEY, "max_retries": 3, "timeout": 10} | kw
    return ChatRunner(ChatParams(**params), where="judge.openai")


always_yes = lambda body, n: "yes"


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
    faults = {
        0: Fault(429, {"Retry-After": "0.4"}),
        1: Fault(500),
        2: Fault(200, body="{not json"),
        3: Fault(200, body=json.dumps({"id": "x", "object": "chat.completion", "choices": []})),
    }
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


# ------------------------------------------------------------------- usage and the cache key
@pytest.mark.hostile
def test_usage_counts_sent_as_strings_are_read_as_numbers():
    """Some servers send `usage` counts as strings ("12"), or text that is no count at all: read,
    or counted as unknown (0), never a TypeError after the reply was paid for."""

    def as_text(body, n):
        reply = completion("yes", body, n)
        details = {"reasoning_tokens": "n/a"}
        reply["usage"] = {"prompt_tokens": "12", "completion_tokens": "3", "completion_tokens_details": details}
        return Fault(200, body=json.dumps(reply))

    with FakeOpenAI(as_text) as srv:
        r = runner(srv)
        assert r.run(["Q?"], yes_no)[0].value == "yes"
        again = runner(srv)
        again.run(["Q?"], yes_no)  # from the cache
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.reasoning_tokens) == (12, 3, 0)
    assert (again.usage.cached_prompt_tokens, again.usage.cached_completion_tokens) == (12, 3)


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


def test_judge_stage_reruns_without_calls_and_sigint_loses_no_paid_reply(tmp_path):
    with FakeOpenAI(rule_responder(), latency=0.05) as srv:
        d, args = _stage_inputs(tmp_path, srv.url)
        cmd = [
            sys.executable,
            "-m",
            "stages.judge",
            *args,
            "--out",
            str(d / "j.parquet"),
            "--metrics",
            str(d / "m.json"),
        ]
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


# ------------------------------------------------------------------- secrets and patience (hostile)
@pytest.mark.hostile
@pytest.mark.parametrize("status", [401, 400, 503])
def test_the_api_key_is_redacted_from_an_error_that_echoes_the_authorization_header(status):
    def echo(body, n):
        auth = srv.headers[n]["authorization"]
        return Fault(
            status,
            body=json.dumps({"error": {"message": f"bad request with header {auth}", "type": "invalid_request_error"}}),
        )

    with FakeOpenAI(echo) as srv:
        with pytest.raises(ApiError) as e:
            runner(srv, max_retries=0).run(["Q?"], yes_no)
        assert SECRET in srv.headers[0]["authorization"]  # the server did echo it
    msg = str(e.value)
    assert SECRET not in msg and f"bad request with header Bearer [{KEY} redacted]" in msg


@pytest.mark.hostile
def test_a_key_as_api_key_env_or_credentials_in_openai_base_url_are_refused_without_repeating_them(monkeypatch):
    """params.yaml refuses both when parsed (tests/test_config.py); the client refuses them too, for
    params built in Python past that check and for OPENAI_BASE_URL, read when base_url is null."""
    pasted = ChatParams.model_construct(**{**ChatParams(model="m").model_dump(), "api_key_env": SECRET})
    with pytest.raises(ApiError) as e:
        ChatRunner(pasted, where="judge.openai")
    assert SECRET not in str(e.value)
    assert str(e.value).startswith("judge.openai.api_key_env: not the name of an environment variable")
    monkeypatch.setenv("OPENAI_BASE_URL", f"https://me:{SECRET}@api.example.com/v1")
    with pytest.raises(ApiError) as e:
        ChatRunner(ChatParams(model="m", api_key_env=KEY), where="cluster.openai")
    assert SECRET not in str(e.value) and str(e.value).startswith(
        "cluster.openai: OPENAI_BASE_URL (read because cluster.openai.base_url is null) carries a user name or "
        "password before the host (user:password@), not repeated here"
    )


@pytest.mark.hostile
def test_timeout_is_a_deadline_per_request_that_cuts_off_a_trickling_server():
    with FakeOpenAI(lambda body, n: Fault(200, trickle=0.05)) as srv:  # ~250 bytes at 20 bytes/s: 12 s
        t0 = time.monotonic()
        with pytest.raises(ApiError, match=r"timed out 1 times \(0.5 s each\); raise judge.openai.timeout"):
            runner(srv, timeout=0.5, max_retries=0).run(["Q?"], yes_no)
        assert time.monotonic() - t0 < 4


@pytest.mark.hostile
def test_retry_after_beyond_the_patience_fails_at_once_saying_what_the_server_asked():
    with FakeOpenAI(lambda body, n: Fault(429, {"Retry-After": "86400"})) as srv:
        t0 = time.monotonic()
        with pytest.raises(ApiError) as e:
            runner(srv, timeout=10, max_retries=2).run(["Q?"], yes_no)
        assert time.monotonic() - t0 < 5 and srv.count == 1
    assert (
        f"judge.openai: {srv.url} answered HTTP 429 and asked to retry after 86400 s (1 d), longer than this "
        "request's remaining patience of 30 s ((max_retries + 1) x timeout = 30 s in all)"
    ) in str(e.value)
    assert "re-run later (every reply so far is cached)" in str(e.value)


@pytest.mark.hostile
def test_stage_error_messages_never_print_the_key(tmp_path):
    def echo(body, n):
        return Fault(
            401,
            body=json.dumps(
                {
                    "error": {
                        "message": f"Incorrect API key {srv.headers[n]['authorization']}",
                        "type": "invalid_request_error",
                    }
                }
            ),
        )

    with FakeOpenAI(echo) as srv:
        args = label_inputs(tmp_path, srv.url)
        res = stage("stages.judge", *args, "--out", str(tmp_path / "j.parquet"), "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 2 and SECRET not in res.stderr + res.stdout
    assert f"Incorrect API key Bearer [{KEY} redacted]" in res.stderr
