"""`halludetect serve`: an OpenAI-compatible server that samples answers with a bundle's base model
and returns every answer with its detector's score, computed from the sampling pass's own states.

    halludetect serve --bundle data/bundles/world/world/max.safetensors --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    r = client.completions.create(model="data/world/model", prompt="Where was Sergi Poboum born?", n=4)
    r.choices[0].text, r.choices[0].hallucination["score"], r.choices[0].hallucination["flag"]

What a request is. A detector reads the states of answers to the prompt it was trained on, so the
request's prompt (`/v1/completions`) or its one user message (`/v1/chat/completions`) is the
*question*, and the server wraps it in the bundle's prompt (its template, or the model's chat
template), exactly as `halludetect score --generate` does. A conversation, a system message or a
prompt of token ids is refused with a 400 saying so: the detector has never seen such states.

What comes back. OpenAI's response, each choice with `token_ids` (the answer's tokens, as vLLM's
`return_token_ids` gives them) and `hallucination`: score (the seeds' mean logit), probability
(Platt), flag and threshold, `in_distribution` and its reason, the answer's mean and lowest token
log-prob, and `reason` when the answer could not be scored (empty, too short for the method).
`extra_body={"explain": true}` adds each token's contribution (detectors/evidence.py). The response's
`detector` names the bundle, method, layer and threshold.

Choosing by the score (`extra_body={"select": ...}`, or the server's `--select` for requests that give
none; `"none"` turns the server's off). It costs the n answers' sampling and buys what
`python -m bench.select` measures (docs/benchmarks.md, "Choosing answers by their score"):

- `best_of_n`: the n answers are sampled and scored, and the one of the lowest score comes back (the
  first among equal scores; an answer that could not be scored is never chosen over one that was),
  alone, as choice 0; its `hallucination.selection` lists every answer's index, score and flag.
- `abstain`: the same choice, but where it is flagged (so every scored answer is) or nothing could be
  scored, a refusal comes back instead: no text (chat: `content` null and `refusal` saying why),
  `finish_reason` "content_filter", `hallucination.abstained` true, and the scores it refused on.

How it runs. One thread owns the model. Requests wait in a queue; each round takes the first waiting
request and every other one with the same sampling settings, up to `max_batch` answers, and samples
them in one batched `generate` with a hook on the bundle's layer (activations/sampled_states.py): the
bag is what that pass computed, no second forward pass. Every answer draws from its own random
stream, keyed (seed, question, choice index), so a request with a `seed` gets the same answers
whatever else is in flight (up to the float noise of batch-mates' padding). A served score equals
`halludetect score`'s on the same question and answer to float tolerance (tests/scoring/test_serve.py).

Streaming (`stream: true`, completions and chat): server-sent events as OpenAI sends them, a chunk
per token whose text is certain to be the answer's, each with the detector's running score (the
network on the answer so far: scoring/streaming.py), the last chunk of each choice with its
finish_reason and the `hallucination` object a request without `stream` gets, then `data: [DONE]`.
A client that goes away mid-stream frees its slot at once (noticed within a quarter second, though
nothing is being sent to it), and its rows stop at the next step.
Through `--engine` the chunks are the engine's tokens as it streams them (decoded and held back as
above), with `running_score` null: vLLM writes an answer's states when it ends, so the score comes
in the last chunk; a client that goes closes the engine's stream, which aborts the request there.
Not with `select` (it chooses among finished answers).

Limits and refusals, each a JSON error `{"error": {"message", "type", "param", "code"}}`, never a
crash: a body over `max_request_bytes` (413), more than `max_concurrency` requests in flight (429 and
Retry-After), `max_tokens` over the server's limit, `n` over `max_n`, a question that does not fit
the context, fields the server does not implement
(logprobs, echo, penalties, tools) and unknown fields (400, naming the field). With `api_key_env`,
every request needs `Authorization: Bearer <the variable's value>` (401 otherwise); the key is read
from the environment and never logged. The server binds 127.0.0.1 unless told otherwise.

In front of vLLM (`engine=EngineClient(...)`, `halludetect serve --engine URL --engine-layers ...`):
no model is loaded here. Each answer is one request (a request's n at once, each on a thread of its own,
so that vLLM batches them) to a vLLM server started with hidden-state
extraction and `allow_custom_save_path` (docs/models-and-generation.md, "States from the engine"),
asking `kv_transfer_params: {"include_output_tokens": true, "hidden_states_path": <ours>}`: a fresh
name in the states directory this server owns (lm/engine_states.py's `StatesDir`). That file is read
whatever the reply names (vLLM's names none after a stop string), only as a regular file of ours,
after its writer's lock; checked (`check_states`), the bundle's layer taken (the top layer through
the model's final norm, read alone from its weight files), scored, and deleted; files of requests
given up on are swept. vLLM batches; requests go to it as they come, from the HTTP threads.

Methods that read several answers of a question (HaMI with P_sem, EigenScore) cannot score one
answer: such a bundle is refused when the server starts, naming what it needs.
"""

from __future__ import annotations

import contextlib
import copy
import hmac
import json
import math
import os
import queue
import re
import secrets
import select
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pydantic import ValidationError

from halludetect.activations.engine_dump import FinalHead
from halludetect.config import GenerateParams
from halludetect.core.credentials import url_credentials
from halludetect.core.errors import UserError
from halludetect.lm.engine_states import StatesDir, StatesProblem, check_states
from halludetect.lm.hf_models import load_config
from halludetect.lm.model_inputs import encode_prompt
from halludetect.scoring.answer_files import AnswerRow
from halludetect.scoring.bundle import ScoreBundle, load_bundle
from halludetect.scoring.scorer import OptionError, Scorer, at_least_one

# what a choice's `hallucination` holds, from the scorer's row (answer_files.output_schema)
SCORE_FIELDS = (
    "score",
    "probability",
    "flag",
    "reason",
    "in_distribution",
    "ood_reason",
    "mean_logprob",
    "min_logprob",
)
EVIDENCE_FIELDS = ("tokens", "token_start", "token_end", "offsets_exact", "contributions", "bias")
# fields OpenAI's API defines that this server does not implement: refused unless given their neutral value
NOT_IMPLEMENTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "stream_options": (None,),
}


