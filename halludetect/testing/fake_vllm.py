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
- every reply has `kv_transfer_params` (null unless hidden states are extracted, below);
- `GET /v1/models` lists the served name with `root` and `max_model_len`;
- errors in vLLM's shape, `{"error": {"message", "type", "param", "code"}}`: 404 for a model name
  it does not serve, 400 for a request longer than the context, a prompt id outside the
  vocabulary, or a parameter this fake does not implement (echo, penalties, min_p).

`"stream": true` streams as vLLM 0.34.0's `completion_stream_generator` does
(entrypoints/openai/completion/serving.py:343-626): server-sent events over a chunked response, one
`data: <chunk>` per engine step (`stream_step` tokens a step, 1 by default; 2 is a step that
accepted a draft token), then a usage chunk when `stream_options.include_usage` asks for it, then
`data: [DONE]`. A chunk is the `CompletionStreamResponse` of `model_dump_json(exclude_unset=True)`:
`id`, `object`, `created`, `model`, `choices` (one: `index`, `text`, `logprobs`, `finish_reason`,
`stop_reason`, `prompt_token_ids` on the first chunk with `return_token_ids`, `token_ids` the step's
ids with it, `weight_versions`) and `kv_transfer_params`, null except on a choice's last chunk, where
it is what the unstreamed reply carries (null after a stop string: 531-535). A step's text is the
detokenizer's new text less the last `max(len(stop)) - 1` characters, held back until the answer
ends (v1/engine/detokenizer.py:90, 163-178); the ids of the step that completes a stop string end
with that token (output_processor.py:900-918); `logprobs` cover the step's ids, their `text_offset`
going on from the previous chunk's (serving.py:459-479). The answer is computed first and its steps
sent `stream_delay` seconds apart; a client that leaves mid-stream is counted in `streams_left`
(vLLM aborts the request then: its states file is written all the same).

Switches to misbehave, for the bad-input tests: `mutate_stream(frames, body, n)` returns the
server-sent frames to send instead of vLLM's (each `data: ...\n\n`, or any bytes as text: a comment,
an error object mid-stream, no `[DONE]`, ids outside the vocabulary); `fault(body, n)` returns a `Fault` (any status,
Retry-After, a raw or cut body, a delay, a trickle) or None, and may block to hold a request (a
200 without a body is computed first, its states file included, and delivered late);
`mutate(response, body, n)` returns the response to send instead (fewer choices, ids outside
the vocabulary, NaN log-probs, another text); `dtype="bfloat16"` serves like a bf16 engine;
`models_latency` delays `GET /v1/models` (an engine still loading its model);
`logprobs_mode="processed_logprobs"` returns the warped distribution's log-probs, as vLLM's
`--logprobs-mode processed_logprobs` does; `weight_noise` perturbs the weights (another revision
of the model); `tokenizer_dir` serves with another tokenizer; `token_ids` says which of vLLM's
token-id options it implements ("both", "return_token_ids", "tokens_as_ids", "none": an engine
that ignores both, as an old vLLM does).

Hidden states. `hidden_states=[ids]` serves as `vllm serve` started with the `extract_hidden_states`
speculative method (`eagle_aux_hidden_state_layer_ids: ids`) and the `ExampleHiddenStatesConnector`
(`shared_storage_path: states_dir`, `allow_custom_save_path`, `use_synchronization_lock`) does. What
follows is read from vLLM 0.34.0's code (commit 62d4bc3c7; paths under `vllm/`, EHSC =
`distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`), checked against
0.32.0, whose connector differs only in how `request_finished` builds `token_ids` (a `torch.tensor`
of the list instead of `token_ids_to_tensor`, EHSC 543-546): the same ids.

- The ids are checked when the server starts (here: `ValueError`): empty, duplicated, negative or
  above the model's `num_hidden_layers` (config.json). vLLM has no explicit range check: it keeps
  `tuple(sorted(set(ids)))` (model_executor/models/interfaces.py:1630) and collects the residual
  stream where a block index matches (interfaces.py:1653-1663, models/llama.py:429-441); an id
  that never matches, or a duplicate, leaves fewer states than `len(ids)`, which the speculator
  refuses (v1/worker/gpu/spec_decode/extract_hidden_states.py:128-132); an empty list is refused at
  its lines 42-46. Id k < num_hidden_layers is the residual stream after k blocks (transformers'
  `output_hidden_states[k]`); k = num_hidden_layers the last block's output before the final norm.
