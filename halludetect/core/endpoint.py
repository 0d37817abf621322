"""An OpenAI-compatible HTTP endpoint as the pipeline calls it: the judge and the clustering
(`labels/chat_client.py`, chat completions) and the sampler (`lm/completions.py`, completions).

What is sent and how a reply is read belong to the caller; this module holds what every caller
needs and none should write twice, on top of the official `openai` client:

- the key comes from the environment variable named in params, checked before any work, and
  is redacted from every message (an endpoint may echo the Authorization header in an error);
  a key pasted in place of the variable's name, or credentials in a base URL, are refused
  without being repeated (core/credentials.py);
- bounded concurrency, over one URL or several replicas of one model: `concurrency` requests
  in flight per replica, each request sent to the replica with the fewest in flight;
- `timeout` is a deadline per HTTP request, headers and body together: a server that trickles
  a byte a second is cut off after `timeout` seconds (the HTTP client's own timeout is per read);
- retries with backoff on 408/409/429/5xx, timeouts, dropped connections and malformed bodies
  (`Malformed`, raised by the caller's reader). Retry-After is honoured; one longer than the
  request's remaining patience ((max_retries + 1) x timeout in all) fails at once, saying what
  the server asked for. A retry goes to another replica when there is one;
- replies are stored as they arrive in a `CallCache` (SQLite), under a key the caller derives
  from the request: a re-run asks nothing it has, and processes running at once claim a
  request before sending it and wait for another's reply rather than send it twice;
- SIGINT and SIGTERM stop the run cleanly: no request is started after, retries included, and the
  ones in flight are awaited and stored. An error that retries cannot fix does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import inspect
import json
import os
import random
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import openai

try:  # the openai client's HTTP library: httpx2 since openai 3, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from halludetect.core.call_cache import CallCache
from halludetect.core.credentials import key_variable_problem, url_credentials
from halludetect.core.errors import UserError

OPENAI_URL = "https://api.openai.com/v1"
RETRY_STATUS = (408, 409, 429)  # and every 5xx: what the openai client itself retries
POLL_S = (0.05, 0.5)  # waiting for another process's reply: first and longest poll interval


class ApiError(UserError, RuntimeError):
    """An endpoint problem that retrying cannot fix; the message names the params key to check."""


class Malformed(Exception):
    """A reply body the caller cannot read (cut, not JSON, missing fields): asked again, at most
    `max_retries` times, then an ApiError."""


class Stop(Exception):
    """Raised inside tasks that were not started because the run is stopping."""


async def settled(*aws) -> list:
    """The results of `aws` run together, in order, raised from only once every one has finished:
    the first error that is not a `Stop`, else the first `Stop`. A caller that fans requests out
    must use this, not a bare `asyncio.gather`, which raises the first error at once and leaves the
    others running unawaited: a request in flight beside one that stopped would be cut off as the
    run closes, and its reply, received and paid for, asked again by the next run."""
    out = await asyncio.gather(*aws, return_exceptions=True)
    errors = [x for x in out if isinstance(x, BaseException)]
    if errors:
        raise next((e for e in errors if not isinstance(e, Stop)), errors[0])
    return out


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


def duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def backoff(n: int) -> float:
    """The n-th retry's wait (0-based) without a Retry-After: 0.5 s doubling to 8 s, with jitter."""
    return min(0.5 * 2**n, 8.0) * (1 - 0.25 * random.random())


def cut_body(e: BaseException) -> str | None:
    """The error behind `e` when the server closed the connection before the whole body (the
    announced length) had come: a cut reply, not an unreachable server."""
    while e is not None:
        name = type(e).__name__
        if any(k in name for k in ("Payload", "ContentLength", "RemoteProtocol", "IncompleteRead")):
            return f"{name}: {e}"
        e = e.__cause__ or e.__context__
    return None


def count(value) -> int | None:
    """A token count from a reply's `usage`: an int, or None where the endpoint gives none or
    something else. Some servers send counts as strings ("12") or floats: read, not added as text."""
    if isinstance(value, bool):
        return None
    if (isinstance(value, float) and value.is_integer()) or (isinstance(value, str) and value.strip().isdigit()):
        value = int(value)
    return value if isinstance(value, int) and value >= 0 else None


