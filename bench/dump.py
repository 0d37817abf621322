"""The activation dump: throughput, write speed against the disk, and memory against size.

Two child processes run the real `dump` (all layers of the world model, float16) over N and
4N synthetic responses (random answer tokens after real world prompts, lengths 8-32), so
their peak RSS can be compared: streaming writes keep it flat. `tokens_per_s` is the 4N
dump's. Then the 4N child times the HDF5 writer against the disk (see `child`):
`write_mb_per_s` against `disk_mb_per_s`, same process, same disk, alternating.

    python -m bench.dump [--responses 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from bench.common import WORLD_MODEL, WORLD_QUESTIONS, emit, need, peak_rss_mb, setup_threads


def synthetic_generations(questions: pl.DataFrame, n: int, vocab: int, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 33, n)
    ids = [rng.integers(3, vocab, k).tolist() for k in lengths]
    qids = questions["id"].to_list()
    return pl.DataFrame(
        {
            "question_id": [qids[i % len(qids)] for i in range(n)],
            "sample_index": [i // len(qids) for i in range(n)],
            "token_ids": ids,
            "n_tokens": lengths.astype(np.int32),
        }
    )


def plain_write(path: Path, nbytes: int) -> float:
    block = np.random.default_rng(1).bytes(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.write(block[: nbytes & ((1 << 20) - 1)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def replay(layers_data, out_dir: Path, responses_per_append: int = 64) -> float:
    from halludetect.activations.layer_writer import LayerWriter, fsync_files

    out_dir.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    writers = []
    for i, layer in enumerate(layers_data):
        w = LayerWriter(out_dir / f"layer_{i}.h5", layer.states.shape[1], "float16", layer.attrs)
        lengths = layer.lengths()
        for a in range(0, len(lengths), responses_per_append):
            b = min(a + responses_per_append, len(lengths))
            w.append(layer.states[layer.offsets[a] : layer.offsets[b]], lengths[a:b], layer.response_ids[a:b])
        w.close(fsync=False)
        writers.append(w)
    fsync_files([w.path for w in writers])  # as `dump` does
    seconds = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return seconds


def child(n: int, out_dir: Path) -> dict:
    from halludetect.activations import capture as activations
    from halludetect.activations.layer_reader import read_layer
    from halludetect.config import ModelPreset
    from halludetect.lm.hf_models import check_layers, load_model, load_tokenizer
    from halludetect.qa.questions import read_questions

    setup_threads()
    preset = ModelPreset(path=str(WORLD_MODEL), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    layers = check_layers("all", model.config)
    questions = read_questions(WORLD_QUESTIONS)
    gens = synthetic_generations(questions, n, len(tokenizer))

    t0 = time.perf_counter()
    activations.dump(
        model,
        tokenizer,
        questions,
        gens,
        out_dir,
        layers,
        positions="predicting",
        dtype="float16",
        batch_size=64,
        attrs={},
        log=lambda *_: None,
    )
    seconds = time.perf_counter() - t0
    rss = peak_rss_mb()
    nbytes = sum(p.stat().st_size for p in out_dir.glob("layer_*.h5"))

    # Write speed against the disk's, side by side: the dumped states replayed through
    # LayerWriter (appends of 64 responses, close, fsync) alternating with plain sequential
    # writes of the same bytes (1 MiB blocks, fsync), five times each, medians, each after an
    # untimed `sync`. The disk's write-back makes single timings swing by 3x on these machines.
    layers_data = [read_layer(p, dtype=np.float16) for p in sorted(out_dir.glob("layer_*.h5"))]
    write_s, disk_s = [], []
    for _ in range(5):
        os.sync()  # each timing starts with no dirty pages of the previous one still being written back
        write_s.append(replay(layers_data, out_dir / "replay"))
        os.sync()
        disk_s.append(plain_write(out_dir / "plain.bin", nbytes))
    return {
        "responses": n,
        "tokens": int(gens["n_tokens"].sum()),
        "layers": len(layers),
        "seconds": seconds,
        "write_seconds": statistics.median(write_s),
        "bytes": nbytes,
        "disk_seconds": statistics.median(disk_s),
        "peak_rss_mb": rss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--responses", type=int, default=2000, help="N (the second run dumps 4N)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    need(WORLD_MODEL, WORLD_QUESTIONS)
    if args.child:
        print(json.dumps(child(args.child, args.out)))
        return
    runs = {}
    for label, n in (("n", args.responses), ("4n", 4 * args.responses)):
        with tempfile.TemporaryDirectory(dir="data") as tmp:  # the disk the real dumps go to
            res = subprocess.run(
                [sys.executable, "-m", "bench.dump", "--child", str(n), "--out", tmp],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[label] = json.loads(res.stdout.strip().splitlines()[-1])
    big = runs["4n"]
    mb = big["bytes"] / 2**20
    emit(
        {
            "benchmark": "dump",
            "model": "world",
            "layers": big["layers"],
            "dtype": "float16",
            "responses_n": runs["n"]["responses"],
            "responses_4n": big["responses"],
            "mb_4n": round(mb, 1),
            "tokens_per_s": round(big["tokens"] / big["seconds"], 1),
            "write_mb_per_s": round(mb / big["write_seconds"], 1),
            "disk_mb_per_s": round(mb / big["disk_seconds"], 1),
            "write_fraction_of_disk": round(big["disk_seconds"] / big["write_seconds"], 3),
            "peak_rss_mb_n": round(runs["n"]["peak_rss_mb"], 1),
            "peak_rss_mb_4n": round(big["peak_rss_mb"], 1),
            "rss_ratio_4n_n": round(big["peak_rss_mb"] / runs["n"]["peak_rss_mb"], 3),
        }
    )


if __name__ == "__main__":
    main()
