"""Which answers the detectors see, and how one answer is named across stages.

Both `dump` and `judge` select with `select_answers`, so labels and activations cover the
same answers; `response_id` is the key that joins them.
"""

from __future__ import annotations

import polars as pl


def response_id(question_id: str, sample_index: int) -> str:
    return f"{question_id}/{sample_index}"


def response_ids(df: pl.DataFrame) -> pl.Expr:
    """`response_id` as a polars expression over question_id and sample_index columns."""
    return pl.concat_str([pl.col("question_id"), pl.col("sample_index").cast(pl.String)], separator="/")


def select_answers(generations: pl.DataFrame, n_train_samples: int = 1) -> tuple[pl.DataFrame, dict]:
    """Train split: the first `n_train_samples` samples per question; val/test: all of them.

    Returns (selected rows, excluded counts). Zero-token answers have no bag: they are
    excluded and counted, never written as empty bags or judged.
    """
    keep = (pl.col("split") != "train") | (pl.col("sample_index") < n_train_samples)
    chosen = generations.filter(keep)
    empty = chosen.filter(pl.col("n_tokens") == 0)
    return chosen.filter(pl.col("n_tokens") > 0), {"empty_answer": empty.height}
