"""Loading a dataset into the common schema (qa/questions.py), and the question-level split: the
prepare stage's library.

A dataset is data: its format (a file of qa/formats/, named by core/registry.py, or the preset's own
`format:`; docs/datasets.md) says which hub dataset it is and where the hub rows' fields go, and what
is done to every record (a question suffix, the context dropped, unanswerable ones dropped). A local
file is in the common schema already (or its `file_fields` rename one of its own fields; `reader`
names Python for a file of another shape, BioASQ's JSON). Every source first produces raw records,
each with where it came from (file and 1-based line, Parquet row, hub row). One typed validator
(`QARecord`) checks them all and reports every problem at once, as `<file>:<line>: <field>: <what>
(<fix>)`, before anything is written. Then the format's conventions apply to hub and file records
alike (SQuAD: answerable only; NQ-open: "?" appended as the semantic-entropy code does), so the
local samples shipped in tests/fixtures exercise the conventions the hub path uses.

What a record may hold:
    id        a string or an integer (7 becomes "7"; 0 is a real id); absent or null: the md5
              of the question (the semantic-entropy scheme). No control characters (NUL...):
              HDF5 and file names cannot hold them. Two records whose ids end up equal are
              an error naming both lines, unless they are exact repeats (dropped, counted).
    question  a non-empty string
    answers   a string, a list of strings, or SQuAD's {"text": [...], "answer_start": [...]};
              [] marks an unanswerable question (dropped, counted)
    context   a string or null
    incorrect_answers  optional: a string or a list of strings, known wrong answers the judge
              may use (TruthfulQA's incorrect answers, HaluEval's hallucinated answer)
    category  optional: a string or null (TruthfulQA's category)
Other fields are ignored.

The context is kept in the questions table (the leak check reads it), never shown to the model: prompt 1 is
the question alone, as in the paper ("without providing any additional context"). A dataset
whose problem needs its passage to be answerable therefore puts it into the question (SVAMP).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from halludetect.config import (
    DatasetFormat,
    DatasetPreset,
    FieldSource,
    HubSource,
    Joined,
    Md5Of,
    PrepareParams,
    RowNumber,
    dataset_format,
)
from halludetect.core import registry
from halludetect.qa.questions import SCHEMA, SPLITS, DatasetError, control_characters, read_questions  # noqa: F401

MAX_LISTED = 20  # problems shown in one error message (all are counted)


def md5_id(question: str) -> str:
    """The id scheme of the semantic-entropy code (and of the shipped NQ/TriviaQA samples)."""
    return str(int(hashlib.md5(question.encode("utf-8")).hexdigest(), 16))


def _dedupe(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for x in items:
        x = x.strip()
        if x:
            seen.setdefault(x, None)
    return list(seen)


def _kind(v: Any) -> str:
    """A JSON value's kind, as a user would name it in an error message."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, int | float):
        return f"a number ({v!r})"
    if isinstance(v, list | tuple):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, str):
        return "a string"
    return f"a {type(v).__name__}"


