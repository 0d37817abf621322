"""What the dump's log-prob check sees (halludetect/activations/logprob_check.py): the differences
between the generations' log-probs and the teacher-forced ones, for samplers that serve the right
model with float noise and for ones that do not.

Each row samples the same questions (K 5, temperature 0.5, 32 new tokens) one way and runs the
dump's check over the answers with both tolerances off, reporting the mean |difference| over
every token, the worst answer's mean and the worst token: hf in float32 and bfloat16, the fake
vLLM engine (halludetect/testing/fake_vllm.py) in float32 and bfloat16, with processed log-probs,
and with its weights perturbed by Gaussian noise of a share of each tensor's standard deviation
(another revision). The dump runs in float32 unless the row says bf16.

    python -m bench.logprob_check [--model data/world/model] [--questions-file data/questions/world.parquet]
                                  [--questions 180]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import polars as pl

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, need, setup_threads
from halludetect.activations.capture import dump
from halludetect.activations.logprob_check import LogprobCheck
from halludetect.config import GenerateParams, ModelPreset
from halludetect.lm.completions import generate_completions
from halludetect.lm.generation import generate
from halludetect.lm.hf_models import load_config, load_generation_eos, load_model, load_tokenizer
from halludetect.qa.questions import read_questions
from halludetect.testing.fake_vllm import FakeVLLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=WORLD_MODEL)
    ap.add_argument("--questions-file", type=Path, default=WORLD_QUESTIONS)
    ap.add_argument("--questions", type=int, default=180)
    args = ap.parse_args()
    need(args.model, args.questions_file)
    setup_threads()
    path = str(args.model)
    questions = read_questions(args.questions_file).head(args.questions)
    params = GenerateParams(n_samples=5, temperature=0.5, max_new_tokens=32, stop=["\n", "Question:"])
    preset = ModelPreset(path=path, dtype="float32")
    tokenizer, config = load_tokenizer(preset), load_config(preset)
    eos = load_generation_eos(preset, config)
    dumpers = {d: load_model(ModelPreset(path=path, dtype=d), "cpu") for d in ("float32", "bfloat16")}

    def differences(gens: pl.DataFrame, dump_dtype: str = "float32") -> dict:
        check = LogprobCheck("bench", None, None)
        with tempfile.TemporaryDirectory() as d:
            kept = gens.filter(pl.col("n_tokens") > 0)
            dump(dumpers[dump_dtype], tokenizer, questions, kept, Path(d), [1], positions="predicting",
                 dtype="float32", batch_size=64, attrs={}, check=check, log=lambda *a: None)  # fmt: skip
        return {
            "tokens": check.tokens,
            "mean": round(check.mean, 5),
            "worst_answer_mean": round(check.worst_answer[0], 5),
            "worst_token": round(check.worst[0], 5),
        }

    def served(**engine) -> pl.DataFrame:
        with FakeVLLM(args.model, **engine) as srv:
            p = GenerateParams.model_validate(
                params.model_dump() | {"backend": "completions", "endpoint": {"base_url": srv.url, "concurrency": 8}}
            )
            return generate_completions(tokenizer, config, questions, p, model=path, eos=eos)[0]

    rows = {
        "hf float32": differences(generate(dumpers["float32"], tokenizer, questions, params)),
        "hf bfloat16, dump bf16": differences(generate(dumpers["bfloat16"], tokenizer, questions, params), "bfloat16"),
        "engine float32": differences(served()),
    }
    bf16 = served(dtype="bfloat16")
    rows["engine bfloat16"] = differences(bf16)
    rows["engine bfloat16, dump bf16"] = differences(bf16, "bfloat16")
    rows["engine processed log-probs"] = differences(served(logprobs_mode="processed_logprobs"))
    for noise in (0.02, 0.05, 0.1, 0.3):
        rows[f"engine weights + {noise} std noise"] = differences(served(weight_noise=noise))
    emit({"benchmark": "logprob_check", "model": path, "questions": questions.height, "k": 5, "rows": rows})


if __name__ == "__main__":
    main()
