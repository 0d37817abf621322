"""The dump from the engine's states against the teacher-forced dump, on the same answers.

`dump.source: engine` (halludetect/activations/engine_dump.py) writes the layer files from the
states a vLLM server kept while it sampled; `hf` runs every answer through the model again. Both
dump every layer of the world model in float16 over the same N synthetic responses (random answer
tokens after real world prompts, lengths 8-32, as bench.dump makes them), alternating
(engine, hf, engine, ...), median of `--repeats`; the log-prob check is off on both sides (the
synthetic answers have no recorded log-probs). The engine's per-answer states files are made first,
untimed, from one pass of the same model (what the fake engine writes); the top layer goes through
the final norm in the engine dump, as it must.

What this measures is the dump stage's own cost with each source on this machine. What the engine
pays to keep the states while it samples (vLLM's extraction and its file writes) is not here: no
vLLM runs on these machines.

    python -m bench.engine_dump [--responses 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, need, setup_threads
from bench.dump import synthetic_generations


@torch.no_grad()
def write_states(model, tokenizer, questions, gens, states, layers: list[int], eos: int) -> None:
    """Each answer's engine states file, as generate keeps them: rows from the prompt's last token on,
    over the answer and an end token (vLLM's ids: the top one before the final norm)."""
    from safetensors.torch import save_file

    from halludetect.activations.capture import _decoder_layers
    from halludetect.lm.model_inputs import encode_prompt

    text = dict(zip(questions["id"], questions["question"]))
    top = model.config.num_hidden_layers
    kept: list[torch.Tensor] = []
    hook = _decoder_layers(model)[-1].register_forward_hook(
        lambda _m, _i, o: kept.append(o[0] if isinstance(o, tuple) else o)
    )
    try:
        for r in gens.iter_rows(named=True):
            prompt = encode_prompt(tokenizer, text[r["question_id"]], False)
            output = list(r["token_ids"]) + [eos]
            out = model(input_ids=torch.tensor([prompt + output[:-1]]), output_hidden_states=True, use_cache=False)
            rows = torch.stack([kept[-1][0] if k == top else out.hidden_states[k][0] for k in layers], 1)
            save_file(
                {
                    "states": rows[len(prompt) - 1 :].contiguous(),
                    "layers": torch.tensor(layers),
                    "token_ids": torch.tensor(output),
                },
                str(states.answer_path(r["question_id"], r["sample_index"])),
            )
    finally:
        hook.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    need(WORLD_MODEL, WORLD_QUESTIONS)
    threads = setup_threads()

    from halludetect.activations.capture import dump
    from halludetect.activations.engine_dump import FinalHead, dump_engine
    from halludetect.config import ModelPreset
    from halludetect.lm.engine_states import AnswerStates
    from halludetect.lm.hf_models import check_layers, load_model, load_tokenizer
    from halludetect.qa.questions import read_questions

    preset = ModelPreset(path=str(WORLD_MODEL), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    layers = check_layers("all", model.config)
    questions = read_questions(WORLD_QUESTIONS)
    gens = synthetic_generations(questions, args.responses, len(tokenizer)).sort("question_id", "sample_index")
    tmp = Path(tempfile.mkdtemp())
    states = AnswerStates(tmp / "states")
    states.reset()
    t0 = time.perf_counter()
    write_states(model, tokenizer, questions, gens, states, layers, tokenizer.eos_token_id)
    made = time.perf_counter() - t0
    head = FinalHead(preset)
    top = model.config.num_hidden_layers
    seconds: dict[str, list[float]] = {"engine": [], "hf": []}
    common = dict(positions="predicting", dtype="float16", batch_size=64, attrs={}, log=lambda *_: None)
    for _ in range(args.repeats):
        for side in ("engine", "hf"):
            out = tmp / side
            out.mkdir()
            t0 = time.perf_counter()
            if side == "engine":
                dump_engine(gens, states, out, layers, top=top, hidden=model.config.hidden_size, head=head, **common)
            else:
                dump(model, tokenizer, questions, gens, out, layers, **common)
            seconds[side].append(time.perf_counter() - t0)
            shutil.rmtree(out)
    states_mb = sum(p.stat().st_size for p in states.dir.glob("*")) / 2**20
    shutil.rmtree(tmp)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    tokens = int(gens["n_tokens"].sum())
    emit(
        {
            "bench": "engine_dump",
            "responses": args.responses,
            "tokens": tokens,
            "layers": len(layers),
            "threads": threads,
            "seconds": {k: round(v, 3) for k, v in med.items()},
            "tokens_per_s": {k: round(tokens / v) for k, v in med.items()},
            "hf_over_engine": round(med["hf"] / med["engine"], 2),
            "states_files_mb": round(states_mb, 1),
            "states_made_untimed_s": round(made, 1),
        }
    )


if __name__ == "__main__":
    main()
