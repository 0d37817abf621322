"""Entailment backends: given a question and ordered answer pairs (A, B), does A entail B?

Each returns one of "entailment", "neutral", "contradiction" per pair.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from halludetect.registry import lookup, registrar
from halludetect.text import normalise

Relation = Literal["entailment", "neutral", "contradiction"]


class NLI(Protocol):
    name: str

    def relations(self, question: str, pairs: list[tuple[str, str]]) -> list[Relation]: ...


NLI_BACKENDS: dict[str, Callable[..., NLI]] = {}


register = registrar(NLI_BACKENDS)


def get_nli(name: str, **kwargs) -> NLI:
    return lookup("NLI backend", name, NLI_BACKENDS)(**kwargs)


@register("exact")
class ExactNLI:
    """Offline: A entails B iff their normalised texts are equal; otherwise neutral.

    It cannot see paraphrases, so it under-merges; on the demo world, where answers are
    templated sentences, equal normalised text is what "same meaning" means.
    """

    name = "exact"

    def relations(self, question: str, pairs: list[tuple[str, str]]) -> list[Relation]:
        return ["entailment" if normalise(a) == normalise(b) else "neutral" for a, b in pairs]
