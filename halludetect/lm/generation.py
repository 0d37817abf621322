"""The `hf` sampler: K answers per question with transformers, batched, one random stream per answer.

Batching. A work unit of `batch_size` questions (sampling.py: the units, resume, parallel
processes, the questions' order) is one `model.generate` call over batch_size x K left-padded
rows. Because a unit's rows and padding never depend on how many processes ran or where a run
was interrupted, every way of running gives the same bytes.

Randomness. Each row, (question, sample, attempt), draws from its own stream, seeded from a
hash of (generate.seed, question id, sample index, attempt), and only from it: its answer
does not depend on its batch-mates or on the batch size, up to the float noise of padding.
We sample in our own logits processor (`RowSampler`): temperature, top-k, top-p and the
repetition penalty are transformers' own warpers, then inverse-CDF sampling with the row's
uniform for this step. transformers runs a custom processor *before* its own warpers, so we
run generate in greedy mode and hand it a one-hot choice, which keeps its caching, EOS and
stop-string handling.

Log-probabilities. `token_logprobs` are log-softmax of the model's *raw* logits (temperature
1, no penalty) at each answer token: P(A | q) as the semantic-probability formula needs,
not the warped sampling distribution. They are gathered one step at a time, so memory stays
O(rows x vocab), not O(rows x steps x vocab) as with `output_logits`.

Token bookkeeping. `token_ids` are the answer tokens only, without EOS and without the stop
sequence, and `text == tokenizer.decode(token_ids).strip()`, so the dump can rebuild the exact
model input as prompt ids + token_ids.

Empty answers (the model stopped at once) are re-sampled with fresh streams (attempt 1, 2,
...) at most `empty_retries` times; `attempts` records how many draws an answer took. One
still empty is kept and later excluded from the bags, counted.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import polars as pl
import torch
from tqdm import tqdm
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from halludetect.config import GenerateParams
from halludetect.core.unit_store import UnitStore
from halludetect.lm.hf_models import cache_kwarg, eos_ids, input_device
from halludetect.lm.model_inputs import pad_ids
from halludetect.lm.parallel import Workers
from halludetect.lm.sampling import GENERATIONS_SCHEMA, sample


# ------------------------------------------------------------------------ sampling
def row_seed(seed: int, question_id: str, sample_index: int, attempt: int) -> int:
    key = f"{seed}\x1f{question_id}\x1f{sample_index}\x1f{attempt}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1  # < 2**63


def seed_uniforms(seeds: list[int], steps: int) -> torch.Tensor:
    """[rows, steps] float64 uniforms in [0, 1): the draws of a stream seeded with each seed."""
    out = torch.empty(len(seeds), steps, dtype=torch.float64)
    g = torch.Generator()
    for r, seed in enumerate(seeds):
        g.manual_seed(seed)
        out[r] = torch.rand(steps, generator=g, dtype=torch.float64)
    return out


def row_uniforms(keys: list[tuple], steps: int) -> torch.Tensor:
    """[rows, steps] float64 uniforms in [0, 1): row r's draw for each generation step."""
    return seed_uniforms([row_seed(*key) for key in keys], steps)


class RowSampler(LogitsProcessor):
    """Warp, sample each row from its own uniforms, record raw log-probs, return a one-hot choice."""

    def __init__(
        self, uniforms: torch.Tensor, prompt_width: int, params: GenerateParams, greedy: bool, processed: bool = False
    ):
        self.u = uniforms  # [R, steps]
        self.width = prompt_width
        self.greedy = greedy
        self.logprobs = torch.zeros(uniforms.shape, dtype=torch.float32, device=uniforms.device)  # [R, steps]
        # With `processed`, also the log-probs of the warped distribution (what an engine serving
        # "processed" log-probs returns: the fake engine's wrong mode, testing/fake_vllm.py).
        self.processed = torch.zeros_like(self.logprobs) if processed else None
        warpers = []
        if params.repetition_penalty != 1.0:
            warpers.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if not greedy:
            if params.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(params.top_p))
        self.warp = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        logp = torch.log_softmax(scores.float(), dim=-1)  # [R, V] the raw model distribution
        warped = self.warp(input_ids, scores)  # [R, V]
        if self.greedy:
            token = warped.argmax(dim=-1)  # [R]
        else:
            cdf = torch.softmax(warped.double(), dim=-1).cumsum(dim=-1)  # [R, V]
            target = self.u[:, step : step + 1] * cdf[:, -1:]  # [R, 1], scaled so rounding never overshoots
            # right=True: the first index whose cdf exceeds the target, so a token of
            # probability 0 (a flat step of the cdf) can never be picked.
            token = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(scores.shape[1] - 1)
        self.logprobs[:, step] = logp.gather(1, token[:, None]).squeeze(1)
        if self.processed is not None:
            self.processed[:, step] = torch.log_softmax(warped.float(), -1).gather(1, token[:, None]).squeeze(1)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, token[:, None], 0.0)


