"""`halludetect serve` under load: what scoring adds to serving, and a check of every served score.

One server process (halludetect/scoring/serve.py) on loopback, one model, one bundle. For each number
of concurrent clients (1, 8, 64) runs alternate between the server *with* scoring (the hook on the
bundle's layer, the bags, the detector, the distribution check) and *without* (the same sampling,
batching and HTTP, no hook, no detector), `--repeats` times each, so a slow patch of a noisy machine
hits both. Every request i of a run asks for one answer with seed i: both sides sample the same
answers, so they do the same generation work and differ only by scoring. Each side reports its
median over repeats of the per-answer latency (median and p90 over requests) and of the throughput;
`latency_ratio` is with / without (the issue's goal: at most 1.05).

The load test: every scored response of every run (question, answer token ids, served score) is
scored again offline, teacher-forced (`score_answers`, as `halludetect score` does), and the largest
difference is reported; in float32 (the world) a difference over `--atol` fails the run.

Presets:
  world            the demo world's model and its `max` bundle (data/bundles/world/world/max.safetensors),
                   the world's test questions; run from a built world
  deep             a randomly initialised Llama of 32 blocks, d 256 (bench.score's), to try the next on a CPU
  llama3-8b-shape  a randomly initialised Llama-3.1-8B-shaped model (32 blocks, d 4096, GQA 8, vocab
                   128,256) in bfloat16 with a word-level tokenizer of that vocabulary, and a `max`
                   detector of random weights at layer 16 (three seeds): run it on a GPU, `--device cuda`.
                   Random weights sample random tokens, so every answer runs to --max-tokens.

    python -m bench.serve                                   # the world on the CPU, about a minute
    python -m bench.serve --stream                          # streamed: time to first token, per token
    python -m bench.serve --preset llama3-8b-shape --device cuda

`--engine` (the world only): `halludetect serve --engine` in front of the faithful fake vLLM
(halludetect/testing/fake_vllm.py, vLLM 0.34.0's hidden-states behaviour) in a third process: it
serves the world's model with hidden-state extraction of every layer, listed out of order
(`--engine-layers`, default [2, 3, 4, 0, 1]; its files hold them ascending), `allow_custom_save_path`,
and merges up to `--engine-batch` waiting requests into one generate. The server asks it for each
answer with a states file of its own in a directory under /dev/shm, reads, checks, scores and
deletes it (scoring/serve.py). The stops are GenerateParams' (a newline, "Question:"), which the world's
model, ending its one-sentence answers with its end token, hardly ever writes: `--extra-stop a` adds a
letter its words often hold, so that many replies end by a stop string and name no file (the fake's
`stop_string_endings`; the fake then decodes a token past the stop, as vLLM's engine does before the
abort reaches it), whose files are read all the same. The fake starts writing each file as it replies;
`--engine-states-delay S` makes its writer wait S seconds first, as vLLM's may still be at it when the
reply arrives (the server's read then waits for its lock).
For each number of concurrent clients, `--repeats` runs: per-answer latency (median and p90 over
requests) and throughput, medians over repeats; the file round trip in the server, per answer
(`EngineClient.read_states` + `StatesDir.release`, timed by this bench around them, not in the
library): its mean in µs, its share of the median per-answer latency, and how many answers found the
engine's writer still at the file when the reply came (`round_trip_waited`: the read then waits on its
lock); the sweep after each request; the answers per engine batch. At the end: every served score
against the offline scorer (as above), replies that named no file, and that no file of ours is left
in the states directory (`hd-*`), nor any in the engine's own.

    python -m bench.serve --engine                          # the world in front of the fake vLLM
    python -m bench.serve --engine --extra-stop a           # ... with replies that name no file
    python -m bench.serve --engine --stream                 # ... every answer streamed from the engine
    python -m bench.serve --engine --n 4                    # ... 4 answers a request, asked at once

With `--stream` every request streams through the engine too (each answer one streamed engine
request): the same checks, and the time to the first chunk and per chunk after it. The fake
computes an answer before it sends its first chunk, so these times are its answers' latency and
what the server adds per chunk, not a real vLLM's time to first token.

`--stream`: every request streams (`stream: true`, server-sent events, read as they arrive), and
each side reports, beside the whole answer's latency, the time to the first chunk (time to first
token, TTFT: the prompt's pass and the first step, then the chunk on the wire) and the time per
token after it ((last chunk - first chunk) / (chunks - 1), per answer): with scoring, each chunk
also carries the running score (scoring/streaming.py), which is the work this adds per token.
`ttft_ratio` is with / without scoring (issue 54: at most 1.05). The check of every served score
reads each streamed answer's last chunk, and its text and token ids are the chunks' concatenation.

Clients are threads of a second process (started once) speaking HTTP/1.1 with keep-alive
(http.client): in the server's process, 64 client threads would contend for its interpreter lock with
the model thread, which waits for it after every torch call it makes (the hook's too). On a machine
with few cores clients and server still share the CPU, on both sides alike, and torch's threads then
stall on every core the HTTP work takes: on 2 cores run it with `HALLUDETECT_THREADS=1`, which leaves
one core to the clients and the server's HTTP threads (docs/benchmarks.md has both).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench.common import WORLD_QUESTIONS, emit, need, setup_threads
from halludetect.config import GenerateParams
from halludetect.scoring.scorer import Scorer, score_answers
from halludetect.scoring.serve import EngineClient, Limits, Server, Service

WORLD_BUNDLE = Path("data/bundles/world/world/max.safetensors")
SYNTHETIC_REVISION = "random-init-seed-0"  # what the random model's config and its bundle both say


# ------------------------------------------------------------------ a Llama-3.1-8B-shaped model and detector
def word_tokenizer(vocab_size: int, words: list[str]):
    """A word-level tokenizer of `vocab_size` ids: specials, the prompt's and questions' words, fillers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}
    for w in words:
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def synthetic(shape: str, device: str, layer: int, out: Path):
    """(model, tokenizer, bundle path, questions): random weights of a shape of bench.score's (in
    bfloat16 on a GPU, float32 on the CPU) and a `max` detector of random weights for its layer
    `layer`, in a bundle that names that model."""
    from bench.score import random_llama
    from halludetect.detectors.build import build_detector
    from halludetect.methods.pooling import PoolingParams
    from halludetect.prompts import GENERATION, template_hash
    from halludetect.scoring.bundle import save_bundle

    questions = [f"Where was person {i} born ?" for i in range(64)]
    words = sorted({w for text in [GENERATION, *questions] for w in text.split()})
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = random_llama(shape, dtype, device)
    model.config._commit_hash = SYNTHETIC_REVISION
    tokenizer = word_tokenizer(model.config.vocab_size, words)
    d, n = model.config.hidden_size, model.config.num_hidden_layers
    params = PoolingParams()
    torch.manual_seed(0)
    detectors = {s: build_detector("max", d, params).state_dict() for s in (0, 1, 2)}
    rates = {"val_fpr": 0.05, "val_tpr": 0.5, "test_fpr": 0.05, "test_tpr": 0.5}
    dtype_name = str(dtype).removeprefix("torch.")
    preset = {"path": f"random/{shape}", "revision": None, "dtype": dtype_name, "chat_template": False}
    meta = {
        "method": "max",
        "params": params.model_dump(),
        "d": d,
        "layer": layer,
        "n_layers": n,
        "base_model": {
            "path": preset["path"],
            "revision": None,
            "resolved_revision": SYNTHETIC_REVISION,
            "files": None,
            "hidden_size": d,
            "num_hidden_layers": n,
            "preset": preset,
        },
        "inputs": {
            "positions": "predicting",
            "prompt_template": GENERATION,
            "prompt_hash": template_hash(GENERATION),
            "chat_template": False,
            "states_dtype": dtype_name,
        },
        "seeds": [0, 1, 2],
        "combine": "mean_logit",
        "thresholds": {"fpr_0.05": {"threshold": 0.0, "target_fpr": 0.05, **rates}},
        "default_threshold": "fpr_0.05",
        "calibration": {"method": "platt", "a": 1.0, "b": 0.0},
        "evaluation": {"n_val": 2, "n_test": 2, "n_val_hallucinated": 1, "n_test_hallucinated": 1},
    }
    path = out / "max.safetensors"
    save_bundle(path, detectors, meta)
    return model, tokenizer, path, questions