class ApiError(Exception):
    """A request refused: its HTTP status, OpenAI's error type, and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 256  # the most tokens one answer may have
    max_n: int = 16  # answers per request
    max_batch: int = 64  # answers sampled together in one pass
    max_concurrency: int = 64  # requests in flight; more get 429
    max_request_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("max_tokens", "max_n", "max_batch", "max_concurrency", "max_request_bytes"):
            at_least_one(f"{name} (--{name.replace('_', '-')})", getattr(self, name))


@dataclass
class Job:
    """One request: its question's prompt ids, one random-stream key per choice, the sampling settings."""

    question: str
    prompt: list[int]
    keys: list[tuple]
    params: GenerateParams
    greedy: bool
    explain: bool
    select: str | None = None  # best_of_n | abstain (module docstring): one answer chosen by its score
    stream: bool = False  # its tokens sent as they are sampled (scoring/streaming.py)
    future: Future = field(default_factory=Future)
    events: queue.Queue = field(default_factory=queue.Queue)  # streaming: Chunk, then None at the round's end
    cancelled: threading.Event = field(default_factory=threading.Event)  # streaming: the client has gone
    streamed: list = field(default_factory=list)  # streaming: each choice's StreamedRow, set by the model thread
    closers: set = field(default_factory=set)  # streaming through --engine: what closes each engine stream

    def hung_up_by(self, close: Callable[[], None]) -> Callable[[], None]:
        """`close` is one of what `hangup` calls (at once where the client has already gone); the
        function that takes it back."""
        self.closers.add(close)
        if self.cancelled.is_set():
            close()
        return lambda: self.closers.discard(close)

    def hangup(self) -> None:
        """The client has gone: every engine stream of this request is closed."""
        for close in list(self.closers):
            close()

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys are sampled together (one `generate` takes one set of settings)."""
        p = self.params
        return (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_new_tokens, tuple(p.stop), self.greedy)


# ------------------------------------------------------------------------------ requests
def _number(body: dict, name: str, kind: type, low: float, high: float | None = None, *, low_open=False):
    value = body.get(name)
    ok = isinstance(value, kind) if kind is int else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not ok:
        raise ApiError(400, f"'{name}' must be {'a whole number' if kind is int else 'a number'}, got {value!r}", name)
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        bound = f"{'above' if low_open else 'at least'} {low}" + ("" if high is None else f" and at most {high}")
        raise ApiError(400, f"'{name}' must be {bound}, got {value!r}", name)
    return value


def _question(body: dict, chat: bool) -> str:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of messages", "messages")
        if len(messages) != 1 or not isinstance(messages[0], dict) or messages[0].get("role") != "user":
            raise ApiError(
                400,
                "'messages' must be one user message, the question: the detector was trained on the states of "
                "answers to single questions in the bundle's prompt (no system message, no conversation)",
                "messages",
            )
        content = messages[0].get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(400, "a message's content parts must all be text", "messages")
            content = "".join(p["text"] for p in content)
        text, param = content, "messages"
    else:
        text, param = body.get("prompt"), "prompt"
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if isinstance(text, list) and text and all(isinstance(t, int) for t in text):
            raise ApiError(
                400,
                "'prompt' is token ids: send the question as text (the server wraps it in the prompt the "
                "detector was trained on)",
                "prompt",
            )
        if isinstance(text, list):
            raise ApiError(400, "'prompt' must be one question (a string): send one request per question", "prompt")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, f"the question ('{param}') must be a non-empty string", param)
    return _unicode(text, param)


def _unicode(text: str, param: str) -> str:
    """`text` if it is Unicode a tokenizer can take: JSON may carry a lone surrogate ("\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"'{param}' is not valid Unicode text: a lone surrogate at character {e.start}", param
        ) from None
    return text


def _events(r, deadline: float, max_line: int = 1 << 20):
    """The data of each server-sent event of response `r` (bytes; multi-line data joined by a newline;
    comments and other fields skipped), until the stream ends; ApiError 502 for a line over `max_line`
    bytes or a stream still going at `deadline` (time.monotonic)."""
    data: list[bytes] = []
    while True:
        line = r.readline(max_line + 1)
        if time.monotonic() > deadline:
            raise ApiError(502, "the engine's stream ran past the engine timeout")
        if not line:
            return
        if len(line) > max_line:
            raise ApiError(502, f"the engine sent a stream line over {max_line} bytes")
        line = line.rstrip(b"\r\n")
        if not line:  # an event ends at a blank line
            if data:
                yield b"\n".join(data)
                data = []
        elif not line.startswith(b":"):  # ": keep-alive" (vLLM's sse_keep_alive.py) and other comments
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)