@dataclass
class Trimmed:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length"


def trim_answer(
    tokenizer, ids: list[int], stop: list[str], max_new_tokens: int, eos: list[int] | None = None
) -> Trimmed:
    """Cut at EOS (or padding) or at the first stop sequence, on a token boundary.

    The token that completes a stop sequence is dropped with everything after it; if it also
    carried answer characters (BPE may merge ".\\n"), they go too, so that text, ids and
    log-probabilities always describe the same tokens.
    """
    ends = set(eos or []) | {tokenizer.eos_token_id, tokenizer.pad_token_id}
    reason = "length"
    for i, t in enumerate(ids):
        if t in ends:
            ids, reason = ids[:i], "eos"
            break
    if stop and any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
        # The first token index at which the decoded prefix contains a stop sequence (the
        # whole answer is decoded first: most answers end at EOS and need no search).
        for k in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
            if any(s in prefix for s in stop):
                ids, reason = ids[: k - 1], "stop"
                break
    if reason == "length" and len(ids) < max_new_tokens:
        reason = "eos"  # generation ended early without a token we saw: treat as finished
    return Trimmed(ids, tokenizer.decode(ids, skip_special_tokens=True).strip(), reason)


def _shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, repeats: int):
    """The KV cache of each prompt's first W-1 tokens, computed once and copied for its `repeats` rows.

    K samples of one question share their prompt, so computing it once saves (K-1)/K of the
    prefill; `generate` then starts from the cache and runs only the last prompt token.
    Positions follow the attention mask exactly as `generate` computes them for left padding.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, W]
    model(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        **{cache_kwarg(model): cache},
    )
    cache.batch_repeat_interleave(repeats)
    return cache


@torch.no_grad()
def generate_raw(
    model,
    tokenizer,
    prompts: list[list[int]],
    seeds: list[int],
    params: GenerateParams,
    eos: list[int],
    greedy: bool = False,
    repeats: int = 1,
    processed: bool = False,
    streamer=None,
    stopping=None,
) -> tuple[list[list[int]], RowSampler, float]:
    """One `generate` call over rows (prompt ids, random-stream seed): every row's new ids as
    generate returns them (EOS or the stop string's last token, then padding), the sampler (its
    raw log-probs [R, steps]) and the wall time. With `repeats` > 1, rows come in runs of
    `repeats` sharing one prompt, whose prefill is then computed once. `streamer` (transformers'
    BaseStreamer: the prompts [R, W], then each step's tokens [R]) and `stopping` (a
    StoppingCriteria ending rows early: a served request whose client left) are `halludetect
    serve`'s; neither changes what a row samples."""
    device = input_device(model)
    t0 = time.perf_counter()
    kw = {}
    if repeats > 1 and len(prompts[0]) > 1:
        unique_ids, unique_mask = pad_ids(prompts[::repeats], tokenizer.pad_token_id, left=True)
        kw[cache_kwarg(model)] = _shared_prefill(model, unique_ids.to(device), unique_mask.to(device), repeats)
        ids, mask = unique_ids.repeat_interleave(repeats, 0), unique_mask.repeat_interleave(repeats, 0)
    else:
        ids, mask = pad_ids(prompts, tokenizer.pad_token_id, left=True)
    width = ids.shape[1]
    sampler = RowSampler(seed_uniforms(seeds, params.max_new_tokens).to(device), width, params, greedy, processed)
    # A complete config: values left unset would be filled from the model's own generation
    # config (Llama 3.1 ships do_sample=True, temperature 0.6, top_p 0.9). The warpers' values
    # are transformers' neutral defaults, which it does not warn about in greedy mode; the
    # real ones live in RowSampler.
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=False,
        num_beams=1,
        temperature=1.0,
        top_p=1.0,
        top_k=50,
        repetition_penalty=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        stop_strings=params.stop or None,
        use_cache=True,
    )
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        generation_config=config,
        logits_processor=LogitsProcessorList([sampler]),
        tokenizer=tokenizer,
        streamer=streamer,
        stopping_criteria=StoppingCriteriaList([stopping]) if stopping is not None else None,
        **kw,
    )
    return out[:, width:].cpu().tolist(), sampler, time.perf_counter() - t0


