"""The OpenAI-compatible chat client shared by the `openai` judge and NLI backends: bounded
concurrency, retries, strict parsing, usage and cost (the reply cache is `call_cache.py`).

Any endpoint that speaks chat completions works: OpenAI, Azure OpenAI (its `/openai/v1/` URL),
vLLM, Ollama, llama.cpp's server. On top of the official `openai` client this adds:

- the key comes from the environment variable named in params, checked before any work;
- bounded concurrency: `AsyncOpenAI` under a semaphore;
- `timeout` is a deadline per HTTP request, headers and body together: a server that trickles
  a byte a second is cut off after `timeout` seconds (the HTTP client's own timeout is per read);
- retries here, with backoff, on 408/409/429/5xx, timeouts, dropped connections and malformed
  bodies. Retry-After is honoured; one longer than the request's remaining patience
  ((max_retries + 1) x timeout in all) fails at once, saying what the server asked for;
- a persistent call cache (SQLite) keyed by endpoint, model, messages, sampling parameters and
  attempt number: a re-run makes no call, and an interrupted run resumes without paying twice.
  It lives outside DVC's outputs (which DVC deletes before a stage runs): `HALLUDETECT_CACHE`
  or `~/.cache/halludetect`, shared by every workspace and queued experiment. Processes
  running at once claim a request before sending it, and wait for another's reply rather than
  send the same request (`call_cache.py`);
- the API key is redacted from every error message (an endpoint may echo the Authorization
  header in an error body);
- strict parsing by the caller's parser: an unparseable reply is asked again (a new attempt,
  so a new cache key) and after `parse_retries` it is invalid, never read as a guess;
- usage accounting: calls, cache hits, tokens, and a cost estimate from the price table.

An error that retries cannot fix stops the run: calls in flight are awaited and stored, none
is started after, and the error says how much is saved. SIGINT and SIGTERM do the same, so
Ctrl-C on `dvc repro` loses no paid reply.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

try:  # the openai client's HTTP library: httpx2 since openai 3, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from halludetect.config import ChatParams, Price
from halludetect.core.errors import UserError
from halludetect.labels.call_cache import CallCache, cache_path

OPENAI_URL = "https://api.openai.com/v1"
RETRY_STATUS = (408, 409, 429)  # and every 5xx: what the openai client itself retries
POLL_S = (0.05, 0.5)  # waiting for another process's reply: first and longest poll interval


class ApiError(UserError, RuntimeError):
    """An endpoint problem that retrying cannot fix; the message names the params key to check."""


@dataclass
class Usage:
    """What a run asked and paid. `cost_usd` is this run's calls; `cost_usd_all` prices every
    reply the outputs rest on, cached or not (what the labels cost when first made)."""

    model: str
    calls: int = 0  # requests that reached the endpoint and came back
    cache_hits: int = 0
    unparseable: int = 0  # replies the parser rejected (each is asked again, up to parse_retries)
    invalid: int = 0  # items still unparseable after every attempt
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    waited: int = 0  # of the cache hits, replies another process was asking for at the same time
    cached_prompt_tokens: int = 0  # tokens of the cache hits (not paid again)
    cached_completion_tokens: int = 0
    seconds: float = 0.0  # wall time spent waiting for the endpoint in this run

    def add(self, reply: dict, cached: bool) -> None:
        if cached:
            self.cache_hits += 1
            self.cached_prompt_tokens += reply["prompt_tokens"] or 0
            self.cached_completion_tokens += reply["completion_tokens"] or 0
        else:
            self.calls += 1
            self.prompt_tokens += reply["prompt_tokens"] or 0
            self.completion_tokens += reply["completion_tokens"] or 0
            self.reasoning_tokens += reply["reasoning_tokens"] or 0

    def merge(self, other: Usage) -> None:
        for k, v in asdict(other).items():
            if k != "model":
                setattr(self, k, getattr(self, k) + v)

    def report(self, prices: dict[str, Price]) -> dict:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        price = prices.get(self.model)
        if price is None:
            out["cost_usd"] = out["cost_usd_all"] = None
            out["cost_note"] = f"no price for '{self.model}' in params.yaml `prices`"
        else:
            cost = lambda p, c: (p * price.input + c * price.output) / 1e6
            out["cost_usd"] = round(cost(self.prompt_tokens, self.completion_tokens), 6)
            out["cost_usd_all"] = round(
                cost(
                    self.prompt_tokens + self.cached_prompt_tokens,
                    self.completion_tokens + self.cached_completion_tokens,
                ),
                6,
            )
        return out


@dataclass
class Reply:
    text: str | None  # the last reply's text (None: the endpoint returned no content)
    value: Any  # the parsed value; None = invalid after every attempt
    attempts: int


def retry_after(headers) -> float | None:
    """Seconds the server asks to wait (`retry-after-ms`, or `Retry-After` in seconds or as an
    HTTP date), or None when it says nothing readable."""
    if headers is None:
        return None
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(0.0, float(ms) / 1000)
    except ValueError:
        pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _backoff(n: int) -> float:
    """The n-th retry's wait (0-based) without a Retry-After: 0.5 s doubling to 8 s, with jitter."""
    return min(0.5 * 2**n, 8.0) * (1 - 0.25 * random.random())


