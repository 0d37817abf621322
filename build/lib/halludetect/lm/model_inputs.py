"""Questions and answers as model inputs: prompt ids, padded batches, and the context check.

Shared by generation (sampling) and the dump (teacher-forced pass), so that both feed the model
exactly the same ids, and an edit to the sampler never re-runs the dump.
"""

from __future__ import annotations

import torch

from halludetect.lm.hf_models import ModelError, context_length
from halludetect.prompts import GENERATION, generation_prompt


def encode_prompt(tokenizer, question: str, chat_template: bool, template: str = GENERATION) -> list[int]:
    """Prompt 1 (or another `template` with a {question} field, e.g. a detector bundle's) as token ids,
    with the special tokens the model expects (BOS for Llama)."""
    text = generation_prompt(question, template)
    if chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def check_context(model, prompt_lengths: dict[str, int], extra_tokens: int, what: str) -> None:
    """Fail before any work if a prompt plus `extra_tokens` does not fit the model's context.
    `model` is a loaded model or its config (a sampler that only talks to an endpoint loads no weights)."""
    limit = context_length(getattr(model, "config", model))
    if limit is None:
        return
    over = {q: n for q, n in prompt_lengths.items() if n + extra_tokens > limit}
    if over:
        worst = max(over, key=over.get)
        raise ModelError(
            f"{len(over)} question(s) do not fit the model's context of {limit} tokens with {what} "
            f"(longest: question '{worst}', {over[worst]} prompt tokens + {extra_tokens}). "
            "Lower generate.max_new_tokens, or drop such questions from the dataset"
        )


def pad_ids(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as ids [R, W] and attention mask [R, W].

    Left padding for generation (every row's next token goes at column W); right padding for
    a plain forward pass (real tokens keep the positions they had unpadded).
    """
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [R, W]
    mask = torch.zeros_like(ids)
    for r, seq in enumerate(seqs):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[r, cols] = torch.tensor(seq)
        mask[r, cols] = 1
    return ids, mask
