"""The judge interface and its registry.

A judge answers, for a batch of (question, answer, references) items, "is the answer
correct?" either with the reference answers (pass 1) or without them (pass 2, the paper's
prompt 2). A verdict is "yes", "no" or "invalid"; an invalid verdict is never read as a
label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel

from halludetect.core import registry

VerdictValue = Literal["yes", "no", "invalid"]


@dataclass(frozen=True)
class JudgeItem:
    question: str
    answer: str
    references: tuple[str, ...]
    incorrect: tuple[str, ...] = ()  # known wrong answers (TruthfulQA, HaluEval); () for most datasets


@dataclass(frozen=True)
class Verdict:
    verdict: VerdictValue
    raw: str  # the backend's raw reply (or, for rule-based judges, the rule that fired)


class Judge(Protocol):
    name: str

    def judge(self, items: list[JudgeItem], with_reference: bool) -> list[Verdict]: ...


def get_judge(name: str, **kwargs) -> Judge:
    """The judge backend `name` of core/registry.py (kind "judge": a built-in or a plugin's entry
    point), built with the settings of its params section."""
    return registry.resolve("judge", name)(**kwargs)


def judge_from(jp) -> Judge:
    """The judge `jp.backend` names (jp: the `judge` params), built with its section `judge.<backend>`.
    A plugin has no section there, and a plugin named like one of the section's own keys
    (`two_pass`) must not be handed that key's value: only a settings section (a mapping) is
    passed on."""
    section = getattr(jp, jp.backend, None)
    return get_judge(jp.backend, **(section.model_dump() if isinstance(section, BaseModel) else {}))
