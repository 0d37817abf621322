"""The leak check of prepare (halludetect/labels/leak.py) on the real samples: SQuAD's passage holds
its answer but is never shown, so its prompt leaks as little as TriviaQA's; the same questions with
the passage written into the question leak nearly always; and the prepare stage writes the check
into its metrics JSON."""

import json

import polars as pl
import pytest
from support import QA_SAMPLES, base_params, qa_sample, stage, write_params

from halludetect.config import DatasetPreset, PrepareParams, ReportParams
from halludetect.labels.leak import leak_check
from halludetect.qa.datasets import prepare

THRESHOLD = ReportParams().leak_threshold


def questions(loader: str, path) -> pl.DataFrame:
    return prepare(DatasetPreset(loader=loader, path=str(path)), PrepareParams())[0]


def test_squad_passage_holds_the_answer_but_the_prompt_does_not_show_it():
    squad = leak_check(questions("squad", QA_SAMPLES / "squad.jsonl"))
    assert squad["questions"] == 263 and squad["with_context"] == 263
    assert squad["context_fraction"] > 0.95  # an answer is a span of its passage
    assert squad["prompt_fraction"] < THRESHOLD  # prompt 1 is the question alone


def test_trivia_qa_prompts_rarely_hold_an_answer():
    trivia = leak_check(questions("trivia_qa", QA_SAMPLES / "trivia_qa.jsonl"))
    # a few questions name an alias of the answer ("... born Heather Renee Sweet?"); none has a context
    assert trivia["prompt_fraction"] < THRESHOLD and trivia["context_fraction"] is None
    assert trivia["prompt_count"] > 0 and len(trivia["examples"]) == min(trivia["prompt_count"], 10)


def test_squad_with_its_passage_in_the_question_leaks(tmp_path):
    """What a user gets by writing the passage into the question (the prompt then shows it)."""
    rows = [json.loads(line) for line in (QA_SAMPLES / "squad.jsonl").read_text().splitlines()]
    path = tmp_path / "open_book.jsonl"
    path.write_text(
        "\n".join(json.dumps({**r, "question": f"{r['context']} {r['question']}", "context": None}) for r in rows)
    )
    leak = leak_check(questions("file", path))
    assert leak["prompt_fraction"] > 0.95 and leak["prompt_fraction"] > THRESHOLD


@pytest.mark.parametrize(
    ("loader", "name", "context"),
    [("truthful_qa", "truthful_qa.jsonl", False), ("halueval_qa", "halueval_qa.jsonl", True)],
)
def test_the_new_datasets_prompts_stay_below_the_threshold(loader, name, context):
    leak = leak_check(questions(loader, qa_sample(name)))
    assert leak["prompt_fraction"] < THRESHOLD
    # HaluEval's knowledge holds the right answer mostly; it is not shown either
    assert (leak["context_fraction"] is not None and leak["context_fraction"] > 0.5) == context


def test_prepare_writes_the_leak_check_into_its_metrics(tmp_path):
    data = base_params()
    data["datasets"]["squad"] = {"loader": "squad", "path": str(QA_SAMPLES / "squad.jsonl")}
    res = stage(
        "stages.prepare",
        "--params",
        str(write_params(tmp_path / "params.yaml", data)),
        "--dataset",
        "squad",
        "--out",
        str(tmp_path / "q.parquet"),
        "--metrics",
        str(tmp_path / "m.json"),
    )
    assert res.returncode == 0, res.stderr
    leak = json.loads((tmp_path / "m.json").read_text())["leak"]
    expected = leak_check(pl.read_parquet(tmp_path / "q.parquet"))
    assert leak == expected and leak["shown"] == "question" and leak["context_fraction"] > 0.95