# ------------------------------------------------------------------- the validator
class QARecord(BaseModel):
    """One raw QA record, typed. Field validators run before the type check, so each problem
    gets one message with its fix rather than pydantic's list of union branches."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str | None = None  # None: derived from the question
    question: str
    answers: list[str]
    context: str | None = None
    incorrect_answers: list[str] = []
    category: str | None = None

    @field_validator("id", mode="before")
    @classmethod
    def _id(cls, v):
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise ValueError(
                f"{_kind(v)}, not a string or an integer (quote it, or leave it out to derive an id from the question)"
            )
        v = str(v)
        if not v.strip():
            raise ValueError("empty (give a real id, or leave the field out to derive one from the question)")
        if bad := control_characters(v):
            raise ValueError(
                f"{v!r} contains the control character {bad[0]} (HDF5 files and file names cannot hold it: remove it)"
            )
        return v

    @field_validator("question", mode="before")
    @classmethod
    def _question(cls, v):
        if v is None:
            raise ValueError("null (every record needs the question text)")
        if not isinstance(v, str):
            fix = "join the words into one string" if isinstance(v, list) else "write the question text as a string"
            raise ValueError(f"{_kind(v)}, not a string ({fix})")
        if not v.strip():
            raise ValueError("empty (every record needs the question text)")
        return v.strip()

    @field_validator("answers", mode="before")
    @classmethod
    def _answers(cls, v):
        if isinstance(v, dict):  # SQuAD's own format on the hub: {"text": [...], "answer_start": [...]}
            if "text" not in v:
                raise ValueError(
                    f"an object without 'text' ({sorted(v)}); give a list of strings or SQuAD's "
                    "{'text': [...], 'answer_start': [...]}"
                )
            v = v["text"]
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list | tuple):
            raise ValueError(f"{_kind(v)}, not a string or a list of strings ([] for an unanswerable question)")
        for i, a in enumerate(v):
            if not isinstance(a, str):
                fix = (
                    "answers must be a flat list of strings"
                    if isinstance(a, list | tuple | dict)
                    else "quote it if it is meant as an answer"
                )
                raise ValueError(f"item {i} is {_kind(a)}, not a string ({fix})")
        return _dedupe(v)

    @field_validator("context", "category", mode="before")
    @classmethod
    def _context(cls, v):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{_kind(v)}, not a string or null")
        return v

    @field_validator("incorrect_answers", mode="before")
    @classmethod
    def _incorrect(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list | tuple):
            raise ValueError(f"{_kind(v)}, not a string or a list of strings (the known wrong answers; [] for none)")
        for i, a in enumerate(v):
            if not isinstance(a, str):
                raise ValueError(f"item {i} is {_kind(a)}, not a string (a flat list of the wrong answers' texts)")
        return _dedupe(v)


@dataclass(frozen=True)
class Located:
    """A validated record, where it came from, and its id as the source spelt it."""

    where: str  # "<file>:<line>", "<file> row <n>", "<hub id> (hub) row <n>"
    record: QARecord
    raw_id: Any  # the id as given (7 and "7" both become "7": that collision is reported)
    rid: str  # the final id


@dataclass
class LoadReport:
    """What a loader dropped and why: counted, never silent."""

    read: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    repeated_ids: list[str] = field(default_factory=list)  # exact repeats of an earlier record, dropped

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def _fail(source: str, problems: list[str]) -> DatasetError:
    shown = problems[:MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return DatasetError(
        f"{source}: {len(problems)} problem(s); nothing was written. Fix them and re-run prepare:\n  "
        + "\n  ".join(shown)
        + more
    )


def _collision(prev: Located, x: Located) -> str:
    """The message for record `x` whose final id is already that of the different record `prev`."""
    if (prev.raw_id is None) != (x.raw_id is None):
        lone, other = (x, prev) if x.raw_id is None else (prev, x)
        return (
            f"{lone.where}: id: none given, so its id is the md5 of its question, '{x.rid}', which is the id "
            f"of {other.where} (give it an id of its own)"
        )
    if type(prev.raw_id) is not type(x.raw_id):
        return (
            f"{x.where}: id: {x.raw_id!r} and {prev.raw_id!r} at {prev.where} both become the id '{x.rid}' "
            "(give one of them another id)"
        )
    if x.raw_id is None:
        return (
            f"{x.where}: question: the same question as {prev.where} (both without an id) with other answers "
            "or context (merge the two records into one, or give them ids)"
        )
    return (
        f"{x.where}: id: '{x.rid}' is also the id of {prev.where}, with another question, answers or context "
        "(ids must be unique: rename one, or remove the repeat)"
    )


def validate_records(rows: list[tuple[str, Any]], source: str, report: LoadReport) -> list[Located]:
    """Every raw (where, record) checked at once; ids made final and checked for collisions.

    Raises one `DatasetError` listing every problem. Exact repeats (same id, question,
    answers and context) are dropped and their ids kept in `report.repeated_ids`.
    """
    problems: list[tuple[int, str]] = []  # (position in rows, message): reported in file order
    out = []
    for pos, (where, raw) in enumerate(rows):
        if isinstance(raw, Unreadable):
            problems.append((pos, f"{where}: {raw.problem}"))
            continue
        if not isinstance(raw, dict):
            problems.append(
                (
                    pos,
                    f"{where}: record: {_kind(raw)}, not an object (each record is one JSON object "
                    '{"id": ..., "question": ..., "answers": [...]})',
                )
            )
            continue
        try:
            rec = QARecord.model_validate(raw)
        except ValidationError as err:
            for e in err.errors():
                name = ".".join(str(p) for p in e["loc"]) or "record"
                if e["type"] == "missing":
                    problems.append(
                        (
                            pos,
                            f"{where}: {name}: missing (the common schema needs question and answers; "
                            "id and context are optional)",
                        )
                    )
                else:
                    problems.append((pos, f"{where}: {name}: {e['msg'].removeprefix('Value error, ')}"))
            continue
        out.append((pos, Located(where, rec, raw.get("id"), rec.id if rec.id is not None else md5_id(rec.question))))
    first: dict[str, Located] = {}
    kept = []
    for pos, x in out:
        prev = first.get(x.rid)
        if prev is None:
            first[x.rid] = x
            kept.append(x)
        elif prev.record == x.record and type(prev.raw_id) is type(x.raw_id):
            report.repeated_ids.append(x.rid)  # an exact repeat: the same record twice
        else:
            problems.append((pos, _collision(prev, x)))
    if problems:
        raise _fail(source, [msg for _, msg in sorted(problems, key=lambda p: p[0])])
    return kept


# ------------------------------------------------------------------- local readers
@dataclass(frozen=True)
class Unreadable:
    """A line that is not UTF-8 or not JSON: carried to the validator, which reports it with the rest."""

    problem: str


def _json_lines(path: Path) -> list[tuple[str, Any]]:
    """(where, value) per non-blank line; a line that cannot be decoded or parsed becomes `Unreadable`."""
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            whole = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            whole = None  # not one JSON document: read it as JSON Lines below
        if isinstance(whole, list):
            raise DatasetError(
                f"{path}:1: the file holds one JSON array; records are read as JSON Lines, one object "
                f"per line: convert it (e.g. `jq -c '.[]' {path.name} > {path.stem}.jsonl`) and point "
                "the dataset preset's path at the .jsonl"
            )
    rows = []
    for n, line in enumerate(data.split(b"\n"), 1):
        where = f"{path}:{n}"
        try:
            text = line.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as e:
            rows.append(
                (
                    where,
                    Unreadable(
                        f"not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1}; re-save "
                        "the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`)"
                    ),
                )
            )
            continue
        if not text.strip():
            continue
        try:
            rows.append((where, json.loads(text)))
        except json.JSONDecodeError as e:
            rows.append((where, Unreadable(f"not valid JSON ({e.msg} at column {e.colno}; one JSON object per line)")))
    return rows


def read_records(path: str | Path) -> list[tuple[str, Any]]:
    """A local JSONL (.jsonl/.json) or Parquet file as (where, raw record), not yet validated."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    if path.suffix == ".parquet":
        try:
            df = pl.read_parquet(path)
        except (pl.exceptions.PolarsError, OSError) as e:
            raise DatasetError(
                f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None
        return [(f"{path} row {n}", r) for n, r in enumerate(df.iter_rows(named=True), 1)]
    if path.suffix in (".jsonl", ".json"):
        return _json_lines(path)
    raise DatasetError(f"{path}: unsupported file type '{path.suffix}'; use .jsonl or .parquet")


def _hub_rows(preset: DatasetPreset, hub: HubSource, split: str | None = None):
    """Load a dataset from the Hugging Face hub (needs network or a populated HF cache); the preset's
    hf_id, hf_config, hf_split and revision override the format's."""
    try:
        import datasets as hf_datasets
    except ImportError as e:  # pragma: no cover - datasets is a runtime dependency
        raise DatasetError("the 'datasets' package is needed to load from the hub") from e
    hf_id = preset.hf_id or hub.id
    try:
        return hf_datasets.load_dataset(
            hf_id,
            preset.hf_config or hub.config,
            split=split or preset.hf_split or hub.split,
            revision=preset.revision,
        )
    except Exception as e:  # the hub raises many types; all mean "not reachable/available"
        raise DatasetError(
            f"could not load '{hf_id}' from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Offline, point the dataset preset's 'path' at a local JSONL/Parquet in the common "
            "schema (id, question, answers, context), e.g. tests/fixtures/qa_samples/"
        ) from None


# ------------------------------------------------------------------------- formats
# A dataset is data: a format (config.DatasetFormat; the built-in ones are halludetect/qa/formats/*.yaml,
# listed in core/registry.py) says where its hub rows' fields go in the common schema, and what is
# done to every record, hub or file. Python is only for a file of another shape (`reader`: BioASQ).
_MISSING = object()


def _path(row: Any, dotted: str) -> Any:
    """The value at a dotted path of a hub row ("answer.value"), or _MISSING."""
    for key in dotted.split("."):
        if not isinstance(row, dict) or key not in row:
            return _MISSING
        row = row[key]
    return row


def number_text(value: Any) -> Any:
    """A number as text: 51.0 -> "51" (SVAMP's 1,000 answers are all integers; a fraction stays "2.5").
    Anything but a number is passed on for the validator to name."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _field(row: Any, source: FieldSource, n: int, name: str) -> Any:
    """A hub row's value for one common-schema field (config.FieldSource); `n` is its 1-based row.
    A missing or mistyped source becomes `Unreadable`, naming the hub's field."""
    if isinstance(source, RowNumber):
        return str(n - 1 + source.row)
    if isinstance(source, Md5Of):
        text = _path(row, source.md5)
        return md5_id(text) if isinstance(text, str) else _bad(source.md5, text, "a string (the id is its md5)")
    if isinstance(source, Joined):
        parts = [_path(row, k) for k in source.join]
        for k, v in zip(source.join, parts):
            if not isinstance(v, str):
                return _bad(k, v, f"a string (the {name} joins {', '.join(source.join)})")
        return source.sep.join(v.strip() for v in parts)
    if isinstance(source, list):  # values concatenated: strings and lists of strings
        out: list = []
        for k in source:
            v = _path(row, k)
            if v is _MISSING:
                return _bad(k, v, f"a string or a list (the {name})")
            out.extend(v if isinstance(v, list) else [v])
        return out
    v = _path(row, source)
    if v is _MISSING:
        return _bad(source, v, f"the {name}") if name in ("question", "answers") else None
    return v


def _bad(key: str, value: Any, wanted: str) -> Unreadable:
    got = "missing" if value is _MISSING else _kind(value)
    return Unreadable(f"{key}: {got}, not {wanted}; check that the preset's hub id, config and split name this dataset")


def _hub_records(preset: DatasetPreset, fmt: DatasetFormat, where, split=None) -> list[tuple[str, Any]]:
    rows = []
    for n, row in enumerate(_hub_rows(preset, fmt.hub, split), 1):
        rec = {name: _field(row, src, n, name) for name, src in fmt.fields.items()}
        if fmt.answers == "number" and "answers" in rec:
            rec["answers"] = number_text(rec["answers"])
        bad = next((v for v in rec.values() if isinstance(v, Unreadable)), None)
        rows.append((where(n), bad if bad is not None else rec))
    return rows


def _renamed(where: str, raw: Any, file_fields: dict[str, str]) -> tuple[str, Any]:
    """A local record with the file's own field names (`file_fields`) read as the common ones, where
    the common name is absent."""
    if not isinstance(raw, dict):
        return where, raw
    for name, own in file_fields.items():
        if name in raw or own not in raw:
            continue
        v = raw[own]
        ok = v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        if not ok:
            return where, Unreadable(f"{own}: {_kind(v)}, not a string, a list of strings or null (read as {name})")
        raw = {**raw, name: v}
    return where, raw


def read_bioasq(path: Path, report: LoadReport) -> list[tuple[str, Any]]:
    """BioASQ Task B's JSON {"questions": [...]}: `body` the question, each item of `exact_answer` (a
    list of synonym lists for factoid and list questions) its first synonym; questions without an
    exact answer are dropped (counted)."""
    if not path.exists():
        raise DatasetError(
            f"BioASQ file {path} does not exist. BioASQ may not be redistributed: register at "
            "bioasq.org, download Task B 'training11b.json' and place it at that path "
            "(or set datasets.bioasq.path)"
        )
    try:
        questions = json.loads(path.read_bytes())["questions"]
        if not isinstance(questions, list):
            raise TypeError(f"'questions' is {_kind(questions)}")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DatasetError(f"{path}: expected BioASQ JSON {{'questions': [...]}} ({type(e).__name__}: {e})") from None
    rows = []
    for n, q in enumerate(questions, 1):
        where = f"{path} question {n}"
        if not isinstance(q, dict):
            rows.append((where, q))  # the validator names it
            continue
        exact = q.get("exact_answer")
        if exact is None:
            report.drop("bioasq: no exact_answer")
            continue
        items = exact if isinstance(exact, list) else [exact]
        answers = [a for a in (_first(i) for i in items) if isinstance(a, str)]
        rows.append((where, {"id": q.get("id"), "question": q.get("body"), "answers": answers, "context": None}))
    report.read = len(questions)
    return rows


def _first(x):
    while isinstance(x, list):
        if not x:
            return None
        x = x[0]
    return x


def load_format(
    preset: DatasetPreset, fmt: DatasetFormat, report: LoadReport, split: str | None = None
) -> list[Located]:
    """The validated records of a preset read through its format: its local file (`path`: in the
    common schema, or read by the format's `reader`) or its hub rows, then the format's transforms."""
    name = preset.loader or "file"
    if preset.path:
        path = Path(preset.path)
        if fmt.reader is not None:
            rows = registry.load_target(fmt.reader, f"datasets loader '{name}' reader")(path, report)
        else:
            rows = [_renamed(w, raw, fmt.file_fields) for w, raw in read_records(path)]
            report.read = len(rows)
        records = validate_records(rows, preset.path, report)
    else:
        hub_id = preset.hf_id or fmt.hub.id
        rows = _hub_records(preset, fmt, lambda n: f"{hub_id} (hub) row {n}", split)
        report.read = len(rows)
        records = validate_records(rows, f"{name} (hub)", report)
    out = []
    for x in records:
        if fmt.unanswerable is not None and not x.record.answers:
            report.drop(fmt.unanswerable)
            continue
        update = {}
        if fmt.question_suffix:
            update["question"] = x.record.question + fmt.question_suffix
        if fmt.context == "drop":
            update["context"] = None
        out.append(Located(x.where, x.record.model_copy(update=update), x.raw_id, x.rid) if update else x)
    return out


def load_records(preset: DatasetPreset, report: LoadReport, split: str | None = None) -> list[Located]:
    """The preset's validated records: its format's (above), or a plugin's Python loader's, which is
    called as loader(preset, report, split) and returns validated records (`validate_records`)."""
    fmt = dataset_format(preset)  # None: the loader is a function, not a format
    if fmt is not None:
        return load_format(preset, fmt, report, split)
    return registry.resolve("dataset", preset.loader)(preset, report, split)


# ---------------------------------------------------------------------- normalise
def normalise(records: list[Located], report: LoadReport) -> list[dict]:
    """Common-schema rows; records with no usable reference answer are dropped (counted)."""
    out = []
    for x in records:
        if not x.record.answers:
            report.drop("no reference answer")
        else:
            out.append(
                {
                    "id": x.rid,
                    "question": x.record.question,
                    "answers": x.record.answers,
                    "context": x.record.context,
                    "incorrect_answers": x.record.incorrect_answers,
                    "category": x.record.category,
                }
            )
    return out


def assign_splits(ids: list[str], params: PrepareParams) -> list[str]:
    """Question-level split, stable under adding or removing other questions.

    Each id is ranked by a seeded hash; the first `train` fraction of the ranking is train,
    and so on. A question keeps its split when the dataset grows.
    """
    order = sorted(range(len(ids)), key=lambda i: hashlib.sha256(f"{params.seed}:{ids[i]}".encode()).digest())
    n = len(ids)
    n_train = round(params.train * n)
    n_val = round(params.val * n)
    split = [""] * n
    for rank, i in enumerate(order):
        split[i] = "train" if rank < n_train else "val" if rank < n_train + n_val else "test"
    return split


def _ranked(rows: list[dict], seed: int) -> list[dict]:
    """Rows in a seeded hash order of their ids: a question's rank never depends on the others."""
    return sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).digest())


