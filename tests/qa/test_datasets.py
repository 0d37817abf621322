"""QA loaders and the split (halludetect/qa/datasets.py): each loader on a sample of its source, the
common schema, exact split sizes from one source or two hub splits, stable splits; and the
hostile cases, every bad record named by file and 1-based line (null, numeric or list questions,
nested answers, colliding ids, NUL in an id, JSON arrays, Latin-1 bytes, a missing field), all of
them at once, with nothing written."""

import json
from pathlib import Path

import polars as pl
import pytest
from support import ROOT, base_params, stage, write_params

from halludetect.config import DatasetPreset, PrepareParams
from halludetect.qa.datasets import DatasetError, assign_splits, md5_id, prepare, read_questions

SAMPLES = ROOT / "tests" / "fixtures" / "qa_samples"


SPLIT = PrepareParams(seed=0, train=0.5, val=0.2, test=0.3)


THIRDS = PrepareParams(seed=0, train=0.34, val=0.33, test=0.33)  # 3 questions: one per split


def test_trivia_qa_sample():
    df, report = prepare(DatasetPreset(loader="trivia_qa", path=str(SAMPLES / "trivia_qa.jsonl")), SPLIT)
    assert df.height == 500 and report.dropped == {}
    row = df.filter(df["question"].str.starts_with("What type of animal is a dik-dik")).row(0, named=True)
    assert row["answers"][0] == "Antelope" and "Antelopes" in row["answers"]
    assert row["id"] == md5_id(row["question"])  # the semantic-entropy id scheme


def test_squad_keeps_answerable_only():
    df, report = prepare(DatasetPreset(loader="squad", path=str(SAMPLES / "squad.jsonl")), SPLIT)
    assert df.height == 263
    assert report.dropped == {"squad: unanswerable (no reference answer)": 237}
    assert df["context"].null_count() == 0  # SQuAD keeps its passage


def test_nq_appends_question_mark():
    df, _ = prepare(DatasetPreset(loader="nq", path=str(SAMPLES / "nq_open.jsonl")), SPLIT)
    assert df.height == 500
    assert df["question"].str.ends_with("?").all()
    assert "when was the last time anyone was on the moon?" in df["question"].to_list()


def test_bioasq_local_file(tmp_path):
    data = {
        "questions": [
            {"id": "a1", "type": "factoid", "body": "Which gene is mutated?", "exact_answer": [["BRCA1", "brca-1"]]},
            {"id": "a2", "type": "list", "body": "Name two drugs.", "exact_answer": [["aspirin"], ["ibuprofen"]]},
            {"id": "a3", "type": "yesno", "body": "Is it?", "exact_answer": "yes"},
            {"id": "a4", "type": "summary", "body": "Explain."},
        ]
    }
    path = tmp_path / "training11b.json"
    path.write_text(json.dumps(data))
    df, report = prepare(DatasetPreset(loader="bioasq", path=str(path)), THIRDS)
    answers = dict(zip(df["id"], df["answers"].to_list()))
    assert answers == {"a1": ["BRCA1"], "a2": ["aspirin", "ibuprofen"], "a3": ["yes"]}
    assert report.dropped == {"bioasq: no exact_answer": 1}


def test_bioasq_missing_file_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetError, match="register at bioasq.org.*training11b.json"):
        prepare(DatasetPreset(loader="bioasq", path=str(tmp_path / "training11b.json")), SPLIT)


