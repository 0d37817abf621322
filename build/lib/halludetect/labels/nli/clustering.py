"""Semantic clustering of the K answers to a question, and semantic probability and entropy.

Answers with equal normalised text are merged first, with no NLI call. The u unique answers
are then clustered greedily: each joins the first cluster whose representative it is
equivalent to, asking both directions (A->B, B->A), else founds a new cluster. A question
therefore costs at most u(u-1) directed comparisons, and u = 1 costs none. (The semantic-
entropy code compares raw answers, duplicates included, with every later unassigned one.)

The greedy step is sequential within a question but independent across questions, so all
questions advance together: each round sends every waiting question's next pair in one
`relations` call (one classifier batch, or one burst of concurrent API calls). Each
question is charged an equal share of its rounds' wall time (it made 2 of each round's
calls), which is the per-question cost `evaluate` adds to HaMI (SP).

Equivalence rules: "paper" = (E,E), (E,N), (N,E); "strict" = (E,E) only. A relation the
backend could not give (None) marks the question invalid: its answers get no cluster and no
P_sem, and are counted, never guessed.

P_sem (paper): a cluster's probability is the sum of its members' sequence likelihoods over
the sum of all K likelihoods; an answer's P_sem is its cluster's. Sequence likelihood is
exp(mean token log-prob) (`p_sem_mean`, length-normalised) or exp(sum) (`p_sem_sum`); the
count-based variant (`p_sem_count`, the HaMI code's) is cluster size / K. All are stored, so
choosing one (a detector param) never re-runs clustering. Semantic entropy is
-sum_C P_C log P_C with each of the three P_C.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from halludetect.labels.nli.backends import NLI, Relation
from halludetect.labels.text import normalise

EQUIVALENCE = {
    "paper": {("entailment", "entailment"), ("entailment", "neutral"), ("neutral", "entailment")},
    "strict": {("entailment", "entailment")},
}

CLUSTERS_SCHEMA = {
    "question_id": pl.String,
    "sample_index": pl.Int32,
    "split": pl.String,
    "valid": pl.Boolean,  # false: the NLI backend failed on this question (no P_sem)
    "semantic_id": pl.Int32,
    "p_sem_mean": pl.Float64,
    "p_sem_sum": pl.Float64,
    "p_sem_count": pl.Float64,
    "semantic_entropy_mean": pl.Float64,
    "semantic_entropy_sum": pl.Float64,
    "semantic_entropy_discrete": pl.Float64,
    "n_clusters": pl.Int32,
    "n_unique": pl.Int32,
    "nli_calls": pl.Int32,
}

TIMINGS_SCHEMA = {
    "question_id": pl.String,
    "n_answers": pl.Int32,
    "n_unique": pl.Int32,
    "nli_calls": pl.Int32,
    "seconds": pl.Float64,
}


@dataclass
class _Question:
    """One question's greedy clustering, advanced a comparison at a time."""

    question: str
    texts: list[str]
    keys: list[str] = field(init=False)
    unique_keys: list[str] = field(init=False)  # each normalised text once, in order of first appearance
    unique: list[str] = field(init=False)  # the first answer with each normalised text
    reps: list[int] = field(default_factory=list)  # per cluster: its representative's position in `unique`
    cluster: list[int] = field(default_factory=list)  # per placed unique answer: its cluster
    cand: int = 0  # the cluster the next unique answer is being compared with
    calls: int = 0
    seconds: float = 0.0
    invalid: bool = False

    def __post_init__(self):
        self.keys = [normalise(t) for t in self.texts]
        first = {}
        for t, k in zip(self.texts, self.keys):
            first.setdefault(k, t)
        self.unique_keys, self.unique = list(first), list(first.values())

    def pending(self) -> tuple[str, str] | None:
        """(answer to place, representative to compare with), or None when done."""
        if self.invalid or len(self.cluster) == len(self.unique):
            return None
        if not self.reps:  # the first unique answer founds cluster 0 without a call
            self.reps.append(0)
            self.cluster.append(0)
            return self.pending()
        return self.unique[len(self.cluster)], self.unique[self.reps[self.cand]]

    def advance(self, fwd: Relation | None, bwd: Relation | None, rule: set) -> None:
        self.calls += 2
        if fwd is None or bwd is None:
            self.invalid = True
        elif (fwd, bwd) in rule:
            self.cluster.append(self.cand)
            self.cand = 0
        elif self.cand + 1 < len(self.reps):
            self.cand += 1
        else:
            self.reps.append(len(self.cluster))
            self.cluster.append(len(self.reps) - 1)
            self.cand = 0

    def ids(self) -> list[int] | None:
        """Cluster id per answer (0, 1, ... in order of first appearance), None if invalid."""
        if self.invalid:
            return None
        of_key = dict(zip(self.unique_keys, self.cluster))
        return [of_key[k] for k in self.keys]


