"""The files `halludetect score` reads and writes: answers in (JSONL or Parquet), scores out.

Input, one row per answer to score:

    question           str, required
    answer             str, required (absent with --generate: the model samples it)
    id                 str or int, optional, kept in the output (one type for the whole file)
    answer_token_ids   list[int], optional: the answer's tokens as the model produced them
                       (a generations Parquet's token_ids); the answer text is tokenized otherwise
    p_sem              float in [0, 1], for detectors that read it (hami_sp)

Other columns are ignored. Every row is checked in a first streamed pass, before the model
is loaded: a malformed row is an error naming its line (JSONL, 1-based) or row (Parquet,
0-based). Rows are then read again in parts of `rows_per_part`, so memory does not grow with
the number of rows.

Output (Parquet or JSONL, by extension), one row per input row, in input order: `row` (the
0-based input row), `id`, with --generate `answer`, `answer_token_ids`, `finish_reason`, then
`n_tokens`, `score` (the ensemble's bag logit), `probability` (calibrated), `flag` (score >=
the threshold), `reason` (why a row has no score: empty_answer, too_long, too_short, no_p_sem;
null when scored), `in_distribution` (whether the answer's token log-probs are within the range of
the answers the detector was fit on: scoring/answer_range.py; null when not checked),
`ood_reason` (why not), `mean_logprob` and `min_logprob` (the answer's own token log-probs under
the base model: their mean and lowest) and, if asked, `seed_scores`; with --explain, `question`, `answer` and the token
evidence (EXPLAIN_SCHEMA).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from halludetect.core.atomic_io import atomic_path
from halludetect.core.errors import UserError

READERS = (".jsonl", ".parquet")


class InputError(UserError, ValueError):
    """A malformed input row or file; the message names the file and line (or row)."""


@dataclass
class AnswerRow:
    row: int  # 0-based index of the row in the input
    where: str  # "line 13" (JSONL) or "row 12" (Parquet), for messages
    id: str | int | None
    question: str
    answer: str | None
    token_ids: list[int] | None
    p_sem: float | None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_row(rec, row: int, where: str, *, generate: bool, source: str) -> AnswerRow:
    """One input record checked and typed; a problem is an InputError naming `source` and `where`."""

    def fail(what: str):
        raise InputError(f"{source}, {where}: {what}")

    if not isinstance(rec, dict):
        fail(f"expected a JSON object, got {type(rec).__name__}")
    q = rec.get("question")
    if not isinstance(q, str) or not q.strip():
        fail("'question' must be a non-empty string" + ("" if "question" in rec else " (missing)"))
    answer, token_ids = rec.get("answer"), rec.get("answer_token_ids")
    if generate:
        if answer is not None or token_ids is not None:
            fail(
                "--generate samples the answers: the input must not have 'answer' or 'answer_token_ids' "
                "(drop them, or score the answers without --generate)"
            )
    else:
        if not isinstance(answer, str):
            fail(
                "'answer' must be a string"
                + ("" if "answer" in rec else " (missing; to sample answers to questions alone, pass --generate)")
            )
        if token_ids is not None and (
            not isinstance(token_ids, list) or not all(_is_int(t) and t >= 0 for t in token_ids)
        ):
            fail("'answer_token_ids' must be a list of non-negative integers")
    rid = rec.get("id")
    if rid is not None and not (isinstance(rid, str) or _is_int(rid)):
        fail(f"'id' must be a string or an integer, got {type(rid).__name__}")
    p_sem = rec.get("p_sem")
    if p_sem is not None and (
        isinstance(p_sem, bool) or not isinstance(p_sem, int | float) or not math.isfinite(p_sem) or not 0 <= p_sem <= 1
    ):
        fail(f"'p_sem' must be a number in [0, 1] or null, got {p_sem!r}")
    return AnswerRow(row, where, rid, q, answer, token_ids, None if p_sem is None else float(p_sem))


class RowCheck:
    """What the first pass learns about the rows: their count, one id type, whether any has P_sem."""

    def __init__(self, source: str, vocab_size: int | None = None):
        self.source, self.vocab_size = source, vocab_size
        self.n_rows = 0
        self.id_type: type | None = None
        self.first_where = ""
        self.has_p_sem = False

    def add(self, r: AnswerRow) -> None:
        kind = None if r.id is None else type(r.id)
        if self.n_rows == 0:
            self.id_type, self.first_where = kind, r.where
        elif kind is not self.id_type:
            name = lambda t: t.__name__ if t else "missing"  # noqa: E731
            raise InputError(
                f"{self.source}, {r.where}: 'id' is {name(kind)} here but {name(self.id_type)} at "
                f"{self.first_where}: give every row an id of one type, or none"
            )
        if self.vocab_size is not None and r.token_ids and max(r.token_ids) >= self.vocab_size:
            raise InputError(
                f"{self.source}, {r.where}: answer_token_ids {max(r.token_ids)} is outside the model's "
                f"vocabulary of {self.vocab_size}: token ids of another model?"
            )
        self.has_p_sem |= r.p_sem is not None
        self.n_rows += 1


class AnswerFile:
    """A JSONL or Parquet file of answers (or of questions alone, with `generate`)."""

    def __init__(self, path: str | Path, *, generate: bool = False):
        self.path = Path(path)
        self.generate = generate
        if self.path.suffix not in READERS:
            raise InputError(f"{self.path}: unknown input format '{self.path.suffix}': use .jsonl or .parquet")
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such input file")
        self.n_rows = 0
        self.id_type: type | None = None  # str or int, None when the file has no ids
        self.has_p_sem = False

    # ---------------------------------------------------------------- reading
    def _records(self) -> Iterator[tuple[int, str, object]]:
        """(row, where, parsed record) for every data row, streamed."""
        if self.path.suffix == ".jsonl":
            row = 0
            with self.path.open("rb") as f:  # bytes: a line that is not UTF-8 is named, as prepare does
                for n, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                    except UnicodeDecodeError as e:
                        raise InputError(
                            f"{self.path}, line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                            "re-save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`"
                        ) from None
                    if not line.strip():
                        continue  # blank lines (a trailing newline) are no rows
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise InputError(f"{self.path}, line {n}: not valid JSON ({e.msg}, column {e.colno})") from None
                    yield row, f"line {n}", rec
                    row += 1
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise InputError(f"{self.path}: not a readable Parquet file ({e})") from None
        columns = [c for c in ("id", "question", "answer", "answer_token_ids", "p_sem") if c in pf.schema_arrow.names]
        row = 0
        batches = pf.iter_batches(batch_size=4096, columns=columns)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:  # damaged data pages: the footer read fine
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise InputError(
                    f"{self.path}: damaged Parquet data after row {row - 1} ({first}); write the file again"
                    if row
                    else f"{self.path}: damaged Parquet data in its first rows ({first}); write the file again"
                ) from None
            if batch is None:
                return
            for rec in batch.to_pylist():
                yield row, f"row {row}", rec
                row += 1

    def check(self, vocab_size: int | None = None) -> AnswerFile:
        """The first pass: every row parsed and checked (ids of one type, token ids within
        `vocab_size`); nothing is kept."""
        seen = RowCheck(str(self.path), vocab_size)
        for r in self.rows():
            seen.add(r)
        if seen.n_rows == 0:
            raise InputError(f"{self.path}: no rows to score")
        self.n_rows, self.id_type, self.has_p_sem = seen.n_rows, seen.id_type, seen.has_p_sem
        return self

    def rows(self) -> Iterator[AnswerRow]:
        for row, where, rec in self._records():
            yield parse_row(rec, row, where, generate=self.generate, source=str(self.path))

    def parts(self, rows_per_part: int) -> Iterator[tuple[int, list[AnswerRow]]]:
        """(part number, its rows) in order; only one part is in memory at a time."""
        part: list[AnswerRow] = []
        for r in self.rows():
            part.append(r)
            if len(part) == rows_per_part:
                yield r.row // rows_per_part, part
                part = []
        if part:
            yield part[0].row // rows_per_part, part


# ------------------------------------------------------------------------------ output
# --explain adds the answer's token evidence (halludetect/detectors/evidence.py): score = bias + sum(contributions).
EXPLAIN_SCHEMA = {
    "tokens": pl.List(pl.String),  # each token's decoded piece
    "token_start": pl.List(pl.Int32),  # its [start, end) in `answer`
    "token_end": pl.List(pl.Int32),
    "offsets_exact": pl.Boolean,  # False: the tokens do not spell `answer`; the offsets are aligned, approximate
    "contributions": pl.List(pl.Float64),  # each token's share of the score (the seeds' mean)
    "bias": pl.Float64,
}


def output_schema(id_type: type | None, generate: bool, per_seed: bool, explain: bool = False) -> dict:
    schema: dict = {"row": pl.Int64}
    if id_type is not None:
        schema["id"] = pl.String if id_type is str else pl.Int64
    if generate:
        schema |= {"answer": pl.String, "answer_token_ids": pl.List(pl.Int64), "finish_reason": pl.String}
    schema |= {
        "n_tokens": pl.Int32,
        "score": pl.Float64,
        "probability": pl.Float64,
        "flag": pl.Boolean,
        "reason": pl.String,
        "in_distribution": pl.Boolean,  # null: not checked (the bundle predates the check, or it was turned off)
        "ood_reason": pl.String,  # why not (answer_range.check); null when in distribution or not checked
        "mean_logprob": pl.Float64,  # the answer's mean token log-prob under the base model
        "min_logprob": pl.Float64,  # its lowest token log-prob
    }
    if per_seed:
        schema["seed_scores"] = pl.List(pl.Float64)
    if explain:  # the question and answer too, so that `halludetect explain` reads this file alone
        schema |= {"question": pl.String, "answer": pl.String, **EXPLAIN_SCHEMA}
    return schema


def output_format(path: str | Path) -> str:
    suffix = Path(path).suffix
    if suffix not in (".parquet", ".jsonl"):
        raise InputError(f"{path}: unknown output format '{suffix}': use .parquet or .jsonl")
    return suffix[1:]


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names: the same path once resolved (symlinks), or the same inode (hard links)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist
        return False


def check_output(path: str | Path, what: str, reads: dict[str, str | Path | None]) -> None:
    """Before any work: `path` can be written and is none of the files the run reads (`reads`:
    what -> path), so that writing it never destroys an input."""
    out = Path(path)
    if out.is_dir():
        raise InputError(f"{what} {out} is a directory: give a file path in it (e.g. {out / 'scores.parquet'})")
    parent = out.parent
    if not parent.is_dir():
        raise InputError(f"{what} {out}: its folder {parent} does not exist (create it first, or fix the path)")
    for name, other in reads.items():
        if other is not None and _same_file(out, Path(other)):
            raise InputError(
                f"{what} {out} is the {name} {other}: writing it would destroy what this run reads; give another path"
            )


def write_output(parts: list[Path], out: str | Path, schema: dict) -> None:
    """Join finished parts (Parquet files of `schema`) into `out`, one part in memory at a time,
    written atomically: a killed join leaves no output, and the parts stay for a re-run."""
    import pyarrow.parquet as pq

    fmt = output_format(out)
    with atomic_path(out) as tmp:
        if fmt == "parquet":
            arrow_schema = pl.DataFrame(schema=schema).to_arrow().schema
            with pq.ParquetWriter(tmp, arrow_schema) as writer:
                for part in parts:
                    writer.write_table(pq.read_table(part, schema=arrow_schema))
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for part in parts:
                    for rec in pl.read_parquet(part).iter_rows(named=True):
                        f.write(json.dumps(rec, allow_nan=False, ensure_ascii=False) + "\n")
