"""The dump from the engine's states against the teacher-forced dump, on the same answers, and what
the engine's states file costs generate per answer on its way in.

`dump.source: engine` (halludetect/activations/engine_dump.py) writes the layer files from the
states a vLLM server kept while it sampled; `hf` runs every answer through the model again. Both
dump every layer of the world model in float16 over the same N synthetic responses (random answer
tokens after real world prompts, lengths 8-32, as bench.dump makes them), alternating
(engine, hf, round trip, engine, ...), median of `--repeats`; the log-prob check is off on both sides
(the synthetic answers have no recorded log-probs). The engine's per-answer states files are made
first, untimed, from one pass of the same model per answer (what the fake engine writes); the top
layer goes through the final norm in the engine dump, as it must. That pass, one answer at a time,
is timed on its own: `forward_us_per_answer`, the teacher-forced forward pass an answer costs.

The file round trip (`round_trip_*`): for the first `--round-trip` of those answers (default all),
each answer's file as vLLM 0.34.0 writes it and the faithful fake (halludetect/testing/fake_vllm.py)
imitates: `hidden_states` [T, k, d] in the engine's dtype (the world's float32), a column for every
layer of the world model in ascending id order (the top id the last block's output before the final
norm), `token_ids` int64 = prompt + output[:-1] (the output ending with an end token), and its
`<file>.lock`, taken and released around the write as the engine's writer does; all in a `StatesDir`
under /dev/shm (a temporary directory when it is not writable), untimed. Then, timed answer by
answer, what generate does with a reply (lm/completions.py): `AnswerStates.take` (wait for the lock,
read the file as a regular file of ours, `check_states`, keep the answer's rows in a file of the run's
states folder, delete the engine's file and lock); every other reply names the file, the rest name
none, as a stop string's do. `round_trip_us_per_answer` is the mean over answers, median of the
repeats; `round_trip_over_hf_dump` its ratio to the hf dump's cost per answer (its seconds /
responses), the work the engine states replace. `round_trip_parts_us` splits another pass of each
repeat into take's steps (read, check, keep, release), done as take does them (means over answers,
median of the repeats); `file_bytes_per_answer` is the engine's file, `kept_bytes_per_answer` what
generate keeps of it.

What this measures is the dump stage's and generate's own costs with each source on this machine.
What the engine pays to keep the states while it samples (vLLM's extraction and its file writes) is
not here: no vLLM runs on these machines (`engine_write_us_per_answer` is this process writing the
files with safetensors, for scale only).

    python -m bench.engine_dump [--responses 2000] [--repeats 3] [--round-trip N]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, need, setup_threads
from bench.dump import synthetic_generations


@torch.no_grad()
def write_states(
    model, tokenizer, questions, gens, states, layers: list[int], eos: int, engine_files: int = 0
) -> tuple[float, list[dict]]:
    """Each answer's engine states file, as generate keeps them: rows from the prompt's last token on,
    over the answer and an end token (vLLM's ids: the top one before the final norm). Returns the
    seconds of the forward passes alone, and for the first `engine_files` answers what vLLM writes
    for them ({prompt, output, hidden_states [T, k, d], token_ids [T]})."""
    from safetensors.torch import save_file

    from halludetect.activations.capture import _decoder_layers
    from halludetect.lm.model_inputs import encode_prompt

    text = dict(zip(questions["id"], questions["question"]))
    top = model.config.num_hidden_layers
    kept: list[torch.Tensor] = []
    files: list[dict] = []
    forward = 0.0
    hook = _decoder_layers(model)[-1].register_forward_hook(
        lambda _m, _i, o: kept.append(o[0] if isinstance(o, tuple) else o)
    )
    try:
        for r in gens.iter_rows(named=True):
            prompt = encode_prompt(tokenizer, text[r["question_id"]], False)
            output = list(r["token_ids"]) + [eos]
            t0 = time.perf_counter()
            out = model(input_ids=torch.tensor([prompt + output[:-1]]), output_hidden_states=True, use_cache=False)
            forward += time.perf_counter() - t0
            rows = torch.stack([kept[-1][0] if k == top else out.hidden_states[k][0] for k in layers], 1)
            kept.clear()
            save_file(
                {
                    "states": rows[len(prompt) - 1 :].contiguous(),
                    "layers": torch.tensor(layers),
                    "token_ids": torch.tensor(output),
                },
                str(states.answer_path(r["question_id"], r["sample_index"])),
            )
            if len(files) < engine_files:
                tokens = torch.tensor(prompt + output[:-1], dtype=torch.int64)
                files.append({"prompt": prompt, "output": output, "hidden_states": rows, "token_ids": tokens})
    finally:
        hook.remove()
    return forward, files


def write_engine_files(engine, files: list[dict]) -> tuple[list[str], float, int]:
    """Each answer's file in the states directory `engine` as the engine writes it: the lock taken
    (O_CREAT|O_WRONLY|O_TRUNC, LOCK_EX), the file written, the lock released by closing it. Returns
    the names, the seconds the writes took and the files' bytes."""
    from safetensors.torch import save_file

    names, seconds, size = [], 0.0, 0
    for f in files:
        name = engine.new()
        path = engine.full(name)
        t0 = time.perf_counter()
        lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": f["hidden_states"], "token_ids": f["token_ids"]}, path)
        finally:
            os.close(lock)
        seconds += time.perf_counter() - t0
        size += os.stat(path).st_size
        names.append(name)
    return names, seconds, size


def round_trip(answer_states, files: list[dict], names: list[str], hidden: int, max_tokens: int) -> list[float]:
    """Seconds of `AnswerStates.take` per answer, as generate calls it on a reply."""
    from halludetect.lm.engine_states import StatesProblem

    engine, out = answer_states.engine, []
    for i, (f, name) in enumerate(zip(files, names)):
        transfer = {"hidden_states_path": engine.full(name)} if i % 2 == 0 else None  # a stop string's: none
        key = hashlib.sha256(str(i).encode()).hexdigest()
        t0 = time.perf_counter()
        answer_states.take(name, transfer, f["prompt"], f["output"], key, hidden=hidden, max_tokens=max_tokens)
        out.append(time.perf_counter() - t0)
    if any(engine.path.glob("hd-*")):
        raise StatesProblem(f"files of ours left in {engine.path} after the round trip")
    return out


def round_trip_parts(answer_states, files: list[dict], names: list[str], hidden: int, max_tokens: int) -> dict:
    """Mean microseconds per answer of take's steps, done as `AnswerStates.take` does them."""
    from safetensors.torch import save_file

    from halludetect.lm.engine_states import check_states

    engine, k = answer_states.engine, len(answer_states.layers)
    parts = {"read": 0.0, "check": 0.0, "keep": 0.0, "release": 0.0}
    for i, (f, name) in enumerate(zip(files, names)):
        prompt, output = f["prompt"], f["output"]
        t0 = time.perf_counter()
        data = engine.read(name, max_bytes=engine.max_bytes(len(prompt) + max_tokens, k, hidden))
        t1 = time.perf_counter()
        rows = check_states(data, prompt=prompt, output=output, layers=k, hidden=hidden)
        t2 = time.perf_counter()
        out = answer_states.dir / f"parts_{i}.safetensors"
        tmp = out.with_name(out.name + ".tmp")
        rows = rows[len(prompt) - 1 :].contiguous()
        kept = {"states": rows, "layers": torch.tensor(answer_states.layers), "token_ids": torch.tensor(output)}
        save_file(kept, str(tmp))
        os.replace(tmp, out)
        t3 = time.perf_counter()
        engine.release(name)
        t4 = time.perf_counter()
        for part, s in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[part] += s
    return {p: round(s / len(files) * 1e6, 1) for p, s in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--round-trip", type=int, default=None, help="answers in the file round trip (default all)")
    args = ap.parse_args()
    need(WORLD_MODEL, WORLD_QUESTIONS)
    threads = setup_threads()

    from halludetect.activations.capture import dump
    from halludetect.activations.engine_dump import FinalHead, dump_engine
    from halludetect.config import ModelPreset
    from halludetect.lm.engine_states import AnswerStates, StatesDir
    from halludetect.lm.hf_models import check_layers, load_model, load_tokenizer
    from halludetect.qa.questions import read_questions

    preset = ModelPreset(path=str(WORLD_MODEL), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    layers = check_layers("all", model.config)  # ascending: the engine's columns
    questions = read_questions(WORLD_QUESTIONS)
    gens = synthetic_generations(questions, args.responses, len(tokenizer)).sort("question_id", "sample_index")
    n_trip = args.responses if args.round_trip is None else min(args.round_trip, args.responses)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        states = AnswerStates(tmp / "states")
        states.reset()
        t0 = time.perf_counter()
        forward, files = write_states(model, tokenizer, questions, gens, states, layers, tokenizer.eos_token_id, n_trip)
        made = time.perf_counter() - t0
        head = FinalHead(preset)
        top, hidden = model.config.num_hidden_layers, model.config.hidden_size
        max_tokens = max(len(f["output"]) for f in files) if files else 1
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        with StatesDir(tempfile.mkdtemp(prefix="halludetect-bench-", dir=where), temporary=True) as engine:
            kept = AnswerStates(tmp / "kept", layers, engine)
            seconds: dict[str, list[float]] = {"engine": [], "hf": []}
            trips: list[list[float]] = []
            writes, file_bytes, kept_bytes = [], 0, 0
            parts: list[dict] = []
            common = dict(positions="predicting", dtype="float16", batch_size=64, attrs={}, log=lambda *_: None)
            for _ in range(args.repeats):
                for side in ("engine", "hf"):
                    out = tmp / side
                    out.mkdir()
                    t0 = time.perf_counter()
                    if side == "engine":
                        dump_engine(gens, states, out, layers, top=top, hidden=hidden, head=head, **common)
                    else:
                        dump(model, tokenizer, questions, gens, out, layers, **common)
                    seconds[side].append(time.perf_counter() - t0)
                    shutil.rmtree(out)
                if files:
                    kept.reset()
                    names, written, file_bytes = write_engine_files(engine, files)
                    writes.append(written)
                    trips.append(round_trip(kept, files, names, hidden, max_tokens))
                    kept_bytes = sum(p.stat().st_size for p in kept.dir.glob("request_*"))
                    kept.reset()
                    names, _, _ = write_engine_files(engine, files)
                    parts.append(round_trip_parts(kept, files, names, hidden, max_tokens))
            states_mb = sum(p.stat().st_size for p in states.dir.glob("*")) / 2**20
    med = {k: statistics.median(v) for k, v in seconds.items()}
    tokens = int(gens["n_tokens"].sum())
    result = {
        "bench": "engine_dump",
        "responses": args.responses,
        "tokens": tokens,
        "layers": len(layers),
        "threads": threads,
        "seconds": {k: round(v, 3) for k, v in med.items()},
        "tokens_per_s": {k: round(tokens / v) for k, v in med.items()},
        "hf_over_engine": round(med["hf"] / med["engine"], 2),
        "us_per_answer": {k: round(v / args.responses * 1e6, 1) for k, v in med.items()},
        "forward_us_per_answer": round(forward / args.responses * 1e6, 1),
        "states_files_mb": round(states_mb, 1),
        "states_made_untimed_s": round(made, 1),
    }
    if files:
        mean = statistics.median(sum(t) / len(t) for t in trips)
        result |= {
            "round_trip_answers": len(files),
            "round_trip_dir": "/dev/shm" if where else tempfile.gettempdir(),
            "round_trip_us_per_answer": round(mean * 1e6, 1),
            "round_trip_us_p50": round(statistics.median(statistics.median(t) for t in trips) * 1e6, 1),
            "round_trip_us_p90": round(statistics.median(sorted(t)[int(0.9 * (len(t) - 1))] for t in trips) * 1e6, 1),
            "round_trip_over_hf_dump": round(mean / (med["hf"] / args.responses), 4),
            "round_trip_over_forward": round(mean / (forward / args.responses), 4),
            "round_trip_parts_us": {k: round(statistics.median(p[k] for p in parts), 1) for k in parts[0]},
            "file_bytes_per_answer": round(file_bytes / len(files)),
            "kept_bytes_per_answer": round(kept_bytes / len(files)),
            "engine_write_us_per_answer": round(statistics.median(writes) / len(files) * 1e6, 1),
        }
    emit(result)


if __name__ == "__main__":
    main()
