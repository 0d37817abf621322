"""A local engine with vLLM's completions semantics, serving a Hugging Face model through transformers
on 127.0.0.1: for the tests, the benchmark and offline demos of `generate.backend: completions`.

`POST /v1/completions` takes what `lm/completions.py` sends and what vLLM takes:

- `prompt` as token ids (or as text, tokenised with the special tokens, as vLLM does), `n`,
  `seed` (answer i of a request draws from the stream seeded with seed + i, as vLLM's parallel
  sampling seeds its children), `temperature` (0: greedy), `top_p`, `top_k` (0 or -1: off),
  `min_p` 0, `repetition_penalty`, `max_tokens`, `stop`, `logprobs`;
- `return_token_ids` (each choice gets `token_ids` and `prompt_token_ids`) and
  `return_tokens_as_token_ids` (`logprobs.tokens` as "token_id:N"), vLLM's two ways to give ids;
- each choice's `token_ids` run to the EOS token or the token that completes a stop string,
  both included, as vLLM's do; its `text` stops before the stop string; `finish_reason` is
  "stop" (EOS or a stop string, named in `stop_reason`) or "length";
- `GET /v1/models` lists the served name with `root` and `max_model_len`;
- errors in vLLM's shape, `{"error": {"message", "type", "param", "code"}}`: 404 for a model name
  it does not serve, 400 for a request longer than the context, a prompt id outside the
  vocabulary, or a parameter this fake does not implement (streaming, echo, penalties, min_p).

Switches to misbehave, for the bad-input tests: `fault(body, n)` returns a `Fault` (any status,
Retry-After, a raw or cut body, a delay, a trickle) or None, and may block to hold a request;
`mutate(response, body, n)` returns the response to send instead (fewer choices, ids outside
the vocabulary, NaN log-probs, another text); `dtype="bfloat16"` serves like a bf16 engine;
`models_latency` delays `GET /v1/models` (an engine still loading its model);
`logprobs_mode="processed_logprobs"` returns the warped distribution's log-probs, as vLLM's
`--logprobs-mode processed_logprobs` does;
`hidden_states=[ids]` extracts hidden states as vLLM started with the `extract_hidden_states`
speculative method and the `ExampleHiddenStatesConnector` does: a request with
`kv_transfer_params: {"include_output_tokens": true}` gets a safetensors file in `states_dir`
(`hidden_states` [tokens, layers, hidden] in the engine's dtype, `token_ids` [tokens]: the prompt and
every output token but the last, which no forward pass saw), named in the response's
`kv_transfer_params.hidden_states_path`, written under an exclusive flock on `<file>.lock` after
`states_delay` seconds (as vLLM's writer threads do, after the reply), from the model's own forward
pass: layer id k < num_hidden_layers is the residual stream after k blocks, k = num_hidden_layers the
last block's output before the final norm (vLLM's ids); without `include_output_tokens`, or with
`states_tokens="prompt"` (an engine that ignores it), the prompt's states only; `weight_noise`
perturbs the weights (another revision of the model); `tokenizer_dir` serves with another
tokenizer; `token_ids` says which of vLLM's token-id options it implements ("both",
"return_token_ids", "tokens_as_ids", "none": an engine that ignores both, as an old vLLM does).

Reproducible: with `batch=1` (the default) requests are computed one at a time, each alone (its
n rows share one prompt, so there is no padding), so a request's answers do not depend on what
else is in flight. `batch` > 1 merges up to that many waiting requests with the same sampling
settings into one batched `generate`, as an engine's continuous batching does: faster, but an
answer's logits then carry the float noise of its batch-mates' padding. The model loads on the
first request (a test may start the server before the model exists) and again when its weights
file changes.

    python -m halludetect.testing.fake_vllm --model data/world/model --port 8000 [--batch 16]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import torch

from halludetect.config import GenerateParams, ModelPreset
from halludetect.lm.generation import generate_raw
from halludetect.lm.hf_models import context_length, eos_ids, load_model, load_tokenizer
from halludetect.testing.fake_openai import Fault, _Server, send

TOKEN_ID_MODES = ("both", "return_token_ids", "tokens_as_ids", "none")


class RequestError(Exception):
    """A request vLLM would refuse: (status, type, message, param)."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> str:
        return json.dumps(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}
        )


