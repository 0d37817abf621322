"""Tokenizer and tiny LlamaForCausalLM for the demo world, trained on the CPU.

The result is saved with `save_pretrained` (config, safetensors, tokenizer), so the rest of
the pipeline loads it through exactly the `AutoModelForCausalLM` / `AutoTokenizer` path that
loads Llama-3.1-8B.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from halludetect.core import numerics

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (as GPT-2 and Llama 3 use), so decode(encode(x)) == x for any text.

    BPE merges what is frequent: the names of well-known people become few tokens, names
    seen rarely stay in pieces, as entity names do in real vocabularies.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    # Like Llama's tokenizer, encoding adds BOS: the model always saw documents start with it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )


@dataclass
class TrainReport:
    n_docs: int
    n_tokens: int
    n_params: int
    epochs: int
    final_loss: float
    seconds: float


@numerics.fixed_threads(numerics.WORLD_THREADS)
def train_model(
    docs: list[str],
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    n_layers: int,
    n_heads: int,
    intermediate_size: int,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    log=print,
) -> tuple[LlamaForCausalLM, TrainReport]:
    """Next-token training on the corpus, each document wrapped in BOS ... EOS, on exactly
    `numerics.WORLD_THREADS` threads (the same splits of every sum on every machine)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    encoded = [
        [tokenizer.bos_token_id, *tokenizer.encode(d, add_special_tokens=False), tokenizer.eos_token_id] for d in docs
    ]
    max_len = max(map(len, encoded))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        max_position_embeddings=max(128, 2 ** math.ceil(math.log2(max_len * 2))),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    steps_per_epoch = math.ceil(len(encoded) / batch_size)
    total = steps_per_epoch * epochs
    warmup = max(1, total // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    # Sorting by length inside shuffled chunks keeps padding low without fixing batch order.
    t0 = time.perf_counter()
    model.train()
    loss_val = float("nan")
    for epoch in range(epochs):
        order = list(range(len(encoded)))
        rng.shuffle(order)
        chunks = [order[i : i + batch_size * 16] for i in range(0, len(order), batch_size * 16)]
        batches = []
        for chunk in chunks:
            chunk.sort(key=lambda i: len(encoded[i]))
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(batches)
        total_loss = 0.0
        for batch in batches:
            seqs = [encoded[i] for i in batch]
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for row, s in enumerate(seqs):  # right padding for training: positions start at 0
                ids[row, : len(s)] = torch.tensor(s)
                mask[row, : len(s)] = 1
            labels = ids.masked_fill(mask == 0, -100)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total_loss += loss.item()
        loss_val = total_loss / len(batches)
        log(f"world model epoch {epoch + 1}/{epochs}: loss {loss_val:.4f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    report = TrainReport(
        n_docs=len(docs),
        n_tokens=sum(map(len, encoded)),
        n_params=n_params,
        epochs=epochs,
        final_loss=loss_val,
        seconds=time.perf_counter() - t0,
    )
    return model, report
