"""QA loaders and the split (halludetect/qa/datasets.py): each loader on a sample of its source, the
common schema, exact split sizes from one source or two hub splits, stable splits; and the
hostile cases, every bad record named by file and 1-based line (null, numeric or list questions,
nested answers, colliding ids, NUL in an id, JSON arrays, Latin-1 bytes, a missing field), all of
them at once, with nothing written."""

import json
from pathlib import Path

import polars as pl
import pytest
from support import QA_SAMPLES, base_params, qa_sample, stage, write_params

from halludetect.config import DatasetPreset, PrepareParams
from halludetect.qa.datasets import DatasetError, assign_splits, md5_id, prepare, read_questions

SPLIT = PrepareParams(seed=0, train=0.5, val=0.2, test=0.3)


THIRDS = PrepareParams(seed=0, train=0.34, val=0.33, test=0.33)  # 3 questions: one per split


def test_trivia_qa_sample():
    df, report = prepare(DatasetPreset(loader="trivia_qa", path=str(QA_SAMPLES / "trivia_qa.jsonl")), SPLIT)
    assert df.height == 500 and report.dropped == {}
    row = df.filter(df["question"].str.starts_with("What type of animal is a dik-dik")).row(0, named=True)
    assert row["answers"][0] == "Antelope" and "Antelopes" in row["answers"]
    assert row["id"] == md5_id(row["question"])  # the semantic-entropy id scheme


def test_squad_keeps_answerable_only():
    df, report = prepare(DatasetPreset(loader="squad", path=str(QA_SAMPLES / "squad.jsonl")), SPLIT)
    assert df.height == 263
    assert report.dropped == {"squad: unanswerable (no reference answer)": 237}
    assert df["context"].null_count() == 0  # SQuAD keeps its passage


def test_nq_appends_question_mark():
    df, _ = prepare(DatasetPreset(loader="nq", path=str(QA_SAMPLES / "nq_open.jsonl")), SPLIT)
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
    preset = DatasetPreset(loader="trivia_qa", path=str(QA_SAMPLES / "trivia_qa.jsonl"), max_questions=100)
    df, _ = prepare(preset, SPLIT)
    assert df.height == 100
    assert df.columns == ["id", "question", "answers", "context", "split", "incorrect_answers", "category"]
    assert set(df["split"]) == {"train", "val", "test"}


