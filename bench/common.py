"""Helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

WORLD_MODEL = Path("data/world/model")
WORLD_QUESTIONS = Path("data/questions/world.parquet")


def need(*paths: Path) -> None:
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        sys.exit(
            f"error: {', '.join(missing)} missing: build the demo world first "
            "(`make bench` does, or `dvc repro` the stages that write them)"
        )


def setup_threads() -> int:
    n = int(os.environ.get("HALLUDETECT_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def timed(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def emit(result: dict) -> None:
    print(json.dumps(result, sort_keys=True), flush=True)
