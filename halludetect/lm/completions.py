"""Sampling through a serving engine: `generate.backend: completions`.

The stage stays a client: vLLM or SGLang serve the preset's model behind an OpenAI-compatible
completions endpoint (one URL, or a list of replicas), and this module asks them for what the
`hf` sampler (generation.py) computes itself, and writes the same generations table.

- Prompts go as token ids that our tokenizer made (prompt 1, in the chat template when the
  preset asks), so tokenisation is ours. An engine adds no BOS to token-id prompts; the
  `prompt_token_ids` it echoes are checked against what was sent.
- Every sampling setting is sent, neutral ones included (top_k -1, min_p 0, no penalties):
  vLLM fills unset ones from the model's generation_config.json (Llama 3.1's temperature 0.6,
  top_p 0.9), which would sample from another distribution than params.yaml says.
- K answers: by default one request per question with `n` = K and one `seed`, derived from
  (generate.seed, question id) by the hash the hf sampler seeds its streams with. vLLM gives
  each of the n answers its own generator seeded with seed + i, so answer i is a function of
  (generate.seed, question, i) and of the engine's logits. `endpoint.per_request: answer` sends
  K requests with n = 1 instead, each seeded by its answer's own key (for an engine whose `n`
  does not seed its answers apart).
- The ids of the sampled tokens come back through vLLM's `return_token_ids` (vLLM >= 0.10.2,
  SGLang) or `return_tokens_as_token_ids` ("token_id:N" tokens, older vLLM); both are asked for
  and either is read. An endpoint that gives neither is refused, naming the option.
- Log-probs: `logprobs` of the sampled tokens, which must be the raw model's (vLLM's default
  `--logprobs-mode raw_logprobs`): log-softmax of the logits, as the hf sampler records. The
  dump recomputes them from the local weights and fails on a mismatch
  (activations/logprob_check.py): another model, revision, tokenizer or logprob mode.
- Stops: the engine stops at EOS and at `generate.stop` (which saves its time), and the ids it
  returns are then cut exactly as the hf sampler cuts its own (`generation.trim_answer`):
  without EOS, without the token that completes a stop string; `text` is our decoding of the
  kept ids, and `finish_reason` ours (eos, stop, length).
- Empty answers are re-sampled as in hf: one request with n = 1 per empty answer, seeded by
  (generate.seed, question, sample, attempt), at most `generate.empty_retries` times.

Every reply is checked before anything of it is kept: as many choices as asked, each finished
("stop" or "length"), ids inside the tokenizer's vocabulary, one finite log-prob <= 0 per id, a
text that decodes from the ids, the prompt echoed as sent. A cut or unreadable body, too few
choices or an unfinished choice is asked again (at most `endpoint.max_retries` times); anything
else is an error naming the request and what was wrong, never a row with invented tokens or
log-probs.

Resumable as hf: finished units go to the UnitStore, and each reply is stored as it arrives in
`requests.sqlite` in the same progress directory (core/call_cache.py, with claims), so a killed
run re-sends only the requests that were in flight, and a resumed run writes what an
uninterrupted one would have. Both go when the stage's output is written: a forced re-run
samples again. Requests go to the replica with the fewest in flight, `endpoint.concurrency` per
replica (core/endpoint.py).

Reproducible: the answers are what the engine samples for these seeds. vLLM's samples for a
seed are reproducible when its logits are; its logits depend on the batch a request shares
unless batch invariance is on (`VLLM_BATCH_INVARIANT=1`), so two runs against a busy engine
may differ in a token near a tie. Within a run and across a resumed run, nothing is asked twice.
The hf and completions backends give different answers for the same seed: their random
streams differ (inverse-CDF draws from our streams against the engine's own sampler).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hashlib
import json
import logging
import math
import re
import sqlite3
import tempfile
import time
from pathlib import Path

import polars as pl
from tqdm import tqdm

from halludetect.config import GenerateParams
from halludetect.core.call_cache import CallCache
from halludetect.core.endpoint import ApiError, Endpoint, Malformed, Stop, count, settled
from halludetect.core.errors import UserError
from halludetect.core.unit_store import UnitStore
from halludetect.lm.engine_states import AnswerStates, StatesDir, StatesProblem, check_states, engine_dir
from halludetect.lm.generation import row_seed, trim_answer
from halludetect.lm.hf_models import ModelError
from halludetect.lm.parallel import Workers
from halludetect.lm.sampling import GENERATIONS_SCHEMA, sample

logger = logging.getLogger("halludetect")
WHERE = "generate.endpoint"
TOKEN_ID = re.compile(r"token_id:(\d+)")
REQUESTS_FILE = "requests.sqlite"
LOGPROB_SLACK = 1e-4  # a log-prob above 0 by more than float rounding is not a log-prob


def request_seed(seed: int, question_id: str, sample: int | str, attempt: int) -> int:
    """A request's seed, 30 bits: every engine takes it, and vLLM's seed + i for answer i stays in range."""
    return row_seed(seed, question_id, sample, attempt) >> 33


def _norm(text: str) -> str:
    return " ".join(text.split())


class CompletionsSampler:
    """Samples the units of one run through the endpoint of `params.endpoint`, serving `model`."""

    def __init__(
        self,
        tokenizer,
        params: GenerateParams,
        model: str,
        eos: list[int],
        cache: CallCache,
        states: AnswerStates | None = None,
        hidden: int | None = None,
    ):
        ep = params.endpoint
        self.tokenizer, self.params, self.eos, self.states, self.hidden = tokenizer, params, eos, states, hidden
        self.vocab = len(tokenizer)
        self.endpoint = Endpoint(
            ep.urls,
            where=WHERE,
            model=model,
            api_key_env=ep.api_key_env,
            concurrency=ep.concurrency,
            max_retries=ep.max_retries,
            timeout=ep.timeout,
            cache=cache,
            route="completions",
            refused_hint="model, and the sampling settings of generate",
        )
        # Every setting sent, neutral ones too: an engine fills unset ones from the model's
        # generation_config.json (see the module's docstring).
        self.sampling = {
            "model": model,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "min_p": 0.0,
            "repetition_penalty": params.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop": list(params.stop),
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
            "stream": False,
        }
        self.stats = {"requests_sent": 0, "replies_kept_from_before": 0, "replies_waited_for": 0}
        self.stats |= {"prompt_tokens": 0, "completion_tokens": 0}
        self._first: dict[str, list[dict]] = {}  # the rows of the question asked alone before the others

    # ------------------------------------------------------------------ checks before work
    async def preflight(self, longest_prompt: int) -> None:
        """Each replica serves the model and fits the longest request, by its /models; before any sampling."""
        ep, need = self.endpoint, longest_prompt + self.params.max_new_tokens
        for i, url in enumerate(ep.base_urls):
            if self.states is not None:
                await self._probe_states(i, url)
            listing = await ep.get(i, "/models")
            if listing is None:  # no /models route: nothing to check here
                continue
            served = {m.get("id"): m for m in listing.get("data") or [] if isinstance(m, dict)}
            if ep.model not in served:
                names = sorted(str(k) for k in served)
                close = difflib.get_close_matches(ep.model, names, n=1)
                raise ep.error(
                    f"{WHERE}: {url} does not serve '{ep.model}' (it serves {', '.join(names) or 'nothing'})"
                    f"{f'; did you mean {close[0]!r}?' if close else ''}. "
                    f"Set {WHERE}.model to the served name (null means the preset's path, what `vllm serve <path>` "
                    "calls it), or start the engine with --served-model-name"
                )
            limit = served[ep.model].get("max_model_len")
            if isinstance(limit, int) and need > limit:
                raise ModelError(
                    f"{WHERE}: {url} serves '{ep.model}' with max_model_len {limit}, but the longest prompt "
                    f"({longest_prompt} tokens) + generate.max_new_tokens ({self.params.max_new_tokens}) is {need}; "
                    "start the engine with a larger --max-model-len, or lower generate.max_new_tokens"
                )

    async def _probe_states(self, replica: int, url: str) -> None:
        """One greedy request of two tokens, no stop, asks replica `replica` (every try of it) for a
        states file of ours: a server without extraction, one that ignores the path we give or
        include_output_tokens, or one whose files generate cannot read or that hold other layers fails
        here, before any sampling (each named with its fix)."""
        engine, prompt = self.states.engine, self._probe_prompt
        if not self.hidden:
            raise UserError(f"{WHERE}.hidden_states: the model's config gives no hidden_size to check states against")
        name = engine.new()

        def read(data: dict, _url: str) -> dict:
            transfer = data.get("kv_transfer_params")
            named = transfer.get("hidden_states_path") if isinstance(transfer, dict) else None
            fix = (
                'start it as docs/models-and-generation.md ("States from the engine") says, with '
                '"allow_custom_save_path": true in kv_connector_extra_config, or drop generate.endpoint.hidden_states'
            )
            if named is None:
                raise self.endpoint.error(
                    f"{WHERE}: {url} names no states file for a request it ended itself (kv_transfer_params has no "
                    f"hidden_states_path): it was not started with hidden-state extraction; {fix}"
                )
            if named != engine.full(name):
                raise self.endpoint.error(
                    f"{WHERE}: {url} wrote the states file at another path than the request gave: it ignores "
                    f"hidden_states_path (vLLM does without allow_custom_save_path); {fix}"
                )
            choices = data.get("choices") if isinstance(data.get("choices"), list) else []
            ids = choices[0].get("token_ids") if choices and isinstance(choices[0], dict) else None
            try:
                limit = engine.max_bytes(len(prompt) + 2, len(self.states.layers), self.hidden)
                check_states(
                    engine.read(name, max_bytes=limit),
                    prompt=prompt,
                    output=ids if isinstance(ids, list) else [],
                    layers=len(self.states.layers),
                    hidden=self.hidden,
                )
            except StatesProblem as e:
                raise self.endpoint.error(
                    f"{WHERE}: {url} wrote a states file in {engine.path} that generate cannot use: {e}. It must "
                    "write where generate reads (the same machine, or a shared filesystem at the same path: "
                    f"{WHERE}.states_dir)"
                ) from None
            return {"reply": "", "prompt_tokens": None, "completion_tokens": None, "reasoning_tokens": None}

        body = {**self.sampling, "prompt": prompt, "n": 1, "seed": 0, "max_tokens": 2, "temperature": 0.0, "stop": []}
        body["kv_transfer_params"] = {"include_output_tokens": True, "hidden_states_path": engine.full(name)}
        try:
            await self.endpoint.call("/completions", body, read, replica=replica, pin=True)
        finally:
            engine.release(name)

    # ------------------------------------------------------------------ one request
    def _read(self, what: str, prompt: list[int], n: int, key: str, tries: list[str]):
        """The reader of one request's reply: checked choices, or Malformed (asked again) or ApiError;
        with `states`, the answer's hidden states are kept (lm/engine_states.py) before the reply is,
        read from the file the last of `tries` named."""
        ep = self.endpoint

        def read(data: dict, url: str) -> dict:
            def bad(message: str) -> ApiError:
                return ep.error(f"{WHERE}: the reply to {what} from {url} {message}")

            choices = data.get("choices")
            if not isinstance(choices, list):
                raise Malformed(f"the reply to {what} has no choices list")
            if len(choices) != n:
                raise Malformed(f"the reply to {what} has {len(choices)} choices for n = {n}")
            order = sorted(range(n), key=lambda i: choices[i].get("index", i) if isinstance(choices[i], dict) else i)
            out = [self._choice(choices[i], k, what, prompt, bad) for k, i in enumerate(order)]
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
            reply = {
                "reply": json.dumps(out),
                "prompt_tokens": count(usage.get("prompt_tokens")),
                "completion_tokens": count(usage.get("completion_tokens")),
                "reasoning_tokens": None,
            }
            if self.states is None:
                return reply
            return keep_states(data.get("kv_transfer_params"), out, reply, bad)

        async def keep_states(transfer, out: list[dict], reply: dict, bad) -> dict:
            # One answer per request (config checks per_request: answer). Its file is read on a thread:
            # vLLM writes it after the reply, and the other requests in flight go on meanwhile.
            try:
                await asyncio.to_thread(
                    self.states.take, tries[-1], transfer, prompt, out[0]["ids"], key,
                    hidden=self.hidden, max_tokens=self.params.max_new_tokens,
                )  # fmt: skip
            except StatesProblem as e:
                raise bad(str(e)) from None
            out[0]["states_key"] = key
            reply["reply"] = json.dumps(out)
            return reply

        return read

    def _choice(self, c, k: int, what: str, prompt: list[int], bad) -> dict:
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise Malformed(f"the reply to {what}: choice {k} has no text")
        finish = c.get("finish_reason")
        if finish not in ("stop", "length"):  # "abort", None: the engine did not finish it
            raise Malformed(f"the reply to {what}: choice {k} ended with finish_reason {finish!r}")
        lp = c.get("logprobs") if isinstance(c.get("logprobs"), dict) else {}
        tokens = lp.get("tokens")
        from_tokens = None
        if isinstance(tokens, list) and all(isinstance(t, str) and TOKEN_ID.fullmatch(t) for t in tokens):
            from_tokens = [int(TOKEN_ID.fullmatch(t)[1]) for t in tokens]
        ids = c.get("token_ids")
        if ids is None and from_tokens is None:
            raise bad(
                "has no token ids. The engine must return the ids of the sampled tokens: vLLM >= 0.10.2 does for "
                "`return_token_ids` (sent), an older vLLM with `vllm serve ... --return-tokens-as-token-ids`; "
                "SGLang for `return_token_ids` in a version whose completions take it"
            )
        if ids is None:
            ids = from_tokens
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad(f"has token ids that are not integers in choice {k}: {str(ids)[:80]}")
        if from_tokens is not None and from_tokens != ids:
            raise bad(f"gives two different id lists in choice {k} (token_ids and its logprobs' tokens)")
        if len(ids) > self.params.max_new_tokens:
            # The engine's ids count its tokens (EOS and a stop string's token included, as
            # max_tokens counts them). Kept, such answers would reach the dump, whose context
            # check would then blame the prompt.
            raise bad(
                f"has {len(ids)} tokens in choice {k}, for max_tokens {self.params.max_new_tokens} asked "
                "(generate.max_new_tokens): the engine ignores max_tokens, so its answers are not the ones "
                "params.yaml asks for; serve the model with vLLM or SGLang, or remove what drops max_tokens "
                "between the stage and the engine (a proxy, a gateway)"
            )
        lps = lp.get("token_logprobs")
        if ids and not isinstance(lps, list):
            raise bad(
                f"has no log-probs for the tokens of choice {k} (`logprobs: 1` was sent): the engine ignores "
                "`logprobs` on completions; use vLLM or SGLang"
            )
        lps = lps or []
        if len(lps) != len(ids):
            raise bad(f"has {len(lps)} log-probs for the {len(ids)} tokens of choice {k}")
        for t, x in enumerate(lps):
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x > LOGPROB_SLACK:
                raise bad(f"has log-prob {x!r} at token {t} of choice {k}: not a finite number <= 0")
        outside = [t for t in ids if not 0 <= t < self.vocab]
        if outside:
            raise bad(
                f"has token id {outside[0]} in choice {k}, outside the preset tokenizer's vocabulary of {self.vocab}: "
                "the engine serves another tokenizer or model than the preset"
            )
        echoed = c.get("prompt_token_ids")
        if echoed is not None and echoed != prompt:
            raise bad(
                "says the engine saw other prompt ids than were sent (it re-tokenised the prompt or added a "
                f"BOS): {len(echoed)} ids for the {len(prompt)} sent"
            )
        ours = _norm(self.tokenizer.decode(ids, skip_special_tokens=True))
        if not ours.startswith(_norm(c["text"])):
            raise bad(
                f"has a text that does not decode from its ids in choice {k}: the engine says {c['text']!r}, the "
                f"preset's tokenizer reads {ours!r}; the engine serves another tokenizer than the preset"
            )
        return {"ids": ids, "logprobs": [float(x) for x in lps], "text": c["text"], "finish": finish}

    async def ask(self, question: dict, n: int, seed: int, what: str) -> tuple[list[dict], float]:
        """The checked choices of one request, and its endpoint seconds (0 for a kept reply)."""
        body = {**self.sampling, "prompt": question["prompt"], "n": n, "seed": seed}
        if self.states is not None:  # vLLM's per-request option: the output tokens' states too
            body["kv_transfer_params"] = {"include_output_tokens": True}
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        tries: list[str] = []  # with states: the file each try names, a fresh one per try

        def body_of_try() -> dict:
            # A retried request must not share a file with the try it replaces, which the engine may still
            # be running: vLLM's worker takes each file's lock blocking (EHSC:283-290), and two requests
            # on one lock would stall it. The earlier try's file is left to the sweep.
            if tries:
                self.states.engine.release(tries[-1])
            tries.append(self.states.engine.new())
            path = self.states.engine.full(tries[-1])
            return {**body, "kv_transfer_params": {"include_output_tokens": True, "hidden_states_path": path}}

        what = f"{what} (question '{question['id']}', n = {n}, seed {seed})"
        read = self._read(what, question["prompt"], n, key, tries)
        sent = body if self.states is None else body_of_try
        try:
            reply, cached, waited = await self.endpoint.reply(key, {"body": body}, "/completions", sent, read)
        finally:
            if tries:  # read or not, the last try's file goes (one the engine writes later, the sweep removes)
                self.states.engine.release(tries[-1])
        if cached:
            self.stats["replies_kept_from_before" if not waited else "replies_waited_for"] += 1
        else:
            self.stats["requests_sent"] += 1
            self.stats["prompt_tokens"] += count(reply.get("prompt_tokens")) or 0
            self.stats["completion_tokens"] += count(reply.get("completion_tokens")) or 0
        return json.loads(reply["reply"]), 0.0 if cached else float(reply.get("latency_s") or 0.0)

    # ------------------------------------------------------------------ a question, a unit
    async def question(self, q: dict) -> list[dict]:
        """The K rows of one question, empty answers re-sampled."""
        if q["id"] in self._first:
            return self._first.pop(q["id"])
        p = self.params
        k = p.n_samples
        if p.endpoint.per_request == "question":
            choices, secs = await self.ask(q, k, request_seed(p.seed, q["id"], "all", 0), "the request")
            seconds = [secs / k] * k
        else:
            asked = await settled(
                *(self.ask(q, 1, request_seed(p.seed, q["id"], s, 0), f"answer {s}") for s in range(k))
            )
            choices, seconds = [c for cs, _ in asked for c in cs], [secs for _, secs in asked]
        rows = [self._trim(c) for c in choices]
        kept = list(choices)  # each answer's final choice (its states, with `states`)
        attempts = [1] * k
        for attempt in range(1, p.empty_retries + 1):
            empty = [s for s in range(k) if not rows[s][0].token_ids]
            if not empty:
                break
            again = await settled(
                *(
                    self.ask(q, 1, request_seed(p.seed, q["id"], s, attempt), f"answer {s}, attempt {attempt}")
                    for s in empty
                )
            )
            for s, (cs, secs) in zip(empty, again):
                if self.states is not None:
                    self.states.discard(kept[s]["states_key"])  # the empty answer's states go with it
                rows[s], kept[s] = self._trim(cs[0]), cs[0]
                attempts[s] += 1
                seconds[s] += secs
        if self.states is not None:
            for s, c in enumerate(kept):
                self.states.keep(q["id"], s, c["states_key"])
        return [
            {
                "question_id": q["id"],
                "split": q["split"],
                "sample_index": s,
                "text": t.text,
                "token_ids": t.token_ids,
                "token_logprobs": lps,
                "n_tokens": len(t.token_ids),
                "prompt_tokens": len(q["prompt"]),
                "finish_reason": t.finish_reason,
                "attempts": attempts[s],
                "seconds": seconds[s],
            }
            for s, (t, lps) in enumerate(rows)
        ]

    def _trim(self, choice: dict):
        """An engine's choice cut as the hf sampler cuts its own answers."""
        p = self.params
        t = trim_answer(self.tokenizer, choice["ids"], p.stop, p.max_new_tokens, self.eos)
        return t, choice["logprobs"][: len(t.token_ids)]

    async def unit(self, unit: list[dict]) -> pl.DataFrame:
        rows = await settled(*(self.question(q) for q in unit))  # a stop waits for the unit's requests in flight
        return pl.DataFrame([r for qs in rows for r in qs], schema=GENERATIONS_SCHEMA)

    async def run(self, units: list[list[dict]], todo: list[int], store: UnitStore | None, show: bool) -> dict:
        """Every unit of `todo`, each kept in `store` (or returned) as it completes."""
        results: dict[int, pl.DataFrame] = {}
        if not todo:  # every unit kept from before: the engine need not even be up
            return results
        outcomes: list = []
        bar = tqdm(total=len(todo), desc="generate[completions]", unit="unit", disable=not show)

        async def one(u: int) -> None:
            df = await self.unit(units[u])
            if store:
                store.put(u, df)
            results[u] = df
            bar.update()
            if self.states is not None:  # the files of requests given up on (time-outs, retries): bounded
                self.states.engine.sweep()

        try:
            async with self.endpoint.session() as ep:
                longest = max((len(q["prompt"]) for u in todo for q in units[u]), default=0)
                self._probe_prompt = units[todo[0]][0]["prompt"]
                await self.preflight(longest)
                # The first question goes alone: a misconfigured engine fails after one request.
                q = units[todo[0]][0]
                self._first[q["id"]] = await self.question(q)
                tasks = [asyncio.create_task(one(u)) for u in todo]
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                stopping = ep.stopping
        finally:
            bar.close()
        errors = [e for e in outcomes if isinstance(e, BaseException) and not isinstance(e, Stop)]
        if errors or stopping:
            kept = f"{len(results)} of {len(todo)} units done; every reply received is kept, re-run to resume"
            if errors:
                if not isinstance(errors[0], ApiError):
                    raise errors[0]
                raise self.endpoint.error(f"{errors[0]} ({kept})") from errors[0]
            raise KeyboardInterrupt(self.endpoint.redact(f"{stopping} ({kept})"))
        return results


