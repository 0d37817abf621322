"""Batched sampling versus the peers' way, and the two backends side by side, on the world model,
same questions and K.

Baseline: one question per `generate` call with `output_hidden_states=True` (how the
paper's and HaMI's code sample and collect states), K samples per call. Ours (`hf`):
`generate` over `batch_size` questions x K rows, hidden states left to the dump. Both sample
temperature 0.5, at most 32 new tokens, stop at a newline. Runs alternate (ours, baseline,
ours, ...) and each side reports its median, so a slow patch of the machine hits both.

`completions`: the same questions and settings through `generate.backend: completions`
against the fake vLLM engine (halludetect/testing/fake_vllm.py) serving the same model on the
same CPU in its own process, merging up to `--engine-batch` waiting requests into one batched
`generate` as an engine's continuous batching does; once per `--concurrency` value (requests
in flight). It measures the client's overhead and what concurrency buys against a batching
engine on this CPU, not vLLM's speed: the engine here is transformers on 2 shared cores.

    python -m bench.generation [--questions 128] [--repeats 3] [--concurrency 1 4 16 64] [--engine-batch 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import torch

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, median, need, setup_threads, timed
from halludetect.config import GenerateParams, ModelPreset
from halludetect.lm.completions import generate_completions
from halludetect.lm.generation import generate
from halludetect.lm.hf_models import load_config, load_generation_eos, load_model, load_tokenizer
from halludetect.lm.model_inputs import encode_prompt
from halludetect.qa.questions import read_questions

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def engine(model: Path, batch: int, threads: int):
    """The fake vLLM engine in its own process, as a real engine runs beside the stage."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "halludetect.testing.fake_vllm", "--model", str(model), "--port", "0"]
        + ["--batch", str(batch), "--threads", str(threads)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc.stdout.readline().split()[1]  # "serving http://127.0.0.1:PORT/v1 ..."
    finally:
        proc.terminate()
        proc.wait()


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
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="completions: in flight")
    ap.add_argument("--engine-batch", type=int, default=64, help="requests the fake engine merges into one generate")
    ap.add_argument("--model", type=Path, default=WORLD_MODEL)
    ap.add_argument("--questions-file", type=Path, default=WORLD_QUESTIONS)
    args = ap.parse_args()
    need(args.model, args.questions_file)
    threads = setup_threads()
    preset = ModelPreset(path=str(args.model), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    config = load_config(preset)
    eos = load_generation_eos(preset, config)
    questions = read_questions(args.questions_file).head(args.questions)
    params = GenerateParams(n_samples=5, temperature=0.5, max_new_tokens=32, stop=["\n"], batch_size=args.batch_size)
    samples = questions.height * params.n_samples

    generate(model, tokenizer, questions.head(4), params)  # warm-up: first-call costs out of the timings
    peers_way(model, tokenizer, questions.head(2), params)
    ours, base = [], []
    served: dict[int, list[float]] = {c: [] for c in args.concurrency}
    with engine(args.model, args.engine_batch, threads) as url:
        for _ in range(args.repeats):
            seconds, df = timed(generate, model, tokenizer, questions, params)
            assert df.height == samples
            ours.append(samples / seconds)
            seconds, n = timed(peers_way, model, tokenizer, questions, params)
            assert n == samples
            base.append(samples / seconds)
            for c in args.concurrency:
                endpoint = {"base_url": url, "concurrency": c}
                served_params = GenerateParams.model_validate(
                    params.model_dump() | {"backend": "completions", "endpoint": endpoint}
                )
                seconds, (df, _) = timed(
                    generate_completions, tokenizer, config, questions, served_params, model=str(args.model), eos=eos
                )
                assert df.height == samples
                served[c].append(samples / seconds)
    best = max(args.concurrency, key=lambda c: median(served[c]))
    emit(
        {
            "benchmark": "generation",
            "model": str(args.model),
            "questions": questions.height,
            "k": params.n_samples,
            "max_new_tokens": params.max_new_tokens,
            "batch_size": params.batch_size,
            "threads": threads,
            "repeats": args.repeats,
            "samples_per_s": round(median(ours), 1),
            "baseline_samples_per_s": round(median(base), 1),
            "ratio": round(median(ours) / median(base), 2),
            "completions_engine": f"fake vLLM (transformers, float32, CPU, batch {args.engine_batch}, own process)",
            "completions_samples_per_s": {str(c): round(median(v), 1) for c, v in served.items()},
            "completions_best_concurrency": best,
            "completions_vs_hf": round(median(served[best]) / median(ours), 2),
        }
    )


if __name__ == "__main__":
    main()
