"""Metrics of scores against labels: AUROC with a bootstrap interval, AUPRC, and the
logit-space margin; per-seed figures summarised as mean and standard error.

Labels: hallucination = 1. The margin is mean(y z) with y in {-1, +1} and z the bag logit, as
the paper defines it (logit space, before the sigmoid).

AUROC and average precision are computed here with numpy, exactly as sklearn's
`roc_auc_score` and `average_precision_score` define them (tests/test_detectors.py checks
them against sklearn on random and tied scores): importing sklearn.metrics takes 1.2 s (it
loads scipy and pandas), and every per-layer train stage (45 processes for the demo world)
would pay it to compute one number per epoch.
"""

from __future__ import annotations

import math

import numpy as np

from halludetect.errors import DataError


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
    v = np.asarray(values, dtype=np.float64)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None
    return {"mean": float(v.mean()), "stderr": se, "per_seed": [float(x) for x in v]}


def bootstrap_auroc_ci(y: np.ndarray, scores: list[np.ndarray], n: int, seed: int) -> list[float] | None:
    """95% percentile interval of the seed-mean AUROC, resampling test responses."""
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(n):
        idx = rng.integers(0, len(y), len(y))
        if y[idx].min() == y[idx].max():
            continue  # a one-class resample has no AUROC; it is skipped, not scored
        stats.append(np.mean([auroc(y[idx], s[idx]) for s in scores]))
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return [float(lo), float(hi)]


def split_metrics(y: np.ndarray, scores: list[np.ndarray], bootstrap: int = 0, seed: int = 0,
                  logits: bool = True) -> dict:
    """Metrics of one split for per-seed scores (each [N]). The margin needs logits: for a
    score that is not one (a baseline), it is None rather than a number on another scale."""
    out = {
        "n": int(len(y)),
        "n_hallucinated": int(y.sum()),
        "auroc": mean_se([auroc(y, s) for s in scores]),
        "auprc": mean_se([average_precision(y, s) for s in scores]),
        "margin": mean_se([margin(y, s) for s in scores]) if logits else None,
        "scores_mean_by_label": {str(lab): float(np.mean([s[y == lab].mean() for s in scores])) for lab in (0, 1)},
    }
    if bootstrap:
        out["auroc_ci95"] = bootstrap_auroc_ci(y, scores, bootstrap, seed)
    return out
