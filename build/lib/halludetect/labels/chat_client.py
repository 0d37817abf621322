"""The OpenAI-compatible chat client shared by the `openai` judge and NLI backends: strict parsing,
usage and cost, over the endpoint machinery of `core/endpoint.py` (bounded concurrency, retries,
deadlines, claims, redaction) and the reply cache of `core/call_cache.py`.

Any endpoint that speaks chat completions works: OpenAI, Azure OpenAI (its `/openai/v1/` URL),
vLLM, Ollama, llama.cpp's server. On top of `core/endpoint.py` this adds:

- a persistent call cache (SQLite) keyed by endpoint, model, messages, sampling parameters and
  attempt number: a re-run makes no call, and an interrupted run resumes without paying twice.
  It lives outside DVC's outputs (which DVC deletes before a stage runs): `HALLUDETECT_CACHE`
  or `~/.cache/halludetect`, shared by every workspace and queued experiment; processes
  running at once claim a request before sending it (`core/call_cache.py`);
- strict parsing by the caller's parser: an unparseable reply is asked again (a new attempt,
  so a new cache key) and after `parse_retries` it is invalid, never read as a guess;
- usage accounting: calls, cache hits, tokens, and a cost estimate from the price table.

An error that retries cannot fix stops the run: calls in flight are awaited and stored, none
is started after, and the error says how much is saved. SIGINT and SIGTERM do the same, so
Ctrl-C on `dvc repro` loses no paid reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from halludetect.config import ChatParams, Price
from halludetect.core.call_cache import CallCache, cache_path
from halludetect.core.credentials import url_credentials
from halludetect.core.endpoint import OPENAI_URL, ApiError, Endpoint, Malformed, Stop, count, retry_after

__all__ = ["ApiError", "ChatRunner", "Reply", "Usage", "retry_after"]


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
        # `count` again: a cache written before counts were read as ints may hold strings.
        prompt, completion = count(reply["prompt_tokens"]) or 0, count(reply["completion_tokens"]) or 0
        if cached:
            self.cache_hits += 1
            self.cached_prompt_tokens += prompt
            self.cached_completion_tokens += completion
        else:
            self.calls += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.reasoning_tokens += count(reply["reasoning_tokens"]) or 0

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
        from_env = None if p.base_url else os.environ.get("OPENAI_BASE_URL")
        if from_env and (problem := url_credentials(from_env)):  # params' own base_url is checked when parsed
            raise ApiError(f"{self.where}: OPENAI_BASE_URL (read because {self.where}.base_url is null) {problem}")
        self.base_url = (p.base_url or from_env or OPENAI_URL).rstrip("/")
        self.endpoint = Endpoint(
            [self.base_url],
            where=self.where,
            model=p.model,
            api_key_env=p.api_key_env,
            concurrency=p.concurrency,
            max_retries=p.max_retries,
            timeout=p.timeout,
            cache=self.cache,
            route="chat completions",
            refused_hint="model, temperature, reasoning_effort, max_completion_tokens",
        )
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
        return self.endpoint.redact(text)

    # ------------------------------------------------------------------ internals
    async def _run_all(self, prompts, parse, desc) -> list[Reply]:
        from tqdm import tqdm

        # Equal prompts (K samples often give the same answer) are asked once.
        distinct = list(dict.fromkeys(prompts))
        results: dict[str, Reply] = {}
        bar = tqdm(total=len(distinct), desc=f"{self.where} {desc}", unit="prompt", mininterval=2.0, leave=False)
        t0 = time.perf_counter()

        async def one(prompt: str) -> None:
            results[prompt] = await self._resolve(prompt, parse)
            bar.update()

        outcomes: list = []
        try:
            async with self.endpoint.session() as endpoint:
                # The first prompt that needs a call goes alone: a wrong URL, key or model name
                # then fails after one request, not after `concurrency` of them.
                first = next((q for q in distinct if self.cache.get(self.key(q, 0)[0]) is None), None)
                if first is not None:
                    await one(first)
                tasks = [asyncio.create_task(one(q)) for q in distinct if q not in results]
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                stopping = endpoint.stopping
        finally:
            bar.close()
            self.usage.seconds += time.perf_counter() - t0
        errors = [e for e in outcomes if isinstance(e, BaseException) and not isinstance(e, Stop)]
        if errors or stopping:
            saved = (
                f"{len(results)} of {len(distinct)} distinct prompts done; every reply received is cached, "
                "re-run to resume"
            )
            if errors:
                raise self.endpoint.error(f"{errors[0]} ({saved})") from errors[0]
            raise KeyboardInterrupt(self.redact(f"{stopping} ({saved})"))
        return [results[q] for q in prompts]

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
        key, request = self.key(prompt, attempt)
        reply, cached, waited = await self.endpoint.reply(key, request, "/chat/completions", request["body"], _read)
        self.usage.add(reply, cached=cached)
        self.usage.waited += waited
        return reply["reply"]


def _read(data: dict, url: str) -> dict:
    """A chat completion's text and usage; a body without them is malformed. Usage counts are
    read as ints (`count`): some servers send strings, or nothing."""
    try:
        text = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as e:
        raise Malformed(f"{type(e).__name__}: {e}") from None
    if text is not None and not isinstance(text, str):
        raise Malformed(f"TypeError: message content is {type(text).__name__}")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    details = usage.get("completion_tokens_details")
    details = details if isinstance(details, dict) else {}
    return {
        "reply": text,
        "prompt_tokens": count(usage.get("prompt_tokens")),
        "completion_tokens": count(usage.get("completion_tokens")),
        "reasoning_tokens": count(details.get("reasoning_tokens")),
    }
