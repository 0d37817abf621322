"""Semantic clustering of the K answers to a question, and semantic probability.

Answers with equal normalised text are merged first (no NLI call). The u unique answers are
then clustered greedily, as the semantic-entropy code does: each joins the first cluster
whose representative it is equivalent to, asking both directions (A->B, B->A). So a
question costs at most u(u-1) directed comparisons.

Equivalence rules: "paper" = (E,E), (E,N), (N,E); "strict" = (E,E) only.

P_sem (paper): a cluster's probability is the sum of its members' sequence likelihoods over
the sum of all K likelihoods; an answer's P_sem is its cluster's. Sequence likelihood is
exp(mean token log-prob) ("mean", length-normalised) or exp(sum) ("sum"). The count-based
variant (the HaMI code's) uses cluster size / K. Semantic entropy is -sum_C P_C log P_C,
with likelihood-based or count-based P_C.
"""

from __future__ import annotations

import time

import numpy as np
import polars as pl

from halludetect.nli.backends import NLI
from halludetect.text import normalise

EQUIVALENCE = {
    "paper": {("entailment", "entailment"), ("entailment", "neutral"), ("neutral", "entailment")},
    "strict": {("entailment", "entailment")},
}

CLUSTERS_SCHEMA = {
    "question_id": pl.String,
    "sample_index": pl.Int32,
    "split": pl.String,
    "semantic_id": pl.Int32,
    "p_sem": pl.Float64,
    "p_sem_count": pl.Float64,
    "semantic_entropy": pl.Float64,
    "semantic_entropy_discrete": pl.Float64,
    "n_clusters": pl.Int32,
    "n_unique": pl.Int32,
    "nli_calls": pl.Int32,
    "seconds": pl.Float64,
}


def cluster_question(nli: NLI, question: str, texts: list[str], equivalence: str) -> tuple[list[int], int]:
    """Cluster ids for `texts` (0, 1, ... in order of first appearance) and the NLI calls made."""
    rule = EQUIVALENCE[equivalence]
    keys = [normalise(t) for t in texts]
    unique: list[int] = []  # index of the first text with each normalised key
    for i, k in enumerate(keys):
        if all(keys[j] != k for j in unique):
            unique.append(i)
    reps: list[int] = []  # per cluster, the text index representing it
    cluster_of_unique: dict[str, int] = {}
    calls = 0
    for i in unique:
        assigned = None
        for c, rep in enumerate(reps):
            fwd, bwd = nli.relations(question, [(texts[i], texts[rep]), (texts[rep], texts[i])])
            calls += 2
            if (fwd, bwd) in rule:
                assigned = c
                break
        if assigned is None:
            assigned = len(reps)
            reps.append(i)
        cluster_of_unique[keys[i]] = assigned
    return [cluster_of_unique[k] for k in keys], calls


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def semantic_probabilities(ids: list[int], logliks: list[float]) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Per answer: P_sem (likelihood) and P_sem (count); per question: both entropies."""
    ids_a = np.asarray(ids)
    ll = np.asarray(logliks, dtype=np.float64)
    w = np.exp(ll - ll.max())  # stable: the common factor cancels in the ratio
    n_c = ids_a.max() + 1
    mass = np.bincount(ids_a, weights=w, minlength=n_c) / w.sum()
    count = np.bincount(ids_a, minlength=n_c) / len(ids_a)
    return mass[ids_a], count[ids_a], _entropy(mass), _entropy(count)


def cluster_responses(nli: NLI, questions: pl.DataFrame, generations: pl.DataFrame, *,
                      equivalence: str, likelihood: str) -> pl.DataFrame:
    """One row per non-empty answer. Empty answers have no likelihood: excluded, and the
    stage counts them."""
    qtext = dict(zip(questions["id"], questions["question"]))
    rows = []
    gens = generations.filter(pl.col("n_tokens") > 0).sort("question_id", "sample_index")
    for (qid,), group in gens.group_by("question_id", maintain_order=True):
        t0 = time.perf_counter()
        texts = group["text"].to_list()
        ids, calls = cluster_question(nli, qtext[qid], texts, equivalence)
        agg = (lambda lp: float(np.mean(lp))) if likelihood == "mean" else (lambda lp: float(np.sum(lp)))
        logliks = [agg(lp) for lp in group["token_logprobs"].to_list()]
        p_sem, p_cnt, se, se_d = semantic_probabilities(ids, logliks)
        seconds = time.perf_counter() - t0
        for k, r in enumerate(group.select("sample_index", "split").iter_rows(named=True)):
            rows.append(
                {
                    "question_id": qid, "sample_index": r["sample_index"], "split": r["split"],
                    "semantic_id": ids[k], "p_sem": float(p_sem[k]), "p_sem_count": float(p_cnt[k]),
                    "semantic_entropy": se, "semantic_entropy_discrete": se_d,
                    "n_clusters": max(ids) + 1, "n_unique": len(set(map(normalise, texts))),
                    "nli_calls": calls, "seconds": seconds,
                }
            )
    return pl.DataFrame(rows, schema=CLUSTERS_SCHEMA)