def test_generic_file_and_bad_records(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(
        '{"question": "Q1?", "answers": ["a"]}\n{"question": "Q2?", "answers": "b"}\n'
        '{"question": "Q3?", "answers": []}\n{"question": "Q4?", "answers": ["c"]}\n'
    )
    df, report = prepare(DatasetPreset(loader="file", path=str(good)), THIRDS)
    assert df.height == 3 and report.dropped == {"no reference answer": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Q1?"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: answers: missing"):
        prepare(DatasetPreset(loader="file", path=str(bad)), SPLIT)
    csv = tmp_path / "x.csv"
    csv.write_text("question,answers\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        prepare(DatasetPreset(loader="file", path=str(csv)), SPLIT)


def test_hub_loader_offline_error_names_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match="point the dataset preset's 'path' at a local"):
        prepare(DatasetPreset(loader="nq"), SPLIT)


def test_split_sizes_and_stability():
    ids = [str(i) for i in range(1000)]
    split = assign_splits(ids, SPLIT)
    assert [split.count(s) for s in ("train", "val", "test")] == [500, 200, 300]
    # adding questions never moves existing ones across val/test <-> train much: stable hashing
    more = assign_splits(ids + [str(i) for i in range(1000, 1100)], SPLIT)
    moved = sum(a != b for a, b in zip(split, more))
    assert moved < 60
    assert assign_splits(ids, SPLIT) == split  # deterministic


def test_max_questions_and_schema():
    preset = DatasetPreset(loader="trivia_qa", path=str(SAMPLES / "trivia_qa.jsonl"), max_questions=100)
    df, _ = prepare(preset, SPLIT)
    assert df.height == 100
    assert df.columns == ["id", "question", "answers", "context", "split"]
    assert set(df["split"]) == {"train", "val", "test"}


def test_sizes_give_exact_question_counts_from_one_source():
    preset = DatasetPreset(
        loader="trivia_qa", path=str(SAMPLES / "trivia_qa.jsonl"), sizes={"train": 300, "val": 80, "test": 120}
    )
    df, _ = prepare(preset, SPLIT, "tqa")
    assert {s: int(n) for s, n in df.group_by("split").len().iter_rows()} == {"train": 300, "val": 80, "test": 120}
    again, _ = prepare(preset, SPLIT, "tqa")
    assert again.equals(df)  # deterministic for a seed
    too_many = DatasetPreset(
        loader="trivia_qa", path=str(SAMPLES / "trivia_qa.jsonl"), sizes={"train": 400, "val": 100, "test": 100}
    )
    with pytest.raises(
        DatasetError,
        match=r"datasets.tqa.sizes asks for more .*eval needs 200, the source after "
        r"the train questions has 100",
    ):
        prepare(too_many, SPLIT, "tqa")


def test_train_questions_come_from_their_own_hub_split(monkeypatch):
    """As the paper must have for NQ-open (3,610 validation questions, 4,000 train ones): train
    from the hub's train split, val/test from its validation split, no question in both."""
    from halludetect.qa import datasets

    def fake_hub(preset, default_id, default_config, default_split):
        split = preset.hf_split or default_split
        if split == "validation":
            return [{"question": f"eval question {i}", "answer": ["a"]} for i in range(30)]
        assert split == "train"
        return [{"question": f"train question {i}", "answer": ["a"]} for i in range(50)] + [
            {"question": f"eval question {i}", "answer": ["a"]} for i in range(5)
        ]  # overlap with validation

    monkeypatch.setattr(datasets, "_hub_rows", fake_hub)
    preset = DatasetPreset(loader="nq", sizes={"train": 45, "val": 10, "test": 20}, train_hf_split="train")
    df, report = prepare(preset, SPLIT, "nq")
    by = {s: df.filter(df["split"] == s)["question"].to_list() for s in ("train", "val", "test")}
    assert [len(by[s]) for s in ("train", "val", "test")] == [45, 10, 20]
    assert all(q.startswith("train question") for q in by["train"])  # the overlapping five stay out of train
    assert not set(by["val"]) & set(by["test"]) and report.read == 85
    with pytest.raises(DatasetError, match="train needs 51, hub split 'train' has 50"):
        prepare(preset.model_copy(update={"sizes": preset.sizes.model_copy(update={"train": 51})}), SPLIT, "nq")


def test_sizes_are_checked_with_the_other_keys():
    with pytest.raises(ValueError, match="remove max_questions"):
        DatasetPreset(loader="nq", max_questions=10, sizes={"train": 1, "val": 1, "test": 1})
    with pytest.raises(ValueError, match="set sizes too"):
        DatasetPreset(loader="nq", train_hf_split="train")


def test_the_paper_presets_carry_the_papers_sizes():
    from halludetect.config import load_params

    p = load_params("params.yaml")
    for name in ("trivia_qa", "squad", "nq"):
        d = p.dataset(name)
        assert (d.sizes.train, d.sizes.val, d.sizes.test, d.train_hf_split) == (4000, 800, 1200, "train"), name
    bio = p.dataset("bioasq")
    assert (bio.sizes.train, bio.sizes.val, bio.sizes.test, bio.train_hf_split) == (2300, 600, 600, None)


# -------------------------------------------------------------------- bad records (hostile)
GOOD = [json.dumps({"id": f"g{i}", "question": f"Good question {i}?", "answers": [f"a{i}"]}) for i in range(10)]


def qa_file(tmp_path: Path, lines: list, name: str = "qa.jsonl") -> Path:
    """A QA file: the 10 good records first (lines 1-10), then `lines` (line 11 on)."""
    path = tmp_path / name
    with path.open("wb") as f:
        for line in [*GOOD, *lines]:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


def prepare_error(path: Path) -> str:
    with pytest.raises(DatasetError) as e:
        prepare(DatasetPreset(loader="file", path=str(path)), SPLIT)
    return str(e.value)


@pytest.mark.hostile
def test_prepare_rejects_a_null_question_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": null, "answers": ["Paris"]}'])
    assert f"{path}:11: question: null (every record needs the question text)" in prepare_error(path)


@pytest.mark.hostile
def test_prepare_rejects_a_numeric_question_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": 42, "answers": ["Paris"]}'])
    assert f"{path}:11: question: a number (42), not a string" in prepare_error(path)


@pytest.mark.hostile
def test_prepare_rejects_a_list_question_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": ["Where", "born?"], "answers": ["Paris"]}'])
    assert f"{path}:11: question: a list, not a string (join the words into one string)" in prepare_error(path)


@pytest.mark.hostile
def test_prepare_reads_the_text_of_a_squad_style_answers_dict(tmp_path):
    path = qa_file(
        tmp_path, ['{"id": "x", "question": "Where?", "answers": {"text": ["Paris", "Paris"], "answer_start": [3, 3]}}']
    )
    df, _ = prepare(DatasetPreset(loader="file", path=str(path)), SPLIT)
    assert df.filter(pl.col("id") == "x")["answers"].to_list() == [["Paris"]]


@pytest.mark.hostile
def test_prepare_rejects_a_nested_answers_list_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": "Where?", "answers": [["Paris"], "Lyon"]}'])
    msg = prepare_error(path)
    assert f"{path}:11: answers: item 0 is a list, not a string (answers must be a flat list of strings)" in msg


@pytest.mark.hostile
def test_prepare_keeps_id_0_as_a_real_id(tmp_path):
    path = qa_file(tmp_path, ['{"id": 0, "question": "Zero?", "answers": ["none"]}'])
    df, _ = prepare(DatasetPreset(loader="file", path=str(path)), SPLIT)
    assert df.filter(pl.col("question") == "Zero?")["id"].to_list() == ["0"]
    assert md5_id("Zero?") not in df["id"].to_list()


@pytest.mark.hostile
def test_prepare_rejects_ids_7_and_string_7_naming_both_lines(tmp_path):
    path = qa_file(
        tmp_path,
        ['{"id": 7, "question": "Seven?", "answers": ["a"]}', '{"id": "7", "question": "Seven?", "answers": ["a"]}'],
    )
    assert (
        f"{path}:12: id: '7' and 7 at {path}:11 both become the id '7' (give one of them another id)"
        in prepare_error(path)
    )


@pytest.mark.hostile
def test_prepare_rejects_a_repeated_id_with_another_question_naming_both_lines(tmp_path):
    path = qa_file(
        tmp_path,
        ['{"id": "d", "question": "First?", "answers": ["a"]}', '{"id": "d", "question": "Second?", "answers": ["a"]}'],
    )
    assert (
        f"{path}:12: id: 'd' is also the id of {path}:11, with another question, answers or context (ids must "
        "be unique: rename one, or remove the repeat)"
    ) in prepare_error(path)


@pytest.mark.hostile
def test_prepare_drops_exact_repeats_and_counts_them_with_their_ids(tmp_path):
    path = qa_file(tmp_path, ['{"id": "r", "question": "Again?", "answers": ["a"]}'] * 3)
    data = base_params()
    data["datasets"]["mine"] = {"loader": "file", "path": str(path)}
    res = stage(
        "stages.prepare",
        "--params",
        str(write_params(tmp_path / "params.yaml", data)),
        "--dataset",
        "mine",
        "--out",
        str(tmp_path / "q.parquet"),
        "--metrics",
        str(tmp_path / "m.json"),
    )
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["repeated_records"] == {"count": 2, "ids": ["r", "r"]} and m["dropped"] == {} and m["questions"] == 11


@pytest.mark.hostile
def test_prepare_rejects_a_nul_in_a_question_id_before_any_forward_pass(tmp_path):
    path = qa_file(tmp_path, ['{"id": "q\\u0000x", "question": "Nul?", "answers": ["a"]}'])
    assert (
        f"{path}:11: id: 'q\\x00x' contains the control character NUL (HDF5 files and file names cannot hold "
        "it: remove it)"
    ) in prepare_error(path)


@pytest.mark.hostile
def test_generate_and_dump_refuse_a_hand_made_questions_file_with_a_nul_id(tmp_path):
    path = tmp_path / "questions.parquet"
    pl.DataFrame(
        {
            "id": ["ok", "bad\x00id"],
            "question": ["A?", "B?"],
            "answers": [["a"], ["b"]],
            "context": [None, None],
            "split": ["train", "test"],
        },
        schema={
            "id": pl.String,
            "question": pl.String,
            "answers": pl.List(pl.String),
            "context": pl.String,
            "split": pl.String,
        },
    ).write_parquet(path)
    with pytest.raises(
        DatasetError,
        match=r"questions.parquet: ids with control characters \(HDF5 cannot hold "
        r"them\): \['bad\\x00id'\]; re-run prepare",
    ):
        read_questions(path)


@pytest.mark.hostile
def test_prepare_names_file_and_line_of_a_json_array_line(tmp_path):
    path = qa_file(tmp_path, ['["Where?", "Paris"]'])
    assert f"{path}:11: record: a list, not an object (each record is one JSON object" in prepare_error(path)


@pytest.mark.hostile
def test_prepare_names_file_and_line_of_a_json_string_line(tmp_path):
    path = qa_file(tmp_path, ['"Where was he born?"'])
    assert f"{path}:11: record: a string, not an object" in prepare_error(path)


@pytest.mark.hostile
def test_prepare_names_file_and_line_of_latin1_bytes(tmp_path):
    line = '{"id": "c", "question": "Caf\u00e9?", "answers": ["x"]}'.encode("latin-1")
    path = qa_file(tmp_path, [line])
    assert (
        f"{path}:11: not UTF-8 (byte 0xe9 at column {line.index(0xE9) + 1}; re-save the file as UTF-8, e.g. "
        "`iconv -f latin1 -t utf-8`)"
    ) in prepare_error(path)


@pytest.mark.hostile
def test_prepare_refuses_a_json_file_holding_an_array_with_the_fix(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"question": "Where?", "answers": ["Paris"]}]))
    assert prepare_error(path).startswith(
        f"{path}:1: the file holds one JSON array; records are read as JSON "
        "Lines, one object per line: convert it (e.g. `jq -c '.[]' qa.json > "
        "qa.jsonl`)"
    )


