"""QA loaders into one common schema, and the question-level split.

Common schema (one row per question):
    id: str, question: str, answers: list[str] (non-empty), context: str | None,
    split: "train" | "val" | "test"

Every loader first produces raw records {id, question, answers, context}, from the hub or
from a local file, then the same per-dataset convention is applied (SQuAD: answerable only;
NQ-open: "?" appended as the semantic-entropy code does; BioASQ: questions with an
exact_answer). So the local samples shipped in tests/fixtures exercise the conventions the
hub path uses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from halludetect.config import DatasetPreset, PrepareParams
from halludetect.errors import UserError

SCHEMA = {
    "id": pl.String,
    "question": pl.String,
    "answers": pl.List(pl.String),
    "context": pl.String,
    "split": pl.String,
}
SPLITS = ("train", "val", "test")


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


@dataclass
class LoadReport:
    """What a loader dropped and why: counted, never silent."""

    read: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


# ------------------------------------------------------------------- local readers
def read_records(path: str | Path) -> list[dict]:
    """A local JSONL or Parquet file of records with at least id, question, answers."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    if path.suffix == ".parquet":
        return pl.read_parquet(path).to_dicts()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        return rows
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
            hf_id, preset.hf_config or default_config, split=preset.hf_split or default_split,
            revision=preset.revision,
        )
    except Exception as e:  # the hub raises many types; all mean "not reachable/available"
        raise DatasetError(
            f"could not load '{hf_id}' from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Offline, point the dataset preset's 'path' at a local JSONL/Parquet in the common "
            "schema (id, question, answers, context), e.g. tests/fixtures/qa_samples/"
        ) from None


# ------------------------------------------------------------------------- loaders
def _load_file(preset: DatasetPreset, report: LoadReport) -> list[dict]:
    """The world's qa.jsonl and any user file are already in the common schema."""
    return read_records(preset.path)


def _load_trivia_qa(preset: DatasetPreset, report: LoadReport) -> list[dict]:
    if preset.path:
        return read_records(preset.path)
    ds = _hub_rows(preset, "trivia_qa", "rc.nocontext", "validation")
    return [
        {
            "id": md5_id(r["question"]),
            "question": r["question"],
            "answers": [r["answer"]["value"], *r["answer"]["aliases"]],
            "context": None,
        }
        for r in ds
    ]


def _load_squad(preset: DatasetPreset, report: LoadReport) -> list[dict]:
    if preset.path:
        rows = read_records(preset.path)
    else:
        ds = _hub_rows(preset, "squad_v2", None, "validation")
        rows = [
            {"id": r["id"], "question": r["question"], "answers": r["answers"]["text"], "context": r["context"]}
            for r in ds
        ]
    kept = []
    for r in rows:  # SQuAD v2 unanswerable questions have no reference: not usable here
        if r.get("answers"):
            kept.append(r)
        else:
            report.drop("squad: unanswerable (no reference answer)")
    return kept


def _load_nq(preset: DatasetPreset, report: LoadReport) -> list[dict]:
    if preset.path:
        rows = read_records(preset.path)
    else:
        ds = _hub_rows(preset, "nq_open", None, "validation")
        rows = [{"id": md5_id(r["question"]), "question": r["question"], "answers": r["answer"]} for r in ds]
    # NQ-open questions are lower-case fragments without "?"; the peers append it.
    return [{**r, "question": r["question"].rstrip() + "?", "context": None} for r in rows]


def _first(x):
    while isinstance(x, list):
        if not x:
            return None
        x = x[0]
    return x


def _load_bioasq(preset: DatasetPreset, report: LoadReport) -> list[dict]:
    path = Path(preset.path)
    if not path.exists():
        raise DatasetError(
            f"BioASQ file {path} does not exist. BioASQ may not be redistributed: register at "
            "bioasq.org, download Task B 'training11b.json' and place it at that path "
            "(or set datasets.bioasq.path)"
        )
    try:
        questions = json.loads(path.read_text())["questions"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DatasetError(f"{path}: expected BioASQ JSON {{'questions': [...]}} ({e})") from None
    rows = []
    for q in questions:
        exact = q.get("exact_answer")
        if exact is None:
            report.drop("bioasq: no exact_answer")
            continue
        # factoid/list answers are lists of synonym lists: keep each item's first synonym.
        items = exact if isinstance(exact, list) else [exact]
        answers = [a for a in (_first(i) for i in items) if isinstance(a, str)]
        rows.append({"id": q["id"], "question": q["body"], "answers": answers, "context": None})
    return rows


LOADERS: dict[str, Callable[[DatasetPreset, LoadReport], list[dict]]] = {
    "world": _load_file,
    "file": _load_file,
    "trivia_qa": _load_trivia_qa,
    "squad": _load_squad,
    "nq": _load_nq,
    "bioasq": _load_bioasq,
}


# ---------------------------------------------------------------------- normalise
def normalise(rows: list[dict], report: LoadReport) -> list[dict]:
    """Validate, de-duplicate answers and ids, drop rows with no usable answer (counted)."""
    out, seen = [], set()
    for n, r in enumerate(rows):
        missing = [k for k in ("question", "answers") if k not in r]
        if missing:
            raise DatasetError(f"record {n} lacks {missing}; the common schema needs id, question, answers")
        question = str(r["question"]).strip()
        answers = r["answers"] if isinstance(r["answers"], list) else [r["answers"]]
        answers = _dedupe(str(a) for a in answers if a is not None)
        rid = str(r.get("id") or md5_id(question))
        if not question:
            report.drop("empty question")
        elif not answers:
            report.drop("no reference answer")
        elif rid in seen:
            report.drop("duplicate id")
        else:
            seen.add(rid)
            out.append({"id": rid, "question": question, "answers": answers, "context": r.get("context")})
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


def prepare(preset: DatasetPreset, params: PrepareParams) -> tuple[pl.DataFrame, LoadReport]:
    report = LoadReport()
    rows = LOADERS[preset.loader](preset, report)
    report.read = len(rows)
    rows = normalise(rows, report)
    if preset.max_questions is not None:
        rows = sorted(rows, key=lambda r: hashlib.sha256(f"{params.seed}:{r['id']}".encode()).digest())
        rows = rows[: preset.max_questions]
    if not rows:
        raise DatasetError(f"no usable questions after loading ({report.dropped or 'the source is empty'})")
    splits = assign_splits([r["id"] for r in rows], params)
    df = pl.DataFrame([{**r, "split": s} for r, s in zip(rows, splits)], schema=SCHEMA)
    return df.sort("id"), report


def read_questions(path: str | Path) -> pl.DataFrame:
    df = pl.read_parquet(path)
    missing = set(SCHEMA) - set(df.columns)
    if missing:
        raise DatasetError(f"{path}: not a questions file (missing columns {sorted(missing)})")
    return df
