"""QA loaders into one common schema, and the question-level split.

Common schema (one row per question):
    id: str, question: str, answers: list[str] (non-empty), context: str | None,
    split: "train" | "val" | "test",
    incorrect_answers: list[str] (known wrong answers, for the judge; [] for most datasets),
    category: str | None (TruthfulQA's category; null elsewhere)

Every loader first produces raw records {id, question, answers, context}, from the hub or
from a local file, each with where it came from (file and 1-based line, Parquet row, hub
row). One typed validator (`QARecord`) checks them all and reports every problem at once,
as `<file>:<line>: <field>: <what> (<fix>)`, before anything is written. Then the same
per-dataset convention is applied (SQuAD: answerable only; NQ-open: "?" appended as the
semantic-entropy code does; BioASQ: questions with an exact_answer). So the local samples
shipped in tests/fixtures exercise the conventions the hub path uses.

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
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from halludetect.config import DatasetPreset, PrepareParams
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
MAX_LISTED = 20  # problems shown in one error message (all are counted)


class DatasetError(UserError, ValueError):
    """A dataset file or hub dataset that cannot be read into the common schema."""


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


def control_characters(text: str) -> list[str]:
    """The control characters in `text` (NUL, ESC, ...), named: HDF5 and file names refuse them."""
    return [
        unicodedata.name(c, f"U+{ord(c):04X}") if c != "\0" else "NUL" for c in text if unicodedata.category(c) == "Cc"
    ]


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


def _hub_rows(preset: DatasetPreset, default_id: str, default_config: str | None, default_split: str):
    """Load a dataset from the Hugging Face hub (needs network or a populated HF cache)."""
    try:
        import datasets as hf_datasets
    except ImportError as e:  # pragma: no cover - datasets is a runtime dependency
        raise DatasetError("the 'datasets' package is needed to load from the hub") from e
    hf_id = preset.hf_id or default_id
    try:
        return hf_datasets.load_dataset(
            hf_id,
            preset.hf_config or default_config,
            split=preset.hf_split or default_split,
            revision=preset.revision,
        )
    except Exception as e:  # the hub raises many types; all mean "not reachable/available"
        raise DatasetError(
            f"could not load '{hf_id}' from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Offline, point the dataset preset's 'path' at a local JSONL/Parquet in the common "
            "schema (id, question, answers, context), e.g. tests/fixtures/qa_samples/"
        ) from None


def _hub_where(preset: DatasetPreset, default_id: str) -> Callable[[int], str]:
    return lambda n: f"{preset.hf_id or default_id} (hub) row {n}"


# ------------------------------------------------------------------------- loaders
# Each returns validated records; `prepare` applies ids' collision checks, sampling and splits.
def _load_file(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    """The world's qa.jsonl and any user file are already in the common schema."""
    rows = read_records(preset.path)
    report.read = len(rows)
    return validate_records(rows, preset.path, report)