# ------------------------------------------------------------------ the load
def spread(worker, clients: int, requests: int) -> tuple[float, list]:
    """Requests 0..requests-1 dealt round-robin to `clients` threads, each running `worker(its share)`:
    (wall seconds, every result)."""
    shares = [list(range(c, requests, clients)) for c in range(clients)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for part in pool.map(worker, shares) for r in part]
    return time.perf_counter() - t0, results


def client_run(url: str, name: str, questions: list[str], clients: int, requests: int, max_tokens: int, n=1):
    """`requests` requests from `clients` threads, request i asking question i (mod) with seed i, `n`
    answers each: (wall seconds, [(latency, question, response)])."""
    host, port = url.split("//")[1].split("/")[0].split(":")

    def worker(share: list[int]):
        conn, out = http.client.HTTPConnection(host, int(port), timeout=600), []
        for i in share:
            body = {"model": name, "prompt": questions[i % len(questions)], "seed": i, "max_tokens": max_tokens}
            body |= {"n": n} if n > 1 else {}
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"request {i}: {response.status} {data}")
            out.append((time.perf_counter() - t0, body["prompt"], data))
        conn.close()
        return out

    return spread(worker, clients, requests)


def stream_run(url: str, name: str, questions: list[str], clients: int, requests: int, max_tokens: int, n=1):
    """`client_run` with `stream: true`: (wall seconds, [(latency, question, choices, ttft, per_token)]),
    each choice rebuilt from its chunks (text and token ids joined, the last chunk's hallucination)."""
    host, port = url.split("//")[1].split("/")[0].split(":")

    def worker(share: list[int]):
        out = []
        for i in share:
            body = {"model": name, "prompt": questions[i % len(questions)], "seed": i, "max_tokens": max_tokens}
            body |= {"stream": True} | ({"n": n} if n > 1 else {})
            conn = http.client.HTTPConnection(host, int(port), timeout=600)  # a stream closes its connection
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"request {i}: {response.status} {response.read()[:500]!r}")
            times, choices = [], [{"text": "", "token_ids": [], "hallucination": None} for _ in range(n)]
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                times.append(time.perf_counter() - t0)
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"request {i}: {chunk}")
                c = chunk["choices"][0]
                choice = choices[c["index"]]
                choice["text"] += c["text"]
                choice["token_ids"] += c["token_ids"]
                if c["finish_reason"] is not None:
                    choice["hallucination"] = c.get("hallucination")
            conn.close()
            per_token = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
            out.append((times[-1], body["prompt"], choices, times[0], per_token))
        return out

    return spread(worker, clients, requests)


