"""Answers scored per second: early exit against a full forward pass and against the peers' way.

The same model object, the same answers (prompt 1 + answer token ids) and the same detector
(a `max` network, 3 seeds averaged, as a bundle scores), three ways:

  early exit   batches of right-padded prompt + answer; the forward stops after the detector's
               layer (`early_exit.states_until`): blocks above it and the LM head never run
  full         the same batches through the whole model with the layer captured, as the dump does
  peers        one `model.generate(..., output_hidden_states=True)` per answer, forced to emit the
               answer's tokens (how the paper's and HaMI's code collect states)

Runs alternate (early, full, peers, early, ...) and each side reports its median over
`--repeats`, so a slow patch of a noisy machine hits all three. For a layer L of an n-block
model the early exit computes L blocks where the full pass computes n plus the LM head, so
`ratio_full` should approach n / L; the issue states the target as n / (L + 1), which we
report too (`n_over_layer_plus_1`).

Presets:
  world            the demo world's model (4 blocks, d 128) and its val/test answers
  deep             a randomly initialised Llama with 32 blocks, d 256 (built here, no download)
  llama3-8b-shape  a randomly initialised Llama-3.1-8B-shaped model (32 blocks, d 4096, GQA 8,
                   vocab 128,256) in bfloat16: run it on a GPU, `--device cuda`

    python -m bench.score                                   # world + deep on the CPU, a minute or two
    python -m bench.score --preset llama3-8b-shape --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, median, need, setup_threads
from halludetect.activations.bags import Bags
from halludetect.activations.capture import bag_positions, bag_slice, capture
from halludetect.activations.early_exit import states_until
from halludetect.config import ModelPreset
from halludetect.detectors.build import build_detector
from halludetect.lm.hf_models import load_model, load_tokenizer
from halludetect.lm.model_inputs import encode_prompt, pad_ids
from halludetect.methods.pooling import PoolingParams
from halludetect.qa.questions import read_questions

WORLD_GENERATIONS = Path("data/generations/world/world.parquet")
SHAPES = {
    "deep": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "llama3-8b-shape": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def random_llama(shape: str, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def world_answers(n: int, model_dir: str, questions: str, generations: str) -> tuple[list, int]:
    """The first n non-empty val/test answers of the world's generations, as (prompt ids, answer ids)."""
    need(Path(model_dir), Path(questions), Path(generations))
    tok = load_tokenizer(ModelPreset(path=model_dir))
    text = dict(read_questions(questions).select("id", "question").iter_rows())
    gens = (
        pl.read_parquet(generations)
        .filter((pl.col("split") != "train") & (pl.col("n_tokens") > 0))
        .sort("question_id", "sample_index")
        .head(n)
    )
    return [
        (encode_prompt(tok, text[q], False), list(ids))
        for q, ids in gens.select("question_id", "token_ids").iter_rows()
    ], tok.pad_token_id


def random_answers(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompt 1 is ~30 tokens and world answers ~12: the same shape, random ids (no special tokens)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(10, vocab, rng.integers(25, 36)).tolist(), rng.integers(10, vocab, rng.integers(5, 21)).tolist())
        for _ in range(n)
    ]


class ForceAnswer(LogitsProcessor):
    """Greedy generation that emits the given answer: the peers' cost for the same answer."""

    def __init__(self, answer: list[int], width: int):
        self.answer, self.width = answer, width

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.answer[input_ids.shape[1] - self.width]] = 0
        return forced


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def score_bags(detectors, h: torch.Tensor, starts, lengths) -> torch.Tensor:
    row, col = (t.to(h.device) for t in bag_positions(starts, lengths))
    bags = Bags(h[row, col].to(torch.float16).float(), torch.as_tensor(lengths, device=h.device))
    return torch.stack([d(bags) for d in detectors]).mean(0)


@torch.no_grad()
def batched(model, answers, pad_id, layer, n_blocks, detectors, batch_size, early: bool) -> int:
    device = str(model.get_input_embeddings().weight.device)
    for a in range(0, len(answers), batch_size):
        part = answers[a : a + batch_size]
        ids, mask = pad_ids([p + x for p, x in part], pad_id, left=False)
        ids, mask = ids.to(device), mask.to(device)
        if early:
            h = states_until(model, layer, n_blocks, ids, mask)
        else:
            with capture(model, [layer]) as store:
                model(input_ids=ids, attention_mask=mask, use_cache=False)
            h = store[layer]
        score_bags(
            detectors, h, [bag_slice(len(p), len(x), "predicting").start for p, x in part], [len(x) for _, x in part]
        )
    sync(device)
    return len(answers)


