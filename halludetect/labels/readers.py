"""The label tables that train and evaluate read, checked where they are read.

`judgments.parquet` (stage judge) and `clusters.parquet` (stage cluster) are outputs of paid
work, so people inspect and sometimes hand-edit them. A label of 2, a kept row without a
label (which numpy would turn into int64-min, a "label" of -9223372036854775808) or the
same answer twice with opposite labels must stop the stage that reads them, naming the file,
the rows and the fix, before any training.

Checked: the columns the readers use and their types; no null in the key columns; split in
train/val/test; one row per (question_id, sample_index); judgments: on kept rows a label in
{0, 1}; clusters: on valid rows P_sem in [0, 1] and semantic entropies finite and >= 0.

The required columns are written out here rather than imported from the writers
(`judges/protocol.py`, `nli/clustering.py`): training then does not depend on the judge's or
the clustering's code, only on the tables they wrote.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from halludetect.core.artifacts import read_parquet
from halludetect.core.errors import DataError

SPLITS = ("train", "val", "test")
SHOWN = 5  # offending rows named per problem

JUDGMENT_COLUMNS = {
    "question_id": "string",
    "sample_index": "integer",
    "split": "string",
    "label": "integer",
    "kept": "boolean",
}
P_SEM = ("p_sem_mean", "p_sem_sum", "p_sem_count")
ENTROPY = ("semantic_entropy_mean", "semantic_entropy_sum", "semantic_entropy_discrete")
CLUSTER_COLUMNS = {
    "question_id": "string",
    "sample_index": "integer",
    "split": "string",
    "valid": "boolean",
    **dict.fromkeys(P_SEM + ENTROPY, "float"),
}

_KINDS = {
    "string": lambda t: t == pl.String,
    "integer": lambda t: t.is_integer(),
    "boolean": lambda t: t == pl.Boolean,
    "float": lambda t: t.is_float(),
}


class LabelTableError(DataError):
    """A judgments or clusters table that cannot be trained or evaluated on as it is."""


def _rows(df: pl.DataFrame, mask: pl.Series, show: str | None = None) -> str:
    """'rows 4, 9 (q1/0, q2/3)': 1-based row numbers and response ids of the first offending rows."""
    hit = df.with_row_index("_row", offset=1).filter(mask)
    parts = []
    for r in hit.head(SHOWN).iter_rows(named=True):
        extra = f": {r[show]!r}" if show else ""
        parts.append(f"row {r['_row']} ({r['question_id']}/{r['sample_index']}{extra})")
    more = f" and {hit.height - SHOWN} more" if hit.height > SHOWN else ""
    return ", ".join(parts) + more


def _check(df: pl.DataFrame, columns: dict[str, str], key_notnull: tuple[str, ...]) -> list[str]:
    """Columns, types, nulls in the keys, splits and duplicate responses: the checks both tables share."""
    problems = []
    for name, kind in columns.items():
        if name not in df.columns:
            problems.append(f"column '{name}' is missing")
        elif not _KINDS[kind](df.schema[name]):
            problems.append(f"column '{name}' is {df.schema[name]}, not {kind}")
    if problems:  # the row checks below need the columns as typed
        return problems
    for name in key_notnull:
        if n := df[name].null_count():
            problems.append(f"{name}: {n} null value(s) at {_rows(df, df[name].is_null())}")
    bad_split = df["split"].is_not_null() & ~df["split"].is_in(SPLITS)
    if bad_split.any():
        problems.append(f"split: not one of {list(SPLITS)} at {_rows(df, bad_split, 'split')}")
    dup = df.select(pl.struct("question_id", "sample_index").is_duplicated()).to_series()
    if dup.any():
        problems.append(
            f"the same response on more than one row (one row per question_id and sample_index): "
            f"{_rows(df, dup, 'label' if 'label' in df.columns else None)}"
        )
    return problems


def _raise(path: str | Path, problems: list[str], writer: str) -> None:
    if problems:
        raise LabelTableError(
            f"{path}: {len(problems)} problem(s):\n  "
            + "\n  ".join(problems)
            + f"\nRe-run {writer} to rewrite it (dvc repro --force the {writer} stage), or undo "
            "the hand edit"
        )


def check_judgments(df: pl.DataFrame, source: str | Path) -> pl.DataFrame:
    """The judge's table, checked; returned unchanged."""
    problems = _check(df, JUDGMENT_COLUMNS, ("question_id", "sample_index", "split", "kept"))
    if not problems:
        kept = df["kept"].fill_null(False)
        null = kept & df["label"].is_null()
        if null.any():
            problems.append(
                f"label: null on kept row(s) {_rows(df, null)} (a kept answer needs 0 or 1; an answer "
                "without a label has kept = false)"
            )
        bad = kept & df["label"].is_not_null() & ~df["label"].is_in([0, 1])
        if bad.any():
            problems.append(f"label: not 0 (correct) or 1 (hallucinated) on kept row(s) {_rows(df, bad, 'label')}")
    _raise(source, problems, "judge")
    return df


def check_clusters(df: pl.DataFrame, source: str | Path) -> pl.DataFrame:
    """The clustering's table, checked; returned unchanged."""
    problems = _check(df, CLUSTER_COLUMNS, ("question_id", "sample_index", "split", "valid"))
    if not problems:
        valid = df["valid"].fill_null(False)
        for name in P_SEM:
            bad = valid & (df[name].is_null() | ~df[name].is_between(0.0, 1.0))
            if bad.any():
                problems.append(f"{name}: null or outside [0, 1] on valid row(s) {_rows(df, bad, name)}")
        for name in ENTROPY:
            bad = valid & (df[name].is_null() | ~df[name].is_finite() | (df[name] < 0))
            if bad.any():
                problems.append(f"{name}: null, negative or not finite on valid row(s) {_rows(df, bad, name)}")
    _raise(source, problems, "cluster")
    return df


def read_judgments(path: str | Path) -> pl.DataFrame:
    """judgments.parquet, read and checked."""
    return check_judgments(read_parquet(path, "judge", "judgments table"), path)


def read_clusters(path: str | Path) -> pl.DataFrame:
    """clusters.parquet, read and checked."""
    return check_clusters(read_parquet(path, "cluster", "clusters table"), path)