class EngineClient:
    """A vLLM server with hidden-state extraction that `serve` forwards answers to: its completions
    URL, served model name, the layer ids it extracts (any order: vLLM's files hold them ascending),
    an optional key variable, and `states_dir`, where it is asked to write each answer's states file
    (vLLM's `allow_custom_save_path`; None: a private directory made at start and removed at stop)."""

    def __init__(
        self,
        url: str,
        model: str | None,
        layers: list[int],
        *,
        api_key_env: str | None = None,
        timeout=600.0,
        states_dir: str | Path | None = None,
    ):
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise OptionError(f"--engine-layers {layers}: the server's eagle_aux_hidden_state_layer_ids, each once")
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
            raise OptionError(f"--engine: '{url}' is not an http(s) URL, e.g. http://localhost:8001/v1")
        if problem := url_credentials(url):  # a key belongs in --engine-key-env, never in a URL we log
            raise OptionError(f"--engine: the URL carries {problem}: give the key with --engine-key-env")
        self.url, self.model, self.layers = url.rstrip("/"), model, sorted(layers)
        key = api_key_from(api_key_env)
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.timeout = timeout
        self.states_dir, self.states = states_dir, None

    def open_states(self) -> StatesDir:
        """The directory the engine writes our files in, owned by this server until `close_states`."""
        if self.states is None:
            if self.states_dir is not None:
                self.states = StatesDir(self.states_dir)
            else:  # a RAM disk where there is one: the file round trip is then a memory copy
                shm = Path("/dev/shm")
                where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
                self.states = StatesDir(tempfile.mkdtemp(prefix="halludetect-serve-", dir=where), temporary=True)
        return self.states

    def close_states(self) -> None:
        if self.states is not None:
            self.states.close()

    def _call(self, route: str, body: dict | None = None) -> tuple[int, str]:
        """(status, body text) of a GET (no body) or a POST to the engine; OSError when unreachable."""
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def check(self) -> None:
        """The server is up and serves `model`: before the first request."""
        try:
            status, text = self._call("/models")
        except OSError as e:  # down, refused, a timeout: named
            raise UserError(f"--engine {self.url} cannot be reached: {type(e).__name__}: {e}") from None
        if status != 200:
            raise UserError(f"--engine {self.url}/models answered {status}: give its /v1 URL (and --engine-key-env)")
        try:
            served = [m.get("id") for m in (json.loads(text).get("data") or []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            raise UserError(
                f"--engine {self.url}/models did not answer a model list: is it an OpenAI-compatible server?"
            ) from None
        if self.model not in served:
            raise UserError(
                f"--engine {self.url} serves {served}, not '{self.model}': pass --engine-model, or serve the "
                "bundle's base model"
            )

    def _body(self, prompt: list[int], params: GenerateParams, greedy: bool, seed: int, states: str) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "n": 1,
            "seed": seed,
            "max_tokens": params.max_new_tokens,
            "temperature": 0.0 if greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "repetition_penalty": params.repetition_penalty,
            # neutral settings sent too: vLLM fills unset ones from the model's generation_config.json
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop": list(params.stop),
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": True,
            "kv_transfer_params": {"include_output_tokens": True, "hidden_states_path": states},
        }

    def _unnamed(self, text: str, states: str) -> str:
        """An engine's message passed on, cut, and without our states path, which the request carried
        and an engine or proxy may echo."""
        text = re.sub(r"hd-[0-9a-f]{24}\.safetensors", "<file>", text.replace(str(states), "<states file>"))
        if self.states is not None:
            text = text.replace(str(self.states.path), "<states directory>")
        return text[:300]

    @staticmethod
    def _finished(choice, transfer, params: GenerateParams) -> dict:
        """The reply's choice checked as an answer the engine finished, with the reply's `kv_transfer_params`."""
        if not isinstance(choice, dict) or not isinstance(choice.get("token_ids"), list):
            raise ApiError(502, "the engine gave no token ids (vLLM >= 0.10.2 returns them)")
        if choice.get("finish_reason") not in ("stop", "length"):
            raise ApiError(502, f"the engine did not finish the answer (finish_reason {choice.get('finish_reason')!r})")
        if len(choice["token_ids"]) > params.max_new_tokens:
            raise ApiError(
                502, f"the engine returned {len(choice['token_ids'])} tokens for max_tokens {params.max_new_tokens}"
            )
        return {**choice, "kv_transfer_params": transfer}

    def complete(self, prompt: list[int], params: GenerateParams, greedy: bool, seed: int, states: str) -> dict:
        """One answer, its states written at `states`: the reply's first choice, with `kv_transfer_params`
        (ApiError 502 on failure)."""
        try:
            status, text = self._call("/completions", self._body(prompt, params, greedy, seed, states))
            data = json.loads(text) if status == 200 else None
        except (OSError, ValueError) as e:
            raise ApiError(502, f"the engine did not answer ({type(e).__name__})") from None
        if status != 200:  # its message is the engine's own (a context too long, say)
            raise ApiError(502, f"the engine answered {status}: {self._unnamed(text, states)}")
        if not isinstance(data, dict):
            raise ApiError(502, "the engine's reply is not a JSON object")
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        return self._finished(choice, data.get("kv_transfer_params"), params)

    def stream(
        self,
        prompt: list[int],
        params: GenerateParams,
        greedy: bool,
        seed: int,
        states: str,
        on_tokens: Callable[[list[int]], None],
        hangup: Callable[[Callable[[], None]], Callable[[], None]],
    ) -> dict:
        """One answer streamed (vLLM's `completion_stream_generator`: halludetect/testing/fake_vllm.py
        says what it sends): `on_tokens` gets each chunk's token ids as they come; the answer comes
        back as `complete` gives it. `hangup` is handed the function that closes the engine's stream
        from another thread (a client that left: vLLM then aborts the request), and returns the one
        that takes it back. Everything the engine
        sends is untrusted: a line over 1 MiB, more chunks than `max_tokens` allows, an error object,
        malformed JSON, tokens after the end, a reply that is not a stream, a stream that ends before
        the answer or runs past the timeout are each a 502."""
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(self.url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.netloc, timeout=self.timeout)
        body = self._body(prompt, params, greedy, seed, states) | {"stream": True}

        def close() -> None:  # from any thread: a blocked read wakes with an error
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)

        let_go = hangup(close)
        try:
            try:
                conn.request("POST", url.path + "/completions", json.dumps(body).encode(), self._headers)
                r = conn.getresponse()
                if r.status != 200:
                    text = r.read(64 * 1024).decode(errors="replace")
                    raise ApiError(502, f"the engine answered {r.status}: {self._unnamed(text, states)}")
                kind = r.getheader("Content-Type", "")
                if not kind.startswith("text/event-stream"):  # a server or proxy that ignores `stream`
                    raise ApiError(502, f"the engine did not stream its answer (Content-Type {kind[:60]!r})")
                return self._read_stream(r, params, states, on_tokens)
            except (OSError, http.client.HTTPException) as e:
                raise ApiError(502, f"the engine's stream broke off ({type(e).__name__})") from None
        finally:
            let_go()
            conn.close()

    def _read_stream(self, r, params: GenerateParams, states: str, on_tokens) -> dict:
        """The answer assembled from the engine's server-sent events (see `stream`)."""
        deadline, most = time.monotonic() + self.timeout, params.max_new_tokens + 8  # vLLM: a chunk per step
        ids: list[int] = []
        lps: list | None = []
        finish = transfer = None
        chunks = 0
        for data in _events(r, deadline):
            if data == b"[DONE]":
                break
            try:
                event = json.loads(data)
            except (ValueError, RecursionError):
                raise ApiError(502, "the engine sent a stream chunk that is not JSON") from None
            if not isinstance(event, dict):
                raise ApiError(502, "the engine sent a stream chunk that is not a JSON object")
            if "error" in event:  # vLLM's error mid-stream (serving.py:613-620)
                error = event["error"]
                message = error.get("message") if isinstance(error, dict) else error
                raise ApiError(502, f"the engine failed mid-stream: {self._unnamed(str(message), states)}")
            choices = event.get("choices")
            if choices == [] and "usage" in event:  # stream_options' usage chunk
                continue
            chunks += 1
            if chunks > most:
                raise ApiError(502, f"the engine sent more than {most} chunks for max_tokens {params.max_new_tokens}")
            choice = choices[0] if isinstance(choices, list) and len(choices) == 1 else None
            if not isinstance(choice, dict) or choice.get("index") != 0:
                raise ApiError(502, "the engine sent a stream chunk without its one choice")
            if finish is not None:
                raise ApiError(502, "the engine sent more of the answer after it finished it")
            step = choice.get("token_ids")
            if not isinstance(step, list):
                raise ApiError(502, "the engine gave no token ids (vLLM >= 0.10.2 returns them)")
            if len(ids) + len(step) > params.max_new_tokens:
                raise ApiError(502, f"the engine returned over {params.max_new_tokens} tokens for max_tokens "
                               f"{params.max_new_tokens}")  # fmt: skip
            given = choice.get("logprobs")
            step_lps = given.get("token_logprobs") if isinstance(given, dict) else None
            lps = lps + step_lps if isinstance(step_lps, list) and lps is not None else None
            ids += step
            if step:
                on_tokens(step)
            finish = choice.get("finish_reason")
            if finish is not None:
                transfer = event.get("kv_transfer_params")
        if finish is None:
            raise ApiError(502, "the engine's stream ended before the answer finished")
        choice = {"token_ids": ids, "finish_reason": finish, "logprobs": lps and {"token_logprobs": lps}}
        return self._finished(choice, transfer, params)

    def read_states(self, name: str, named, prompt: list[int], ids: list[int], max_tokens: int, hidden: int):
        """The checked states [len(prompt) + len(ids) - 1, k, d] of our file `name`, whatever path the reply
        names (`named`: vLLM's reply names none when a stop string ended the answer). Only our directory's
        regular file of that name is ever opened; StatesProblem why not."""
        if named is not None and named != self.states.full(name):
            raise StatesProblem(
                f"the reply names {str(named)[:200]!r}, not the path the request gave: the engine ignores "
                'hidden_states_path (start vLLM with "allow_custom_save_path": true), or is not to be trusted'
            )
        limit = self.states.max_bytes(len(prompt) + max_tokens, len(self.layers), hidden)
        data = self.states.read(name, max_bytes=limit)
        return check_states(data, prompt=prompt, output=ids, layers=len(self.layers), hidden=hidden)

    def probe(self, prompt: list[int], params: GenerateParams, hidden: int) -> None:
        """One greedy two-token answer at start: a server without extraction, one that ignores our path or
        include_output_tokens, whose files this server cannot read or that holds other layers fails
        here, naming the fix."""
        name = self.states.new()
        fix = (
            'start vLLM as docs/models-and-generation.md ("States from the engine") says, with '
            '"allow_custom_save_path": true, on a machine that sees --engine-states-dir at the same path'
        )
        try:
            # two tokens and no stop: an engine that saves the prompt's states only shows it here (unless
            # its first token is an end token), and the engine itself ends the request (its reply names a file)
            two = params.model_copy(update={"max_new_tokens": 2, "stop": []})
            try:
                choice = self.complete(prompt, two, True, 0, self.states.full(name))
            except ApiError as e:
                raise UserError(f"--engine {self.url}: the first request failed: {e.message}") from None
            transfer = choice.get("kv_transfer_params")
            named = transfer.get("hidden_states_path") if isinstance(transfer, dict) else None
            if named is None:
                raise UserError(
                    f"--engine {self.url} names no states file for an answer it ended itself: it was not started "
                    f"with hidden-state extraction; {fix}"
                )
            if named != self.states.full(name):
                raise UserError(
                    f"--engine {self.url} wrote the states file at another path than the request gave: it ignores "
                    f"hidden_states_path (vLLM does without allow_custom_save_path); {fix}"
                )
            try:
                self.read_states(name, named, prompt, choice["token_ids"], 2, hidden)
            except StatesProblem as e:
                where = f"the states file it wrote in {self.states.path}"
                raise UserError(f"--engine {self.url}: {where}: {e}; {fix}") from None
        finally:
            self.states.release(name)