@dataclass
class _Job:
    prompt: list[int]
    n: int
    seeds: list[int]
    key: tuple  # the sampling settings: only jobs with equal keys share a batch
    params: GenerateParams
    greedy: bool
    future: Future
    states: bool | None = None  # None: no states asked; else whether the output tokens' states are


class _Engine:
    """The model and its tokenizer, loaded on first use and again when the weights file changes."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path, dtype: str, weight_noise: float):
        self.model_dir, self.tokenizer_dir, self.dtype, self.noise = model_dir, tokenizer_dir, dtype, weight_noise
        self._lock = threading.Lock()
        self._stamp = None
        self.model = self.tokenizer = None

    def _weights_stamp(self):
        files = sorted(self.model_dir.glob("*.safetensors"))
        return tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)

    def get(self):
        with self._lock:
            stamp = self._weights_stamp()
            if self.model is None or stamp != self._stamp:
                model = load_model(ModelPreset(path=str(self.model_dir), dtype=self.dtype), "cpu")
                if self.noise:
                    g = torch.Generator().manual_seed(0)
                    with torch.no_grad():
                        for p in model.parameters():
                            if p.numel() > 1:
                                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * self.noise * p.float().std())
                self.model = model
                self.tokenizer = load_tokenizer(ModelPreset(path=str(self.tokenizer_dir)))
                self.eos = eos_ids(model, self.tokenizer)
                self.max_len = context_length(model.config)
                self._stamp = stamp
            return self.model, self.tokenizer


def finish(tokenizer, ids: list[int], eos: list[int], stop: list[str]) -> tuple[list[int], str, str, str | int | None]:
    """vLLM's ending of one choice: (token_ids, text, finish_reason, stop_reason). The ids run to
    the EOS token or the token that completes a stop string, included; the text stops before
    the stop string."""
    ends = set(eos)
    out: list[int] = []
    for t in ids:
        out.append(t)
        if t in ends:
            return out, tokenizer.decode(out, skip_special_tokens=True), "stop", None
        text = tokenizer.decode(out, skip_special_tokens=True)
        hits = [(text.index(s), s) for s in stop if s in text]
        if hits:
            at, s = min(hits)
            return out, text[:at], "stop", s
    return out, tokenizer.decode(out, skip_special_tokens=True), "length", None


class FakeVLLM:
    """Context manager: `with FakeVLLM("data/world/model") as srv: ... srv.url ...`."""

    def __init__(
        self,
        model_dir: str | Path,
        served_name: str | None = None,
        *,
        tokenizer_dir: str | Path | None = None,
        port: int = 0,
        latency: float = 0.0,
        dtype: str = "float32",
        logprobs_mode: str = "raw_logprobs",
        weight_noise: float = 0.0,
        token_ids: str = "both",
        batch: int = 1,
        fault: Callable[[dict, int], Fault | None] | None = None,
        mutate: Callable[[dict, dict, int], dict] | None = None,
        models_latency: float = 0.0,
        hidden_states: list[int] | None = None,
        states_dir: str | Path | None = None,
        states_delay: float = 0.0,
        states_tokens: str = "output",
    ):
        if hidden_states is not None and states_dir is None:
            raise ValueError("hidden_states needs a states_dir (vLLM's shared_storage_path)")
        self.hidden_states, self.states_delay, self.states_tokens = hidden_states, states_delay, states_tokens
        self.states_dir = None if states_dir is None else Path(states_dir)
        self._writes: list[threading.Thread] = []
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode {logprobs_mode!r}: raw_logprobs or processed_logprobs")
        if token_ids not in TOKEN_ID_MODES:
            raise ValueError(f"token_ids {token_ids!r}: one of {TOKEN_ID_MODES}")
        model_dir = Path(model_dir)
        self.name = served_name or str(model_dir)
        self.engine = _Engine(model_dir, Path(tokenizer_dir or model_dir), dtype, weight_noise)
        self.latency, self.logprobs_mode, self.token_ids, self.batch = latency, logprobs_mode, token_ids, batch
        self.fault, self.mutate, self.models_latency = fault, mutate, models_latency
        self.requests: list[dict] = []  # every POST body, in arrival order
        self.headers: list[dict[str, str]] = []  # their headers, names lower-cased
        self.batches = 0  # generate calls (several requests each when batch > 1)
        self.in_flight = self.max_in_flight = 0  # POSTs being answered now, and the most at once
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self.server = _Server(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._threads = [
            threading.Thread(target=self.server.serve_forever, daemon=True),
            threading.Thread(target=self._work, daemon=True),
        ]

    def __enter__(self) -> FakeVLLM:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._jobs.put(None)
        for t in self._writes:
            t.join()

    @property
    def count(self) -> int:
        return len(self.requests)

    def reload(self, weight_noise: float | None = None, logprobs_mode: str | None = None) -> None:
        """Serve from now on with other weights (noise on the model's own) or another logprob mode,
        as an engine restarted with another revision or `--logprobs-mode` would."""
        if weight_noise is not None:
            self.engine.noise, self.engine.model = weight_noise, None
        if logprobs_mode is not None:
            self.logprobs_mode = logprobs_mode

    # ------------------------------------------------------------------ the engine loop
    def _work(self) -> None:
        waiting: list[_Job] = []
        while True:
            if not waiting:
                job = self._jobs.get()
                if job is None:
                    return
                waiting.append(job)
            while len(waiting) < self.batch:  # what else is already queued joins the batch
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                waiting.append(job)
            key = waiting[0].key
            group = [j for j in waiting if j.key == key][: self.batch]
            waiting = [j for j in waiting if j not in group]
            try:
                results = self._run(group)
            except Exception as e:  # noqa: BLE001  (a failed batch fails its requests, not the server)
                for j in group:
                    j.future.set_exception(e)
                continue
            for j, r in zip(group, results):
                j.future.set_result(r)

    def _run(self, group: list[_Job]) -> list[list[dict]]:
        model, tokenizer = self.engine.get()
        first = group[0]
        prompts = [j.prompt for j in group for _ in range(j.n)]
        seeds = [s for j in group for s in j.seeds]
        processed = self.logprobs_mode == "processed_logprobs"
        gen, sampler, _ = generate_raw(
            model,
            tokenizer,
            prompts,
            seeds,
            first.params,
            self.engine.eos,
            greedy=first.greedy,
            repeats=first.n if len(group) == 1 else 1,
            processed=processed,
        )
        with self._lock:
            self.batches += 1
        logprobs = (sampler.processed if processed else sampler.logprobs).cpu().double()
        rows, out = iter(range(len(prompts))), []
        for j in group:
            choices = []
            for _ in range(j.n):
                r = next(rows)
                ids, text, reason, stop_reason = finish(tokenizer, gen[r], self.engine.eos, first.params.stop)
                choices.append(
                    {
                        "ids": ids,
                        "text": text,
                        "finish": reason,
                        "stop": stop_reason,
                        "logprobs": logprobs[r, : len(ids)],
                    }
                )
            if j.states is not None:
                ids = choices[0]["ids"]
                tokens = j.prompt + ids[:-1] if j.states and self.states_tokens == "output" else j.prompt
                choices[0]["states_path"] = self._write_states(model, tokens)
            out.append(choices)
        return out

    def _write_states(self, model, tokens: list[int]) -> str:
        """vLLM's states file of one request: taken from one forward pass of the model over `tokens`,
        written after `states_delay` under the flock its reader waits on (see the module docstring)."""
        from safetensors.torch import save_file

        from halludetect.activations.capture import _decoder_layers

        kept: list[torch.Tensor] = []
        hook = _decoder_layers(model)[-1].register_forward_hook(
            lambda _m, _i, out: kept.append(out[0] if isinstance(out, tuple) else out)
        )
        try:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
        finally:
            hook.remove()
        n = model.config.num_hidden_layers
        if bad := [k for k in self.hidden_states if k > n]:  # vLLM refuses such a server at start
            raise RequestError(400, "BadRequestError", f"fake vLLM: layer ids {bad} above num_hidden_layers {n}")
        layers = [kept[-1][0] if k == n else out.hidden_states[k][0] for k in self.hidden_states]
        tensors = {
            "hidden_states": torch.stack(layers, dim=1).contiguous(),  # [T, layers, d]
            "token_ids": torch.tensor(tokens, dtype=torch.int64),
        }
        self.states_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            path = self.states_dir / f"cmpl-{secrets.token_hex(8)}.safetensors"
        lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)

        def write():
            try:
                time.sleep(self.states_delay)
                save_file(tensors, str(path))
            finally:
                os.close(lock)  # releases the flock: readers waiting on it go on

        t = threading.Thread(target=write, daemon=True)
        t.start()
        self._writes.append(t)
        return str(path)

    # ------------------------------------------------------------------ one request
    def _job(self, body: dict) -> _Job:
        """The request checked as vLLM checks it, as a job for the engine loop."""
        model, tokenizer = self.engine.get()
        if body.get("model") != self.name:
            raise RequestError(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.", "model")
        for unsupported in ("stream", "echo"):
            if body.get(unsupported):
                raise RequestError(
                    400, "BadRequestError", f"fake vLLM: `{unsupported}` is not implemented", unsupported
                )
        for penalty in ("presence_penalty", "frequency_penalty", "min_p"):
            if body.get(penalty) not in (None, 0, 0.0):
                raise RequestError(400, "BadRequestError", f"fake vLLM: `{penalty}` is not implemented", penalty)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise RequestError(400, "BadRequestError", "fake vLLM: one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise RequestError(400, "BadRequestError", "Either prompt or prompt_embeds must be provided and non-empty.")
        vocab = len(tokenizer)
        if bad := [t for t in prompt if not 0 <= t < vocab]:
            raise RequestError(400, "BadRequestError", f"Token id {bad[0]} is out of vocabulary", "prompt")
        max_tokens = int(body.get("max_tokens") or 16)
        limit = self.engine.max_len
        if limit and len(prompt) + max_tokens > limit:
            raise RequestError(
                400,
                "BadRequestError",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        n = int(body.get("n") or 1)
        seed = body.get("seed")
        base = int(seed) if seed is not None else secrets.randbits(30)
        temperature = 1.0 if body.get("temperature") is None else float(body["temperature"])
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        top_k = int(body.get("top_k") or 0)
        params = GenerateParams.model_construct(
            **{
                **GenerateParams().model_dump(),
                "temperature": temperature if temperature > 0 else 1.0,
                "top_p": float(body.get("top_p") if body.get("top_p") is not None else 1.0),
                "top_k": max(top_k, 0),
                "repetition_penalty": float(body.get("repetition_penalty") or 1.0),
                "max_new_tokens": max_tokens,
                "stop": stop,
            }
        )
        key = (temperature, params.top_p, params.top_k, params.repetition_penalty, max_tokens, tuple(stop))
        states = None
        transfer = body.get("kv_transfer_params")
        if isinstance(transfer, dict) and self.hidden_states is not None:  # an engine without extraction ignores it
            if n != 1:
                raise RequestError(400, "BadRequestError", "fake vLLM: hidden states for one answer per request", "n")
            states = bool(transfer.get("include_output_tokens"))
        job = _Job(prompt, n, [base + i for i in range(n)], key, params, temperature == 0, Future(), states)
        return job

    def _response(self, body: dict, job: _Job, choices: list[dict], number: int) -> dict:
        tokenizer = self.engine.tokenizer
        want_ids = body.get("return_token_ids") and self.token_ids in ("both", "return_token_ids")
        as_ids = body.get("return_tokens_as_token_ids") and self.token_ids in ("both", "tokens_as_ids")
        out = []
        for i, c in enumerate(choices):
            choice = {"index": i, "text": c["text"], "logprobs": None, "finish_reason": c["finish"]}
            choice["stop_reason"] = c["stop"]
            if body.get("logprobs") is not None:
                tokens = [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in c["ids"]]
                lps = [float(x) for x in c["logprobs"]]
                offsets, at = [], 0
                for t in tokens:
                    offsets.append(at)
                    at += len(t)
                choice["logprobs"] = {
                    "text_offset": offsets,
                    "token_logprobs": lps,
                    "tokens": tokens,
                    "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)],  # the sampled token only
                }
            if want_ids:
                choice["token_ids"] = c["ids"]
                choice["prompt_token_ids"] = job.prompt
            out.append(choice)
        completion = sum(len(c["ids"]) for c in choices)
        transfer = (
            {"kv_transfer_params": {"hidden_states_path": choices[0]["states_path"]}} if job.states is not None else {}
        )
        return {
            **transfer,
            "id": f"cmpl-{number}",
            "object": "text_completion",
            "created": 0,
            "model": self.name,
            "choices": out,
            "usage": {
                "prompt_tokens": len(job.prompt),
                "completion_tokens": completion,
                "total_tokens": len(job.prompt) + completion,
            },
        }

    def _handler(self):
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _error(self, e: RequestError) -> None:
                send(self, e.status, e.body())

            def do_GET(self):
                path = self.path.rstrip("/")
                if path.endswith("/models"):
                    time.sleep(srv.models_latency)
                    srv.engine.get()
                    data = [
                        {
                            "id": srv.name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "vllm",
                            "root": str(srv.engine.model_dir),
                            "parent": None,
                            "max_model_len": srv.engine.max_len,
                        }
                    ]
                    send(self, 200, json.dumps({"object": "list", "data": data}))
                elif path.endswith("/stats"):  # for a benchmark in another process
                    with srv._lock:
                        send(self, 200, json.dumps({"requests": len(srv.requests), "batches": srv.batches}))
                else:
                    self._error(RequestError(404, "NotFoundError", f"no route {self.path}"))

            def do_POST(self):
                with srv._lock:
                    srv.in_flight += 1
                    srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
                try:
                    self._post()
                finally:
                    with srv._lock:
                        srv.in_flight -= 1

            def _post(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError as e:
                    return self._error(RequestError(400, "BadRequestError", f"JSON decode error: {e}"))
                with srv._lock:
                    number = len(srv.requests)
                    srv.requests.append(body)
                    srv.headers.append({k.lower(): v for k, v in self.headers.items()})
                path = self.path.rstrip("/")
                if not path.endswith("/v1/completions"):  # a chat route, a typo: vLLM's 404
                    return self._error(RequestError(404, "NotFoundError", f"no route {self.path}"))
                fault = srv.fault(body, number) if srv.fault else None
                if fault is not None:
                    time.sleep(srv.latency + fault.delay)
                    error = RequestError(fault.status, "InternalServerError", f"injected {fault.status}").body()
                    if fault.status == 200 and fault.body is None:  # a good reply, delivered slowly or cut
                        fault = Fault(200, fault.headers, self._complete(body, number), 0.0, fault.trickle, fault.cut)
                    return send(
                        self,
                        fault.status,
                        fault.body if fault.body is not None else error,
                        fault.headers,
                        fault.trickle,
                        fault.cut,
                    )
                try:
                    text = self._complete(body, number)
                except RequestError as e:
                    return self._error(e)
                except Exception as e:  # noqa: BLE001  (the engine failed: 500, as a server would)
                    return self._error(RequestError(500, "InternalServerError", f"{type(e).__name__}: {e}"))
                time.sleep(srv.latency)
                send(self, 200, text)

            def _complete(self, body: dict, number: int) -> str:
                job = srv._job(body)
                srv._jobs.put(job)
                response = srv._response(body, job, job.future.result(), number)
                if srv.mutate:
                    response = srv.mutate(response, body, number)
                return json.dumps(response, allow_nan=True)

        return Handler


def nan_logprobs(response: dict, body: dict, n: int) -> dict:
    """A `mutate` that makes the first choice's log-probs NaN (a broken engine)."""
    response["choices"][0]["logprobs"]["token_logprobs"] = [math.nan] * len(
        response["choices"][0]["logprobs"]["token_logprobs"]
    )
    return response


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (data/world/model)")
    p.add_argument("--name", help="the served model name (default: the --model path, as vllm serve names it)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--batch", type=int, default=1, help="requests merged into one generate call (1: reproducible)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--latency", type=float, default=0.0, help="seconds added to every reply")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with FakeVLLM(a.model, a.name, port=a.port, batch=a.batch, dtype=a.dtype, latency=a.latency) as srv:
        print(f"serving {srv.url} (model {srv.name}; Ctrl-C to stop)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