def cluster_all(nli: NLI, items: list[tuple[str, list[str]]], equivalence: str) -> list[_Question]:
    """Cluster every (question, answers) item; all questions advance in lock-step rounds."""
    rule = EQUIVALENCE[equivalence]
    states = [_Question(q, texts) for q, texts in items]
    while waiting := [(s, p) for s in states if (p := s.pending()) is not None]:
        pairs = [x for s, (a, b) in waiting for x in ((s.question, a, b), (s.question, b, a))]
        t0 = time.perf_counter()
        rel = nli.relations(pairs)
        share = (time.perf_counter() - t0) / len(waiting)
        for k, (s, _) in enumerate(waiting):
            s.seconds += share
            s.advance(rel[2 * k], rel[2 * k + 1], rule)
    return states


def cluster_question(nli: NLI, question: str, texts: list[str], equivalence: str) -> tuple[list[int] | None, int]:
    """Cluster ids for one question's answers (None if the backend failed) and the NLI calls made."""
    (s,) = cluster_all(nli, [(question, texts)], equivalence)
    return s.ids(), s.calls


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


def unusable_clustering(clusters: pl.DataFrame) -> list[str]:
    """Why a clustering cannot be used, one line per reason: no question that needed the NLI
    backend (two or more unique answers) got a valid clustering, or a split has no valid answer.
    Partial invalidity is allowed: those questions get no P_sem, and are counted."""
    per_q = clusters.unique("question_id", keep="first")
    out = []
    needed = per_q.filter(pl.col("n_unique") > 1)
    if needed.height and not needed["valid"].any():
        out.append(
            f"every one of the {needed.height} questions that needed the NLI backend is invalid (no usable "
            "relation came back)"
        )
    for split in ("train", "val", "test"):
        part = clusters.filter(pl.col("split") == split)
        if part.height and not part["valid"].any():
            out.append(f"{split}: {part.height} answers, none with a valid clustering (no P_sem)")
    return out


def cluster_responses(
    nli: NLI, questions: pl.DataFrame, generations: pl.DataFrame, *, equivalence: str
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(clusters: one row per non-empty answer, timings: one row per question).

    Empty answers have no likelihood: they are excluded (the stage counts them). The
    clusters frame holds no wall times, so the same answers and relations give the same bytes.
    """
    qtext = dict(zip(questions["id"], questions["question"]))
    gens = generations.filter(pl.col("n_tokens") > 0).sort("question_id", "sample_index")
    groups = [(qid, g) for (qid,), g in gens.group_by("question_id", maintain_order=True)]
    states = cluster_all(nli, [(qtext[qid], g["text"].to_list()) for qid, g in groups], equivalence)
    rows, timings = [], []
    for (qid, g), s in zip(groups, states):
        t0 = time.perf_counter()
        ids = s.ids()
        per = {k: [None] * g.height for k in ("p_sem_mean", "p_sem_sum", "p_sem_count")}
        ent = dict.fromkeys(("semantic_entropy_mean", "semantic_entropy_sum", "semantic_entropy_discrete"))
        if ids is not None:
            lps = g["token_logprobs"].to_list()
            p_mean, p_cnt, ent["semantic_entropy_mean"], ent["semantic_entropy_discrete"] = semantic_probabilities(
                ids, [float(np.mean(lp)) for lp in lps]
            )
            p_sum, _, ent["semantic_entropy_sum"], _ = semantic_probabilities(ids, [float(np.sum(lp)) for lp in lps])
            per = {"p_sem_mean": p_mean.tolist(), "p_sem_sum": p_sum.tolist(), "p_sem_count": p_cnt.tolist()}
        for k, r in enumerate(g.select("sample_index", "split").iter_rows(named=True)):
            rows.append(
                {
                    "question_id": qid,
                    "sample_index": r["sample_index"],
                    "split": r["split"],
                    "valid": ids is not None,
                    "semantic_id": ids[k] if ids is not None else None,
                    **{c: v[k] for c, v in per.items()},
                    **ent,
                    "n_clusters": len(s.reps) if ids is not None else None,
                    "n_unique": len(s.unique),
                    "nli_calls": s.calls,
                }
            )
        timings.append(
            {
                "question_id": qid,
                "n_answers": g.height,
                "n_unique": len(s.unique),
                "nli_calls": s.calls,
                "seconds": s.seconds + time.perf_counter() - t0,
            }
        )
    return pl.DataFrame(rows, schema=CLUSTERS_SCHEMA), pl.DataFrame(timings, schema=TIMINGS_SCHEMA)
