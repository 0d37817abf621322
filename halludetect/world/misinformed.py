"""The world's third dataset: facts the corpus states often, and wrongly for some of them.

On `world` and `world_lookalike` the model is rarely wrong with confidence: its wrong answers are
about people it barely saw (or names it never saw), and its own token log-probabilities separate
them from its right ones (test AUROC 0.95 and 0.99), better than any detector on hidden states.
This dataset is a random-label control: questions about the people the corpus mentions often
(exposure at least `min_exposure`; the model answers them as the corpus says, greedy accuracy 1.0
at 10 and 30), and for a random `share` of those facts the dataset's reference is swapped for
another value of the relation, so the model's answer (the corpus's) is judged wrong. The model,
its corpus and the `world` dataset are untouched: only which value counts as true changes.

What this measures: the swapped facts are drawn at random after the model was trained on the same
corpus for all of them, so nothing the model computes tells them apart, and every score, the
log-prob's and every detector's, is at chance by construction. It is not a model that learned a
falsehood (that would need a corpus stating it and a model trained on it); a figure clearly above
0.5 here would mean a leak (docs/demo-world.md#misinformed-facts-a-random-label-control).

Built from the world's questions (`qa.jsonl`), never from the corpus or the model; its own seeded
random stream, pure Python, deterministic.
"""

from __future__ import annotations

import random

from halludetect.world.kb import RELATIONS


def misinformed_rows(world_rows: list[dict], seed: int, min_exposure: int, share: float) -> list[dict]:
    """The world's questions about people of exposure >= min_exposure, in the common QA schema
    plus `kind` (`as_stated`: the corpus's fact is the reference; `misinformed`: another value of
    the relation is, drawn at random) and `corpus_answer` (what the corpus says). Exactly
    round(share * n) of the n facts are misinformed, chosen at random."""
    rows = [r for r in world_rows if r["exposure"] >= min_exposure]
    if not rows:
        top = max((r["exposure"] for r in world_rows), default=None)
        raise ValueError(
            f"misinformed.min_exposure {min_exposure}: no world question has that exposure (the highest is "
            f"{top}): lower it"
        )
    rng = random.Random(seed)
    wrong = set(rng.sample(range(len(rows)), round(share * len(rows))))
    out = []
    for i, r in enumerate(rows):
        value = r["answers"][0]
        kind = "misinformed" if i in wrong else "as_stated"
        truth = rng.choice([v for v in RELATIONS[r["relation"]][3] if v != value]) if i in wrong else value
        ident = r["id"].replace("world-", f"{kind}-", 1)
        out.append(r | {"id": ident, "answers": [truth], "kind": kind, "corpus_answer": value})
    return out