def open_request_store(path: Path) -> CallCache:
    """The replies of an interrupted run (core/call_cache.py); a damaged file is discarded with a
    warning naming it (its requests are sent again), never trusted."""
    try:
        cache = CallCache(path)
        cache.db.execute("SELECT COUNT(*) FROM calls").fetchone()
        return cache
    except sqlite3.DatabaseError as e:
        logger.warning("discarding the damaged request store %s (%s); its requests will be sent again", path, e)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return CallCache(path)


class EngineSampler:
    """The `completions` sampler (lm/sampling.py's interface): the units through the endpoint of
    `generate.endpoint`, serving `model` (the served name); `config` is the model's (its context),
    `eos` its EOS ids. The replies of an interrupted run are in the store's directory
    (`requests.sqlite`), so a resumed run sends only what it has no reply for."""

    def __init__(
        self,
        tokenizer,
        config,
        *,
        model: str,
        eos: list[int],
        replicas: int = 1,
        states_dir: str | Path | None = None,
        states_layers: list[int] | None = None,
    ):
        self.tokenizer, self.context, self.model = tokenizer, config, model
        self.states = None if states_layers is None else AnswerStates(states_dir, states_layers)
        self.eos = sorted(set(eos) | ({tokenizer.eos_token_id} - {None}))
        self.device = f"completions endpoint serving '{model}' ({replicas} replica(s))"
        self.stats: dict | None = None

    def sample_units(
        self, units, todo, params: GenerateParams, store, workers: Workers, log
    ) -> dict[int, pl.DataFrame]:
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            where = store.dir if store else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            cache = open_request_store(where / REQUESTS_FILE)
            stack.callback(cache.close)
            if log and len(cache) and workers.main:
                log(f"{len(cache)} replies kept from an interrupted run: their requests are not sent again")
            if self.states is not None:
                if params.endpoint.per_request != "answer":  # a reply names one states file: one answer each
                    raise UserError(
                        "generate.endpoint.hidden_states asks one states file per answer: set "
                        "generate.endpoint.per_request: answer"
                    )
                if not len(cache) and len(todo) == len(units) and workers.main:
                    self.states.reset()  # a fresh run keeps no states of an earlier one
                self.states.dir.mkdir(parents=True, exist_ok=True)
                where_engine = engine_dir(self.states.dir, params.endpoint.states_dir, workers.rank)
                self.states.engine = stack.enter_context(StatesDir(where_engine, temporary=True))
            hidden = getattr(getattr(self.context, "get_text_config", lambda: self.context)(), "hidden_size", None)
            sampler = CompletionsSampler(self.tokenizer, params, self.model, self.eos, cache, self.states, hidden)
            try:
                return asyncio.run(sampler.run(units, todo, store, show=workers.main))
            finally:
                self.stats = {
                    "replicas": len(params.endpoint.urls),
                    "wall_seconds": round(time.perf_counter() - t0, 3),
                    **sampler.stats,
                    **({"engine_files_swept": self.states.engine.removed} if self.states else {}),
                }


def generate_completions(
    tokenizer,
    config,
    questions: pl.DataFrame,
    params: GenerateParams,
    *,
    model: str,
    eos: list[int],
    chat_template: bool = False,
    store: UnitStore | None = None,
    workers: Workers | None = None,
    log=None,
    states_dir: str | Path | None = None,
) -> tuple[pl.DataFrame | None, dict]:
    """`generation.generate`'s contract through the endpoint of `params.endpoint` (`sampling.sample`
    with the `completions` sampler): one row per (question, sample) in the questions' order, the
    same schema; `model` is the served name, `config` the model's config (for its context), `eos`
    its EOS ids; with `params.endpoint.hidden_states`, each answer's engine states are kept in
    `states_dir` (lm/engine_states.py). Also returns the run's request counts. With several `workers`, process 0 returns
    the merged frame, the others None."""
    sampler = EngineSampler(
        tokenizer,
        config,
        model=model,
        eos=eos,
        replicas=len(params.endpoint.urls),
        states_dir=states_dir,
        states_layers=params.endpoint.hidden_states,
    )
    df = sample(sampler, questions, params, chat_template=chat_template, store=store, workers=workers, log=log)
    return df, sampler.stats
