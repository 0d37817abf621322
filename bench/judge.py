"""The `openai` judge against a local OpenAI-compatible server with a fixed latency.

1. Efficiency: `--calls` distinct judge prompts through `ChatRunner` at `--concurrency`
   against a server that answers after `--latency` seconds. The ideal wall time is
   calls x latency / concurrency; efficiency = ideal / measured (median of `--repeats`, each
   with an empty call cache). The server runs in its own process, as a real endpoint would.
2. Re-runs: the `judge` stage itself (a subprocess, both passes, 100 questions x 5 answers)
   is interrupted mid-way, re-run to completion, then re-run again. The server counts
   requests and distinct request bodies; every request beyond the distinct ones was paid
   twice. Once with SIGINT (what Ctrl-C on `dvc repro` sends: calls in flight are awaited and
   stored) and once with SIGKILL (nothing can be stored: the calls in flight are lost).
3. Two at once: two `judge` stages on the same inputs started together on one empty call
   cache (what `dvc queue start -j 2` does with two queued experiments). The server counts
   requests and distinct bodies: every request beyond the distinct ones was paid twice.

    python -m bench.judge [--calls 500] [--latency 0.05] [--concurrency 32] [--repeats 3] [--only two-at-once]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import yaml

from bench.common import emit, median
from halludetect.config import ChatParams
from halludetect.core.call_cache import CallCache
from halludetect.labels.chat_client import ChatRunner
from halludetect.labels.text import YES_NO, parse_choice
from halludetect.prompts import labeling_prompt

REPO = Path(__file__).resolve().parents[1]
KEY = "BENCH_JUDGE_KEY"


@contextmanager
def server(latency: float):
    proc = subprocess.Popen(
        [sys.executable, "-m", "halludetect.testing.fake_openai", "--port", "0", "--latency", str(latency)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().split()[1]  # "serving http://127.0.0.1:PORT/v1 ..."
        yield url
    finally:
        proc.terminate()
        proc.wait()


def stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats") as r:
        return json.loads(r.read())


def efficiency_run(url: str, calls: int, concurrency: int, cache_dir: Path) -> float:
    prompts = [labeling_prompt(f"Where was person {i} born?", f"In City{i}.", (f"City{i}",)) for i in range(calls)]
    runner = ChatRunner(
        ChatParams(model="bench", base_url=url, api_key_env=KEY, concurrency=concurrency),
        where="bench",
        cache=CallCache(cache_dir / "calls.sqlite"),
    )
    t0 = time.perf_counter()
    out = runner.run(prompts, lambda t: parse_choice(t, YES_NO))
    wall = time.perf_counter() - t0
    assert runner.usage.calls == calls and all(r.value for r in out)
    return wall


def stage_files(d: Path, url: str, concurrency: int) -> list[str]:
    n = 100
    pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was person {i} born?" for i in range(n)],
            "answers": [[f"City{i}"] for i in range(n)],
            "context": [""] * n,
            "split": ["test"] * n,
        }
    ).write_parquet(d / "questions.parquet")
    pl.DataFrame(
        [
            {
                "question_id": f"q{i}",
                "sample_index": k,
                "split": "test",
                "n_tokens": 3,
                "text": f"Born in City{i}{k or ''}.",
                "token_logprobs": [-0.5] * 3,
            }
            for i in range(n)
            for k in range(5)
        ]
    ).write_parquet(d / "generations.parquet")
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["judge"]["backend"] = "openai"
    data["judge"]["openai"].update(base_url=url, api_key_env=KEY, concurrency=concurrency)
    (d / "params.yaml").write_text(yaml.safe_dump(data))
    return [
        sys.executable,
        "-m",
        "stages.judge",
        "--params",
        str(d / "params.yaml"),
        "--questions",
        str(d / "questions.parquet"),
        "--generations",
        str(d / "generations.parquet"),
        "--out",
        str(d / "judgments.parquet"),
        "--metrics",
        str(d / "metrics.json"),
    ]


def kill_and_rerun(latency: float, concurrency: int, sig: signal.Signals, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp, server(latency) as url:
        d = Path(tmp)
        env = env | {"HALLUDETECT_CACHE": str(d / "cache")}
        cmd = stage_files(d, url, concurrency)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while stats(url)["distinct"] < 300 and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(sig)
        rc = proc.wait()
        at_kill = stats(url)
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        after_resume = stats(url)
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        final = stats(url)
        m = json.loads((d / "metrics.json").read_text())
        return {
            "signal": sig.name,
            "exit_code": rc,
            "requests_before_kill": at_kill["requests"],
            "distinct_calls": final["distinct"],
            "total_requests": final["requests"],
            "repeat_calls": final["requests"] - final["distinct"],
            "calls_in_last_rerun": final["requests"] - after_resume["requests"],
            "cache_hits_in_last_rerun": m["api"]["cache_hits"],
        }


def two_at_once(latency: float, concurrency: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp, server(latency) as url:
        d = Path(tmp)
        env = env | {"HALLUDETECT_CACHE": str(d / "cache")}
        cmd = stage_files(d, url, concurrency)
        runs = []
        for i in (0, 1):
            out = [
                a.replace("judgments.parquet", f"judgments{i}.parquet").replace("metrics.json", f"metrics{i}.json")
                for a in cmd
            ]
            runs.append(
                subprocess.Popen(out, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            )
        errors = [p.communicate()[1] for p in runs]
        if any(p.returncode for p in runs):
            raise SystemExit(f"a judge run failed: {errors}")
        s = stats(url)
        same = (d / "judgments0.parquet").read_bytes() == (d / "judgments1.parquet").read_bytes()
        return {
            "requests": s["requests"],
            "distinct_prompts": s["distinct"],
            "paid_twice": s["requests"] - s["distinct"],
            "identical_outputs": same,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["two-at-once"], help="run one part only")
    a = ap.parse_args()
    os.environ[KEY] = "bench-key-not-secret"
    if a.only == "two-at-once":
        emit({"two_at_once": two_at_once(a.latency, a.concurrency, dict(os.environ))})
        return
    walls = []
    with server(a.latency) as url:
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                walls.append(efficiency_run(url, a.calls, a.concurrency, Path(tmp)))
    ideal = a.calls * a.latency / a.concurrency
    wall = median(walls)
    runs = [kill_and_rerun(a.latency, a.concurrency, s, dict(os.environ)) for s in (signal.SIGINT, signal.SIGKILL)]
    for r in runs:
        print(json.dumps(r, sort_keys=True))
    both = two_at_once(a.latency, a.concurrency, dict(os.environ))
    print(json.dumps({"two_at_once": both}, sort_keys=True))
    emit(
        {
            "calls": a.calls,
            "latency_s": a.latency,
            "concurrency": a.concurrency,
            "wall_s": round(wall, 3),
            "wall_s_runs": [round(w, 3) for w in walls],
            "ideal_s": round(ideal, 3),
            "efficiency": round(ideal / wall, 3),
            "repeat_calls_after_rerun": runs[0]["repeat_calls"] + runs[0]["calls_in_last_rerun"],
            "repeat_calls_after_sigkill": runs[1]["repeat_calls"],
            "calls_in_rerun_after_completion": runs[0]["calls_in_last_rerun"] + runs[1]["calls_in_last_rerun"],
            "two_at_once_requests": both["requests"],
            "two_at_once_distinct": both["distinct_prompts"],
            "two_at_once_paid_twice": both["paid_twice"],
        }
    )


if __name__ == "__main__":
    main()