def score_bundle_refusal(b: ScoreBundle) -> str:
    """Why a score bundle is not served: its scores are computed from answers given, in a file."""
    return (
        f"{b.path} is a score bundle of '{b.method}' (a score with nothing to train): halludetect serve scores "
        "the answers it samples with a trained detector's bundle. Score answers with this one by "
        "`halludetect score --bundle ... --input ...`, or serve a detector's bundle (max, mean, hami, ...)"
    )


class Service:
    """The bundle's scorer behind the server: checks requests, batches them, samples and scores.

    `scoring=False` samples the same answers without the hook or the detector (the benchmark's
    baseline: what the model alone costs)."""

    KNOWN = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "user"}
    KNOWN |= {"explain", "repetition_penalty", "select"}

    def __init__(
        self,
        scorer: Scorer,
        *,
        name: str | None = None,
        limits: Limits = Limits(),
        scoring: bool = True,
        engine: EngineClient | None = None,
        select: str | None = None,
        log: Callable[[str], None] = print,
    ):
        if select not in SELECT:
            raise OptionError(f"--select {select!r}: one of best_of_n, abstain, or none")
        if select and not scoring:
            raise OptionError("--select chooses by the score: it needs scoring on")
        self.select = select
        b = scorer.bundle
        if isinstance(b, ScoreBundle):
            raise UserError(score_bundle_refusal(b))
        if b.reads.p_sem or b.reads.question:
            need = "each answer's P_sem (K answers clustered by entailment)" if b.reads.p_sem else "the K answers"
            raise UserError(
                f"{b.path} holds a '{b.method}' detector, which reads {need} of a question together: it cannot "
                "score one served answer. Serve a bundle of a method that scores answers one at a time "
                "(max, mean, attention, hami, ...)"
            )
        if scorer.generate is None:
            raise OptionError("a served scorer samples: build it with generate=GenerateParams(...)")
        self.scorer, self.limits, self.scoring, self.log, self.engine = scorer, limits, scoring, log, engine
        if engine is not None and engine.model is None:  # what `vllm serve <path>` calls the bundle's base model
            engine.model = str(b.meta["base_model"]["preset"]["path"])
        if engine is not None and b.layer not in engine.layers:
            raise UserError(
                f"{b.path} reads layer {b.layer}; the engine extracts {engine.layers} (--engine-layers): start it "
                f"with {b.layer} among its eagle_aux_hidden_state_layer_ids"
            )
        scorer.batch_size = limits.max_batch  # a round's answers in one pass (the scorer cuts at its batch size)
        self.name = name or str(b.meta["base_model"]["preset"]["path"])
        self.defaults = scorer.generate
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._slots = threading.BoundedSemaphore(limits.max_concurrency)
        self._lock, self._tokenizer_lock, self._queue_lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._stopping = threading.Event()
        self._in_flight_changed, self._requests_in_flight = threading.Condition(), 0
        self.stats = {"requests": 0, "answers": 0, "batches": 0, "refused": 0}
        self._worker = threading.Thread(target=self._work, name="halludetect-serve-model", daemon=True)

    def start(self) -> Service:
        if self.engine is not None:  # the states come from the engine's files: no model here
            self.engine.check()
            self.scorer.load_without_model()
            top = int(self.scorer.bundle.meta["base_model"]["num_hidden_layers"])
            self._head = FinalHead(self.scorer.preset, head=False) if self.scorer.bundle.layer == top else None
            self._hidden = int(load_config(self.scorer.preset).get_text_config().hidden_size)
            self._score_lock = threading.Lock()
        else:
            self.scorer.load()
        # The request threads tokenize with a copy of their own, one at a time: a fast tokenizer used
        # from two threads at once can fail ("Already borrowed"), and the model thread uses the original.
        self._tokenizer = copy.deepcopy(self.scorer.tokenizer)
        if self.engine is None:
            self._worker.start()
        else:
            self.engine.open_states()
            try:
                self.engine.probe(self.prompt("?"), self.defaults, self._hidden)
            except BaseException:
                self.engine.close_states()
                raise
        return self

    @contextlib.contextmanager
    def in_flight(self):
        """Counts a request from its first byte read to its last byte sent."""
        with self._in_flight_changed:
            self._requests_in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_changed:
                self._requests_in_flight -= 1
                self._in_flight_changed.notify_all()

    def wait_in_flight(self, wait_s: float = 120.0) -> bool:
        """Wait until no request is in flight (at most `wait_s`); whether none is."""
        with self._in_flight_changed:
            return self._in_flight_changed.wait_for(lambda: self._requests_in_flight == 0, wait_s)

    def _control_tokens(self) -> list[str]:
        """The tokenizer's special tokens as text (`</s>`, `<pad>`, a chat template's markers)."""
        if not hasattr(self, "_specials"):
            tok = self.scorer.tokenizer
            added = getattr(tok, "added_tokens_decoder", {}) or {}
            found = set(tok.all_special_tokens) | {t.content for t in added.values() if getattr(t, "special", False)}
            self._specials = sorted(t for t in found if t and t.strip())
        return self._specials

    def prompt(self, question: str) -> list[int]:
        """The question in the bundle's prompt, as the scorer encodes it (`Scorer._prompt`)."""
        inputs = self.scorer.bundle.meta["inputs"]
        with self._tokenizer_lock:
            return encode_prompt(self._tokenizer, question, inputs["chat_template"], inputs["prompt_template"])

    def stop(self, wait_s: float = 120.0) -> None:
        """An orderly stop: requests that come now and those still waiting get a 503, the round the model
        is running finishes and is answered (up to `wait_s`), then the model thread ends."""
        with self._queue_lock:
            self._stopping.set()
            self._jobs.put(None)
        if self._worker.is_alive():
            self._worker.join(wait_s)
        while True:  # whatever is still queued (the worker had stopped): answered, never left hanging
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.set_exception(ApiError(503, "the server is stopping", kind="service_unavailable"))
        if self.engine is not None:  # a last sweep of the engine's files; the directory goes if it was ours
            self.engine.close_states()

    @property
    def detector(self) -> dict:
        s, b = self.scorer, self.scorer.bundle
        return {
            "bundle": str(b.path),
            "bundle_sha256": b.sha256,
            "method": b.method,
            "layer": b.layer,
            "positions": b.positions,
            "threshold_name": s.threshold_name,
            "threshold": s.threshold,
            "scoring": self.scoring,
        }

    # ------------------------------------------------------------------ one request
    def job(self, body: object, chat: bool) -> Job:
        """The request checked, as a job for the model thread (ApiError on anything wrong)."""
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        known = self.KNOWN | ({"messages", "max_completion_tokens"} if chat else {"prompt"})
        for key in body:
            if key in NOT_IMPLEMENTED:
                if body[key] not in NOT_IMPLEMENTED[key]:
                    raise ApiError(400, f"'{key}' is not implemented by halludetect serve: leave it out", key)
            elif key not in known:
                raise ApiError(400, f"unknown field '{key}' (halludetect serve takes {', '.join(sorted(known))})", key)
        if body.get("model") != self.name:
            raise ApiError(
                404, f"the model '{body.get('model')}' is not served here: this server serves '{self.name}'", "model"
            )
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise ApiError(400, f"'stream' must be true or false, got {stream!r}", "stream")
        question = _question(body, chat)
        if held := [t for t in self._control_tokens() if t in question]:
            # tokenized, they would be the model's control tokens (an end of text, padding), states the
            # detector never saw in a question: refused rather than read as text or as control
            raise ApiError(
                400,
                f"the question holds the model's control token(s) {', '.join(repr(t) for t in held)}: the tokenizer "
                "would read them as control tokens, not as text; leave them out or spell them otherwise",
                "messages" if chat else "prompt",
            )
        d, limits = self.defaults, self.limits
        length_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        update: dict = {}
        if body.get(length_key) is not None:
            update["max_new_tokens"] = _number(body, length_key, int, 1, limits.max_tokens)
        elif d.max_new_tokens > limits.max_tokens:
            raise ApiError(400, f"give '{length_key}' (at most {limits.max_tokens})", length_key)
        n = 1 if body.get("n") is None else _number(body, "n", int, 1, limits.max_n)
        greedy = False
        if body.get("temperature") is not None:
            t = _number(body, "temperature", float, 0, 2)
            greedy = t == 0
            if not greedy:
                update["temperature"] = float(t)
        if body.get("top_p") is not None:
            update["top_p"] = float(_number(body, "top_p", float, 0, 1, low_open=True))
        if body.get("top_k") is not None:
            k = _number(body, "top_k", int, -1)
            update["top_k"] = max(k, 0)  # -1, as vLLM spells "off", is our 0
        if body.get("repetition_penalty") is not None:
            update["repetition_penalty"] = float(_number(body, "repetition_penalty", float, 0, low_open=True))
        if "stop" in body:
            stop = body["stop"]
            stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s.strip() for s in stop):
                raise ApiError(400, "'stop' must be a string or a list of at most 4 non-empty strings", "stop")
            update["stop"] = [_unicode(s, "stop") for s in stop]
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, f"'seed' must be a whole number, got {seed!r}", "seed")
        explain = body.get("explain", False)
        if not isinstance(explain, bool):
            raise ApiError(400, f"'explain' must be true or false, got {explain!r}", "explain")
        if explain:
            try:
                self.scorer.bundle.evidence_rule()
            except UserError as e:
                raise ApiError(400, str(e), "explain") from None
        try:
            params = GenerateParams.model_validate({**d.model_dump(), **update})
        except ValidationError as e:  # what the sampler itself refuses (a stop string of spaces, say)
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else None
            raise ApiError(400, f"{field}: {err['msg']}", {"max_new_tokens": length_key}.get(field, field)) from None
        prompt = self.prompt(question)
        context = self.scorer.context
        if context is not None and len(prompt) + params.max_new_tokens > context:
            raise ApiError(
                400,
                f"the question's prompt is {len(prompt)} tokens; with max_tokens {params.max_new_tokens} it does not "
                f"fit the model's context of {context}",
                length_key,
            )
        select = body.get("select", self.select)
        if select == "none":
            select = None
        if select not in SELECT:
            raise ApiError(400, f"'select' must be one of best_of_n, abstain or none, got {select!r}", "select")
        if select and not self.scoring:
            raise ApiError(400, "'select' chooses by the score, and this server does not score", "select")
        if select and stream:
            raise ApiError(
                400, "'select' chooses among finished answers: it cannot stream; send stream false", "stream"
            )
        base = secrets.randbits(62) if seed is None else seed
        keys = [(base, question, i, 0) for i in range(n)]
        return Job(question, prompt, keys, params, greedy, explain, select, bool(stream))

    def open_stream(self, body: object, chat: bool) -> Job:
        """A streamed request checked and queued, its slot held (ApiError, before any byte is sent, for
        a refused one); `stream_chunks` then gives its chunks, and `close_stream` frees the slot."""
        self._take_slot()
        try:
            job = self.job(body, chat)
            if self.engine is not None:
                self._stream_from_engine(job)
            else:
                self._queue(job)
        except BaseException:
            self._slots.release()
            raise
        return job

    def close_stream(self, job: Job) -> None:
        """The stream's slot freed (the client has its answer, or has gone: its rows then stop)."""
        if not job.future.done():
            job.cancelled.set()
            job.hangup()
        self._slots.release()

    def stream_chunks(self, job: Job, chat: bool, alive: Callable[[], bool] = lambda: True):
        """The chunks of a streamed request, as they come: a chunk per certain token of each choice
        with its running score, then each choice's last chunk (finish_reason, the `hallucination` of
        the unstreamed answer); an error object where the round failed. While no chunk comes (the
        request waits for a round, the engine is slow, text is held back), `alive()` is asked every
        quarter second: a client gone raises ConnectionResetError, as a write to it would."""
        from halludetect.scoring.streaming import Chunk

        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.name,
        }
        started: set[int] = set()

        def chunk(index: int, text: str, ids: list[int], finish: str | None, verdict: dict | None) -> dict:
            choice: dict = {"index": index, "logprobs": None, "finish_reason": finish, "token_ids": ids}
            if chat:
                choice["delta"] = {"content": text} | ({} if index in started else {"role": "assistant"})
                started.add(index)
            else:
                choice["text"] = text
            if verdict is not None:
                choice["hallucination"] = verdict
            return head | {"choices": [choice]}

        while True:
            try:
                event = job.events.get(timeout=0.25)
            except queue.Empty:
                if alive():
                    continue
                raise ConnectionResetError("the client has gone") from None
            if event is None:
                break
            assert isinstance(event, Chunk)
            verdict = {"running_score": event.running_score} if self.scoring else None
            yield chunk(event.choice, event.text, event.token_ids, None, verdict)
        try:
            results = job.future.result()
        except ApiError as e:
            yield e.body()
            return
        except Exception as e:  # noqa: BLE001  (the model failed: said in the stream, the server goes on)
            yield ApiError(500, f"{type(e).__name__}: {e}").body()
            return
        with self._lock:
            self.stats["requests"] += 1
            self.stats["answers"] += len(results)
        whole = self._response(job, results, chat)  # what the request without `stream` would get
        for row, r, c in zip(job.streamed, results, whole["choices"], strict=True):
            text, ids = row.text.rest(r["answer"] or "", r["answer_token_ids"] or [])
            yield chunk(c["index"], text, ids, c["finish_reason"], c.get("hallucination")) | {
                "detector": whole["detector"]
            }

    def _queue(self, job: Job) -> None:
        """The job handed to the model thread, before a stop's last sentinel, or refused (503)."""
        with self._queue_lock:
            if self._stopping.is_set():
                raise ApiError(503, "the server is stopping: retry on another", kind="service_unavailable")
            self._jobs.put(job)

    def _take_slot(self) -> None:
        """One of the --max-concurrency slots, or a 429 (counted)."""
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.stats["refused"] += 1
            raise ApiError(
                429,
                f"more than {self.limits.max_concurrency} requests in flight (--max-concurrency): retry shortly",
                kind="rate_limit_error",
            )

    def answer(self, body: object, chat: bool) -> dict:
        """A request's response (ApiError for a refused one): queued, sampled and scored, shaped."""
        self._take_slot()
        try:
            job = self.job(body, chat)
            if self.engine is not None:
                if self._stopping.is_set():
                    raise ApiError(503, "the server is stopping: retry on another", kind="service_unavailable")
                results = self._from_engine(job)
            else:
                self._queue(job)
                results = job.future.result()
        finally:
            self._slots.release()
        with self._lock:
            self.stats["requests"] += 1
            self.stats["answers"] += len(results)
        return self._response(job, results, chat)

    def _response(self, job: Job, results: list[dict], chat: bool) -> dict:
        choices = []
        for i, r in enumerate(results):
            finish = "length" if r["finish_reason"] == "length" else "stop"
            choice: dict = {"index": i, "finish_reason": finish, "logprobs": None, "token_ids": r["answer_token_ids"]}
            if chat:
                choice["message"] = {"role": "assistant", "content": r["answer"]}
            else:
                choice["text"] = r["answer"]
            if self.scoring:
                verdict = {k: r[k] for k in SCORE_FIELDS}
                verdict["threshold"] = self.scorer.threshold
                if job.explain:
                    verdict |= {k: r.get(k) for k in EVIDENCE_FIELDS}
                choice["hallucination"] = verdict
            choices.append(choice)
        if job.select:
            choices = [_selected(job.select, choices, chat)]
        completion = sum(len(r["answer_token_ids"]) for r in results)  # every answer sampled, chosen or not
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(job.prompt),
                "completion_tokens": completion,
                "total_tokens": len(job.prompt) + completion,
            },
            "detector": self.detector,
        }

    # ------------------------------------------------------------------ in front of vLLM
    def _stream_from_engine(self, job: Job) -> None:
        """A streamed request answered from the engine on a thread of its own: each choice's tokens go
        through a RowText (the same hold-back as in-process) into the job's events, as they come."""
        from halludetect.scoring.streaming import RowText, StreamedRow

        if self._stopping.is_set():
            raise ApiError(503, "the server is stopping: retry on another", kind="service_unavailable")
        t = self._tokenizer
        ends = (set(self._eos()) | {t.eos_token_id, t.pad_token_id}) - {None}  # trim_answer's
        job.streamed = [
            StreamedRow(c, job.events, job.cancelled, RowText(t, job.params.stop, ends)) for c in range(len(job.keys))
        ]

        def run() -> None:
            try:
                job.future.set_result(self._from_engine(job))
            except BaseException as e:  # noqa: BLE001  (said in the stream by stream_chunks)
                job.future.set_exception(e)
            finally:
                job.events.put(None)

        threading.Thread(target=run, name="halludetect-serve-engine-stream", daemon=True).start()

    def _stream_tokens(self, row, ids: list[int]) -> None:
        """A chunk of the engine's ids taken into a streamed row: its certain text sent (no running score)."""
        from halludetect.scoring.streaming import Chunk

        if row.cancelled.is_set():  # the client has gone: the engine's stream is closed by the raise
            raise ApiError(499, "the client has gone")
        self._check_ids(ids)
        text, sent = "", []
        with self._tokenizer_lock:
            for token in ids:
                if (out := row.text.push(token)) is not None:
                    text, sent = text + out[0], sent + out[1]
        if sent:
            row.events.put(Chunk(row.choice, text, sent, None))

    def _from_engine(self, job: Job) -> list[dict]:
        """The request's answers from the engine, each scored from the states file it was asked to write."""
        try:
            return self._answers_from_engine(job)
        finally:  # the files of requests given up on (time-outs, failed reads) go once their writer is done
            with contextlib.suppress(OSError, StatesProblem):  # never a scored answer lost to a sweep
                self.engine.states.sweep()

    def _answers_from_engine(self, job: Job) -> list[dict]:
        """The request's n answers asked of the engine at once (vLLM batches them; one after the
        other, a request of n would take n answers' time), then scored together."""
        if len(job.keys) == 1:
            parts = [self._engine_answer(job, 0, job.keys[0])]
        else:  # the first failure is raised once every answer is done (each releases its file)
            with ThreadPoolExecutor(len(job.keys), thread_name_prefix="halludetect-serve-engine") as pool:
                futures = [pool.submit(self._engine_answer, job, i, key) for i, key in enumerate(job.keys)]
                parts = [f.result() for f in futures]
        rows, bags, answers, lps, reasons = (list(x) for x in zip(*parts, strict=True))
        with self._score_lock:
            out = self.scorer.score_states(rows, bags, answers, lps, job.explain)
        for o, (t, reason), ids in zip(out, reasons, answers):
            o |= {"answer": t.text, "answer_token_ids": ids, "finish_reason": t.finish_reason}
            if reason:
                o["reason"] = reason
        return out

    def _engine_answer(self, job: Job, i: int, key: tuple) -> tuple:
        """Answer i from the engine, its states file read and released: (row, bag or None, answer ids,
        log-probs, (trimmed answer, why it is not scored or None))."""
        from halludetect.lm.generation import row_seed, trim_answer

        s, b, p, engine = self.scorer, self.scorer.bundle, job.params, self.engine
        top = int(b.meta["base_model"]["num_hidden_layers"])
        at = engine.layers.index(b.layer)  # the file's columns are the ids in ascending order
        name = engine.states.new()
        try:
            seed, path = row_seed(*key) >> 33, engine.states.full(name)
            if job.stream:
                if job.cancelled.is_set():
                    raise ApiError(499, "the client has gone")
                take = lambda ids, row=job.streamed[i]: self._stream_tokens(row, ids)  # noqa: E731
                choice = engine.stream(job.prompt, p, job.greedy, seed, path, take, job.hung_up_by)
            else:
                choice = engine.complete(job.prompt, p, job.greedy, seed, path)
            ids, logprobs = self._engine_tokens(choice)
            transfer = choice.get("kv_transfer_params")
            named = transfer.get("hidden_states_path") if isinstance(transfer, dict) else None
            try:
                states = engine.read_states(name, named, job.prompt, ids, p.max_new_tokens, self._hidden)
            except StatesProblem as e:  # the operator's log has the file; the client learns no path
                self.log(f"the engine's states file {engine.states.full(name)}: {e}")
                raise ApiError(502, "the engine's states file cannot be used (the server's log says why)") from None
        finally:
            engine.states.release(name)  # read or not, ours goes (one the engine writes later, the sweep takes)
        with self._tokenizer_lock:  # the request threads' tokenizer, one at a time
            t = trim_answer(self._tokenizer, ids, p.stop, p.max_new_tokens, self._eos())
        n, w = len(t.token_ids), len(job.prompt)
        first = w - 1 if b.positions == "predicting" else w  # the bag's first row in the file
        x = states[first : first + n, at]  # [<= n, d]: rows up to the output's last token but one
        reason = None
        if n == 0:
            reason = "empty_answer"
        elif n < s.min_tokens:
            reason = "too_short"
        elif len(x) < n:  # a generated bag's last state: no pass saw the output's last token
            reason = "no_last_state"
        if reason is None and b.layer == top:
            x = self._head.norm(x)
        row = AnswerRow(row=i, where=f"choice {i}", id=None, question=job.question, answer=t.text, token_ids=None,
                        p_sem=None)  # fmt: skip
        return row, None if reason else x, t.token_ids, logprobs[:n], (t, reason)

    def _engine_tokens(self, choice: dict) -> tuple[list[int], list[float]]:
        """The engine's token ids and their log-probs, checked before anything reads them: ids inside the
        bundle tokenizer's vocabulary, one finite log-prob <= 0 per id where it gives them (ApiError 502)."""
        ids = choice["token_ids"]
        self._check_ids(ids)
        given = (choice.get("logprobs") or {}) if isinstance(choice.get("logprobs"), dict) else {}
        lps = given.get("token_logprobs") or []
        if not isinstance(lps, list) or (lps and len(lps) != len(ids)):
            raise ApiError(502, f"the engine returned {len(lps) if isinstance(lps, list) else 'no list of'} log-probs "
                           f"for {len(ids)} tokens")  # fmt: skip
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v <= 1e-4
                   for v in lps):  # fmt: skip
            raise ApiError(502, "the engine returned log-probs that are not finite numbers <= 0")
        return ids, [float(v) for v in lps]

    def _check_ids(self, ids: list) -> None:
        vocab = len(self._tokenizer)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ApiError(502, f"the engine returned token ids that are not ids of the model's vocabulary ({vocab})")

    def _eos(self) -> list[int]:
        if not hasattr(self, "_eos_ids"):
            from halludetect.lm.hf_models import load_config, load_generation_eos

            preset = self.scorer.preset
            self._eos_ids = load_generation_eos(preset, load_config(preset))
        return self._eos_ids

    # ------------------------------------------------------------------ the model thread
    def _work(self) -> None:
        waiting: list[Job] = []
        while True:
            if not waiting:
                job = self._jobs.get()
                if job is None:
                    return
                waiting.append(job)
            while True:  # every request already queued may join this round
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:  # stopping: the requests still waiting are answered, not left hanging
                    for j in waiting:
                        j.future.set_exception(ApiError(503, "the server is stopping", kind="service_unavailable"))
                    return
                waiting.append(job)
            key, group, rows = waiting[0].batch_key, [], 0
            for j in waiting:
                if j.batch_key == key and (not group or rows + len(j.keys) <= self.limits.max_batch):
                    group.append(j)
                    rows += len(j.keys)
            waiting = [j for j in waiting if j not in group]
            try:
                results = self._run(group)
            except Exception as e:  # noqa: BLE001  (a failed batch fails its requests, not the server)
                for j in group:
                    j.future.set_exception(e)
                    j.events.put(None)
                continue
            with self._lock:
                self.stats["batches"] += 1
            for j, r in zip(group, results):
                j.future.set_result(r)
                j.events.put(None)  # a streamed request's chunks end here

    def _run(self, group: list[Job]) -> list[list[dict]]:
        first = group[0]
        rows = [
            AnswerRow(
                row=i,
                where=f"request {k} choice {i}",
                id=None,
                question=j.question,
                answer=None,
                token_ids=None,
                p_sem=None,
            )
            for k, j in enumerate(group)
            for i in range(len(j.keys))
        ]
        keys = [key for j in group for key in j.keys]
        stream = self._round_stream(group)
        if self.scoring:
            explain = any(j.explain for j in group)
            prompts = [j.prompt for j in group for _ in j.keys]  # encoded by `job`, as the scorer would
            out = self.scorer.sample_and_score(rows, keys, first.params, first.greedy, explain, stream, prompts)
        else:
            out = self._sample_only([j.prompt for j in group for _ in j.keys], keys, first, stream)
        per_job, at = [], 0
        for j in group:
            per_job.append(out[at : at + len(j.keys)])
            at += len(j.keys)
        return per_job

    def _round_stream(self, group: list[Job]):
        """The round's streamed rows (scoring/streaming.py), or None where no request streams."""
        if not any(j.stream for j in group):
            return None
        from halludetect.lm.hf_models import eos_ids
        from halludetect.scoring.streaming import RoundStream, RowText, RunningPool, StreamedRow

        s, p = self.scorer, group[0].params
        ends = set(eos_ids(s.model, s.tokenizer)) | {s.tokenizer.eos_token_id, s.tokenizer.pad_token_id}
        rows, at = {}, 0
        for j in group:
            if j.stream:
                j.streamed = [
                    StreamedRow(c, j.events, j.cancelled, RowText(s.tokenizer, p.stop, ends))
                    for c in range(len(j.keys))
                ]
                rows |= {at + c: row for c, row in enumerate(j.streamed)}
            at += len(j.keys)
        score = (lambda bags: s.bundle.seed_logits(bags).mean(0)) if self.scoring else None  # the seeds' mean logit
        if not hasattr(self, "_running_pool"):  # the bundle's weights stacked once, not per round
            self._running_pool = RunningPool.of(s.bundle)
        running = self._running_pool if self.scoring else None  # max and mean pooling: kept, not recomputed
        return RoundStream(rows, score, s.bundle.positions, s.min_tokens, s.states_dtype, running)

    def _sample_only(self, prompts: list[list[int]], keys: list[tuple], first: Job, stream=None) -> list[dict]:
        from halludetect.activations.sampled_states import sample_with_states
        from halludetect.lm.hf_models import eos_ids

        s = self.scorer
        sampled = sample_with_states(
            s.model,
            s.tokenizer,
            prompts,
            keys,
            first.params,
            eos_ids(s.model, s.tokenizer),
            layer=None,
            positions=s.bundle.positions,
            states_dtype=s.states_dtype,
            greedy=first.greedy,
            stream=stream,
        )
        return [
            {"answer": a.answer.text, "answer_token_ids": a.answer.token_ids, "finish_reason": a.answer.finish_reason}
            for a in sampled
        ]