- The file's `hidden_states` is [tokens, len(ids), hidden] in the engine's dtype
  (extract_hidden_states.py:134, stacked on dim 1), its columns in ASCENDING layer-id order
  whatever order the ids were listed in (interfaces.py:1630), computed here by one forward pass of
  the model over the file's `token_ids` (int64).
- EVERY request that reaches the engine gets a file, with or without `kv_transfer_params`
  (EHSC `build_connector_meta` 497-517 names one for each newly scheduled request,
  `request_finished` 521-560 saves it). Its name is `<states_dir>/<internal request id>.safetensors`
  (EHSC 498-500): the id is `cmpl-<X-Request-Id header, else the body's request_id, else 16 random
  hex>` (entrypoints/openai/completion/serving.py:192; the header wins,
  entrypoints/serve/engine/serving.py:133-142; the body field's default is random,
  completion/protocol.py:147-148), then `-0` (the prompt's index, serving.py:228), then `-<8 random
  hex>` (v1/engine/input_processor.py:359): `cmpl-<id>-0-<8 hex>.safetensors`. With `n` > 1 (only
  without `kv_transfer_params`, below) each answer is a child request `<i>_<that id>`
  (v1/engine/parallel_sampling.py:94) with a file of its own.
- `kv_transfer_params.hidden_states_path` is the file name instead only on a server started with
  `allow_custom_save_path=True`; otherwise it is ignored, with a warning (EHSC 226-234, 506-515).
  Its folders are created (`os.makedirs`, EHSC 287 and 425); a relative path is relative to the
  server's working directory.
- `token_ids` is `all_token_ids[:-1]` (the prompt and every output token but the last, which no
  forward pass saw) when the request's `kv_transfer_params.include_output_tokens` is true, else the
  prompt (EHSC 540-553); `states_tokens="prompt"` makes an engine that ignores the flag.
- The lock: before the reply, `<file>.lock` is opened with O_CREAT|O_WRONLY|O_TRUNC, 0o644 and
  flock(LOCK_EX)ed (EHSC `wait_for_save` 269-290, when the request is first scheduled); a writer
  thread (EHSC 330-347, 436-441) sleeps `states_delay` here (seconds, or a function of the file's
  path: a request the engine goes on with after its client gave up), writes the file, and closes the fd,
  which releases the lock; a reader takes LOCK_SH on it (EHSC `load_hidden_states` 49-67). With
  `use_synchronization_lock=False` there is no lock file at all (EHSC 235-237, 278, 431). A write
  that fails is logged and the server goes on (EHSC `_on_write_done` 292-298). The server never
  deletes a file (the cleanup, EHSC 70-80, is the client's).
- The reply: `request_finished` returns `{"hidden_states_path": file}` (EHSC 560) when the ENGINE
  finishes the request: by EOS, a stop token id, or the length (v1/core/sched/utils.py:98-120,
  `check_stop`), and the reply carries it (serving.py:767, 777). A stop STRING is matched in the
  front end (v1/engine/output_processor.py:828-836), which finishes the request there with that
  step's `kv_transfer_params`, None, since the engine had not finished it (786, 852-860), and
  aborts it in the engine (880-885); the engine's later output is dropped (763-765). So a choice
  ended by a stop string gets `"kv_transfer_params": null`, but its file and lock are still
  written (the abort runs `request_finished` too: v1/core/sched/scheduler.py:3100-3176, 3483-3536),
  and its `token_ids` may run past the token that completed the stop string: the engine went on
  decoding until the abort arrived. Here it ran `run_ahead` tokens on (default 1: the file then
  ends with the stop-completing token; 0: it ends before it, as for EOS), fewer if it met EOS or
  max_tokens: they are the tokens the generation drew past the stop, if it drew any, else a
  continuation sampled with the request's settings. A stop string completed by the request's last
  allowed token ends it in the engine too (by length, the same step): that reply names the file.
  With `n` > 1 the reply's `kv_transfer_params` are those of the child finished last
  (serving.py:767; v1/engine/parallel_sampling.py:102-127): here the answer with the most tokens (the last
  such), named if the engine ended it.
- `n` != 1 with `kv_transfer_params` is refused (400) HERE, to keep the client's tests honest: vLLM
  takes it, names one child's file in the reply, and with a custom path would give every child the
  same file and lock, whose blocking LOCK_EX (EHSC 289) would stall its worker. The client sends one
  answer per request.

Hostile modes, for the client's tests: `states_mode="name_every_file"` names the file for a stop-string
ending too (an engine that always reports it); `"listed_order"` stacks the columns in the order the ids
were listed, not sorted; `states_writer(path, tensors)` replaces `safetensors.torch.save_file` in the
writer thread (a symlink, a FIFO, a directory or other data at the path). `states_files()` lists what is
under `states_dir`; `wait_writes()` waits for the requests being answered and the writer threads.

Seeded answers are the same with and without extraction here. In vLLM they may differ: with the
`extract_hidden_states` speculative method the rejection sampler draws from the request's generator;
that is not imitated.

Reproducible: with `batch=1` (the default) requests are computed one at a time, each alone (its
n rows share one prompt, so there is no padding), so a request's answers do not depend on what
else is in flight. `batch` > 1 merges up to that many waiting requests with the same sampling
settings into one batched `generate`, as an engine's continuous batching does: faster, but an
answer's logits then carry the float noise of its batch-mates' padding. The model loads on the
first request (a test may start the server before the model exists, unless it extracts hidden states:
their ids are checked against config.json at start) and again when its weights file changes.

    python -m halludetect.testing.fake_vllm --model data/world/model --port 8000 [--batch 16]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
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
from halludetect.lm.hf_models import context_length, eos_ids, load_config, load_model, load_tokenizer, n_layers
from halludetect.testing.fake_openai import Fault, _Server, send

TOKEN_ID_MODES = ("both", "return_token_ids", "tokens_as_ids", "none")
STATES_MODES = ("vllm", "name_every_file", "listed_order")
log = logging.getLogger(__name__)


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
    paths: list[Path] | None = None  # None: no extraction; else each answer's states file
    include_output: bool = False  # whether the files hold the output tokens' states (else the prompt's)


def _random_uuid() -> str:
    """vLLM's `random_uuid()`: 16 hex digits (vllm/utils/__init__.py:11-12)."""
    return secrets.token_hex(8)


def _save_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


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
        states_delay: float | Callable[[Path], float] = 0.0,
        states_tokens: str = "output",
        allow_custom_save_path: bool = False,
        use_synchronization_lock: bool = True,
        run_ahead: int = 1,
        states_mode: str = "vllm",
        states_writer: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
        stream_step: int = 1,
        stream_delay: float = 0.0,
        mutate_stream: Callable[[list[str], dict, int], list[str]] | None = None,
    ):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode {logprobs_mode!r}: raw_logprobs or processed_logprobs")
        if token_ids not in TOKEN_ID_MODES:
            raise ValueError(f"token_ids {token_ids!r}: one of {TOKEN_ID_MODES}")
        if states_mode not in STATES_MODES:
            raise ValueError(f"states_mode {states_mode!r}: one of {STATES_MODES}")
        if isinstance(stream_step, bool) or not isinstance(stream_step, int) or stream_step < 1:
            raise ValueError(f"stream_step {stream_step!r}: tokens per engine step, 1 or more")
        if isinstance(run_ahead, bool) or not isinstance(run_ahead, int) or run_ahead < 0:
            raise ValueError(f"run_ahead {run_ahead!r}: a count of tokens, 0 or more")
        model_dir = Path(model_dir)
        self.hidden_states = None if hidden_states is None else list(hidden_states)
        if self.hidden_states is not None:
            if states_dir is None:
                raise ValueError("hidden_states needs a states_dir (vLLM's shared_storage_path)")
            self._columns = self._check_layers(model_dir, self.hidden_states, states_mode)
        self.states_delay, self.states_tokens, self.states_mode = states_delay, states_tokens, states_mode
        self.states_dir = None if states_dir is None else Path(states_dir)
        self.allow_custom_save_path, self.use_synchronization_lock = allow_custom_save_path, use_synchronization_lock
        self.run_ahead, self.states_writer = run_ahead, states_writer
        self._writes: list[threading.Thread] = []
        self.name = served_name or str(model_dir)
        self.engine = _Engine(model_dir, Path(tokenizer_dir or model_dir), dtype, weight_noise)
        self.latency, self.logprobs_mode, self.token_ids, self.batch = latency, logprobs_mode, token_ids, batch
        self.fault, self.mutate, self.models_latency = fault, mutate, models_latency
        self.stream_step, self.stream_delay, self.mutate_stream = stream_step, stream_delay, mutate_stream
        self.streams_left = 0  # streamed replies whose client went before [DONE]
        self.requests: list[dict] = []  # every POST body, in arrival order
        self.headers: list[dict[str, str]] = []  # their headers, names lower-cased
        self.batches = 0  # generate calls (several requests each when batch > 1)
        self.stop_string_endings = 0  # replies with states that named no file (a stop string ended them)
        self.in_flight = self.max_in_flight = 0  # POSTs being answered now, and the most at once
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self.server = _Server(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._threads = [
            threading.Thread(target=self.server.serve_forever, daemon=True),
            threading.Thread(target=self._work, daemon=True),
        ]

    @staticmethod
    def _check_layers(model_dir: Path, ids: list, mode: str) -> list[int]:
        """The layer ids checked as a server start would refuse them (config.json only, no weights),
        and the files' column order: ascending, as vLLM keeps them (interfaces.py:1630), or as listed
        (the "listed_order" mode)."""
        if not ids:
            raise ValueError(
                "hidden_states is empty: vLLM's extract_hidden_states needs eagle_aux_hidden_state_layer_ids"
            )
        if bad := [k for k in ids if isinstance(k, bool) or not isinstance(k, int)]:
            raise ValueError(f"hidden_states {ids}: layer ids must be integers, not {bad}")
        if dup := sorted({k for k in ids if ids.count(k) > 1}):
            raise ValueError(f"hidden_states {ids}: layer ids {dup} are listed more than once")
        top = n_layers(load_config(ModelPreset(path=str(model_dir))))
        if bad := [k for k in ids if not 0 <= k <= top]:
            raise ValueError(
                f"hidden_states {ids}: layer ids {bad} are outside 0..{top} (the model's num_hidden_layers {top}: "
                f"0 is the embeddings, {top} the last block's output)"
            )
        return list(ids) if mode == "listed_order" else sorted(ids)

    def __enter__(self) -> FakeVLLM:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.wait_writes()  # requests still being answered (a client gave up on them) finish first
        self.server.shutdown()
        self.server.server_close()
        self._jobs.put(None)

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

    def wait_writes(self, timeout: float = 120.0) -> None:
        """Wait until no request is being answered (one a client gave up on included) and every states
        file is written (the writer threads, their `states_delay` included); at most `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [t for t in self._writes if t.is_alive()]
                self._writes = pending
                busy = self.in_flight
            if not pending and not busy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake vLLM: {busy} request(s) and {len(pending)} write(s) still going")
            for t in pending:
                t.join(max(deadline - time.monotonic(), 0))
            time.sleep(0.01)

    def states_files(self) -> list[Path]:
        """Every `*.safetensors` and `*.lock` entry under states_dir (recursive, symlinks not followed),
        sorted: files, and whatever a hostile `states_writer` left at a path. Files written to custom
        paths outside states_dir are not listed."""
        if self.states_dir is None or not self.states_dir.is_dir():
            return []
        found = []
        for root, dirs, files in os.walk(self.states_dir):
            found += [Path(root) / f for f in dirs + files if f.endswith((".safetensors", ".lock"))]
        return sorted(found)

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
        # The requests are scheduled: their lock files are taken now, before any reply (EHSC 269-290).
        locks: dict[tuple[int, int], int | None] = {}
        try:
            taken: set[Path] = set()
            for g, j in enumerate(group):
                for i, path in enumerate(j.paths or []):
                    # one flock per path: a second one from this thread would wait on the first forever
                    locks[g, i] = None if path in taken else self._take_lock(path)
                    taken.add(path)
            return self._generate(model, tokenizer, group, locks)
        finally:
            for fd in locks.values():  # the ones no writer thread took over: a failed batch
                if fd is not None:
                    os.close(fd)

    def _generate(
        self, model, tokenizer, group: list[_Job], locks: dict[tuple[int, int], int | None]
    ) -> list[list[dict]]:
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
        for g, j in enumerate(group):
            choices = []
            for i in range(j.n):
                r = next(rows)
                ids, text, reason, stop_reason = finish(tokenizer, gen[r], self.engine.eos, first.params.stop)
                choice = {
                    "ids": ids,
                    "text": text,
                    "finish": reason,
                    "stop": stop_reason,
                    "logprobs": logprobs[r, : len(ids)],
                }
                if j.paths is not None:
                    # Past the stop, only a lone row's generation holds real tokens (a batch pads its ended rows).
                    drawn = gen[r][len(ids) :] if len(prompts) == 1 else []
                    self._save_states(model, tokenizer, j, i, choice, drawn, locks.pop((g, i)))
                choices.append(choice)
            out.append(choices)
        return out

    # ------------------------------------------------------------------ hidden states (see the docstring)
    def _take_lock(self, path: Path) -> int | None:
        """EHSC `wait_for_save` (283-290): `<file>.lock` created and held LOCK_EX, or no lock at all
        (`use_synchronization_lock` False, EHSC 278)."""
        if not self.use_synchronization_lock:
            return None
        lock = f"{path}.lock"
        os.makedirs(os.path.dirname(lock) or ".", exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _save_states(
        self, model, tokenizer, job: _Job, i: int, choice: dict, drawn: list[int], lock: int | None
    ) -> None:
        """Answer i's file: its token ids as `request_finished` takes them (EHSC 540-553), their states,
        written by a thread that then releases the lock; `choice` learns the path and whether the
        reply names it."""
        try:
            path, tensors, by_engine = self._states_file(model, tokenizer, job, i, choice, drawn)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # EHSC 425
        except BaseException:
            if lock is not None:
                os.close(lock)
            raise
        self._submit(path, tensors, lock)
        choice["states_path"] = str(path)
        choice["named"] = by_engine or self.states_mode == "name_every_file"

    def _states_file(self, model, tokenizer, job: _Job, i: int, choice: dict, drawn: list[int]):
        """(path, tensors, whether the engine ended the request) for answer i."""
        ids, max_tokens = choice["ids"], job.params.max_new_tokens
        # The engine ended it (EOS, length: utils.py:98-120) unless the front end matched a stop string
        # before the length ran out (output_processor.py:828-836, 880-885).
        by_engine = not isinstance(choice["stop"], str) or len(ids) >= max_tokens
        if not job.include_output:
            tokens = job.prompt
        elif by_engine:
            tokens = job.prompt + ids[:-1]
        else:  # aborted after the engine ran up to run_ahead tokens on: all_token_ids[:-1]
            ahead = min(self.run_ahead, max_tokens - len(ids))
            if ahead == 0:
                tokens = job.prompt + ids[:-1]
            else:
                more = self._run_ahead(model, tokenizer, job, i, ids, drawn, ahead - 1)
                ended = bool(more) and more[-1] in self.engine.eos  # the engine stopped at EOS: no more after it
                tokens = job.prompt + ids + (more[:-1] if ended else more)
        tensors = {
            "hidden_states": self._states(model, tokens),
            "token_ids": torch.tensor(tokens, dtype=torch.int64),
        }
        return job.paths[i], tensors, by_engine

    def _run_ahead(
        self, model, tokenizer, job: _Job, i: int, ids: list[int], drawn: list[int], count: int
    ) -> list[int]:
        """Up to `count` tokens the engine decoded after `ids` before the abort arrived, ending at EOS if
        one came: those the generation drew past the stop, then a continuation sampled with the request's
        settings (a valid continuation of the model, not the engine's own draws)."""
        more: list[int] = []
        for t in drawn[:count]:
            more.append(t)
            if t in self.engine.eos:
                return more
        if len(more) < count:
            params = job.params.model_copy(update={"max_new_tokens": count - len(more), "stop": []})
            gen, _, _ = generate_raw(
                model,
                tokenizer,
                [job.prompt + ids + more],
                [job.seeds[i] + 1],
                params,
                self.engine.eos,
                greedy=job.greedy,
            )
            for t in gen[0]:
                more.append(t)
                if t in self.engine.eos:
                    break
        return more[:count]

    def _states(self, model, tokens: list[int]) -> torch.Tensor:
        """[tokens, layers, hidden] in the model's dtype from one forward pass over `tokens`: id k <
        num_hidden_layers is `output_hidden_states[k]` (the residual stream after k blocks), k =
        num_hidden_layers the last block's output before the final norm; columns in `_columns` order."""
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
        top = n_layers(model.config)
        layers = [kept[-1][0] if k == top else out.hidden_states[k][0] for k in self._columns]
        return torch.stack(layers, dim=1).contiguous()

    def _submit(self, path: Path, tensors: dict[str, torch.Tensor], lock: int | None) -> None:
        """EHSC `_write_tensors` (330-347) on a thread of its own, after `states_delay`; a failed write is
        logged (EHSC `_on_write_done`, 292-298) and the lock released all the same."""
        writer = self.states_writer or _save_file

        def write():
            try:
                delay = self.states_delay
                time.sleep(delay(path) if callable(delay) else delay)
                writer(path, tensors)
            except Exception as e:  # noqa: BLE001  (a failed write never stops the server)
                log.error("fake vLLM: hidden-states write failed for %s: %r", path, e)
            finally:
                if lock is not None:
                    os.close(lock)  # releases LOCK_EX: readers waiting on LOCK_SH go on

        t = threading.Thread(target=write, daemon=True, name="vllm-hs-save")
        with self._lock:
            self._writes.append(t)
        t.start()

    def _states_paths(self, body: dict, headers: dict[str, str], transfer: dict, n: int) -> list[Path]:
        """Each answer's file, named as vLLM names it (see the docstring)."""
        base = headers.get("x-request-id")
        if base is None:
            base = body.get("request_id")
        internal = f"cmpl-{_random_uuid() if base is None else base}-0-{_random_uuid()[:8]}"
        ids = [internal] if n == 1 else [f"{i}_{internal}" for i in range(n)]
        custom = transfer.get("hidden_states_path")
        if custom is not None and not self.allow_custom_save_path:  # EHSC 506-514
            log.warning("fake vLLM: hidden_states_path given but allow_custom_save_path is off: ignored")
            custom = None
        if custom:  # EHSC 515: `custom_path or default_path`
            return [Path(custom)]
        return [self.states_dir / f"{rid}.safetensors" for rid in ids]

    # ------------------------------------------------------------------ one request
    def _job(self, body: dict, headers: dict[str, str] | None = None) -> _Job:
        """The request checked as vLLM checks it, as a job for the engine loop (`headers`: its
        headers, names lower-cased)."""
        model, tokenizer = self.engine.get()
        if body.get("model") != self.name:
            raise RequestError(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.", "model")
        for unsupported in ("echo",):
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
        job = _Job(prompt, n, [base + i for i in range(n)], key, params, temperature == 0, Future())
        if self.hidden_states is not None:  # every request gets a file; an engine without extraction ignores this
            transfer = body.get("kv_transfer_params")
            if isinstance(transfer, dict) and n != 1:
                raise RequestError(400, "BadRequestError", "fake vLLM: hidden states for one answer per request", "n")
            transfer = transfer if isinstance(transfer, dict) else {}
            job.include_output = bool(transfer.get("include_output_tokens")) and self.states_tokens == "output"
            job.paths = self._states_paths(body, headers or {}, transfer, n)
        return job

    def _transfer(self, job: _Job, choices: list[dict]) -> dict | None:
        """The reply's `kv_transfer_params` (serving.py:767): the last-finished child's, None unless the
        engine ended it (a stop string ended it in the front end: counted in `stop_string_endings`)."""
        if job.paths is None:
            return None
        last = max(range(len(choices)), key=lambda i: (len(choices[i]["ids"]), i))
        if choices[last]["named"]:
            return {"hidden_states_path": choices[last]["states_path"]}
        with self._lock:
            self.stop_string_endings += 1
        return None

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
        return {
            "kv_transfer_params": self._transfer(job, choices),
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

    def _frames(self, body: dict, job: _Job, choices: list[dict], number: int) -> list[str]:
        """The server-sent frames of a streamed reply (see the docstring): each choice's steps, the
        children's steps interleaved as they advance together, then the usage chunk if asked, [DONE]."""
        tokenizer = self.engine.tokenizer
        stop = job.params.stop
        held = max((len(s) for s in stop), default=1) - 1  # detokenizer.py:90: stop_buffer_length
        want_ids = body.get("return_token_ids") and self.token_ids in ("both", "return_token_ids")
        as_ids = body.get("return_tokens_as_token_ids") and self.token_ids in ("both", "tokens_as_ids")
        transfer = self._transfer(job, choices)
        head = {"id": f"cmpl-{number}", "object": "text_completion", "created": 0, "model": self.name}
        per_choice = []
        for i, c in enumerate(choices):
            ids, frames, sent, offset = c["ids"], [], 0, 0
            bounds = list(range(self.stream_step, len(ids), self.stream_step)) + [len(ids)]
            start = 0
            for end in bounds:
                last = end == len(ids)
                if last:
                    text = c["text"]  # the finished text: cut before the stop string (detokenizer.py:163-171)
                else:
                    text = tokenizer.decode(ids[:end], skip_special_tokens=True).rstrip("\ufffd")
                    text = text[: max(len(text) - held, 0)]
                delta = text[sent:] if len(text) > sent else ""
                sent = max(sent, len(text))
                step = ids[start:end]
                logprobs = None
                if body.get("logprobs") is not None:
                    tokens = [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in step]
                    offsets = []
                    for t in tokens:
                        offsets.append(offset)
                        offset += len(t)
                    lps = [float(x) for x in c["logprobs"][start:end]]
                    logprobs = {
                        "text_offset": offsets,
                        "token_logprobs": lps,
                        "tokens": tokens,
                        "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)],
                    }
                choice = {
                    "index": i,
                    "text": delta,
                    "logprobs": logprobs,
                    "finish_reason": c["finish"] if last else None,
                    "stop_reason": c["stop"] if last else None,
                    "prompt_token_ids": job.prompt if want_ids and start == 0 else None,
                    "token_ids": step if want_ids else None,
                    "weight_versions": None,
                }
                frames.append(head | {"choices": [choice], "kv_transfer_params": transfer if last else None})
                start = end
            if "".join(f["choices"][0]["text"] for f in frames) != c["text"]:  # a bug of this fake, said
                raise RuntimeError(f"fake vLLM: streamed text of choice {i} is not its text {c['text']!r}")
            per_choice.append(frames)
        ordered = []  # step k of every choice that has one, then step k + 1
        for k in range(max(map(len, per_choice))):
            ordered += [frames[k] for frames in per_choice if k < len(frames)]
        out = [f"data: {json.dumps(f, ensure_ascii=False)}\n\n" for f in ordered]
        if isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage"):
            done = sum(len(c["ids"]) for c in choices)
            usage = {"prompt_tokens": len(job.prompt), "total_tokens": len(job.prompt) + done}
            usage["completion_tokens"] = done
            out.append(f"data: {json.dumps(head | {'choices': [], 'usage': usage})}\n\n")
        return [*out, "data: [DONE]\n\n"]

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
                    error = RequestError(fault.status, "InternalServerError", f"injected {fault.status}").body()
                    if fault.status == 200 and fault.body is None:  # a good reply, delivered late, slowly or cut:
                        # the engine did the work (its states file and lock included), the reply is what lags
                        fault = Fault(200, fault.headers, self._complete(body, number), fault.delay, fault.trickle,
                                      fault.cut)  # fmt: skip
                    time.sleep(srv.latency + fault.delay)
                    return send(
                        self,
                        fault.status,
                        fault.body if fault.body is not None else error,
                        fault.headers,
                        fault.trickle,
                        fault.cut,
                    )
                if body.get("stream"):
                    return self._stream(body, number)
                try:
                    text = self._complete(body, number)
                except RequestError as e:
                    return self._error(e)
                except Exception as e:  # noqa: BLE001  (the engine failed: 500, as a server would)
                    return self._error(RequestError(500, "InternalServerError", f"{type(e).__name__}: {e}"))
                time.sleep(srv.latency)
                send(self, 200, text)

            def _stream(self, body: dict, number: int) -> None:
                """A streamed reply: refused as a whole before the stream (a JSON error), else a chunked
                text/event-stream of `srv._frames`, a frame per chunk, `stream_delay` s apart."""
                try:
                    job = srv._job(body, {k.lower(): v for k, v in self.headers.items()})
                    srv._jobs.put(job)
                    frames = srv._frames(body, job, job.future.result(), number)
                except RequestError as e:
                    return self._error(e)
                except Exception as e:  # noqa: BLE001
                    return self._error(RequestError(500, "InternalServerError", f"{type(e).__name__}: {e}"))
                if srv.mutate_stream:
                    frames = srv.mutate_stream(frames, body, number)
                time.sleep(srv.latency)
                self.close_connection = True
                try:
                    head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                    self.wfile.write((head + "transfer-encoding: chunked\r\n\r\n").encode())
                    for k, frame in enumerate(frames):
                        if k:
                            time.sleep(srv.stream_delay)
                        data = frame.encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):  # the client went: vLLM aborts the request
                    with srv._lock:
                        srv.streams_left += 1

            def _complete(self, body: dict, number: int) -> str:
                job = srv._job(body, {k.lower(): v for k, v in self.headers.items()})
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