# ------------------------------------------------------------------ --engine: in front of the fake vLLM
def fake_engine(
    conn, model_dir: str, layers: list[int], states_dir: str, batch: int, threads: int, delay: float
) -> None:
    """The faithful fake vLLM in a process of its own, answering `conn`: its URL first, then for "stats"
    its counters, for "drain" the same once every request and states write is done, for "stop" the
    files left in its own states directory, and it stops."""
    torch.set_num_threads(threads)
    from halludetect.testing.fake_vllm import FakeVLLM

    engine = FakeVLLM(
        model_dir,
        hidden_states=layers,
        states_dir=states_dir,
        allow_custom_save_path=True,
        batch=batch,
        states_delay=delay,
    )
    with engine:
        conn.send(engine.url)
        while True:
            command = conn.recv()
            if command == "drain":
                engine.wait_writes()
            if command == "stop":
                engine.wait_writes()
                conn.send([str(f) for f in engine.states_files()])
                return
            with engine._lock:
                conn.send(
                    {
                        "requests": engine.count,
                        "batches": engine.batches,
                        "stop_string_endings": engine.stop_string_endings,
                    }
                )


class TimedEngine(EngineClient):
    """The server's engine client with a clock around each answer's file round trip, read
    (`read_states`) and release (`StatesDir.release`), and the sweep after each request: the bench's
    wrapping, the library's code unchanged."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._clock = threading.Lock()
        self._read: dict[str, tuple[float, bool]] = {}
        self.reset()

    def reset(self) -> None:
        with self._clock:
            self.trips: list[tuple[float, bool]] = []  # (seconds, whether its writer held the lock when read)
            self.sweeps: list[float] = []

    def open_states(self):
        states = super().open_states()
        if not getattr(states, "timed_by_bench", False):
            release, sweep = states.release, states.sweep

            def timed_release(name: str) -> None:
                t0 = time.perf_counter()
                release(name)
                took = time.perf_counter() - t0
                with self._clock:
                    read = self._read.pop(name, None)
                    if read is not None:
                        self.trips.append((read[0] + took, read[1]))

            def timed_sweep(*args, **kw) -> int:
                t0 = time.perf_counter()
                removed = sweep(*args, **kw)
                with self._clock:
                    self.sweeps.append(time.perf_counter() - t0)
                return removed

            states.release, states.sweep, states.timed_by_bench = timed_release, timed_sweep, True
        return states

    def read_states(self, name: str, *args, **kw):
        waits = self.states._held(f"{name}.lock")  # before the clock: is the writer still at it?
        t0 = time.perf_counter()
        try:
            return super().read_states(name, *args, **kw)
        finally:
            took = time.perf_counter() - t0
            with self._clock:
                self._read[name] = (took, waits)


def engine_main(args, threads: int) -> None:
    """`--engine`: the server in front of the fake vLLM in another process (see the docstring)."""
    need(WORLD_BUNDLE, WORLD_QUESTIONS)
    from halludetect.lm.hf_models import load_config, n_layers
    from halludetect.qa.questions import read_questions

    qs = read_questions(str(WORLD_QUESTIONS))
    questions = qs.filter(qs["split"] == "test")["question"].to_list()
    stop = [*GenerateParams().stop, *args.extra_stop]  # the default stops, and any added
    generate = GenerateParams(max_new_tokens=args.max_tokens, stop=stop)
    scorer = Scorer(WORLD_BUNDLE, device=args.device, generate=generate, log=lambda *_: None)
    model_dir = str(scorer.bundle.meta["base_model"]["preset"]["path"])
    top = n_layers(load_config(scorer.preset))
    layers = args.engine_layers or [*range(2, top + 1), 0, 1]  # every layer, out of order
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    tmp = tempfile.TemporaryDirectory(prefix="halludetect-bench-", dir=where)
    ours, theirs = Path(tmp.name) / "ours", Path(tmp.name) / "engine"
    spawn = multiprocessing.get_context("spawn")
    conn, child = spawn.Pipe()
    fake = spawn.Process(
        target=fake_engine,
        args=(child, model_dir, layers, str(theirs), args.engine_batch, threads, args.engine_states_delay),
        daemon=True,
    )
    fake.start()
    if not conn.poll(300):
        raise SystemExit("the fake vLLM did not start within 300 s")
    url = conn.recv()

    def engine_stats() -> dict:
        conn.send("stats")
        return conn.recv()

    client = TimedEngine(url, None, layers, states_dir=ours)
    limits = Limits(max_tokens=args.max_tokens, max_batch=max(args.clients), max_concurrency=max(args.clients))
    service = Service(scorer, name="bench", limits=limits, engine=client, log=lambda *_: None)
    checked: list[tuple[str, dict]] = []
    clients_process = ProcessPoolExecutor(1, mp_context=spawn)
    first = engine_stats()

    def load(*a):  # per request: (latency, question, its choices, ttft, per token)
        wall, results = clients_process.submit(stream_run if args.stream else client_run, *a, args.n).result()
        if not args.stream:
            return wall, [(lat, q, data["choices"], None, None) for lat, q, data in results]
        return wall, results

    with Server(service, port=0, log=lambda *_: None) as srv, clients_process:
        load(srv.url, "bench", questions, max(args.clients), max(args.clients), args.max_tokens)  # warm-up
        for clients in args.clients:
            requests = clients * args.rounds
            keys = ("p50", "p90", "tput", "trip", "direct", "waited", "sweep", "ttft", "per_token")
            runs: dict[str, list] = {k: [] for k in keys}
            before = engine_stats()
            for _ in range(args.repeats):
                client.reset()
                wall, results = load(srv.url, "bench", questions, clients, requests, args.max_tokens)
                with client._clock:
                    trips, sweeps = list(client.trips), list(client.sweeps)
                if len(trips) != requests * args.n:
                    raise SystemExit(f"{len(trips)} round trips timed for {requests * args.n} answers")
                latency = sorted(r[0] for r in results)
                runs["p50"].append(statistics.median(latency))
                runs["p90"].append(latency[int(0.9 * (len(latency) - 1))])
                runs["tput"].append(len(results) * args.n / wall)
                runs["trip"].append(statistics.fmean(t for t, _ in trips))
                direct = [t for t, waited in trips if not waited]
                if direct:  # none when every answer's read waited for the writer
                    runs["direct"].append(statistics.fmean(direct))
                runs["waited"].append(sum(waited for _, waited in trips))
                runs["sweep"].append(statistics.fmean(sweeps))  # one after each request
                if args.stream:
                    runs["ttft"].append(statistics.median(r[3] for r in results))
                    runs["per_token"].append(statistics.median(r[4] for r in results if r[4] == r[4]))
                checked += [(q, choice) for _, q, choices, _, _ in results for choice in choices]
            after = engine_stats()
            med = {k: statistics.median(v) if v else None for k, v in runs.items()}
            emit(
                {
                    "bench": "serve-engine",
                    "preset": "world",
                    "threads": threads,
                    "clients": clients,
                    "requests_per_run": requests,
                    "n": args.n,
                    "max_tokens": args.max_tokens,
                    "engine_layers": layers,
                    "engine_batch": args.engine_batch,
                    "stop": stop,
                    "engine_states_delay_s": args.engine_states_delay,
                    "latency_s_p50": round(med["p50"], 4),
                    "latency_s_p90": round(med["p90"], 4),
                    "answers_per_s": round(med["tput"], 2),
                    "answers_per_engine_batch": round(
                        (after["requests"] - before["requests"]) / max(after["batches"] - before["batches"], 1), 1
                    ),
                    "round_trip_us_per_answer": round(med["trip"] * 1e6, 1),
                    "round_trip_share_of_latency": round(med["trip"] / med["p50"], 5),
                    "round_trip_us_not_waiting": None if med["direct"] is None else round(med["direct"] * 1e6, 1),
                    "round_trip_waited": f"{sum(runs['waited'])}/{requests * args.repeats * args.n}",
                    "sweep_us_per_request": round(med["sweep"] * 1e6, 1),
                    "stop_string_endings": f"{after['stop_string_endings'] - before['stop_string_endings']}/"
                    f"{after['requests'] - before['requests']}",
                    "stream": args.stream,
                    **(
                        {"ttft_s_p50": round(med["ttft"], 4), "per_token_s_p50": round(med["per_token"], 5)}
                        if args.stream
                        else {}
                    ),
                }
            )
        conn.send("drain")  # every states file written before the server's last sweep
        drained = conn.recv()
    left = sorted(p.name for p in ours.glob("hd-*"))
    conn.send("stop")
    engine_left = conn.recv()
    fake.join(60)
    failed = check_served(scorer, checked, "world", args.atol, None, device=args.device)
    emit(
        {
            "bench": "serve-engine-files",
            "requests_to_engine": drained["requests"] - first["requests"],
            "stop_string_endings": drained["stop_string_endings"] - first["stop_string_endings"],
            "files_of_ours_left": len(left),
            "files_left_in_engine_dir": len(engine_left),
        }
    )
    tmp.cleanup()
    if failed:
        raise SystemExit(failed)
    if left or engine_left:
        raise SystemExit(f"states files left: {left[:5]} in {ours}, {engine_left[:5]} in the engine's directory")


def check_served(scorer, checked: list[tuple[str, dict]], preset: str, atol: float, model, **kw) -> str | None:
    """Every served score against the offline scorer, teacher-forced on the served tokens (`model` and
    `kw`: the offline scorer's model and options), emitted; why the run fails, if it does."""
    scoreable = [(q, c) for q, c in checked if c["hallucination"]["score"] is not None]
    rows = [{"question": q, "answer": c["text"], "answer_token_ids": c["token_ids"]} for q, c in scoreable]
    offline = score_answers(scorer.bundle, rows, model, log=lambda *_: None, **kw)
    served = np.array([c["hallucination"]["score"] for _, c in scoreable])
    diff = np.abs(served - offline["score"].to_numpy())
    flips = int((np.array([c["hallucination"]["flag"] for _, c in scoreable]) != offline["flag"].to_numpy()).sum())
    if model is not None:  # bf16's noise is reported, not held to atol
        float32 = next(model.parameters()).dtype == torch.float32
    else:  # the offline scorer loaded the bundle's base model in its preset's dtype
        float32 = scorer.bundle.meta["base_model"]["preset"]["dtype"] == "float32"
    emit(
        {
            "bench": "serve-check",
            "preset": preset,
            "responses": len(checked),
            "scored": len(scoreable),
            "max_abs_diff": float(diff.max()) if len(diff) else None,
            "p99_abs_diff": float(np.quantile(diff, 0.99)) if len(diff) else None,
            "flag_disagreements": flips,
            "atol": atol if float32 else None,
        }
    )
    if float32 and len(diff) and diff.max() > atol:
        return f"served scores differ from the offline scorer's by up to {diff.max():.3g} > {atol}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["world", "deep", "llama3-8b-shape"], default="world")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=3, help="requests per client in one run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--layer", type=int, default=16, help="llama3-8b-shape: the detector's layer")
    ap.add_argument("--atol", type=float, default=1e-3, help="float32: the largest served-vs-offline difference")
    ap.add_argument("--engine", action="store_true", help="the world served in front of the fake vLLM")
    ap.add_argument("--engine-batch", type=int, default=16, help="--engine: requests the fake merges into a batch")
    ap.add_argument("--engine-layers", type=int, nargs="+", help="--engine: its layer ids (default all, unsorted)")
    ap.add_argument("--extra-stop", nargs="+", default=[], help="--engine: stop strings added to the defaults")
    ap.add_argument("--engine-states-delay", type=float, default=0.0, help="--engine: s the fake's writer waits")
    ap.add_argument("--stream", action="store_true", help="every request streams: time to first token, per token")
    ap.add_argument("--n", type=int, default=1, help="--engine: answers per request (the server asks them at once)")
    args = ap.parse_args()
    threads = setup_threads()
    if args.engine:
        if args.preset != "world":
            ap.error("--engine serves the world (the fake vLLM runs its model)")
        return engine_main(args, threads)
    if args.n != 1:
        ap.error("--n: the in-process comparison asks one answer a request (with --engine, any)")
    # random weights never write a stop string, and transformers' stop-string matcher cannot read a
    # word-level vocabulary: the synthetic presets sample to --max-tokens without one
    generate = GenerateParams(max_new_tokens=args.max_tokens, **({} if args.preset == "world" else {"stop": []}))
    tmp = tempfile.TemporaryDirectory()
    if args.preset == "world":
        need(WORLD_BUNDLE, WORLD_QUESTIONS)
        from halludetect.qa.questions import read_questions

        qs = read_questions(str(WORLD_QUESTIONS))
        questions = qs.filter(qs["split"] == "test")["question"].to_list()
        scorer = Scorer(WORLD_BUNDLE, device=args.device, generate=generate, log=lambda *_: None)
    else:
        model, tokenizer, bundle, questions = synthetic(args.preset, args.device, args.layer, Path(tmp.name))
        scorer = Scorer(bundle, model, tokenizer=tokenizer, generate=generate, log=lambda *_: None)
    limits = Limits(max_tokens=args.max_tokens, max_batch=max(args.clients), max_concurrency=max(args.clients))
    service = Service(scorer, name="bench", limits=limits, log=lambda *_: None)
    checked: list[tuple[str, dict]] = []
    clients_process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def load(*a):
        wall, results = clients_process.submit(stream_run if args.stream else client_run, *a).result()
        if not args.stream:
            return wall, [(lat, q, data["choices"][0], None, None) for lat, q, data in results]
        return wall, [(lat, q, choices[0], ttft, tok) for lat, q, choices, ttft, tok in results]

    with Server(service, port=0, log=lambda *_: None) as srv, clients_process:
        for side in ("score", "plain"):  # warm-up, both sides at the most clients: first calls, allocator, kernels
            service.scoring = side == "score"
            load(srv.url, "bench", questions, max(args.clients), max(args.clients), args.max_tokens)
        for clients in args.clients:
            requests = clients * args.rounds
            keys = ("p50", "p90", "tput", "ttft", "per_token")
            sides: dict[str, dict[str, list]] = {s: {k: [] for k in keys} for s in ("score", "plain")}
            batches = {"score": 0, "plain": 0}
            for _ in range(args.repeats):
                for side in ("score", "plain"):
                    service.scoring = side == "score"
                    before = service.stats["batches"]
                    wall, results = load(srv.url, "bench", questions, clients, requests, args.max_tokens)
                    batches[side] += service.stats["batches"] - before
                    latency = sorted(r[0] for r in results)
                    sides[side]["p50"].append(statistics.median(latency))
                    sides[side]["p90"].append(latency[int(0.9 * (len(latency) - 1))])
                    sides[side]["tput"].append(len(results) / wall)
                    if args.stream:
                        sides[side]["ttft"].append(statistics.median(r[3] for r in results))
                        sides[side]["per_token"].append(statistics.median(r[4] for r in results if r[4] == r[4]))
                    if side == "score":
                        checked += [(q, choice) for _, q, choice, _, _ in results]
            med = {s: {k: statistics.median(v) for k, v in d.items() if v} for s, d in sides.items()}
            streamed = {}
            if args.stream:
                streamed = {
                    "ttft_s_p50": {s: round(m["ttft"], 4) for s, m in med.items()},
                    "per_token_s_p50": {s: round(m["per_token"], 5) for s, m in med.items()},
                    "ttft_ratio": round(med["score"]["ttft"] / med["plain"]["ttft"], 3),
                    "per_token_ratio": round(med["score"]["per_token"] / med["plain"]["per_token"], 3),
                }
            emit(
                {
                    "bench": "serve",
                    "preset": args.preset,
                    "device": args.device,
                    "threads": threads,
                    "clients": clients,
                    "requests_per_run": requests,
                    "max_tokens": args.max_tokens,
                    "latency_s_p50": {s: round(m["p50"], 4) for s, m in med.items()},
                    "latency_s_p90": {s: round(m["p90"], 4) for s, m in med.items()},
                    "answers_per_s": {s: round(m["tput"], 2) for s, m in med.items()},
                    "answers_per_pass": {s: round(requests * args.repeats / max(b, 1), 1) for s, b in batches.items()},
                    "latency_ratio": round(med["score"]["p50"] / med["plain"]["p50"], 3),
                    "throughput_ratio": round(med["score"]["tput"] / med["plain"]["tput"], 3),
                    "stream": args.stream,
                    **streamed,
                }
            )
    failed = check_served(scorer, checked, args.preset, args.atol, scorer.model, tokenizer=scorer.tokenizer)
    tmp.cleanup()
    if failed:
        raise SystemExit(failed)


if __name__ == "__main__":
    main()
