"""The text of each token of an answer, and where it sits in the answer's text.

`token_pieces` decodes token by token: a token's piece is what it adds to the decoded text of the
tokens before it (decoding a short window before it, so a long answer costs O(n), not O(n^2)).
A token that ends inside a character (byte-level pieces of one UTF-8 character) adds nothing
itself: its piece is empty, and the token that completes the character carries the text (bytes
that never make a character decode to U+FFFD, as in the answer's own text).

`char_spans` places the pieces in the answer text. When they decode to that text (up to the
whitespace around it: an answer is stored stripped, and prompt 1's answers start with a space),
every span is exact. When they do not (the tokens were given with the answer and spell it another
way, or the tokenizer normalises text), the pieces are aligned to the text character by character
(difflib) and the spans are marked approximate: never wrong silently.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

WINDOW = 8  # tokens decoded before each one: enough context for a tokenizer's spacing rules


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The decoded text each token adds, in order (empty for a token that ends inside a character)."""
    pieces, carry = [], 0  # carry: earlier tokens whose text has not come out yet
    for i in range(len(ids)):
        start = max(0, i - carry - WINDOW)
        before = tokenizer.decode(ids[start : i - carry], skip_special_tokens=True)
        text = tokenizer.decode(ids[start : i + 1], skip_special_tokens=True)
        last = i == len(ids) - 1  # bytes that never complete a character decode to U+FFFD: flush them at the end
        if text.startswith(before) and (last or not text.endswith("\ufffd")):
            pieces.append(text[len(before) :])
            carry = 0
        else:  # an incomplete character: the next token completes it
            pieces.append("")
            carry += 1
    return pieces


@dataclass
class Spans:
    start: list[int]  # character offset of each token's piece in the text
    end: list[int]
    exact: bool  # False: the pieces do not spell the text and were aligned to it


def char_spans(pieces: list[str], text: str) -> Spans:
    """[start, end) of each piece in `text` (module docstring)."""
    decoded = "".join(pieces)
    ends = [0]
    for p in pieces:
        ends.append(ends[-1] + len(p))
    lead_d = len(decoded) - len(decoded.lstrip())
    lead_t = len(text) - len(text.lstrip())
    core = text.strip()
    if decoded.strip() == core:
        lo, hi = lead_t, lead_t + len(core)

        def place(k: int) -> int:
            return min(max(k - lead_d + lead_t, lo), hi)

        return Spans([place(a) for a in ends[:-1]], [place(b) for b in ends[1:]], True)
    where = _alignment(decoded, text)
    return Spans([where[a] for a in ends[:-1]], [where[b] for b in ends[1:]], False)


def _alignment(decoded: str, text: str) -> list[int]:
    """For every position 0..len(decoded) of `decoded`, a position of `text`: matched characters
    map to their match, unmatched ones to the position of the next match (monotone)."""
    where = [len(text)] * (len(decoded) + 1)
    matcher = difflib.SequenceMatcher(None, decoded, text, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size + 1):
            where[a + k] = b + k
    for k in range(len(decoded) - 1, -1, -1):  # unmatched: the next matched position
        where[k] = min(where[k], where[k + 1])
    return where
