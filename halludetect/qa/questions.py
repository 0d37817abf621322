"""The questions table `prepare` writes (data/questions/<dataset>.parquet), one row per question in the
common schema, and its checked reader: what every stage after prepare reads of a dataset. Loading a
dataset into it is qa/datasets.py's (prepare's alone, so that a loader's edit re-runs prepare only).

Common schema:
    id: str, question: str, answers: list[str] (non-empty), context: str | None,
    split: "train" | "val" | "test",
    incorrect_answers: list[str] (known wrong answers, for the judge; [] for most datasets),
    category: str | None (TruthfulQA's category; null elsewhere)
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.errors import UserError

SCHEMA = {
    "id": pl.String,
    "question": pl.String,
    "answers": pl.List(pl.String),
    "context": pl.String,
    "split": pl.String,
    "incorrect_answers": pl.List(pl.String),
    "category": pl.String,
}
# Columns added after the first release: a questions file written before them reads with these
# values (no known wrong answers, no category), which is what the loaders of that time produced.
OPTIONAL_COLUMNS = {"incorrect_answers": [], "category": None}
SPLITS = ("train", "val", "test")


class DatasetError(UserError, ValueError):
    """A dataset file or hub dataset that cannot be read into the common schema."""


def control_characters(text: str) -> list[str]:
    """The control characters in `text` (NUL, ESC, ...), named: HDF5 and file names refuse them."""
    return [
        unicodedata.name(c, f"U+{ord(c):04X}") if c != "\0" else "NUL" for c in text if unicodedata.category(c) == "Cc"
    ]


def read_questions(path: str | Path) -> pl.DataFrame:
    """The questions table `prepare` wrote, checked: the columns, and ids that are unique, not
    null and free of control characters (a hand-edited file fails here, before any model runs)."""
    df = read_parquet(path, "prepare", "questions table")
    df = df.with_columns(
        pl.Series(k, [v] * df.height, dtype=SCHEMA[k]) for k, v in OPTIONAL_COLUMNS.items() if k not in df.columns
    )
    missing = set(SCHEMA) - set(df.columns)
    if missing:
        raise DatasetError(f"{path}: not a questions file (missing columns {sorted(missing)}); re-run prepare")
    problems = []
    if df["id"].dtype != pl.String:
        problems.append(f"id is {df['id'].dtype}, not strings")
    else:
        if n := df["id"].null_count():
            problems.append(f"{n} null id(s)")
        if dup := df["id"].drop_nulls().filter(df["id"].drop_nulls().is_duplicated()).unique().sort().to_list():
            problems.append(f"repeated ids {dup[:5]}")
        bad = [i for i in df["id"].drop_nulls().to_list() if control_characters(i)]
        if bad:
            problems.append(f"ids with control characters (HDF5 cannot hold them): {bad[:5]}")
    if df["split"].dtype == pl.String and (other := sorted(set(df["split"].drop_nulls()) - set(SPLITS))):
        problems.append(f"unknown splits {other} (use {list(SPLITS)})")
    if problems:
        raise DatasetError(f"{path}: " + "; ".join(problems) + "; re-run prepare to rewrite it")
    return df
