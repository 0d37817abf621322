"""The per-layer scores tables the train stage writes (`layer_<L>.parquet`: every val/test response's
logit per seed), read for the evaluation and the figures. Apart from evaluate.py so that the report
stages that draw scores never load torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.errors import DataError


def read_scores(path: Path, seeds: list[int]) -> dict[str, tuple[np.ndarray, list[np.ndarray], pl.DataFrame]]:
    """Per split: labels [N], per-seed scores (each [N], same response order) and the rows of seed 0."""
    df = read_parquet(path, "train", "scores table")
    found = sorted(df["seed"].unique().to_list())
    if found != sorted(seeds):
        raise DataError(f"{path} holds seeds {found}, not train.seeds {sorted(seeds)}: re-run train")
    out = {}
    for split in ("val", "test"):
        part = df.filter(pl.col("split") == split)
        per_seed = [part.filter(pl.col("seed") == s).sort("response_id") for s in seeds]
        out[split] = (
            per_seed[0]["label"].to_numpy().astype(np.int64),
            [p["score"].to_numpy() for p in per_seed],
            per_seed[0],
        )
    return out