def _load(preset: DatasetPreset, report: LoadReport, split: str | None = None) -> list[dict]:
    """A source's usable common-schema rows; `report.read` adds up over the sources loaded."""
    before = report.read
    records = load_records(preset, report, split)  # sets report.read to its own count
    report.read += before
    return normalise(records, report)


def sized_splits(preset: DatasetPreset, name: str, params: PrepareParams, report: LoadReport) -> list[dict]:
    """Exactly `preset.sizes` questions per split (the paper's setup), the first of each source in
    the seeded order. With `train_hf_split`, train questions come from that hub split and val/test
    from the preset's own (so NQ-open's 3,610 validation questions still give 4,000 train ones);
    a question in both is kept for evaluation only."""
    n = preset.sizes
    if preset.train_hf_split is not None and preset.path is None:
        evaluation = _ranked(_load(preset, report), params.seed)
        held_out = {r["id"] for r in evaluation}
        train_rows = _load(preset, report, split=preset.train_hf_split)
        train = _ranked([r for r in train_rows if r["id"] not in held_out], params.seed)
        sources = {
            "train": (train, f"hub split '{preset.train_hf_split}'"),
            "eval": (evaluation, f"hub split '{preset.hf_split or 'the loader default'}'"),
        }
    else:
        everything = _ranked(_load(preset, report), params.seed)
        train, evaluation = everything[: n.train], everything[n.train :]
        sources = {"train": (train, "the source"), "eval": (evaluation, "the source after the train questions")}
    need = {"train": n.train, "eval": n.val + n.test}
    short = [
        f"{k} needs {need[k]}, {where} has {len(rows)}" for k, (rows, where) in sources.items() if len(rows) < need[k]
    ]
    if short:
        raise DatasetError(
            f"datasets.{name}.sizes asks for more usable questions than there are ({'; '.join(short)}); "
            "lower sizes or point the preset at a larger source"
        )
    out = [{**r, "split": "train"} for r in train[: n.train]]
    out += [{**r, "split": "val"} for r in evaluation[: n.val]]
    out += [{**r, "split": "test"} for r in evaluation[n.val : n.val + n.test]]
    return out


def prepare(preset: DatasetPreset, params: PrepareParams, name: str = "dataset") -> tuple[pl.DataFrame, LoadReport]:
    report = LoadReport()
    if preset.sizes is not None:
        rows = sized_splits(preset, name, params, report)
        df = pl.DataFrame(rows, schema=SCHEMA)
        return df.sort("id"), report
    rows = _load(preset, report)
    if preset.max_questions is not None:
        rows = _ranked(rows, params.seed)[: preset.max_questions]
    if not rows:
        raise DatasetError(f"no usable questions after loading ({report.dropped or 'the source is empty'})")
    splits = assign_splits([r["id"] for r in rows], params)
    if empty := [s for s in SPLITS if s not in splits]:
        keys = ", ".join(f"prepare.{s} = {getattr(params, s):g}" for s in empty)
        raise DatasetError(
            f"{len(rows)} questions leave the {' and '.join(empty)} split empty ({keys}): raise "
            "the fraction or use more questions (train, val and test are all needed)"
        )
    df = pl.DataFrame([{**r, "split": s} for r, s in zip(rows, splits)], schema=SCHEMA)
    return df.sort("id"), report
