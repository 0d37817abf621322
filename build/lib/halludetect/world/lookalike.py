"""The world's second dataset: look-alike names (a shift that teaches something).

In the `world` dataset nearly every hallucination is about a person the model barely saw, so a
detector can learn "unfamiliar name" rather than "wrong fact". This dataset asks about the
best-known people (the highest exposure) and about as many *look-alikes*: people absent from
the corpus whose name differs from a well-known person's by one letter. The model has never seen
a look-alike, but the name is nearly one it knows well, so it tends to answer with the famous
person's fact, confidently; the look-alike's own fact is drawn to differ from it, so that
answer is wrong. A detector that learned "wrong fact" flags it, one that learned "unfamiliar
name" may not.

Built from the world's questions (`qa.jsonl`), never from the corpus or the model: the world
stage, its model and its `world` dataset stay byte for byte what they were. Its own seeded
random stream, pure Python, deterministic.
"""

from __future__ import annotations

import random

from halludetect.world.kb import RELATIONS, question_text

_VOWELS = "aeiou"
_CONSONANTS = "bcdfgklmnprstvz"


def _variants(name: str) -> list[str]:
    """Every name one letter away from `name` (a vowel for a vowel, a consonant for a
    consonant, so that it still reads as a name), the first letter of each word kept."""
    out = []
    for i, ch in enumerate(name):
        if i == 0 or name[i - 1] == " " or not ch.isalpha():
            continue
        pool = _VOWELS if ch in _VOWELS else _CONSONANTS if ch in _CONSONANTS else ""
        out += [name[:i] + c + name[i + 1 :] for c in pool if c != ch]
    return out


def lookalike_rows(world_rows: list[dict], seed: int) -> list[dict]:
    """Questions about the world's best-known people (kind `known`, their own facts) and about one
    look-alike of each (kind `lookalike`: a name one letter from theirs that no world person has,
    facts drawn to differ from the known person's), in the common QA schema plus `kind`,
    `lookalike_of` and `exposure` (0 for a look-alike: the corpus never names them)."""
    if not world_rows:
        raise ValueError("the world has no questions to build look-alikes from")
    top = max(r["exposure"] for r in world_rows)
    taken = {r["entity"] for r in world_rows}
    rng = random.Random(seed)
    people: dict[str, list[dict]] = {}
    for r in world_rows:
        if r["exposure"] == top:
            people.setdefault(r["entity"], []).append(r)
    rows = []
    for i, (name, facts) in enumerate(people.items()):
        candidates = [v for v in _variants(name) if v not in taken]
        if not candidates:  # a one-letter name has no variant; the world's names have several
            continue
        twin = rng.choice(candidates)
        taken.add(twin)
        for r in facts:
            rel, value = r["relation"], r["answers"][0]
            rows.append(r | {"id": f"known-{i:04d}-{rel}", "kind": "known", "lookalike_of": None})
            other = rng.choice([v for v in RELATIONS[rel][3] if v != value])
            rows.append(
                {
                    "id": f"lookalike-{i:04d}-{rel}",
                    "question": question_text(rel, twin),
                    "answers": [other],
                    "context": None,
                    "exposure": 0,
                    "relation": rel,
                    "entity": twin,
                    "kind": "lookalike",
                    "lookalike_of": name,
                }
            )
    return rows
