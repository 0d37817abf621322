"""Metrics of scores against labels, per split, for one or several seeds.

Labels: hallucination = 1 (the positive class); a higher score means "more likely hallucinated".

  auroc, auprc        per seed
  margin              mean(y z), y in {-1, +1}, z the bag logit: the paper's logit-space margin
  margin_by_length    the same within answer-length buckets (<= 5, 6-30, > 30 tokens)
  prr, prr_0.5        prediction-rejection ratio as lm-polygraph defines it (normalised area under
                      the prediction-rejection curve, up to 100% / 50% rejected), averaged over
                      the orders of tied scores
  fpr_at_95_tpr       share of correct answers flagged when 95% of hallucinations are caught
  auroc_ci95          bootstrap interval of the seed-mean AUROC, resampling *questions*: a
                      question's K responses share its difficulty, so resampling them one by one
                      treats correlated responses as independent and gives too narrow an interval

Every per-seed figure is summarised as {mean, stderr, sd, per_seed}: SE = SD / sqrt(seeds) is
the uncertainty of the mean; SD is the spread of one run, what the paper's appendix tables call
the standard deviation.

AUROC, average precision and the ROC points are computed here with numpy, exactly as sklearn's
`roc_auc_score`, `average_precision_score` and `roc_curve` define them (tests/test_detectors.py
and tests/test_metrics.py check them against sklearn on random and tied scores): importing
sklearn.metrics takes 1.2 s (it loads scipy and pandas), and every per-layer train stage (45
processes for the demo world) would pay it to compute one number per epoch.
"""

from __future__ import annotations

import math

import numpy as np

from halludetect.core.errors import DataError

# Answer-length buckets (tokens), upper bounds inclusive; the last is open.
LENGTH_BUCKETS = (("<=5", 5), ("6-30", 30), (">30", None))


def _midranks(s: np.ndarray) -> np.ndarray:
    """1-based ranks of `s`, tied values sharing the mean of their ranks."""
    order = np.argsort(s, kind="mergesort")
    _, inverse, counts = np.unique(s[order], return_inverse=True, return_counts=True)
    ranks = np.empty(len(s))
    ranks[order] = (np.cumsum(counts) - (counts - 1) / 2)[inverse]
    return ranks


def auroc(y: np.ndarray, s: np.ndarray) -> float:
    """Area under the ROC curve (hallucination = 1 the positive class): the Mann-Whitney U of
    positives against negatives over their count product, a tie counting one half."""
    y = np.asarray(y).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs both classes")
    u = _midranks(np.asarray(s, dtype=np.float64))[y].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def average_precision(y: np.ndarray, s: np.ndarray) -> float:
    """Average precision: sum over the distinct score thresholds, highest first, of the recall
    gained times the precision at that threshold (sklearn's step-function definition)."""
    y = np.asarray(y).astype(bool)
    s = np.asarray(s, dtype=np.float64)
    order = np.argsort(-s, kind="mergesort")
    ends = np.r_[np.flatnonzero(np.diff(s[order])), len(s) - 1]  # last index of each distinct score
    tp = np.cumsum(y[order])[ends]
    precision = tp / (ends + 1)
    recall = tp / tp[-1]
    return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def check_two_classes(y: np.ndarray, split: str) -> None:
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == len(y):
        raise DataError(
            f"split '{split}' has one class only ({n_pos} hallucinated of {len(y)} kept): AUROC is "
            "undefined. Use more questions, or a model/dataset with both right and wrong answers"
        )


def margin(y01: np.ndarray, z: np.ndarray) -> float:
    return float(np.mean((2 * y01 - 1) * z))


def mean_se(values: list[float]) -> dict:
    """Mean over seeds, its standard error and the standard deviation of one seed."""
    v = np.asarray(values, dtype=np.float64)
    sd = float(v.std(ddof=1)) if len(v) > 1 else None
    se = sd / math.sqrt(len(v)) if sd is not None else None
    return {"mean": float(v.mean()), "stderr": se, "sd": sd, "per_seed": [float(x) for x in v]}


def expected_calibration_error(y01: np.ndarray, prob: np.ndarray, bins: int = 10) -> float:
    """ECE: the mean |observed hallucination rate - mean probability| over `bins` equal-width
    probability bins, each weighted by its share of answers (an empty bin weighs nothing)."""
    y = np.asarray(y01, dtype=np.float64)
    p = np.asarray(prob, dtype=np.float64)
    which = np.minimum((p * bins).astype(np.int64), bins - 1)  # p = 1 falls in the last bin
    gap = np.abs(np.bincount(which, weights=y, minlength=bins) - np.bincount(which, weights=p, minlength=bins))
    return float(gap.sum() / len(y))


