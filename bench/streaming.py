"""What a streamed token's running score costs, without HTTP: the two measurements behind
docs/benchmarks.md's streamed-serving figures, on a built world (its `max` bundle and test questions).

1. The running update (scoring/streaming.py's `RunningPool`) of R streamed rows' new states, one row
   at a time (`add`, the per-row way) and all rows in one product (`add_rows`, what serve runs), side
   by side for R = 1, 8, 64: microseconds per step and their ratio.
2. Time to first token inside the server's process (`Service.open_stream` and its first chunk, no
   HTTP, no client threads), with scoring and without, alternating in blocks of 20 requests, one at a
   time: medians and their ratio (issue 54's aim: at most 1.05), and the whole answer's.

    HALLUDETECT_THREADS=1 python -m bench.streaming [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import WORLD_QUESTIONS, emit, need, setup_threads
from bench.serve import WORLD_BUNDLE
from halludetect.config import GenerateParams


def running_update(repeats: int) -> None:
    from halludetect.scoring.bundle import load_bundle
    from halludetect.scoring.streaming import RunningPool

    pool = RunningPool.of(load_bundle(WORLD_BUNDLE))
    d = pool.weight.shape[0]
    for rows in (1, 8, 64):
        h = torch.randn(rows, d)
        times: dict[str, list[float]] = {"per_row": [], "one_product": []}
        for _ in range(repeats):
            for way in times:
                pooled: list[dict] = [{} for _ in range(rows)]
                t0 = time.perf_counter()
                for _ in range(50):  # 50 steps of every row
                    if way == "per_row":
                        for r in range(rows):
                            pool.add(pooled[r], h[r : r + 1])
                    else:
                        pool.add_rows(pooled, h, [1] * rows)
                times[way].append((time.perf_counter() - t0) / 50)
        med = {k: statistics.median(v) for k, v in times.items()}
        emit(
            {
                "bench": "streaming-running-update",
                "rows": rows,
                "us_per_step": {k: round(v * 1e6, 1) for k, v in med.items()},
                "ratio_one_product_to_per_row": round(med["one_product"] / med["per_row"], 3),
            }
        )


def first_token(repeats: int, max_tokens: int) -> None:
    from halludetect.qa.questions import read_questions
    from halludetect.scoring.scorer import Scorer
    from halludetect.scoring.serve import Limits, Service

    qs = read_questions(str(WORLD_QUESTIONS))
    questions = qs.filter(qs["split"] == "test")["question"].to_list()[:20]
    scorer = Scorer(WORLD_BUNDLE, device="cpu", generate=GenerateParams(max_new_tokens=max_tokens), log=lambda *_: None)
    service = Service(scorer, name="bench", limits=Limits(max_tokens=max_tokens), log=lambda *_: None).start()

    def one(i: int) -> tuple[float, float]:
        body = {"model": "bench", "prompt": questions[i], "seed": i, "max_tokens": max_tokens, "stream": True}
        t0 = time.perf_counter()
        job = service.open_stream(body, False)
        first = None
        for _ in service.stream_chunks(job, False):
            first = time.perf_counter() - t0 if first is None else first
        service.close_stream(job)
        return first, time.perf_counter() - t0

    got: dict[str, list[tuple[float, float]]] = {"score": [], "plain": []}
    try:
        for side in got:  # a warm-up block each
            service.scoring = side == "score"
            [one(i) for i in range(len(questions))]
        for _ in range(repeats):
            for side in got:
                service.scoring = side == "score"
                got[side] += [one(i) for i in range(len(questions))]
    finally:
        service.stop()
    ttft = {s: statistics.median(r[0] for r in v) for s, v in got.items()}
    whole = {s: statistics.median(r[1] for r in v) for s, v in got.items()}
    emit(
        {
            "bench": "streaming-first-token",
            "requests_per_side": len(got["score"]),
            "max_tokens": max_tokens,
            "ttft_ms": {s: round(v * 1e3, 3) for s, v in ttft.items()},
            "whole_ms": {s: round(v * 1e3, 3) for s, v in whole.items()},
            "ttft_ratio": round(ttft["score"] / ttft["plain"], 3),
            "whole_ratio": round(whole["score"] / whole["plain"], 3),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="blocks of each side, alternating")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    need(WORLD_BUNDLE, WORLD_QUESTIONS)
    emit({"bench": "streaming", "threads": setup_threads()})
    running_update(args.repeats)
    first_token(args.repeats, args.max_tokens)


if __name__ == "__main__":
    main()
