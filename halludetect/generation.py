"""Sampling K answers per question, with the model's own token log-probabilities.

Questions are batched with left padding and expanded K times (`num_return_sequences`).
`token_logprobs` are log-softmax of the model's *raw* logits (temperature 1) at each answer
token: the sequence likelihood P(A | q) that the semantic-probability formula uses, not the
temperature-warped sampling distribution.

Token bookkeeping: `token_ids` are the answer tokens only, without EOS and without the stop
sequence, and `text == tokenizer.decode(token_ids)`, so the activation dump can rebuild the
exact model input as prompt ids + token_ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import polars as pl
import torch
from tqdm import tqdm

from halludetect.config import GenerateParams
from halludetect.modeling import input_device
from halludetect.prompts import generation_prompt

GENERATIONS_SCHEMA = {
    "question_id": pl.String,
    "split": pl.String,
    "sample_index": pl.Int32,
    "text": pl.String,
    "token_ids": pl.List(pl.Int64),
    "token_logprobs": pl.List(pl.Float64),
    "n_tokens": pl.Int32,
    "finish_reason": pl.String,
    "seconds": pl.Float64,
}


def encode_prompt(tokenizer, question: str, chat_template: bool) -> list[int]:
    """Prompt 1 as token ids, with the special tokens the model expects (BOS for Llama)."""
    text = generation_prompt(question)
    if chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
    return tokenizer(text, add_special_tokens=True)["input_ids"]


@dataclass
class Trimmed:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length"


def trim_answer(tokenizer, ids: list[int], stop: list[str], max_new_tokens: int) -> Trimmed:
    """Cut at EOS or at the first stop sequence, on a token boundary.

    The token that completes a stop sequence is dropped with everything after it; if it also
    carried answer characters (BPE may merge ".\\n"), they go too, so that text, ids and
    log-probabilities always describe the same tokens.
    """
    eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.pad_token_id}
    reason = "length"
    for i, t in enumerate(ids):
        if t in eos_ids:
            ids, reason = ids[:i], "eos"
            break
    if stop:
        # The first token index at which the decoded prefix contains a stop sequence.
        for k in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
            if any(s in prefix for s in stop):
                ids, reason = ids[: k - 1], "stop"
                break
    if reason == "length" and len(ids) < max_new_tokens:
        reason = "eos"  # generation ended early without a token we saw: treat as finished
    return Trimmed(ids, tokenizer.decode(ids, skip_special_tokens=True).strip(), reason)


@torch.no_grad()
def generate(model, tokenizer, questions: pl.DataFrame, params: GenerateParams, chat_template: bool = False,
             greedy: bool = False):
    """Sample `params.n_samples` answers for every question; one row per (question, sample).

    `greedy` decodes the single most likely answer instead (the world's own metrics use it).
    """
    rows = []
    records = questions.select("id", "question", "split").to_dicts()
    device = input_device(model)
    for start in tqdm(range(0, len(records), params.batch_size), desc="generate", unit="batch"):
        batch = records[start : start + params.batch_size]
        prompts = [encode_prompt(tokenizer, r["question"], chat_template) for r in batch]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        # One seed per batch, derived from the params seed: the same params give the same samples.
        torch.manual_seed(params.seed * 1_000_003 + start)
        sampling = (
            {"do_sample": False, "num_return_sequences": 1}
            if greedy
            else {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                  "top_k": params.top_k, "num_return_sequences": params.n_samples}
        )
        k = sampling["num_return_sequences"]
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **sampling,
            max_new_tokens=params.max_new_tokens,
            stop_strings=params.stop or None,
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        seconds = (time.perf_counter() - t0) / len(out.sequences)
        gen = out.sequences[:, width:].cpu()  # [B*K, new]
        # log p(token) under the raw model distribution, for every generated position.
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B*K, new, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        for j in range(len(gen)):
            rec = batch[j // k]
            t = trim_answer(tokenizer, gen[j].tolist(), params.stop, params.max_new_tokens)
            n = len(t.token_ids)
            rows.append(
                {
                    "question_id": rec["id"],
                    "split": rec["split"],
                    "sample_index": j % k,
                    "text": t.text,
                    "token_ids": t.token_ids,
                    "token_logprobs": logprobs[j, :n].double().tolist(),
                    "n_tokens": n,
                    "finish_reason": t.finish_reason,
                    "seconds": seconds,
                }
            )
    return pl.DataFrame(rows, schema=GENERATIONS_SCHEMA)