def _load_trivia_qa(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    if preset.path:
        return _load_file(preset, report)
    ds = _hub_rows(preset, "trivia_qa", "rc.nocontext", "validation")
    where = _hub_where(preset, "trivia_qa")
    rows = [
        (
            where(n),
            {
                "id": md5_id(r["question"]),
                "question": r["question"],
                "answers": [r["answer"]["value"], *r["answer"]["aliases"]],
                "context": None,
            },
        )
        for n, r in enumerate(ds, 1)
    ]
    report.read = len(rows)
    return validate_records(rows, "trivia_qa (hub)", report)


def _load_squad(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    if preset.path:
        records = _load_file(preset, report)
    else:
        ds = _hub_rows(preset, "squad_v2", None, "validation")
        where = _hub_where(preset, "squad_v2")
        rows = [
            (where(n), {"id": r["id"], "question": r["question"], "answers": r["answers"], "context": r["context"]})
            for n, r in enumerate(ds, 1)
        ]
        report.read = len(rows)
        records = validate_records(rows, "squad_v2 (hub)", report)
    kept = []
    for x in records:  # SQuAD v2 unanswerable questions have no reference: not usable here
        if x.record.answers:
            kept.append(x)
        else:
            report.drop("squad: unanswerable (no reference answer)")
    return kept


def _load_nq(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    if preset.path:
        records = _load_file(preset, report)
    else:
        ds = _hub_rows(preset, "nq_open", None, "validation")
        where = _hub_where(preset, "nq_open")
        rows = [
            (where(n), {"id": md5_id(r["question"]), "question": r["question"], "answers": r["answer"]})
            for n, r in enumerate(ds, 1)
        ]
        report.read = len(rows)
        records = validate_records(rows, "nq_open (hub)", report)
    # NQ-open questions are lower-case fragments without "?"; the peers append it.
    return [
        Located(
            x.where, x.record.model_copy(update={"question": x.record.question + "?", "context": None}), x.raw_id, x.rid
        )
        for x in records
    ]


def _first(x):
    while isinstance(x, list):
        if not x:
            return None
        x = x[0]
    return x


def _load_bioasq(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    path = Path(preset.path)
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
        # factoid/list answers are lists of synonym lists: keep each item's first synonym.
        items = exact if isinstance(exact, list) else [exact]
        answers = [a for a in (_first(i) for i in items) if isinstance(a, str)]
        rows.append((where, {"id": q.get("id"), "question": q.get("body"), "answers": answers, "context": None}))
    report.read = len(questions)
    return validate_records(rows, str(path), report)


def _load_truthful_qa(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    """TruthfulQA's generation set (817 questions, one split). answers: the best answer, then the
    correct ones; incorrect_answers and category are kept for the judge. The id is the 0-based
    row, as in the shipped sample (the upstream CSV's row order, which the hub keeps)."""
    if preset.path:
        return _load_file(preset, report)
    ds = _hub_rows(preset, "truthfulqa/truthful_qa", "generation", "validation")
    where = _hub_where(preset, "truthfulqa/truthful_qa")
    rows = [
        (
            where(n),
            {
                "id": str(n - 1),
                "question": r["question"],
                # the hub keeps the empty piece a trailing ';' leaves: _dedupe drops it
                "answers": [r["best_answer"], *r["correct_answers"]],
                "incorrect_answers": r["incorrect_answers"],
                "category": r["category"],
                "context": None,
            },
        )
        for n, r in enumerate(ds, 1)
    ]
    report.read = len(rows)
    return validate_records(rows, "truthful_qa (hub)", report)


def _halueval_wrong_answer(where: str, raw: Any) -> tuple[str, Any]:
    """A local HaluEval record with its `hallucinated_answer` read as the known wrong answer."""
    if not isinstance(raw, dict) or "hallucinated_answer" not in raw or "incorrect_answers" in raw:
        return where, raw
    wrong = raw["hallucinated_answer"]
    if wrong is not None and not isinstance(wrong, str):
        return where, Unreadable(
            f"hallucinated_answer: {_kind(wrong)}, not a string or null (HaluEval's one wrong answer, as text)"
        )
    return where, {**raw, "incorrect_answers": wrong}


def _load_halueval_qa(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    """HaluEval QA (10,000 HotpotQA questions): the right answer as the reference, the knowledge
    passage as context (kept for the leak check, not shown to the model), the hallucinated answer
    as a known wrong one. The id is the 0-based row of qa_data.json, as in the shipped sample."""
    if preset.path:
        # the shared sample's shape (and HaluEval's own): the wrong answer is `hallucinated_answer`
        rows = [_halueval_wrong_answer(where, raw) for where, raw in read_records(preset.path)]
        report.read = len(rows)
        return validate_records(rows, preset.path, report)
    ds = _hub_rows(preset, "pminervini/HaluEval", "qa", "data")
    where = _hub_where(preset, "pminervini/HaluEval")
    rows = [
        (
            where(n),
            {
                "id": str(n - 1),
                "question": r["question"],
                "answers": r["right_answer"],
                "incorrect_answers": r["hallucinated_answer"],
                "context": r["knowledge"],
            },
        )
        for n, r in enumerate(ds, 1)
    ]
    report.read = len(rows)
    return validate_records(rows, "halueval_qa (hub)", report)


def svamp_answer(value: Any) -> Any:
    """SVAMP's Answer as text: 51.0 -> "51" (all 1,000 are integers; a fraction stays "2.5").
    Anything but a number is passed on for the validator to name."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _load_svamp(preset: DatasetPreset, report: LoadReport) -> list[Located]:
    """SVAMP (1,000 arithmetic word problems). Prompt 1 shows the question alone, so the question is
    the whole problem, Body + " " + Question (the semantic-entropy code's split, Question as the
    question and Body as the context, would ask "How much do you have to pay?" with no numbers);
    context stays null. The answer is the number as text ("51", not "51.0")."""
    if preset.path:
        return _load_file(preset, report)
    ds = _hub_rows(preset, "ChilleD/SVAMP", None, "test")
    where = _hub_where(preset, "ChilleD/SVAMP")
    rows = []
    for n, r in enumerate(ds, 1):
        body, question = r.get("Body"), r.get("Question")
        bad = next((k for k, v in (("Body", body), ("Question", question)) if not isinstance(v, str)), None)
        if bad is not None:  # the validator reports it with the rest
            rows.append(
                (
                    where(n),
                    Unreadable(
                        f"{bad}: {_kind(r.get(bad))}, not a string (SVAMP's problem text; check that "
                        "hf_id, hf_config and hf_split name SVAMP)"
                    ),
                )
            )
            continue
        rows.append(
            (
                where(n),
                {
                    "id": r.get("ID"),
                    "question": f"{body.strip()} {question.strip()}",
                    "answers": svamp_answer(r.get("Answer")),
                    "context": None,
                },
            )
        )
    report.read = len(rows)
    return validate_records(rows, "svamp (hub)", report)


LOADERS: dict[str, Callable[[DatasetPreset, LoadReport], list[Located]]] = {
    "world": _load_file,
    "file": _load_file,
    "trivia_qa": _load_trivia_qa,
    "squad": _load_squad,
    "nq": _load_nq,
    "bioasq": _load_bioasq,
    "truthful_qa": _load_truthful_qa,
    "halueval_qa": _load_halueval_qa,
    "svamp": _load_svamp,
}


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


def _load(preset: DatasetPreset, report: LoadReport) -> list[dict]:
    """A source's usable common-schema rows; `report.read` adds up over the sources loaded."""
    before = report.read
    records = LOADERS[preset.loader](preset, report)  # sets report.read to its own count
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
        train_rows = _load(preset.model_copy(update={"hf_split": preset.train_hf_split}), report)
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