def test_sizes_give_exact_question_counts_from_one_source():
    preset = DatasetPreset(
        loader="trivia_qa", path=str(QA_SAMPLES / "trivia_qa.jsonl"), sizes={"train": 300, "val": 80, "test": 120}
    )
    df, _ = prepare(preset, SPLIT, "tqa")
    assert {s: int(n) for s, n in df.group_by("split").len().iter_rows()} == {"train": 300, "val": 80, "test": 120}
    again, _ = prepare(preset, SPLIT, "tqa")
    assert again.equals(df)  # deterministic for a seed
    too_many = DatasetPreset(
        loader="trivia_qa", path=str(QA_SAMPLES / "trivia_qa.jsonl"), sizes={"train": 400, "val": 100, "test": 100}
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

    def fake_hub(preset, hub, split=None):
        split = split or preset.hf_split or hub.split
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


# ------------------------------------------------- TruthfulQA, HaluEval QA, SVAMP (issue 25)
def test_truthful_qa_sample_keeps_its_wrong_answers_and_category():
    df, report = prepare(DatasetPreset(loader="truthful_qa", path=qa_sample("truthful_qa.jsonl")), SPLIT)
    assert df.height == 817 and report.dropped == {} and report.repeated_ids == []
    row = df.filter(df["id"] == "0").row(0, named=True)
    assert row["question"] == "What happens to you if you eat watermelon seeds?"
    assert row["answers"][:2] == ["The watermelon seeds pass through your digestive system", "Nothing happens"]
    assert "You grow watermelons in your stomach" in row["incorrect_answers"]
    assert row["category"] == "Misconceptions" and row["context"] is None
    assert df["incorrect_answers"].list.len().min() > 0 and df["category"].null_count() == 0


def test_halueval_qa_sample_keeps_knowledge_as_context_and_the_hallucinated_answer():
    df, report = prepare(DatasetPreset(loader="halueval_qa", path=qa_sample("halueval_qa.jsonl")), SPLIT)
    assert df.height == 500 and report.dropped == {}
    row = df.filter(df["id"] == "1").row(0, named=True)
    assert row["answers"] == ["Delhi"] and "head office in Delhi" in row["context"]
    assert row["incorrect_answers"] == ["The Oberoi family's hotel company is based in Mumbai."]
    assert df["context"].null_count() == 0 and (df["incorrect_answers"].list.len() == 1).all()


def test_svamp_sample_asks_the_whole_problem_without_context():
    df, report = prepare(DatasetPreset(loader="svamp", path=qa_sample("svamp.jsonl")), SPLIT)
    assert df.height == 1000 and report.dropped == {}
    row = df.filter(df["id"] == "chal-1").row(0, named=True)
    assert row["question"].startswith("Each pack of dvds costs 76 dollars.")
    assert row["question"].endswith("How much do you have to pay to buy each pack?")
    assert row["answers"] == ["51"] and row["context"] is None
    assert df["context"].null_count() == 1000


def raw_sample(name: str, n: int) -> list[dict]:
    with open(qa_sample(name)) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def fake_load_dataset(monkeypatch, tables: dict) -> list:
    """`datasets.load_dataset` answering from `tables` {(hub id, config, split): rows}; the calls are kept."""
    import datasets as hf

    calls = []

    def load_dataset(hf_id, config=None, *, split, revision=None):
        calls.append((hf_id, config, split, revision))
        return tables[(hf_id, config, split)]

    monkeypatch.setattr(hf, "load_dataset", load_dataset)
    return calls


def test_truthful_qa_hub_rows_give_the_samples_records(monkeypatch):
    """The hub's fields (as the HF script names them) become the sample's records: the
    best answer first, the empty piece a trailing ';' leaves dropped, the 0-based row as id."""
    sample = raw_sample("truthful_qa.jsonl", 6)
    hub = [
        {
            "type": "Adversarial",
            "category": r["category"],
            "question": r["question"],
            "best_answer": r["answers"][0],
            "correct_answers": [*r["answers"][1:], r["answers"][0], ""],
            "incorrect_answers": [*r["incorrect_answers"], ""],
            "source": "https://example.org",
        }
        for r in sample
    ]
    calls = fake_load_dataset(monkeypatch, {("truthfulqa/truthful_qa", "generation", "validation"): hub})
    df, _ = prepare(DatasetPreset(loader="truthful_qa", revision="abc123"), THIRDS)
    assert calls == [("truthfulqa/truthful_qa", "generation", "validation", "abc123")]
    got = {r["id"]: r for r in df.iter_rows(named=True)}
    for r in sample:
        assert got[r["id"]]["answers"] == r["answers"] and got[r["id"]]["question"] == r["question"].strip()
        assert got[r["id"]]["incorrect_answers"] == r["incorrect_answers"]
        assert got[r["id"]]["category"] == r["category"]


def test_halueval_qa_hub_rows_give_the_samples_records(monkeypatch):
    sample = raw_sample("halueval_qa.jsonl", 6)
    hub = [
        {
            "knowledge": r["context"],
            "question": r["question"],
            "right_answer": r["answers"][0],
            "hallucinated_answer": r["hallucinated_answer"],
        }
        for r in sample
    ]
    calls = fake_load_dataset(monkeypatch, {("pminervini/HaluEval", "qa", "data"): hub})
    df, _ = prepare(DatasetPreset(loader="halueval_qa"), THIRDS)
    assert calls == [("pminervini/HaluEval", "qa", "data", None)]
    got = {r["id"]: r for r in df.iter_rows(named=True)}
    for r in sample:
        assert got[r["id"]]["answers"] == r["answers"] and got[r["id"]]["context"] == r["context"]
        assert got[r["id"]]["incorrect_answers"] == [r["hallucinated_answer"]]


def test_svamp_hub_rows_give_the_samples_records_train_from_the_train_split(monkeypatch):
    """ChilleD/SVAMP stores Answer as a float (51.0): the reference is "51", as in the sample."""
    sample = raw_sample("svamp.jsonl", 12)

    def hub(rows):
        return [
            {
                "ID": r["id"],
                "Body": r["body"],
                "Question": r["svamp_question"],
                "Equation": r["equation"],
                "Answer": float(r["answers"][0]),
                "Type": r["type"],
            }
            for r in rows
        ]

    calls = fake_load_dataset(
        monkeypatch,
        {("ChilleD/SVAMP", None, "train"): hub(sample[:8]), ("ChilleD/SVAMP", None, "test"): hub(sample[8:])},
    )
    preset = DatasetPreset(
        loader="svamp", hf_split="test", train_hf_split="train", sizes={"train": 8, "val": 2, "test": 2}
    )
    df, _ = prepare(preset, SPLIT, "svamp")
    assert sorted(c[2] for c in calls) == ["test", "train"]
    got = {r["id"]: r for r in df.iter_rows(named=True)}
    for r in sample:
        assert got[r["id"]]["question"] == r["question"] and got[r["id"]]["answers"] == r["answers"]
    assert sorted(df.filter(df["split"] == "train")["id"]) == sorted(r["id"] for r in sample[:8])


def test_the_new_presets_fit_their_datasets():
    """TruthfulQA has 817 questions in one split, HaluEval QA 10,000, SVAMP 700 train + 300 test."""
    from halludetect.config import load_params

    p = load_params("params.yaml")
    tq, he, sv = p.dataset("truthful_qa"), p.dataset("halueval_qa"), p.dataset("svamp")
    assert tq.sizes.train + tq.sizes.val + tq.sizes.test == 817 and tq.train_hf_split is None
    assert (he.sizes.train, he.sizes.val, he.sizes.test) == (4000, 800, 1200)
    assert (sv.sizes.train, sv.train_hf_split, sv.sizes.val + sv.sizes.test, sv.hf_split) == (700, "train", 300, "test")
    assert not {"truthful_qa", "halueval_qa", "svamp"} & set(p.grid.datasets)  # the demo grid runs offline
    # the whole of TruthfulQA and SVAMP: their presets, pointed at the full samples, take every question
    for name, preset in (("truthful_qa", tq), ("svamp", sv)):
        local = preset.model_copy(update={"path": qa_sample(f"{name}.jsonl")})
        df, _ = prepare(local, p.prepare, name)
        sizes = {s: int(n) for s, n in df.group_by("split").len().iter_rows()}
        assert sizes == preset.sizes.model_dump() and df.height == {"truthful_qa": 817, "svamp": 1000}[name]


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


@pytest.mark.hostile
def test_prepare_names_file_line_and_field_of_a_truthful_qa_file_in_the_wrong_shape(tmp_path):
    path = qa_file(
        tmp_path,
        [
            '{"id": "t1", "question": "Q?", "answers": ["a"], "incorrect_answers": 3}',
            '{"id": "t2", "question": "Q2?", "answers": ["a"], "incorrect_answers": [["b"]], "category": ["Law"]}',
        ],
    )
    with pytest.raises(DatasetError) as e:
        prepare(DatasetPreset(loader="truthful_qa", path=str(path)), SPLIT)
    msg = str(e.value)
    assert f"{path}:11: incorrect_answers: a number (3), not a string or a list of strings" in msg
    assert f"{path}:12: incorrect_answers: item 0 is a list, not a string (a flat list" in msg
    assert f"{path}:12: category: a list, not a string or null" in msg and "3 problem(s)" in msg


@pytest.mark.hostile
def test_prepare_names_file_line_and_field_of_a_halueval_file_in_the_wrong_shape(tmp_path):
    path = qa_file(
        tmp_path,
        [
            '{"id": "h1", "question": "Q?", "answers": ["a"], "context": "k", "hallucinated_answer": ["b", 3]}',
            '{"id": "h2", "question": "Q2?", "right_answer": "a", "knowledge": "k"}',
        ],
    )
    with pytest.raises(DatasetError) as e:
        prepare(DatasetPreset(loader="halueval_qa", path=str(path)), SPLIT)
    msg = str(e.value)
    wanted = "hallucinated_answer: a list, not a string, a list of strings or null (read as incorrect_answers)"
    assert f"{path}:11: {wanted}" in msg
    # HaluEval's own field names are not the common schema: the record says which field it lacks
    assert f"{path}:12: answers: missing (the common schema needs question and answers" in msg


@pytest.mark.hostile
def test_prepare_names_file_line_and_field_of_a_svamp_file_in_the_wrong_shape(tmp_path):
    path = qa_file(tmp_path, ['{"id": "chal-1", "question": "2 + 3?", "answers": 5}'])
    with pytest.raises(DatasetError, match=rf"{path}:11: answers: a number \(5\), not a string or a list of strings"):
        prepare(DatasetPreset(loader="svamp", path=str(path)), SPLIT)


@pytest.mark.hostile
def test_prepare_names_the_hub_row_of_a_svamp_problem_without_its_text(monkeypatch):
    row = {"ID": "chal-1", "Body": None, "Question": "How many?", "Equation": "", "Answer": 1.0, "Type": ""}
    fake_load_dataset(monkeypatch, {("ChilleD/SVAMP", None, "test"): [row]})
    with pytest.raises(DatasetError, match=r"ChilleD/SVAMP \(hub\) row 1: Body: null, not a string"):
        prepare(DatasetPreset(loader="svamp"), SPLIT)


def test_a_questions_file_written_before_the_wrong_answers_column_still_reads(tmp_path):
    """A questions table from before issue 25 has no incorrect_answers or category: it reads with
    none (what every loader of that time produced)."""
    df, _ = prepare(DatasetPreset(loader="trivia_qa", path=str(QA_SAMPLES / "trivia_qa.jsonl")), SPLIT)
    old = tmp_path / "old.parquet"
    df.drop("incorrect_answers", "category").write_parquet(old)
    back = read_questions(old)
    assert back["incorrect_answers"].to_list() == [[]] * df.height and back["category"].null_count() == df.height
    assert back.drop("incorrect_answers", "category").equals(df.drop("incorrect_answers", "category"))