@torch.no_grad()
def peers_way(model, answers, pad_id, layer, detectors) -> int:
    device = str(model.get_input_embeddings().weight.device)
    for prompt, answer in answers:
        ids = torch.tensor([prompt], device=device)
        force = LogitsProcessorList([ForceAnswer(answer, ids.shape[1])])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=len(answer),
            min_new_tokens=len(answer),
            logits_processor=force,
            output_hidden_states=True,
            return_dict_in_generate=True,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
        # step t's last position predicts answer token t (`predicting` bags, as the paper's code stored)
        h = torch.cat([out.hidden_states[t][layer][:, -1:] for t in range(len(answer))], dim=1)  # [1, n, d]
        score_bags(detectors, h, [0], [len(answer)])
    sync(device)
    return len(answers)


def run_preset(name: str, args) -> dict:
    device = args.device
    if name == "world":
        model = load_model(ModelPreset(path=args.world_model, dtype="float32"), device)
        answers, pad_id = world_answers(args.answers, args.world_model, args.questions, args.generations)
        layers = args.layers or [1, 2, 4]
    else:
        model = random_llama(name, torch.bfloat16 if name == "llama3-8b-shape" else torch.float32, device)
        answers, pad_id = random_answers(args.answers, model.config.vocab_size), 0
        layers = args.layers or [8, 16, 24]
    n_blocks = model.config.num_hidden_layers
    d = model.config.hidden_size
    torch.manual_seed(0)
    detectors = [build_detector("max", d, PoolingParams()).to(device).eval() for _ in range(3)]
    peers = answers[: args.peer_answers or len(answers)]
    bs = args.batch_size
    batched(model, answers[:bs], pad_id, layers[0], n_blocks, detectors, bs, True)  # warm-up
    batched(model, answers[:bs], pad_id, layers[0], n_blocks, detectors, bs, False)
    peers_way(model, peers[:2], pad_id, layers[0], detectors)
    rows = []
    for layer in layers:
        rates = {"early": [], "full": [], "peers": []}
        for _ in range(args.repeats):
            for way in rates:
                t0 = time.perf_counter()
                if way == "peers":
                    n = peers_way(model, peers, pad_id, layer, detectors)
                else:
                    n = batched(model, answers, pad_id, layer, n_blocks, detectors, bs, way == "early")
                rates[way].append(n / (time.perf_counter() - t0))
        early, full, peer = (median(rates[w]) for w in ("early", "full", "peers"))
        rows.append(
            {
                "layer": layer,
                "early_exit_answers_per_s": round(early, 1),
                "full_forward_answers_per_s": round(full, 1),
                "peers_answers_per_s": round(peer, 2),
                "ratio_full": round(early / full, 2),
                "ratio_peers": round(early / peer, 1),
                "n_over_layer": round(n_blocks / layer, 2),
                "n_over_layer_plus_1": round(n_blocks / (layer + 1), 2),
            }
        )
        print(rows[-1], flush=True)
    return {
        "preset": name,
        "blocks": n_blocks,
        "hidden": d,
        "dtype": str(next(model.parameters()).dtype),
        "answers": len(answers),
        "peer_answers": len(peers),
        "batch_size": bs,
        "mean_tokens": round(float(np.mean([len(p) + len(x) for p, x in answers])), 1),
        "layers": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        action="append",
        choices=["world", "deep", "llama3-8b-shape"],
        help="repeatable; default: world and deep",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ... (llama3-8b-shape wants a GPU)")
    ap.add_argument("--answers", type=int, default=128, help="answers scored per way and repeat")
    ap.add_argument(
        "--peer-answers",
        type=int,
        default=8,
        help="the first N answers for the peers' way (one generate each; 0: all), default 8",
    )
    ap.add_argument("--layers", type=int, nargs="*", help="detector layers (default: world 1 2 4; others 8 16 24)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world-model", default=str(WORLD_MODEL), help="the world's model directory")
    ap.add_argument("--questions", default=str(WORLD_QUESTIONS), help="the world's questions Parquet")
    ap.add_argument("--generations", default=str(WORLD_GENERATIONS), help="the world's generations Parquet")
    args = ap.parse_args()
    threads = setup_threads()
    presets = args.preset or ["world", "deep"]
    results = [run_preset(p, args) for p in presets]
    emit(
        {
            "benchmark": "score",
            "device": args.device,
            "threads": threads,
            "repeats": args.repeats,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "presets": results,
        }
    )


if __name__ == "__main__":
    main()
