"""p(True) (halludetect/evaluation/p_true.py): the semantic-entropy code's prompt, written out by
hand, and the batched log-probability of " A" against one unbatched forward pass per prompt."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from halludetect.core.errors import DataError
from halludetect.evaluation.p_true import TRUE, few_shot_block, log_p_true, p_true_prompt, p_true_scores


def test_the_prompt_is_the_semantic_entropy_codes():
    assert p_true_prompt("Where was Ann born?", " Ann was born in Oslo.", ["Ann was born in Rome.", "In Oslo."]) == (
        "Question: Where was Ann born?\nBrainstormed Answers: Ann was born in Rome.\nIn Oslo.\n"
        "Ann was born in Oslo.\nPossible answer: Ann was born in Oslo.\nIs the possible answer:\n"
        "A) True\nB) False\nThe possible answer is:"
    )


def test_few_shot_examples_carry_the_judges_label_as_the_letter():
    questions = pl.DataFrame({"id": ["q1", "q2"], "question": ["Q one?", "Q two?"]})
    gens = pl.DataFrame(
        {"question_id": ["q1", "q1", "q2", "q2"], "sample_index": [0, 1, 0, 1], "text": ["a", "b", "c", "d"]}
    )
    judged = pl.DataFrame(
        {
            "question_id": ["q1", "q2"],
            "sample_index": [0, 0],
            "split": ["train", "train"],
            "label": [0, 1],
            "kept": [True, True],
        }
    )
    block = few_shot_block(questions, gens, judged, 2)
    assert block == (
        "Question: Q one?\nBrainstormed Answers: a \nb \nPossible answer: a\nIs the possible answer:\n"
        "A) True\nB) False\nThe possible answer is: A\n"
        "Question: Q two?\nBrainstormed Answers: c \nd \nPossible answer: c\nIs the possible answer:\n"
        "A) True\nB) False\nThe possible answer is: B"
    )
    with pytest.raises(DataError, match="detectors.p_true.few_shot is 3 but only 2 labelled train questions exist"):
        few_shot_block(questions, gens, judged, 3)


def test_batched_log_p_true_equals_one_forward_pass_per_prompt(tiny):
    model, tok = tiny
    prompts = [
        p_true_prompt("Where was Ann born?", f"In {c}.", ["In Oslo.", "In Rome."]) for c in ("Oslo", "Paris", "X")
    ]
    prompts.append("Question: a much longer question than the others, padded in its batch?")
    got = log_p_true(model, tok, prompts, batch_size=3)
    for prompt, value in zip(prompts, got):
        ids = torch.tensor([tok(prompt + TRUE, add_special_tokens=True)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -2]
        assert value == pytest.approx(float(torch.log_softmax(logits.double(), -1)[ids[0, -1]]), abs=1e-4)


def test_only_kept_val_and_test_answers_are_scored_and_the_rest_counted(tiny):
    model, tok = tiny
    questions = pl.DataFrame(
        {"id": ["q1", "q2"], "question": ["Where was Ann born?", "What is " + "very " * 60 + "long?"]}
    )
    gens = pl.DataFrame(
        {
            "question_id": ["q1", "q1", "q1", "q2", "q2"],
            "sample_index": [0, 1, 2, 0, 1],
            "text": ["In Oslo.", "", "In Rome.", "Yes.", "No."],
            "n_tokens": [3, 0, 3, 2, 2],
        }
    ).with_columns(pl.col("sample_index").cast(pl.Int32))
    judged = gens.select("question_id", "sample_index").with_columns(
        pl.lit("test").alias("split"), pl.lit(0).alias("label"), (pl.col("sample_index") != 2).alias("kept")
    )
    scores, left_out, seconds = p_true_scores(model, tok, questions, gens, judged, few_shot=0, batch_size=4)
    assert scores["rid"].to_list() == ["q1/0"]  # q1/1 empty, q1/2 not kept, q2's prompts exceed 128 tokens
    assert left_out == {"empty_answer": 1, "too_long": 2} and seconds >= 0
    assert scores["score"].to_list() == pytest.approx([-v for v in scores["log_p_true"].to_list()])
