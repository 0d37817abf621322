"""The paper's two-pass labelling protocol.

Pass 1 judges every answer against the reference answers (and the known wrong answers, where a
dataset lists them: TruthfulQA, HaluEval). Only answers judged wrong go to
pass 2, which judges them without the references. An answer wrong in both passes is a
hallucination (label 1); right in pass 1 it is correct (label 0); wrong in pass 1 but right
in pass 2 it is inconsistent and dropped (kept = false). An invalid verdict in either pass
drops the answer too, counted by reason: no label is ever made from an error.

Partial invalidity is allowed and counted (the metrics' `invalid` and `dropped`); a split
whose every answer was dropped is not: `unusable_splits` names it, and the judge stage fails
with the counts after writing the table, whose `pass1_raw`/`pass2_raw` hold the replies.
"""

from __future__ import annotations

import polars as pl

from halludetect.labels.judges.base import Judge, JudgeItem

JUDGMENTS_SCHEMA = {
    "question_id": pl.String,
    "sample_index": pl.Int32,
    "split": pl.String,
    "pass1_verdict": pl.String,
    "pass1_raw": pl.String,
    "pass2_verdict": pl.String,
    "pass2_raw": pl.String,
    "label": pl.Int8,
    "kept": pl.Boolean,
    "reason": pl.String,
}


def two_pass(judge: Judge, questions: pl.DataFrame, generations: pl.DataFrame, second_pass: bool = True):
    # Known wrong answers (TruthfulQA's, HaluEval's) go to pass 1 with the references; a table
    # without the column (a hand-built one) has none.
    wrong = "incorrect_answers" in questions.columns
    refs = {
        r["id"]: (r["question"], tuple(r["answers"]), tuple(r["incorrect_answers"] or ()) if wrong else ())
        for r in questions.iter_rows(named=True)
    }
    rows = generations.select("question_id", "sample_index", "split", "text").to_dicts()
    items = [JudgeItem(refs[r["question_id"]][0], r["text"], *refs[r["question_id"]][1:]) for r in rows]
    first = judge.judge(items, with_reference=True)
    wrong = [i for i, v in enumerate(first) if v.verdict == "no"]
    second = dict(zip(wrong, judge.judge([items[i] for i in wrong], with_reference=False))) if second_pass else {}
    out = []
    for i, (r, v1) in enumerate(zip(rows, first)):
        v2 = second.get(i)
        if v1.verdict == "invalid":
            label, kept, reason = None, False, "pass 1 invalid"
        elif v1.verdict == "yes":
            label, kept, reason = 0, True, "correct"
        elif not second_pass:
            label, kept, reason = 1, True, "hallucination (pass 1 only)"
        elif v2.verdict == "invalid":
            label, kept, reason = None, False, "pass 2 invalid"
        elif v2.verdict == "no":
            label, kept, reason = 1, True, "hallucination"
        else:
            label, kept, reason = None, False, "inconsistent"
        out.append(
            {
                **{k: r[k] for k in ("question_id", "sample_index", "split")},
                "pass1_verdict": v1.verdict,
                "pass1_raw": v1.raw,
                "pass2_verdict": v2.verdict if v2 else None,
                "pass2_raw": v2.raw if v2 else None,
                "label": label,
                "kept": kept,
                "reason": reason,
            }
        )
    return pl.DataFrame(out, schema=JUDGMENTS_SCHEMA)


def unusable_splits(judgments: pl.DataFrame) -> list[str]:
    """One line per split that has judged answers but no kept label, with its drop counts."""
    out = []
    for split in ("train", "val", "test"):
        part = judgments.filter(pl.col("split") == split)
        if part.height and not part["kept"].any():
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(part.group_by("reason").len().iter_rows()))
            out.append(f"{split}: {part.height} answers judged, none kept ({reasons})")
    return out


def label_distribution(judgments: pl.DataFrame) -> dict:
    """Per split: judged, kept, correct, hallucinated, dropped by reason (the paper's label table)."""
    out = {}
    for split in ("train", "val", "test"):
        part = judgments.filter(pl.col("split") == split)
        kept = part.filter(pl.col("kept"))
        n_h = int((kept["label"] == 1).sum())
        out[split] = {
            "judged": part.height,
            "kept": kept.height,
            "correct": int((kept["label"] == 0).sum()),
            "hallucinated": n_h,
            "hallucination_rate": n_h / kept.height if kept.height else None,
            "dropped": {r: int(n) for r, n in part.filter(~pl.col("kept")).group_by("reason").len().iter_rows()},
        }
    return out
