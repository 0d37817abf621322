"""Choosing among a question's sampled answers by a detector's score: best-of-n and abstention.

A detector that ranks a question's answers can choose among them instead of only reporting a
score: sample n answers, return the one it scores lowest (the least likely hallucinated), and
abstain on the questions whose chosen answer still scores high. This measures what that buys on
answers the DAG has already sampled, judged and scored (the test split): n samples cost n times the
generation of one, and what they buy is the accuracy of the chosen answers against one sample's,
and how much a score lets one give up (coverage) for accuracy. The report's PRR is the same
question asked of single answers.

Inputs are one row per judged answer: question_id, sample_index, label (0 correct, 1 hallucinated)
and score (higher: more likely hallucinated, as every detector's logit and score in the DAG).
"""

from __future__ import annotations

import numpy as np
import polars as pl

COVERAGES = (1.0, 0.9, 0.8, 0.5)  # the abstention curve's points the tables print
COVERAGE_GRID = np.round(np.linspace(0.05, 1.0, 20), 2)  # the points the figure draws


def check(frame: pl.DataFrame, what: str) -> pl.DataFrame:
    """The rows, checked: the four columns, labels 0 or 1, finite scores, one row per answer."""
    missing = {"question_id", "sample_index", "label", "score"} - set(frame.columns)
    if missing:
        raise ValueError(f"{what}: no column {', '.join(sorted(missing))}")
    if frame.height == 0:
        raise ValueError(f"{what}: no answers")
    if not frame["label"].is_in([0, 1]).all():
        raise ValueError(f"{what}: a label other than 0 (correct) or 1 (hallucinated)")
    if not np.isfinite(frame["score"].cast(pl.Float64).to_numpy()).all():
        raise ValueError(f"{what}: a score that is not a finite number")
    if frame.select("question_id", "sample_index").is_duplicated().any():
        raise ValueError(f"{what}: an answer (question_id, sample_index) given twice")
    return frame


def best_of_n(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per question: the answer of the lowest score (the lowest sample_index among equal
    scores, so that a score that cannot tell the answers apart chooses as one sample does), with
    its label and score, and n, the answers it was chosen from."""
    return (
        frame.sort("question_id", "score", "sample_index")
        .group_by("question_id", maintain_order=True)
        .agg(pl.first("sample_index"), pl.first("label"), pl.first("score"), pl.len().alias("n"))
    )


def first_sample(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per question: its first judged answer (the lowest sample_index), what sampling once gives."""
    return frame.sort("question_id", "sample_index").group_by("question_id", maintain_order=True).first()


def accuracy(chosen: pl.DataFrame) -> float:
    return float((chosen["label"] == 0).mean())


def oracle(frame: pl.DataFrame) -> float:
    """The share of questions with at least one correct answer among theirs: no choice does better."""
    return float(frame.group_by("question_id").agg((pl.col("label") == 0).any())["label"].mean())


def abstention_curve(chosen: pl.DataFrame, coverages=COVERAGES) -> dict[str, float]:
    """Answer the questions whose chosen answer scores lowest and abstain on the rest: at each
    coverage c, the accuracy of the answered ceil(c x questions) (ties broken by question id), and
    `area`, the mean accuracy over every coverage k/Q (the area under the accuracy-coverage curve)."""
    running = _answered_accuracy(chosen)
    out = {f"accuracy_at_{c:g}": float(a) for c, a in zip(coverages, _at(running, coverages), strict=True)}
    out["area"] = float(running.mean())
    return out


def _answered_accuracy(chosen: pl.DataFrame) -> np.ndarray:
    """[Q] the accuracy of the k questions whose chosen answer scores lowest, k = 1..Q (ties: question id)."""
    correct = (chosen.sort("score", "question_id")["label"] == 0).to_numpy().astype(float)
    return np.cumsum(correct) / np.arange(1, len(correct) + 1)


def _at(running: np.ndarray, coverages) -> np.ndarray:
    """`running` read at each coverage c: ceil(c x Q) questions answered, at least one."""
    return np.array([running[max(1, int(np.ceil(c * len(running)))) - 1] for c in coverages])


def complete(judgments: pl.DataFrame, split: str = "test") -> pl.DataFrame:
    """The answers of `split`'s questions whose answers were all judged (kept) and that have as many
    as the most any question has (n): question_id, sample_index, label. A choice among them is a
    choice among the same n answers for every question and every detector."""
    part = judgments.filter(pl.col("split") == split)
    counts = part.group_by("question_id").agg(pl.col("kept").all().alias("all_kept"), pl.len().alias("k"))
    n = int(counts["k"].max() or 0)
    full = counts.filter(pl.col("all_kept") & (pl.col("k") == n)).select("question_id")
    return part.join(full, on="question_id").select("question_id", "sample_index", "label")


def curve(chosen: pl.DataFrame, coverages=COVERAGE_GRID) -> np.ndarray:
    """[len(coverages)] the accuracy of the answered questions at each coverage (`abstention_curve`'s rule)."""
    return _at(_answered_accuracy(chosen), coverages)