# ------------------------------------------------------------------ rejection and FPR
def _normalise(quality: np.ndarray) -> np.ndarray:
    """Min-max to [0, 1], as lm-polygraph's `normalize` (a constant becomes 0.5)."""
    q = np.asarray(quality, dtype=np.float64)
    lo, hi = q.min(), q.max()
    if np.isclose(lo, hi):
        lo, hi = lo - 1, hi + 1
    return (q - lo) / (hi - lo)


def prediction_rejection_area(score: np.ndarray, quality: np.ndarray, max_rejection: float = 1.0) -> float:
    """lm-polygraph's PredictionRejectionArea: mean quality of the kept answers, averaged over
    rejection rates from 0 to `max_rejection`, rejecting the highest scores first.

    quality: higher = better (here 1 - label), min-max normalised as lm-polygraph does. Answers
    with equal scores are rejected in no order of their own, so the area is averaged over every
    order of each tie, exactly: the area is linear in the kept answers' prefix sums, and over
    the orders of a tie each of its positions holds the tie's mean quality in expectation. So
    each answer's quality is replaced by its tie group's mean (P_sem and the answer length have
    many ties; lm-polygraph's stable sort would let the input order decide them).
    """
    q = _normalise(quality)
    n = len(q)
    n_rej = int(max_rejection * n)
    s = np.asarray(score, dtype=np.float64)
    _, group = np.unique(s, return_inverse=True)
    q = (np.bincount(group, weights=q) / np.bincount(group))[group]  # each answer: its tie group's mean
    kept_in_order = q[np.argsort(s, kind="stable")]  # least uncertain first
    cumsum = np.cumsum(kept_in_order)[-n_rej:]  # the n - n_rej + 1 .. n least uncertain
    return float(np.sum(cumsum / np.arange(n - n_rej + 1, n + 1)) / n_rej)


def prr(y01: np.ndarray, score: np.ndarray, max_rejection: float = 1.0) -> float:
    """Prediction-rejection ratio (lm-polygraph's normalised PRR): (PRA - random) / (oracle - random).

    1 = the score rejects every hallucination before any correct answer, 0 = no better than
    random rejection. lm-polygraph estimates the random area from 1,000 shuffles; its expectation
    is exactly the mean normalised quality (each point of the curve is the mean of a random
    subset), which is used here.
    """
    quality = 1.0 - np.asarray(y01, dtype=np.float64)
    area = prediction_rejection_area(score, quality, max_rejection)
    oracle = prediction_rejection_area(-quality, quality, max_rejection)
    random = float(_normalise(quality).mean())
    if oracle == random:
        raise ValueError("PRR needs both correct and hallucinated answers")
    return float((area - random) / (oracle - random))


