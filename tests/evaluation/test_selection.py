"""Choosing answers by their score (halludetect/evaluation/selection.py): best-of-n, one sample,
the oracle and the abstention curve, on hand-made answers whose right results are known."""

from __future__ import annotations

import math

import polars as pl
import pytest

from halludetect.evaluation import selection


def answers(rows):
    return pl.DataFrame(rows, schema=["question_id", "sample_index", "label", "score"], orient="row")


QUESTIONS = answers(
    [
        ("a", 0, 1, 2.0),  # a: the first sample is wrong; the score prefers sample 1, which is right
        ("a", 1, 0, -1.0),
        ("a", 2, 1, 0.5),
        ("b", 0, 0, 0.3),  # b: every score equal: the choice is the first sample, as sampling once
        ("b", 1, 1, 0.3),
        ("c", 0, 1, 1.5),  # c: nothing right to choose
        ("c", 1, 1, 3.0),
    ]
)


def test_best_of_n_takes_the_lowest_score_and_the_first_sample_among_equal_scores():
    chosen = selection.best_of_n(QUESTIONS)
    assert chosen.select("question_id", "sample_index", "label").rows() == [("a", 1, 0), ("b", 0, 0), ("c", 0, 1)]
    assert chosen["n"].to_list() == [3, 2, 2]
    assert selection.accuracy(chosen) == pytest.approx(2 / 3)
    first = selection.first_sample(QUESTIONS)
    assert first["sample_index"].to_list() == [0, 0, 0] and selection.accuracy(first) == pytest.approx(1 / 3)
    assert selection.oracle(QUESTIONS) == pytest.approx(2 / 3)  # c has no right answer to choose


def test_the_abstention_curve_answers_the_lowest_scored_questions_first():
    chosen = selection.best_of_n(QUESTIONS)  # scores: a -1.0 (right), b 0.3 (right), c 1.5 (wrong)
    curve = selection.abstention_curve(chosen, coverages=(1.0, 0.5, 0.1))
    assert curve["accuracy_at_1"] == pytest.approx(2 / 3)
    assert curve["accuracy_at_0.5"] == 1.0  # ceil(1.5) = 2 questions answered: a and b
    assert curve["accuracy_at_0.1"] == 1.0  # at least one question is answered
    assert curve["area"] == pytest.approx((1 + 1 + 2 / 3) / 3)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (QUESTIONS.drop("score"), "no column score"),
        (QUESTIONS.head(0), "no answers"),
        (QUESTIONS.with_columns(pl.lit(2).alias("label")), "a label other than 0"),
        (QUESTIONS.with_columns(pl.lit(math.nan).alias("score")), "not a finite number"),
        (pl.concat([QUESTIONS, QUESTIONS.head(1)]), "given twice"),
    ],
)
def test_answers_that_cannot_be_chosen_among_are_refused_naming_what(frame, message):
    with pytest.raises(ValueError, match=f"cell: .*{message}"):
        selection.check(frame, "cell")
