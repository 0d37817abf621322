"""Batched sampling versus the peers' way, on the world model, same questions and K.

Baseline: one question per `generate` call with `output_hidden_states=True` (how the
paper's and HaMI's code sample and collect states), K samples per call. Ours: `generate`
over `batch_size` questions x K rows, hidden states left to the dump. Both sample
temperature 0.5, at most 32 new tokens, stop at a newline. Runs alternate (ours, baseline,
ours, ...) and each side reports its median, so a slow patch of the machine hits both.

    python -m bench.generation [--questions 128] [--repeats 3]
"""

from __future__ import annotations

import argparse

import polars as pl
import torch

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, median, need, setup_threads, timed
from halludetect.config import GenerateParams, ModelPreset
from halludetect.lm.generation import encode_prompt, generate
from halludetect.lm.hf_models import load_model, load_tokenizer
from halludetect.qa.datasets import read_questions


@torch.no_grad()
def peers_way(model, tokenizer, questions: pl.DataFrame, params: GenerateParams) -> int:
    n = 0
    for q in questions["question"]:
        ids = torch.tensor([encode_prompt(tokenizer, q, False)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=params.temperature,
            top_k=None,
            top_p=None,
            num_return_sequences=params.n_samples,
            max_new_tokens=params.max_new_tokens,
            stop_strings=params.stop,
            tokenizer=tokenizer,
            pad_token_id=tokenizer.pad_token_id,
            output_hidden_states=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
        n += len(out.sequences)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--questions", type=int, default=128, help="two units of 64 at the default batch size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    need(WORLD_MODEL, WORLD_QUESTIONS)
    threads = setup_threads()
    preset = ModelPreset(path=str(WORLD_MODEL), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    questions = read_questions(WORLD_QUESTIONS).head(args.questions)
    params = GenerateParams(n_samples=5, temperature=0.5, max_new_tokens=32, stop=["\n"], batch_size=args.batch_size)
    samples = questions.height * params.n_samples

    generate(model, tokenizer, questions.head(4), params)  # warm-up: first-call costs out of the timings
    peers_way(model, tokenizer, questions.head(2), params)
    ours, base = [], []
    for _ in range(args.repeats):
        seconds, df = timed(generate, model, tokenizer, questions, params)
        assert df.height == samples
        ours.append(samples / seconds)
        seconds, n = timed(peers_way, model, tokenizer, questions, params)
        assert n == samples
        base.append(samples / seconds)
    emit(
        {
            "benchmark": "generation",
            "model": "world",
            "questions": questions.height,
            "k": params.n_samples,
            "max_new_tokens": params.max_new_tokens,
            "batch_size": params.batch_size,
            "threads": threads,
            "repeats": args.repeats,
            "samples_per_s": round(median(ours), 1),
            "baseline_samples_per_s": round(median(base), 1),
            "ratio": round(median(ours) / median(base), 2),
        }
    )


if __name__ == "__main__":
    main()