def roc_points(y01: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every distinct score threshold, highest first: the points of sklearn's
    roc_curve (before it drops the collinear ones)."""
    y = np.asarray(y01).astype(bool)
    s = np.asarray(score, dtype=np.float64)
    order = np.argsort(-s, kind="mergesort")
    ends = np.r_[np.flatnonzero(np.diff(s[order])), len(s) - 1]  # last index of each distinct score
    tp = np.cumsum(y[order])[ends]
    fp = ends + 1 - tp
    return fp / (~y).sum(), tp / y.sum()


def fpr_at_tpr(y01: np.ndarray, score: np.ndarray, tpr_level: float = 0.95) -> float:
    """The false-positive rate at the first threshold that reaches `tpr_level` true-positive rate."""
    fpr, tpr = roc_points(y01, score)
    return float(fpr[np.searchsorted(tpr, tpr_level, side="left")])


# ------------------------------------------------------------------------- bootstrap
def question_groups(question_ids) -> np.ndarray:
    """Dense group index [N] of each response's question (in order of first appearance)."""
    _, first, inverse = np.unique(np.asarray(question_ids), return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # relabel groups by first appearance
    return order[inverse]


def bootstrap_auroc_ci(
    y: np.ndarray, scores: list[np.ndarray], n: int, seed: int, groups: np.ndarray
) -> list[float] | None:
    """95% percentile interval of the seed-mean AUROC, resampling questions (`groups` [N]: the
    question of each response) with replacement, all of a question's responses together.

    A resample that draws a question c times counts its responses c times.
    """
    if n == 0:
        return None
    groups = np.asarray(groups)
    if groups.shape != y.shape:
        raise ValueError(f"groups must name the question of every response: {groups.shape} for {y.shape}")
    n_groups = int(groups.max()) + 1
    rng = np.random.default_rng(seed)
    # [n, N] how often each resample draws each response (its question's draw count): the draws one
    # resample at a time, as they always were (one call for all would consume the stream otherwise)
    weights = np.stack([np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups) for _ in range(n)])
    weights = weights[:, groups]
    y = np.asarray(y).astype(bool)
    per_seed = np.stack([_resampled_aurocs(y, np.asarray(s, dtype=np.float64), weights) for s in scores])  # [S, n]
    # a one-class resample has no AUROC (nan): it is skipped, not scored
    stats = [np.mean([float(a) for a in col]) for col in per_seed.T if not np.isnan(col[0])]
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return [float(lo), float(hi)]


def _resampled_aurocs(y: np.ndarray, s: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """[n] `auroc` of every resample, each response counted as often as `weights` [n, N] says, without
    building the resamples: Mann-Whitney's U summed over the distinct scores from the weights of the
    positives and negatives at each (ties count one half). U is exact in integers (2U), so each value
    has the bits `auroc` gives the resample built out; nan for a one-class resample."""
    if np.isnan(s).any():  # NaN scores rank as `auroc`'s sort ranks them: the resamples built out
        out = []
        for w in weights:
            idx = np.repeat(np.arange(len(y)), w)
            out.append(np.nan if len(idx) == 0 or y[idx].min() == y[idx].max() else auroc(y[idx], s[idx]))
        return np.asarray(out)
    order = np.argsort(s, kind="mergesort")
    starts = np.r_[0, np.flatnonzero(np.diff(s[order])) + 1]  # first position of each distinct score
    w = weights[:, order]  # [n, N] in score order
    pos = y[order]
    wp = np.add.reduceat(np.where(pos, w, 0), starts, axis=1)  # [n, L] positives drawn at each score
    wn = np.add.reduceat(np.where(pos, 0, w), starts, axis=1)  # [n, L] negatives
    below = np.cumsum(wn, axis=1) - wn  # negatives drawn at lower scores
    u2 = (wp * (2 * below + wn)).sum(1)  # [n] 2U
    n_pos, n_neg = wp.sum(1), wn.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((n_pos > 0) & (n_neg > 0), (u2 / 2) / (n_pos * n_neg), np.nan)


# ------------------------------------------------------------------------- per split
def margin_by_length(y: np.ndarray, scores: list[np.ndarray], lengths: np.ndarray) -> dict:
    """Margin mean(y z) within each answer-length bucket (LENGTH_BUCKETS), per seed."""
    lengths = np.asarray(lengths)
    out, lower = {}, 0
    for name, upper in LENGTH_BUCKETS:
        sel = (lengths > lower) & (lengths <= upper if upper is not None else True)
        lower = upper if upper is not None else lower
        out[name] = {
            "n": int(sel.sum()),
            "n_hallucinated": int(y[sel].sum()),
            "margin": mean_se([margin(y[sel], s[sel]) for s in scores]) if sel.any() else None,
        }
    return out


def split_metrics(
    y: np.ndarray,
    scores: list[np.ndarray],
    bootstrap: int = 0,
    seed: int = 0,
    logits: bool = True,
    groups: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
) -> dict:
    """Metrics of one split for per-seed scores (each [N]).

    The margin needs logits: for a score that is not one (a baseline), it is None rather than a
    number on another scale. `groups` (each response's question, see question_groups) is needed
    for the bootstrap; `lengths` (answer tokens) for the margins by length.
    """
    y = np.asarray(y)
    out = {
        "n": int(len(y)),
        "n_hallucinated": int(y.sum()),
        "auroc": mean_se([auroc(y, s) for s in scores]),
        "auprc": mean_se([average_precision(y, s) for s in scores]),
        "prr": mean_se([prr(y, s) for s in scores]),
        "prr_0.5": mean_se([prr(y, s, 0.5) for s in scores]),
        "fpr_at_95_tpr": mean_se([fpr_at_tpr(y, s) for s in scores]),
        "margin": mean_se([margin(y, s) for s in scores]) if logits else None,
        "scores_mean_by_label": {str(lab): float(np.mean([s[y == lab].mean() for s in scores])) for lab in (0, 1)},
    }
    if logits and lengths is not None:
        out["margin_by_length"] = margin_by_length(y, scores, lengths)
    if bootstrap:
        if groups is None:
            raise ValueError("the bootstrap resamples questions: pass each response's question (groups)")
        out["auroc_ci95"] = bootstrap_auroc_ci(y, scores, bootstrap, seed, groups)
        out["bootstrap"] = {"resamples": bootstrap, "unit": "question", "questions": int(np.max(groups)) + 1}
    return out
