"""Answer normalisation shared by the rule-based judge and the exact-match NLI backend."""

from __future__ import annotations

import re
import string
import unicodedata

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def tokens(text: str) -> list[str]:
    return normalise(text).split()


def contains(haystack: str, needle: str) -> bool:
    """True if needle's normalised tokens appear as a contiguous run in haystack's."""
    h, n = tokens(haystack), tokens(needle)
    if not n:
        return False
    return any(h[i : i + len(n)] == n for i in range(len(h) - len(n) + 1))


def recall(response: str, reference: str) -> float:
    """Share of the reference's normalised tokens that occur in the response."""
    ref = tokens(reference)
    if not ref:
        return 0.0
    got = set(tokens(response))
    return sum(t in got for t in ref) / len(ref)


def parse_choice(reply: str | None, forms: dict[str, str]) -> str | None:
    """The one choice a model's reply names, or None (unparseable).

    `forms` maps accepted words to choices ({"yes": "yes", "entails": "entailment", ...}).
    Case, punctuation and markdown are ignored. The reply must *start* with a choice ("Yes.",
    "**No**", "Entailment - both say Paris") and name no other choice anywhere ("Yes ... no"
    is ambiguous). Prose such as "The answer is not correct" or "does not entail" is therefore
    unparseable rather than misread: it is asked again and, failing that, counted as invalid.
    """
    if not reply:
        return None
    words = re.sub(r"[^a-z]+", " ", unicodedata.normalize("NFKC", reply).lower()).split()
    if not words or words[0] not in forms:
        return None
    named = {forms[w] for w in words if w in forms}
    return named.pop() if len(named) == 1 else None


YES_NO = {"yes": "yes", "no": "no"}
RELATIONS = {
    "entailment": "entailment",
    "entails": "entailment",
    "entail": "entailment",
    "neutral": "neutral",
    "contradiction": "contradiction",
    "contradicts": "contradiction",
    "contradict": "contradiction",
}
