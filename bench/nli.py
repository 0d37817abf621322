"""NLI comparisons per question: our clustering versus the semantic-entropy code's scheme.

Same answers, same relations (the `exact` backend, wrapped to count calls). Ours merges
answers with equal normalised text first, then places each unique answer by comparing it
with cluster representatives until one is equivalent (`nli.clustering`). The baseline is
`get_semantic_ids` of the semantic-entropy code (Farquhar et al., 2024): every answer not
yet assigned is compared, both directions, with every later answer, duplicates included.

Answers: the world's generations (all splits, K per question) when built, else a synthetic
set with the world's answer-diversity profile (`--synthetic`).

    python -m bench.nli [--generations data/generations/world/world.parquet]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import polars as pl

from bench.common import emit
from halludetect.labels.nli import EQUIVALENCE, cluster_all, get_nli


class Counting:
    name = "counting"

    def __init__(self):
        self.inner, self.calls = get_nli("exact"), 0

    def relations(self, pairs):
        self.calls += len(pairs)
        return self.inner.relations(pairs)


def semantic_entropy_ids(nli: Counting, question: str, texts: list[str], rule: set) -> list[int]:
    """The semantic-entropy code's `get_semantic_ids`, one pair (two calls) at a time."""
    ids, next_id = [-1] * len(texts), 0
    for i in range(len(texts)):
        if ids[i] == -1:
            ids[i] = next_id
            for j in range(i + 1, len(texts)):
                rel = tuple(nli.relations([(question, texts[i], texts[j]), (question, texts[j], texts[i])]))
                if rel in rule:
                    ids[j] = next_id
            next_id += 1
    return ids


def synthetic(n_questions: int = 600, k: int = 5, seed: int = 0) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    out = []
    for q in range(n_questions):
        pool = [f"Person {q} was born in City{c}." for c in range(rng.choice([1, 2, 3, 5]))]
        out.append((f"Where was person {q} born?", [rng.choice(pool) for _ in range(k)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generations", default="data/generations/world/world.parquet")
    ap.add_argument("--synthetic", action="store_true", help="use synthetic answers even if generations exist")
    ap.add_argument("--equivalence", default="paper", choices=sorted(EQUIVALENCE))
    a = ap.parse_args()
    path = Path(a.generations)
    if path.exists() and not a.synthetic:
        gens = pl.read_parquet(path).filter(pl.col("n_tokens") > 0).sort("question_id", "sample_index")
        items = [(qid, g["text"].to_list()) for (qid,), g in gens.group_by("question_id", maintain_order=True)]
        source = str(path)
    else:
        items, source = synthetic(), "synthetic"
    ours = Counting()
    states = cluster_all(ours, items, a.equivalence)
    base = Counting()
    agree = 0
    for (q, texts), s in zip(items, states):
        ids = semantic_entropy_ids(base, q, texts, EQUIVALENCE[a.equivalence])
        agree += ids == s.ids()  # exact relations are transitive: both must find the same partition
    n = len(items)
    emit(
        {
            "source": source,
            "questions": n,
            "answers": sum(len(t) for _, t in items),
            "mean_unique_answers": round(sum(len(s.unique) for s in states) / n, 3),
            "same_clusters": agree / n,
            "calls_per_question": round(ours.calls / n, 3),
            "baseline_calls_per_question": round(base.calls / n, 3),
            "ratio": round(base.calls / max(ours.calls, 1), 2),
        }
    )


if __name__ == "__main__":
    main()