def why(e: BaseException) -> str:
    """`e`'s text, or its cause's where it has none, or its type's name: never empty (an asyncio
    timeout's text is "", which printed as "cannot reach ... ()")."""
    first = e
    while e is not None:
        if str(e).strip():
            return str(e)
        e = e.__cause__ or e.__context__
    return type(first).__name__


def connect_failure(e: BaseException) -> str | None:
    """The connection error behind `e`, if any (refused, unreachable, DNS): not a slow server."""
    while e is not None:
        if isinstance(e, ConnectionError | socket.gaierror) and not isinstance(e, TimeoutError):
            return f"{type(e).__name__}: {e}"
        e = e.__cause__ or e.__context__
    return None


@dataclass
class Endpoint:
    """One model behind one or more base URLs (replicas). `where` names the params section
    (e.g. "judge.openai") so every error points at the key to fix; `model` is the model name the
    requests carry; `route` is "chat completions" or "completions", for messages; `refused_hint`
    lists the keys to check when the endpoint refuses a request as bad."""

    base_urls: list[str]
    where: str
    model: str
    api_key_env: str | None
    concurrency: int  # per replica
    max_retries: int
    timeout: float
    cache: CallCache
    route: str = "chat completions"
    refused_hint: str = "model"
    stopping: str | None = field(default=None, init=False)

    def __post_init__(self):
        # Checked before the key is read, and never echoed: a key pasted as the variable's name
        # would otherwise come back in "the API key variable <key> is not set".
        if self.api_key_env and (problem := key_variable_problem(self.api_key_env)):
            raise ApiError(f"{self.where}.api_key_env: {problem}")
        for url in self.base_urls:  # credentials in a URL: aiohttp's traceback, and a secret in params
            if problem := url_credentials(url):
                raise ApiError(f"{self.where}.base_url: {problem}")
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ApiError(
                    f"{self.where}: the API key variable {self.api_key_env} is not set; export it, or set "
                    f"{self.where}.api_key_env (null for a local endpoint that needs no key)"
                )
        else:
            key = "no-key"  # local servers ignore it; the client requires some string
        self.base_urls = [u.rstrip("/") for u in self.base_urls]
        self._key = key
        self._secret = key if self.api_key_env else None  # what never appears in a message

    # ------------------------------------------------------------------ messages
    def redact(self, text: str) -> str:
        """`text` without the API key."""
        return text.replace(self._secret, f"[{self.api_key_env} redacted]") if self._secret else text

    def error(self, message: str) -> ApiError:
        return ApiError(self.redact(message))

    # ------------------------------------------------------------------ a session
    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Endpoint]:
        """Clients, slots, signal handlers and the renewal of this run's claims, for one event loop.
        On exit every claim still held is released (others may take those requests now)."""
        # Retries are ours (`call`): they honour the per-request deadline and the patience.
        self._clients = [
            openai.AsyncOpenAI(
                api_key=self._key,
                base_url=url,
                max_retries=0,
                timeout=self.timeout,
                http_client=openai.DefaultAioHttpClient(),
            )
            for url in self.base_urls
        ]
        self._slots = asyncio.Semaphore(self.concurrency * len(self.base_urls))
        self._in_flight = [0] * len(self.base_urls)
        self.stopping = None
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._interrupt, sig)
                handled.append(sig)
            except (ValueError, RuntimeError):  # not the main thread: the default handlers stay
                pass

        async def renew() -> None:  # keep this run's claims alive while their requests are in flight
            while True:
                await asyncio.sleep(self.cache.lease_s / 3)
                self.cache.renew()

        renewing = asyncio.create_task(renew())
        try:
            yield self
        finally:
            renewing.cancel()
            self.cache.release()
            for sig in handled:
                loop.remove_signal_handler(sig)
            for client in self._clients:
                await client.close()

    def _interrupt(self, sig) -> None:
        self.stopping = f"interrupted by {signal.Signals(sig).name}"

    async def _before_retry(self, seconds: float) -> None:
        """Wait `seconds` before a retry, unless the run is stopping, before or during the wait: a
        retry is a request started after the stop, so the request gives up (Stop, its claim
        released: the next run asks for it) rather than keep the stop waiting on a failing replica."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))
        if self.stopping:
            raise Stop

    def _pick(self, avoid: int | None = None) -> int:
        """The replica with the fewest requests in flight (another than `avoid` when there is one)."""
        order = sorted(range(len(self.base_urls)), key=lambda i: (i == avoid, self._in_flight[i], i))
        return order[0]

    # ------------------------------------------------------------------ one request
    async def reply(
        self, key: str, request: dict, path: str, body: dict | Callable[[], dict], read: Callable[[dict, str], dict]
    ) -> tuple[dict, bool, bool]:
        """(reply, cached, waited): from the cache, from another process that is asking for it right
        now (waited for, not sent again), or sent here under this process's claim and stored.
        `request` is what the cache records next to the reply (never the key); `read(body, url)`
        turns the response body from the replica at `url` into the reply dict to store (keys: reply,
        prompt_tokens, completion_tokens, reasoning_tokens: ints or None, see `count`), or raises
        Malformed (asked again) or an ApiError. `body` may be a function giving each try's body (a
        request that names a file of its own per try: lm/completions.py's states)."""
        waited, poll = False, POLL_S[0]
        while True:
            hit = self.cache.get(key)
            if hit is None:
                async with self._slots:  # claimed only when a slot is free: others may take what waits
                    if self.stopping:
                        raise Stop
                    state, hit = self.cache.claim(key)
                    if state == "mine":
                        try:
                            reply = await self.call(path, body, read)
                        except BaseException as e:
                            self.cache.release(key)
                            if isinstance(e, ApiError):
                                self.stopping = self.stopping or str(e)
                            raise
                        self.cache.put(key, request, reply)
                        return reply, False, False
            if isinstance(hit, dict):
                return hit, True, waited
            # Another process holds a live claim: its reply will land in the cache.
            waited = True
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, POLL_S[1])

    async def get(self, replica: int, path: str) -> Any:
        """A GET on one replica (e.g. /models), without retries: the JSON body, or None when the
        route does not exist there (404). Connection and status errors are ApiErrors."""
        url = self.base_urls[replica]
        try:
            resp = await asyncio.wait_for(self._clients[replica].get(path, cast_to=httpx.Response), self.timeout)
            return json.loads(resp.content)
        except openai.NotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self.error(f"{self.where}: {url}{path} returned a body that is not JSON ({e})") from None
        except (asyncio.TimeoutError, openai.APIConnectionError) as e:
            refused = connect_failure(e)
            if isinstance(e, asyncio.TimeoutError | openai.APITimeoutError) and not refused:
                raise self.error(
                    f"{self.where}: {url}{path} did not answer within {self.timeout:g} s ({self.where}.timeout): the "
                    f"server is slow (still loading the model, or overloaded) or a firewall drops the connection; "
                    f"wait and re-run, raise {self.where}.timeout, or check {self.where}.base_url"
                ) from None
            raise self.error(
                f"{self.where}: cannot reach {url} ({refused or why(e.__cause__ or e)}); is the server up "
                f"and {self.where}.base_url right?"
            ) from None
        except openai.APIStatusError as e:
            raise self.error(f"{self.where}: {url}{path} answered HTTP {e.status_code}: {e.message}") from None

    async def call(
        self,
        path: str,
        body: dict | Callable[[], dict],
        read: Callable[[dict, str], Any],
        replica: int | None = None,
        pin: bool = False,
    ) -> dict:
        """One request, retried: a deadline of `timeout` per HTTP request, at most `max_retries`
        retries for timeouts, dropped connections and 408/409/429/5xx, and as many again for
        malformed bodies. A Retry-After beyond the patience left fails at once. `body` is the body, or
        a function called for each try's; `read` may return an awaitable (work on a thread); the first
        try goes to `replica` (default: the least busy), and with `pin` every try does (a check of
        that replica)."""
        where, model = self.where, self.model
        patience = (self.max_retries + 1) * self.timeout
        deadline = time.monotonic() + patience
        failures = malformed = 0
        replica = self._pick() if replica is None else replica
        while True:
            url, sent = self.base_urls[replica], replica
            this = body() if callable(body) else body
            self._in_flight[sent] += 1
            t0 = time.perf_counter()
            try:
                # A raw POST through the client (its auth and errors) rather than the typed
                # `create` methods: it skips the params transform and the response model, about
                # 0.6 ms of CPU a call on the 2-core machines (of ~3 ms in all).
                resp = await asyncio.wait_for(
                    self._clients[replica].post(path, cast_to=httpx.Response, body=this), self.timeout
                )
                try:
                    data = json.loads(resp.content)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise Malformed(f"the body is not JSON ({type(e).__name__}: {e})") from None
                if not isinstance(data, dict):
                    raise Malformed(f"the body is a JSON {type(data).__name__}, not an object")
                reply = read(data, url)  # the url: a reply refused as wrong names the replica that sent it
                if inspect.isawaitable(reply):
                    reply = await reply
            except Malformed as e:
                if malformed == self.max_retries:
                    raise self.error(
                        f"{where}: {url} kept returning malformed replies ({self.max_retries + 1} tries): {e}"
                    ) from None
                await self._before_retry(backoff(malformed))
                malformed += 1
                replica = replica if pin else self._pick(avoid=replica)
                continue
            except openai.AuthenticationError as e:
                raise self.error(f"{where}: {url} rejected the key in ${self.api_key_env}: {e.message}") from None
            except openai.NotFoundError as e:
                raise self.error(
                    f"{where}: {url} has no model '{model}' (or no {self.route} route): {e.message}; check "
                    f"{where}.model and {where}.base_url"
                ) from None
            except (openai.BadRequestError, openai.UnprocessableEntityError, openai.PermissionDeniedError) as e:
                raise self.error(
                    f"{where}: {url} refused the request for model '{model}' (HTTP {e.status_code}): "
                    f"{e.message}; check {where} ({self.refused_hint})"
                ) from None
            except (asyncio.TimeoutError, openai.APIConnectionError) as e:  # APITimeoutError is a connection error
                refused = connect_failure(e)  # the aiohttp transport reports a refused connection as a timeout
                if cut := cut_body(e):
                    final = f"{where}: {url} cut its reply off {self.max_retries + 1} times: {cut}"
                elif isinstance(e, asyncio.TimeoutError | openai.APITimeoutError) and not refused:
                    final = (
                        f"{where}: {url} timed out {self.max_retries + 1} times ({self.timeout:g} s each); "
                        f"raise {where}.timeout or lower concurrency"
                    )
                else:
                    final = (
                        f"{where}: cannot reach {url} ({self.max_retries + 1} tries): "
                        f"{refused or why(e.__cause__ or e)}; is the server up and {where}.base_url right?"
                    )
                wait = None
            except openai.APIStatusError as e:
                if e.status_code not in RETRY_STATUS and e.status_code < 500:
                    raise self.error(f"{where}: {url} answered HTTP {e.status_code}: {e.message}") from None
                final = f"{where}: {url} answered HTTP {e.status_code} after {self.max_retries} retries: {e.message}"
                wait = retry_after(e.response.headers)
                left = deadline - time.monotonic()
                if wait is not None and wait > left:
                    raise self.error(
                        f"{where}: {url} answered HTTP {e.status_code} and asked to retry after {wait:g} s "
                        f"({duration(wait)}), longer than this request's remaining patience of {max(left, 0):.0f} s "
                        f"((max_retries + 1) x timeout = {patience:g} s in all): {e.message}. The endpoint is "
                        f"rate-limiting or out of quota: re-run later (every reply so far is cached), or raise "
                        f"{where}.max_retries or {where}.timeout to wait that long"
                    ) from None
            else:
                reply["latency_s"] = time.perf_counter() - t0
                return reply
            finally:
                self._in_flight[sent] -= 1
            if failures == self.max_retries:
                raise self.error(final) from None
            await self._before_retry(wait if wait is not None else backoff(failures))
            failures += 1
            replica = replica if pin else self._pick(avoid=replica)
