"""How the scores with nothing to train are computed from the sampled answers and their clustering
(their declarations, with what each means: halludetect/methods/scores.py). Each function takes
(generations, clusters, the score's params section detectors.<name>) and returns columns rid, score.

The question-level scores (semantic entropy, lexical similarity, semantic sets) give every answer
of a question the same score. Lexical similarity needs two non-empty answers: a question with one
is left out, counted. p(True) runs the model again (p_true.py).
Lexical similarity is lm-polygraph's LexicalSimilarity: rouge_score's rougeL with the Porter
stemmer, every pair i < j once; lm-polygraph reports minus the mean, the same ranking.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import polars as pl

from halludetect.core.lookup import lookup
from halludetect.core.registry import load_target
from halludetect.core.sections import Section
from halludetect.methods import SCORES, Score
from halludetect.metrics import check_two_classes, question_groups, split_metrics
from halludetect.qa.responses import response_ids


def _by_response(df: pl.DataFrame, score: pl.Expr) -> pl.DataFrame:
    return df.select(response_ids(df).alias("rid"), score.cast(pl.Float64).alias("score"))


def p_sem(generations, clusters, p):
    ok = clusters.filter(pl.col("valid"))
    return _by_response(ok, 1 - pl.col(f"p_sem_{p.variant}"))


def semantic_entropy(generations, clusters, p):
    ok = clusters.filter(pl.col("valid"))
    if p.variant != "polygraph":
        return _by_response(ok, pl.col(f"semantic_entropy_{p.variant}"))
    # lm-polygraph's estimator: -mean_j log sum_{k in cluster(j)} exp(ll_k), ll the answer's summed token
    # log-probs, unnormalised; every answer of a question gets the question's value
    ll = generations.select("question_id", "sample_index", pl.col("token_logprobs").list.sum().alias("ll"))
    rows = ok.join(ll, on=["question_id", "sample_index"], how="left")
    mass = rows.group_by("question_id", "semantic_id").agg(pl.col("ll").alias("lls"))
    mass = mass.with_columns(pl.col("lls").map_elements(_logsumexp, return_dtype=pl.Float64).alias("class_lp"))
    rows = rows.join(mass.drop("lls"), on=["question_id", "semantic_id"], how="left")
    entropy = rows.group_by("question_id").agg((-pl.col("class_lp").mean()).alias("se"))
    return _by_response(rows.join(entropy, on="question_id", how="left"), pl.col("se"))


def _logsumexp(values) -> float:
    return float(np.logaddexp.reduce(np.asarray(list(values), dtype=np.float64)))


def logprob(generations, clusters, p):
    return _by_response(generations.filter(pl.col("n_tokens") > 0), -pl.col("token_logprobs").list.mean())


def length(generations, clusters, p):
    return _by_response(generations, pl.col("n_tokens"))


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F-measure of two answers, as lm-polygraph computes it (rouge_score, Porter stemmer)."""
    return _rouge().score(a, b)["rougeL"].fmeasure


def _rouge():
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return _SCORER


_SCORER = None


def lexical_dissimilarity(texts: list[str]) -> float:
    """1 - mean ROUGE-L F over every pair i < j of a question's answers (at least two)."""
    if len(texts) < 2:
        raise ValueError("lexical similarity needs at least two answers")
    return 1.0 - float(np.mean([rouge_l(a, b) for a, b in itertools.combinations(texts, 2)]))


def lexical_similarity(generations, clusters, p):
    answers = generations.filter(pl.col("n_tokens") > 0).sort("question_id", "sample_index")
    per_q = answers.group_by("question_id", maintain_order=True).agg("text", "sample_index")
    scores = {q: lexical_dissimilarity(t) for q, t in zip(per_q["question_id"], per_q["text"]) if len(t) >= 2}
    scored = answers.filter(pl.col("question_id").is_in(list(scores)))
    return _by_response(scored, pl.col("question_id").replace_strict(scores, return_dtype=pl.Float64))


def semantic_sets(generations, clusters, p):
    ok = clusters.filter(pl.col("valid"))
    return _by_response(ok, pl.col("n_clusters"))


def baseline(name: str) -> Score:
    """The declaration of the score `name` computed from the sampled answers."""
    return lookup("baseline", name, {n: s for n, s in SCORES.items() if s.source == "answers"})


def baseline_scores(name: str, generations: pl.DataFrame, clusters: pl.DataFrame, params: Section) -> pl.DataFrame:
    """Columns rid, score for every response the baseline can score."""
    spec = baseline(name)
    return load_target(spec.compute, f"the score {name}")(generations, clusters, params)


def timed_scores(
    name: str, generations: pl.DataFrame, clusters: pl.DataFrame, params: Section
) -> tuple[pl.DataFrame, float]:
    """The scores and the seconds they took (the baseline's own share of its cost)."""
    t0 = time.perf_counter()
    scores = baseline_scores(name, generations, clusters, params)
    return scores, time.perf_counter() - t0


def evaluate_baseline(scores: pl.DataFrame, judgments: pl.DataFrame, *, bootstrap: int, seed: int) -> dict:
    """A baseline's val/test figures from its per-response scores (columns rid, score)."""
    labels = judgments.filter(pl.col("kept")).select(
        response_ids(judgments).alias("rid"), "question_id", "split", "label"
    )
    joined = labels.join(scores, on="rid", how="left")
    out = {"best_layer": None, "layers": [], "excluded": {}}
    for split in ("val", "test"):
        part = joined.filter(pl.col("split") == split)
        ok = part.filter(pl.col("score").is_not_null() & pl.col("score").is_finite())
        out["excluded"][split] = {"no_score": part.height - ok.height}
        y = ok["label"].to_numpy().astype(np.int64)
        check_two_classes(y, split)
        out[split] = split_metrics(
            y,
            [ok["score"].to_numpy()],
            bootstrap=bootstrap if split == "test" else 0,
            seed=seed,
            logits=False,
            groups=question_groups(ok["question_id"].to_list()),
        )
    return out