def sample_rows(
    model,
    tokenizer,
    prompts: list[list[int]],
    keys: list[tuple],
    params: GenerateParams,
    eos: list[int],
    greedy: bool = False,
    repeats: int = 1,
    streamer=None,
    stopping=None,
) -> tuple[list[Trimmed], list[list[float]], float]:
    """Rows (prompt ids, random-stream key) sampled in one `generate` call: trimmed answers, their
    raw token log-probs and the wall time (`generate_raw`, which takes `streamer` and `stopping`)."""
    seeds = [row_seed(*key) for key in keys]
    gen, sampler, seconds = generate_raw(
        model, tokenizer, prompts, seeds, params, eos, greedy, repeats, streamer=streamer, stopping=stopping
    )
    logprobs = sampler.logprobs.cpu()
    trimmed = [trim_answer(tokenizer, g, params.stop, params.max_new_tokens, eos) for g in gen]
    lps = [logprobs[r, : len(t.token_ids)].double().tolist() for r, t in enumerate(trimmed)]
    return trimmed, lps, seconds


def generate_unit(
    model, tokenizer, unit: list[dict], params: GenerateParams, eos: list[int], greedy: bool = False
) -> pl.DataFrame:
    """All K answers of a unit's questions (dicts with id, split, prompt), empty ones re-sampled."""
    k = 1 if greedy else params.n_samples
    rows = [(q, s) for q in unit for s in range(k)]
    prompts = [q["prompt"] for q, _ in rows]
    trimmed, lps, seconds = sample_rows(
        model, tokenizer, prompts, [(params.seed, q["id"], s, 0) for q, s in rows], params, eos, greedy, repeats=k
    )
    per_row = [seconds / len(rows)] * len(rows)
    attempts = [1] * len(rows)
    for attempt in range(1, 0 if greedy else params.empty_retries + 1):  # greedy would repeat itself
        empty = [r for r, t in enumerate(trimmed) if not t.token_ids]
        if not empty:
            break
        again, again_lps, secs = sample_rows(
            model,
            tokenizer,
            [prompts[r] for r in empty],
            [(params.seed, rows[r][0]["id"], rows[r][1], attempt) for r in empty],
            params,
            eos,
        )
        for r, t, lp in zip(empty, again, again_lps):
            trimmed[r], lps[r] = t, lp
            attempts[r] += 1
            per_row[r] += secs / len(empty)
    return pl.DataFrame(
        [
            {
                "question_id": q["id"],
                "split": q["split"],
                "sample_index": s,
                "text": t.text,
                "token_ids": t.token_ids,
                "token_logprobs": lp,
                "n_tokens": len(t.token_ids),
                "prompt_tokens": len(q["prompt"]),
                "finish_reason": t.finish_reason,
                "attempts": a,
                "seconds": sec,
            }
            for (q, s), t, lp, a, sec in zip(rows, trimmed, lps, attempts, per_row)
        ],
        schema=GENERATIONS_SCHEMA,
    )


class HFSampler:
    """The `hf` sampler (lm/sampling.py's interface): `model` samples every unit in this process,
    `greedy` decodes the single most likely answer instead (the world's own metrics use it)."""

    def __init__(self, model, tokenizer, greedy: bool = False, device: str | None = None):
        self.model, self.tokenizer, self.greedy = model, tokenizer, greedy
        self.context = model
        self.eos = eos_ids(model, tokenizer)
        self.device = device or str(model.device)
        self.stats = None

    def sample_units(
        self, units, todo, params: GenerateParams, store, workers: Workers, log
    ) -> dict[int, pl.DataFrame]:
        results: dict[int, pl.DataFrame] = {}
        for u in tqdm(todo, desc=f"generate[{workers.rank}]", unit="unit", disable=not workers.main):
            df = generate_unit(self.model, self.tokenizer, units[u], params, self.eos, self.greedy)
            if store:
                store.put(u, df)
            results[u] = df
        return results


def generate(
    model,
    tokenizer,
    questions: pl.DataFrame,
    params: GenerateParams,
    *,
    chat_template: bool = False,
    greedy: bool = False,
    store: UnitStore | None = None,
    workers: Workers | None = None,
    log=None,
) -> pl.DataFrame | None:
    """Sample `params.n_samples` answers for every question with `model`; one row per (question,
    sample), in the questions' order (`sampling.sample` with the `hf` sampler). `greedy` decodes the
    single most likely answer instead. With a `store`, finished units are kept on disk and skipped on
    a re-run; with several `workers`, process 0 returns the merged frame, the others None."""
    sampler = HFSampler(model, tokenizer, greedy)
    return sample(sampler, questions, params, chat_template=chat_template, store=store, workers=workers, log=log)
