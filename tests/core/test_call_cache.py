"""The call cache's claims across processes (halludetect/core/call_cache.py), the hostile cases: two
judge runs at once on one cache pay each request once; a claim whose owner died, or whose lease
expired, is taken over at once; a live claim by another process is waited for, not sent again."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import KEY, ROOT, SECRET, label_inputs, yes_no

from halludetect.config import ChatParams
from halludetect.core.call_cache import CallCache
from halludetect.labels.chat_client import ChatRunner
from halludetect.testing.fake_openai import FakeOpenAI, rule_responder


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    """A call cache of this test's own and the fake API key, as tests/labels/conftest.py sets them."""
    monkeypatch.setenv("HALLUDETECT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(KEY, SECRET)


@pytest.mark.hostile
def test_two_judge_runs_at_once_on_one_cache_pay_each_request_once(tmp_path):
    with FakeOpenAI(rule_responder(), latency=0.05) as srv:
        args = label_inputs(tmp_path, srv.url, n=40)
        runs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stages.judge",
                    *args,
                    "--out",
                    str(tmp_path / f"j{i}.parquet"),
                    "--metrics",
                    str(tmp_path / f"m{i}.json"),
                ],
                cwd=ROOT,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ]
        errors = [p.communicate(timeout=120)[1] for p in runs]
        assert [p.returncode for p in runs] == [0, 0], errors
        bodies = [json.dumps(b, sort_keys=True) for b in srv.requests]
    assert len(bodies) == len(set(bodies))  # no request was sent twice
    m = [json.loads((tmp_path / f"m{i}.json").read_text())["api"] for i in (0, 1)]
    assert m[0]["calls"] + m[1]["calls"] == len(set(bodies))
    assert (tmp_path / "j0.parquet").read_bytes() == (tmp_path / "j1.parquet").read_bytes()


def runner(srv, cache: CallCache | None = None, **kw) -> ChatRunner:
    params = {"model": "judge-model", "base_url": srv.url, "api_key_env": KEY, "max_retries": 2, "timeout": 10} | kw
    return ChatRunner(
        ChatParams(**params),
        where="judge.openai",
        cache=cache or CallCache(Path(os.environ["HALLUDETECT_CACHE"]) / "api_calls.sqlite"),
    )


def plant_claim(r: ChatRunner, prompt: str, host: str, pid: int, lease_until: float) -> str:
    """A claim on `prompt`'s request by another owner, as another process would leave it."""
    key, _ = r.key(prompt, 0)
    r.cache.db.execute(
        "INSERT INTO claims VALUES (?, ?, ?, ?, ?)", (key, f"{host}:{pid}:other", host, pid, lease_until)
    )
    return key


@pytest.mark.hostile
def test_a_claim_whose_owner_died_is_taken_over_at_once(tmp_path):
    from halludetect.core.call_cache import HOST

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a SIGKILLed run's pid: gone, its lease still an hour long
    with FakeOpenAI(lambda body, n: "yes") as srv:
        r = runner(srv)
        plant_claim(r, "Q?", HOST, dead.pid, time.time() + 3600)
        t0 = time.monotonic()
        assert r.run(["Q?"], yes_no)[0].value == "yes"
        assert time.monotonic() - t0 < 5 and srv.count == 1


@pytest.mark.hostile
def test_a_claim_whose_lease_expired_is_taken_over(tmp_path):
    with FakeOpenAI(lambda body, n: "yes") as srv:
        r = runner(srv)
        plant_claim(r, "Q?", "another-host", 1, time.time() - 1)  # a crashed run on another machine
        assert r.run(["Q?"], yes_no)[0].value == "yes" and srv.count == 1


@pytest.mark.hostile
def test_a_live_claim_by_another_process_is_waited_for_not_sent_again(tmp_path):
    with FakeOpenAI(lambda body, n: "yes") as srv:
        r = runner(srv)
        key = plant_claim(r, "Q?", "another-host", 1, time.time() + 3600)
        reply = {"reply": "no", "prompt_tokens": 3, "completion_tokens": 1, "reasoning_tokens": None, "latency_s": 0.1}
        # the other process, whose reply lands after a while (its own connection, in its own thread)
        timer = threading.Timer(0.5, lambda: CallCache(r.cache.path).put(key, {"request": 1}, reply))
        timer.start()
        out = r.run(["Q?"], yes_no)
        timer.join()
    assert out[0].value == "no" and srv.count == 0
    assert r.usage.cache_hits == 1 and r.usage.waited == 1 and r.usage.calls == 0