@pytest.mark.hostile
def test_prepare_names_file_and_1_based_line_of_a_missing_field(tmp_path):
    path = qa_file(tmp_path, ['{"id": "m", "question": "Where?"}'])
    assert (
        f"{path}:11: answers: missing (the common schema needs question and answers; id and context are optional)"
    ) in prepare_error(path)


@pytest.mark.hostile
def test_prepare_reports_every_bad_record_at_once_and_the_stage_writes_nothing(tmp_path):
    path = qa_file(
        tmp_path,
        ['{"id": "a", "question": null, "answers": ["x"]}', "[1]", '{"id": "b", "question": "Q?", "answers": 3}'],
    )
    data = base_params()
    data["datasets"]["mine"] = {"loader": "file", "path": str(path)}
    res = stage(
        "stages.prepare",
        "--params",
        str(write_params(tmp_path / "params.yaml", data)),
        "--dataset",
        "mine",
        "--out",
        str(tmp_path / "q.parquet"),
        "--metrics",
        str(tmp_path / "m.json"),
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {path}: 3 problem(s); nothing was written" in res.stderr
    for line in (11, 12, 13):
        assert f"{path}:{line}: " in res.stderr
    assert "answers: a number (3), not a string or a list of strings" in res.stderr
    assert not (tmp_path / "q.parquet").exists()
