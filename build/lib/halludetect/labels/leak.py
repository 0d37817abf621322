"""The leak check of `prepare`: does the prompt the model sees already hold a reference answer?

When it does, the model can copy the answer: its sampled answers agree with each other and with
the reference whatever it knows, so the similarity baselines (lexical similarity, semantic sets,
semantic entropy, P_sem) are trivially strong on that dataset and say little about detection.

Containment is the judge's: a reference answer's SQuAD-normalised tokens (lower case, no
punctuation, no articles) as a contiguous run of the prompt's (`labels/text.py`). The prompt
is prompt 1 with the question alone, as in the paper ("without providing any additional
context"): no dataset's context is shown, so the text checked is the question. Prompt 1's fixed
instruction is left out, being the same for every question (an answer "Answer" would match it
and tell nothing). The context, which the model does not see, is checked too and reported
beside it, so that a user who would show it knows what it would give away (SQuAD's passage
holds its answer by construction).
"""

from __future__ import annotations

import polars as pl

from halludetect.labels.text import tokens

EXAMPLES = 10  # ids of leaking questions listed in the metrics


def _holds(haystack: list[str], answers: list[str]) -> bool:
    for a in answers:
        n = tokens(a)
        if n and any(haystack[i : i + len(n)] == n for i in range(len(haystack) - len(n) + 1)):
            return True
    return False


def leak_check(questions: pl.DataFrame) -> dict:
    """The share of questions whose prompt holds a reference answer, and the same for the context.

    `questions` is the common schema (id, question, answers, context). Returns
    {"prompt_fraction", "prompt_count", "questions", "shown", "examples", "context_fraction",
    "context_count", "with_context"}; context_fraction is None when no question has a context.
    """
    prompt_ids, context_hits, with_context = [], 0, 0
    for r in questions.select("id", "question", "answers", "context").iter_rows(named=True):
        if _holds(tokens(r["question"]), r["answers"]):
            prompt_ids.append(r["id"])
        if r["context"] is not None:
            with_context += 1
            context_hits += _holds(tokens(r["context"]), r["answers"])
    n = questions.height
    return {
        "prompt_fraction": len(prompt_ids) / n if n else 0.0,
        "prompt_count": len(prompt_ids),
        "questions": n,
        "shown": "question",  # prompt 1 shows the question alone; the context is never in the prompt
        "examples": sorted(prompt_ids)[:EXAMPLES],
        "context_fraction": context_hits / with_context if with_context else None,
        "context_count": context_hits,
        "with_context": with_context,
    }