def _connect_failure(e: BaseException) -> str | None:
    """The connection error behind `e`, if any (refused, unreachable, DNS): not a slow server."""
    while e is not None:
        if isinstance(e, ConnectionError | socket.gaierror) and not isinstance(e, TimeoutError):
            return f"{type(e).__name__}: {e}"
        e = e.__cause__ or e.__context__
    return None


class _Stop(Exception):
    """Raised inside tasks that were not started because the run is stopping."""


@dataclass
class ChatRunner:
    """Runs many single-message chat prompts against one endpoint. `where` names the params
    section (e.g. "judge.openai") so every error points at the key to fix."""

    params: ChatParams
    where: str
    cache: CallCache = field(default_factory=lambda: CallCache(cache_path()))
    usage: Usage = field(init=False)

    def __post_init__(self):
        p = self.params
        if p.api_key_env:
            key = os.environ.get(p.api_key_env)
            if not key:
                raise ApiError(
                    f"{self.where}: the API key variable {p.api_key_env} is not set; export it, or set "
                    f"{self.where}.api_key_env (null for a local endpoint that needs no key)"
                )
        else:
            key = "no-key"  # local servers ignore it; the client requires some string
        self.base_url = (p.base_url or os.environ.get("OPENAI_BASE_URL") or OPENAI_URL).rstrip("/")
        self._key = key
        self._secret = key if p.api_key_env else None  # what never appears in a message
        self.usage = Usage(model=p.model)
        # Sampling parameters: part of the cache key, so changing one asks again.
        self.sampling: dict[str, Any] = {}
        if p.temperature is not None:
            self.sampling["temperature"] = p.temperature
        if p.reasoning_effort is not None:
            self.sampling["reasoning_effort"] = p.reasoning_effort
        if p.max_completion_tokens is not None:
            self.sampling["max_completion_tokens"] = p.max_completion_tokens

    # ------------------------------------------------------------------ public
    def run(self, prompts: list[str], parse: Callable[[str], Any], desc: str = "calls") -> list[Reply]:
        """One reply per prompt, in order. Raises ApiError (progress kept in the cache)."""
        if not prompts:
            return []
        return asyncio.run(self._run_all(prompts, parse, desc))

    def key(self, prompt: str, attempt: int) -> tuple[str, dict]:
        """(cache key, request). The key covers endpoint, body and attempt; never the API key."""
        body = {"model": self.params.model, "messages": [{"role": "user", "content": prompt}], **self.sampling}
        request = {"base_url": self.base_url, "body": body, "attempt": attempt}
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest(), request

    def redact(self, text: str) -> str:
        """`text` without the API key (an endpoint may echo the Authorization header in an error)."""
        return text.replace(self._secret, f"[{self.params.api_key_env} redacted]") if self._secret else text

    def _error(self, message: str) -> ApiError:
        return ApiError(self.redact(message))

    # ------------------------------------------------------------------ internals
    async def _run_all(self, prompts, parse, desc) -> list[Reply]:
        from tqdm import tqdm

        p = self.params
        # Retries are ours (`_call`): they honour the per-request deadline and the patience.
        self._client = openai.AsyncOpenAI(
            api_key=self._key,
            base_url=self.base_url,
            max_retries=0,
            timeout=p.timeout,
            http_client=openai.DefaultAioHttpClient(),
        )
        self._sem = asyncio.Semaphore(p.concurrency)
        self._stopping: str | None = None
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._interrupt, sig)
                handled.append(sig)
            except (ValueError, RuntimeError):  # not the main thread: the default handlers stay
                pass
        # Equal prompts (K samples often give the same answer) are asked once.
        distinct = list(dict.fromkeys(prompts))
        results: dict[str, Reply] = {}
        bar = tqdm(total=len(distinct), desc=f"{self.where} {desc}", unit="prompt", mininterval=2.0, leave=False)
        t0 = time.perf_counter()

        async def one(prompt: str) -> None:
            results[prompt] = await self._resolve(prompt, parse)
            bar.update()

        async def renew() -> None:  # keep this run's claims alive while their requests are in flight
            while True:
                await asyncio.sleep(self.cache.lease_s / 3)
                self.cache.renew()

        renewing = asyncio.create_task(renew())
        outcomes: list = []
        try:
            # The first prompt that needs a call goes alone: a wrong URL, key or model name then
            # fails after one request, not after `concurrency` of them.
            first = next((q for q in distinct if self.cache.get(self.key(q, 0)[0]) is None), None)
            if first is not None:
                await one(first)
            tasks = [asyncio.create_task(one(q)) for q in distinct if q not in results]
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            renewing.cancel()
            self.cache.release()  # claims of requests that never completed: others may take them now
            bar.close()
            self.usage.seconds += time.perf_counter() - t0
            for sig in handled:
                loop.remove_signal_handler(sig)
            await self._client.close()
        errors = [e for e in outcomes if isinstance(e, BaseException) and not isinstance(e, _Stop)]
        if errors or self._stopping:
            saved = (
                f"{len(results)} of {len(distinct)} distinct prompts done; every reply received is cached, "
                "re-run to resume"
            )
            if errors:
                raise self._error(f"{errors[0]} ({saved})") from errors[0]
            raise KeyboardInterrupt(self.redact(f"{self._stopping} ({saved})"))
        return [results[q] for q in prompts]

    def _interrupt(self, sig) -> None:
        self._stopping = f"interrupted by {signal.Signals(sig).name}"

    async def _resolve(self, prompt: str, parse) -> Reply:
        text = None
        for attempt in range(self.params.parse_retries + 1):
            text = await self._reply(prompt, attempt)
            value = parse(text) if text is not None else None
            if value is not None:
                return Reply(text, value, attempt + 1)
            self.usage.unparseable += 1
        self.usage.invalid += 1
        return Reply(text, None, self.params.parse_retries + 1)

    async def _reply(self, prompt: str, attempt: int) -> str | None:
        """The reply to one request: from the cache, from another process that is asking for it
        right now (waited for, not sent again), or sent here under this process's claim."""
        key, request = self.key(prompt, attempt)
        waited, poll = False, POLL_S[0]
        while True:
            hit = self.cache.get(key)
            if hit is None:
                async with self._sem:  # claimed only when a slot is free: others may take what waits
                    if self._stopping:
                        raise _Stop
                    state, hit = self.cache.claim(key)
                    if state == "mine":
                        try:
                            reply = await self._call(request)
                        except BaseException as e:
                            self.cache.release(key)
                            if isinstance(e, ApiError):
                                self._stopping = self._stopping or str(e)
                            raise
                        self.cache.put(key, request, reply)
                        self.usage.add(reply, cached=False)
                        return reply["reply"]
            if isinstance(hit, dict):
                self.usage.add(hit, cached=True)
                self.usage.waited += waited
                return hit["reply"]
            # Another process holds a live claim: its reply will land in the cache.
            waited = True
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, POLL_S[1])

    async def _call(self, request: dict) -> dict:
        """One request, retried: a deadline of `timeout` per HTTP request, at most `max_retries`
        retries for timeouts, dropped connections and 408/409/429/5xx, and as many again for
        malformed bodies. A Retry-After beyond the patience left fails at once."""
        p, where = self.params, self.where
        patience = (p.max_retries + 1) * p.timeout
        deadline = time.monotonic() + patience
        failures = malformed = 0
        while True:
            t0 = time.perf_counter()
            try:
                # A raw POST through the client (its auth and errors) rather than
                # `chat.completions.create`: it skips the typed-params transform and the response
                # model, about 0.6 ms of CPU a call on the 2-core machines (of ~3 ms in all).
                resp = await asyncio.wait_for(
                    self._client.post("/chat/completions", cast_to=httpx.Response, body=request["body"]), p.timeout
                )
                data = json.loads(resp.content)
                text = data["choices"][0]["message"]["content"]  # a body without them is malformed
                if text is not None and not isinstance(text, str):
                    raise TypeError(f"message content is {type(text).__name__}")
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                if malformed == p.max_retries:
                    raise self._error(
                        f"{where}: {self.base_url} kept returning malformed replies "
                        f"({p.max_retries + 1} tries): {type(e).__name__}: {e}"
                    ) from None
                await asyncio.sleep(_backoff(malformed))
                malformed += 1
                continue
            except openai.AuthenticationError as e:
                raise self._error(
                    f"{where}: {self.base_url} rejected the key in ${p.api_key_env}: {e.message}"
                ) from None
            except openai.NotFoundError as e:
                raise self._error(
                    f"{where}: {self.base_url} has no model '{p.model}' (or no chat completions "
                    f"route): {e.message}; check {where}.model and {where}.base_url"
                ) from None
            except (openai.BadRequestError, openai.UnprocessableEntityError, openai.PermissionDeniedError) as e:
                raise self._error(
                    f"{where}: {self.base_url} refused the request for model '{p.model}' "
                    f"(HTTP {e.status_code}): {e.message}; check {where} (model, temperature, "
                    f"reasoning_effort, max_completion_tokens)"
                ) from None
            except (asyncio.TimeoutError, openai.APIConnectionError) as e:  # APITimeoutError is a connection error
                refused = _connect_failure(e)  # the aiohttp transport reports a refused connection as a timeout
                if isinstance(e, asyncio.TimeoutError | openai.APITimeoutError) and not refused:
                    final = (
                        f"{where}: {self.base_url} timed out {p.max_retries + 1} times ({p.timeout:g} s each); "
                        f"raise {where}.timeout or lower concurrency"
                    )
                else:
                    final = (
                        f"{where}: cannot reach {self.base_url} ({p.max_retries + 1} tries): "
                        f"{refused or e.__cause__ or e}; is the server up and {where}.base_url right?"
                    )
                wait = None
            except openai.APIStatusError as e:
                if e.status_code not in RETRY_STATUS and e.status_code < 500:
                    raise self._error(f"{where}: {self.base_url} answered HTTP {e.status_code}: {e.message}") from None
                final = (
                    f"{where}: {self.base_url} answered HTTP {e.status_code} after {p.max_retries} retries: {e.message}"
                )
                wait = retry_after(e.response.headers)
                left = deadline - time.monotonic()
                if wait is not None and wait > left:
                    raise self._error(
                        f"{where}: {self.base_url} answered HTTP {e.status_code} and asked to retry after {wait:g} s "
                        f"({_duration(wait)}), longer than this request's remaining patience of {max(left, 0):.0f} s "
                        f"((max_retries + 1) x timeout = {patience:g} s in all): {e.message}. The endpoint is "
                        f"rate-limiting or out of quota: re-run later (every reply so far is cached), or raise "
                        f"{where}.max_retries or {where}.timeout to wait that long"
                    ) from None
            else:
                latency = time.perf_counter() - t0
                usage = data.get("usage") or {}
                details = usage.get("completion_tokens_details") or {}
                return {
                    "reply": text,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "completion_tokens": usage.get("completion_tokens"),
                    "reasoning_tokens": details.get("reasoning_tokens"),
                    "latency_s": latency,
                }
            if failures == p.max_retries:
                raise self._error(final) from None
            await asyncio.sleep(wait if wait is not None else _backoff(failures))
            failures += 1
