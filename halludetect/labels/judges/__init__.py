"""LLM-as-judge backends (registry) and the paper's two-pass labelling protocol."""

from halludetect.labels.judges.base import Judge, JudgeItem, Verdict, get_judge, judge_from
from halludetect.labels.judges.protocol import JUDGMENTS_SCHEMA, label_distribution, two_pass, unusable_splits

__all__ = [
    "JUDGMENTS_SCHEMA",
    "Judge",
    "JudgeItem",
    "Verdict",
    "get_judge",
    "judge_from",
    "label_distribution",
    "two_pass",
    "unusable_splits",
]