# ------------------------------------------------------------------------------ HTTP
class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the default backlog (5) resets connections when many clients connect at once


def _send(handler: BaseHTTPRequestHandler, status: int, payload: dict, headers: dict | None = None) -> None:
    data = json.dumps(payload, allow_nan=False).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    try:
        handler.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    except (BrokenPipeError, ConnectionResetError):  # the client left: nothing to tell it
        handler.close_connection = True


def handler_class(service: Service, api_key: str | None, log: Callable[[str], None]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "halludetect-serve"
        # A client that stops sending (a request line, headers or body never finished, or an idle
        # keep-alive connection) is dropped after this many seconds, not held by a thread forever.
        timeout = 30

        def log_message(self, *args):  # one line per request of our own (_done), never the headers
            pass

        def setup(self):
            super().setup()
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _done(self, status: int, payload: dict, t0: float, headers: dict | None = None) -> None:
            if self.close_connection:  # said, so that the client opens a new one for its next request
                headers = {**(headers or {}), "Connection": "close"}
            _send(self, status, payload, headers)
            log(f"{self.command} {self.path.split('?')[0]} {status} {time.perf_counter() - t0:.3f}s")

        def _authorized(self) -> bool:
            if api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            token = given[7:] if given.startswith("Bearer ") else ""
            return hmac.compare_digest(token.encode(), api_key.encode())

        def _refuse(self, e: ApiError, t0: float) -> None:
            self._done(e.status, e.body(), t0, {"Retry-After": "1"} if e.status == 429 else None)

        def do_GET(self):
            t0 = time.perf_counter()
            path = self.path.split("?")[0].rstrip("/")
            if not self._authorized():
                return self._refuse(ApiError(401, "a valid API key is needed (Authorization: Bearer ...)"), t0)
            if path in ("/health", "/v1/health"):
                return self._done(200, {"status": "ok", "detector": service.detector, "stats": service.stats}, t0)
            if path == "/v1/models":
                model = {"id": service.name, "object": "model", "created": 0, "owned_by": "halludetect"}
                return self._done(200, {"object": "list", "data": [model | {"detector": service.detector}]}, t0)
            self._refuse(ApiError(404, f"no route GET {path} (GET /v1/models, GET /health)"), t0)

        def do_POST(self):
            with service.in_flight():  # a stop waits for the answer to be sent
                self._post()

        def _post(self):
            t0 = time.perf_counter()
            path = self.path.split("?")[0].rstrip("/")
            length = self.headers.get("Content-Length")
            try:
                if not self._authorized():
                    self.close_connection = True  # its body is not read: the connection cannot carry another
                    raise ApiError(401, "a valid API key is needed (Authorization: Bearer ...)")
                if path not in ("/v1/completions", "/v1/chat/completions"):
                    self.close_connection = True
                    raise ApiError(404, f"no route POST {path} (POST /v1/completions, /v1/chat/completions)")
                if length is None or not length.isdigit():
                    self.close_connection = True
                    raise ApiError(411, "a request body with a Content-Length is needed")
                if int(length) > service.limits.max_request_bytes:
                    self.close_connection = True  # its body is not read
                    raise ApiError(
                        413, f"the request is {length} bytes; the limit is {service.limits.max_request_bytes}"
                    )
                try:
                    raw = self.rfile.read(int(length))
                except TimeoutError:  # the body never came: said, and the connection closed
                    self.close_connection = True
                    raise ApiError(408, f"the request body did not arrive within {self.timeout} s") from None
                try:
                    body = json.loads(raw or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ApiError(400, f"the request body is not JSON: {e}") from None
                except RecursionError:  # lists or objects nested thousands deep: no field of ours is
                    raise ApiError(400, "the request body nests its lists or objects too deep") from None
                chat = path.endswith("/chat/completions")
                if isinstance(body, dict) and body.get("stream") is True:
                    return self._stream(service.open_stream(body, chat), chat, t0)
                response = service.answer(body, chat=chat)
            except ApiError as e:
                return self._refuse(e, t0)
            except Exception as e:  # noqa: BLE001  (the model failed: a 500 naming it, and the server goes on)
                return self._refuse(ApiError(500, f"{type(e).__name__}: {e}"), t0)
            self._done(200, response, t0)

        def _client_alive(self) -> bool:
            """Whether the client's end of the connection is still open (it sends nothing more on a
            stream: readable with nothing to read is its close). A client that half-closes its side
            after the request (no HTTP client we know does) reads as gone."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return not readable or self.connection.recv(1, socket.MSG_PEEK) != b""
            except OSError:
                return False

        def _stream(self, job: Job, chat: bool, t0: float) -> None:
            """Server-sent events, each `data: <chunk>`, then `data: [DONE]`; the connection closes after."""
            self.close_connection = True
            status = 200
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for payload in service.stream_chunks(job, chat, self._client_alive):
                    self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:  # the client has gone (a broken pipe, a reset): its rows stop, its slot is freed
                status = 499
            finally:
                service.close_stream(job)
            log(f"POST {self.path.split('?')[0]} {status} stream {time.perf_counter() - t0:.3f}s")

    return Handler


class Server:
    """The service behind an HTTP server on `host`:`port` (0: any free port): a context manager.

    with Server(service, port=0) as srv: ... srv.url ...
    """

    def __init__(
        self,
        service: Service,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        log: Callable[[str], None] = print,
    ):
        self.service = service
        try:
            self.http = _HTTPServer((host, port), handler_class(service, api_key, log))
        except OSError as e:  # in use, not an address of this machine, a privileged port
            raise UserError(
                f"cannot listen on {host}:{port} ({e.strerror or e}): pass another --host or --port"
            ) from None
        self.url = f"http://{host}:{self.http.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.http.serve_forever, name="halludetect-serve-http", daemon=True)

    def __enter__(self) -> Server:
        try:
            self.service.start()
        except BaseException:
            self.http.server_close()  # the socket bound in __init__
            raise
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """An orderly stop (SIGTERM, Ctrl-C): no new connection is taken; requests waiting for the model,
        and new ones on open connections, get a 503; the running round finishes; every request in flight
        is answered before the process may end (no client is cut off mid-reply)."""
        self.http.shutdown()  # the accept loop ends: no new connection
        self.service.stop()
        self.service.wait_in_flight()
        self.http.server_close()


def api_key_from(variable: str | None) -> str | None:
    """The key from the environment variable `variable` (None: no key), refused when unset or empty."""
    if variable is None:
        return None
    key = os.environ.get(variable, "")
    if not key.strip():
        raise UserError(f"--api-key-env {variable}: the variable is not set (or empty): export it, or drop the option")
    return key.strip()


SELECT = (None, "best_of_n", "abstain")


def _selected(policy: str, choices: list[dict], chat: bool) -> dict:
    """The one choice `policy` returns of a request's scored choices (module docstring), as choice 0."""
    scored = [c for c in choices if c["hallucination"]["score"] is not None]
    best = min(scored, key=lambda c: (c["hallucination"]["score"], c["index"])) if scored else choices[0]
    listing = [
        {"index": c["index"], "score": c["hallucination"]["score"], "flag": c["hallucination"]["flag"]} for c in choices
    ]
    verdict = {**best["hallucination"], "selection": {"policy": policy, "chosen": best["index"], "answers": listing}}
    if policy == "abstain" and (not scored or best["hallucination"]["flag"]):
        why = (
            f"every one of the {len(choices)} sampled answers was flagged as a likely hallucination"
            if scored
            else f"none of the {len(choices)} sampled answers could be scored"
        )
        out = {"index": 0, "finish_reason": "content_filter", "logprobs": None, "token_ids": []}
        if chat:
            out["message"] = {"role": "assistant", "content": None, "refusal": why}
        else:
            out["text"] = ""
        return out | {"hallucination": {**verdict, "abstained": True, "reason": why}}
    return {**best, "index": 0, "hallucination": verdict | ({"abstained": False} if policy == "abstain" else {})}


def serve(
    bundle: str | Path,
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key_env: str | None = None,
    name: str | None = None,
    limits: Limits = Limits(),
    engine: EngineClient | None = None,
    select: str | None = None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    **scorer_options,
) -> None:
    """Run the server until interrupted (Ctrl-C or SIGTERM). `scorer_options` are `Scorer`'s."""
    import ipaddress
    import signal

    key = api_key_from(api_key_env)
    loaded = load_bundle(bundle)
    if isinstance(loaded, ScoreBundle):  # before the scorer, whose own refusal (--generate) says less
        raise UserError(score_bundle_refusal(loaded))
    scorer = Scorer(loaded, model, log=log, **scorer_options)
    service = Service(scorer, name=name, limits=limits, engine=engine, select=select, log=log)
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback and key is None:
        log(f"warning: serving on {host}, reachable from other machines, without a key (--api-key-env)")

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with Server(service, host, port, key, log) as srv:
        d = service.detector
        log(
            f"serving {service.name} with the '{d['method']}' detector of {d['bundle']} (layer {d['layer']}, "
            f"flag at {d['threshold_name']} = {d['threshold']:.4g}) on {srv.url}"
        )
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            log("stopping")
