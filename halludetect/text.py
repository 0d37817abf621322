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
