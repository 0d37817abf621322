"""What a bundle's flag and probability are made of, fitted on the validation split: thresholds at
target false-positive rates and at the best F1, each with the rates it reaches on validation and
on test, and Platt scaling of the logits. Export (scoring/export.py) stores them in a bundle;
transfer (evaluation/transfer.py) measures them on another dataset's test split.

Inputs are the seeds' mean logit per response (`ensemble_scores`, from a layer's scores table:
the bundle's own score) and the labels (1 = hallucinated). A threshold flags `z >= threshold`.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from halludetect.config import threshold_name
from halludetect.core.errors import DataError


def ensemble_scores(scores: pl.DataFrame, split: str, seeds: list[int], source: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels [n] and the mean of the seeds' logits [n] of one split's responses, from the
    per-layer scores table (one row per response and seed)."""
    part = scores.filter(pl.col("split") == split)
    have = sorted(part["seed"].unique().to_list())
    if have != sorted(seeds):
        raise DataError(
            f"{source}: the {split} scores hold seeds {have}, the evaluation averaged {sorted(seeds)}: "
            "re-run train and evaluate"
        )
    wide = part.pivot(on="seed", index=["response_id", "label"], values="score", aggregate_function=None)
    cols = [str(s) for s in seeds]
    if wide[cols].null_count().sum_horizontal().item():
        raise DataError(f"{source}: some {split} responses lack a score for some seed: re-run evaluate")
    wide = wide.sort("response_id")
    z = wide.select(pl.mean_horizontal([pl.col(c).cast(pl.Float64) for c in cols])).to_series().to_numpy()
    return wide["label"].to_numpy().astype(np.int64), z


def _labelled(y, z) -> tuple[np.ndarray, np.ndarray]:
    """(y as bool [n], z as float64 [n]), checked: same length, finite scores, both classes."""
    y, z = np.asarray(y).astype(bool), np.asarray(z, dtype=np.float64)
    if y.shape != z.shape or y.ndim != 1:
        raise ValueError(f"labels {y.shape} and scores {z.shape} must be two vectors of one length")
    if not np.isfinite(z).all():
        raise ValueError(f"{int((~np.isfinite(z)).sum())} score(s) are not finite")
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        raise ValueError(
            f"{pos} hallucinated and {neg} correct answer(s): a false- and a true-positive rate need both classes"
        )
    return y, z


def rates_at_threshold(y, z, threshold: float) -> dict:
    """What flagging `z >= threshold` does to labelled scores (y = 1: hallucinated): its false- and
    true-positive rates, precision and F1, and the counts they come from. A transfer check calls it
    with one dataset's threshold on another's scores."""
    y, z = _labelled(y, z)
    flag = z >= threshold
    tp, fp = int((flag & y).sum()), int((flag & ~y).sum())
    pos, neg = int(y.sum()), int((~y).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    return {
        "threshold": float(threshold),
        "fpr": fp / neg,
        "tpr": tp / pos,
        "precision": precision,
        "f1": 2 * tp / (tp + fp + pos),  # = 2 P R / (P + R), and 0 when nothing is flagged
        "flagged": tp + fp,
        "positives": pos,
        "negatives": neg,
    }


def _distinct(y: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every distinct score, highest first, and the true and false positives of flagging z >= it:
    tied scores are flagged together, so a threshold never splits them."""
    order = np.argsort(-z, kind="mergesort")
    zs, ys = z[order], y[order]
    ends = np.r_[np.flatnonzero(np.diff(zs)), len(zs) - 1]  # the last index of each distinct score
    return zs[ends], np.cumsum(ys)[ends], np.cumsum(~ys)[ends]


def threshold_at_fpr(y, z, target_fpr: float) -> dict:
    """The lowest threshold whose false-positive rate on (y, z) is at most `target_fpr` (flag =
    z >= threshold), with `rates_at_threshold`'s figures and `target_fpr`: the most hallucinations
    caught at that rate. Tied scores are flagged together, so the rate reached may be below the
    target. When even the highest score is a correct answer's and flagging it alone exceeds the
    target, the threshold sits just above the highest score and flags nothing (`flagged` 0)."""
    if not 0.0 < target_fpr < 1.0:
        raise ValueError(f"target false-positive rate {target_fpr!r} is not strictly between 0 and 1")
    y, z = _labelled(y, z)
    scores, _, fp = _distinct(y, z)
    within = np.flatnonzero(fp / (~y).sum() <= target_fpr)  # a prefix: fp never decreases
    t = float(scores[within[-1]]) if within.size else float(np.nextafter(scores[0], math.inf))
    return {"target_fpr": target_fpr, **rates_at_threshold(y, z, t)}


def threshold_best_f1(y, z) -> dict:
    """The threshold of the highest F1 on (y, z) (the lowest such threshold on ties), with
    `rates_at_threshold`'s figures."""
    y, z = _labelled(y, z)
    scores, tp, fp = _distinct(y, z)
    f1 = 2 * tp / (tp + fp + y.sum())
    best = np.flatnonzero(f1 == f1.max())[-1]
    return rates_at_threshold(y, z, float(scores[best]))


def threshold_entry(rule: dict, test: tuple[np.ndarray, np.ndarray]) -> dict:
    """A bundle's record of a threshold chosen on validation (`rule`: `threshold_at_fpr`'s or
    `threshold_best_f1`'s figures): what it does on validation, and on test, measured for the
    reader only (test never chooses)."""
    on_test = rates_at_threshold(*test, rule["threshold"])
    return {
        **({"target_fpr": rule["target_fpr"]} if "target_fpr" in rule else {}),
        "threshold": rule["threshold"],
        "val_fpr": rule["fpr"],
        "val_tpr": rule["tpr"],
        "val_precision": rule["precision"],
        "val_f1": rule["f1"],
        "test_fpr": on_test["fpr"],
        "test_tpr": on_test["tpr"],
    }


def choose_thresholds(
    y: np.ndarray, z: np.ndarray, fpr_targets: list[float], test: tuple[np.ndarray, np.ndarray]
) -> dict[str, dict]:
    """A bundle's thresholds on validation logits (y, z): at each target false-positive rate
    (`fpr_<target>`) and at the best F1 (`best_f1`), each with its validation and test figures."""
    out = {threshold_name(t): threshold_entry(threshold_at_fpr(y, z, t), test) for t in fpr_targets}
    out["best_f1"] = threshold_entry(threshold_best_f1(y, z), test)
    return out


PLATT_MAX_STEPS = 100


def fit_platt(y: np.ndarray, z: np.ndarray) -> dict:
    """Platt scaling p = sigmoid(a z + b): the unregularised logistic regression of the labels on the
    logits, fitted by Newton's method with a backtracking line search (Platt's own fit; Lin, Lin and
    Weng 2007 for the safeguards). Two parameters need no optimiser library: this is the exact
    maximum-likelihood fit (to the last digits, where lbfgs stops at its tolerance), and it spares
    every evaluate and transfer stage the 1.2 s import of scikit-learn. On validation logits that
    separate the classes perfectly the likelihood has no maximum (a grows without bound): the fit
    stops after PLATT_MAX_STEPS steps and says `converged: false`."""
    y, z = np.asarray(y, dtype=np.float64), np.asarray(z, dtype=np.float64)
    x = np.stack([z, np.ones_like(z)], axis=1)  # [n, 2]

    def nll(w: np.ndarray) -> float:
        s = x @ w  # [n] a z + b
        return float(np.sum(np.logaddexp(0.0, s) - y * s))  # -sum(y log p + (1 - y) log(1 - p))

    rate = np.clip(y.mean(), 1e-12, 1 - 1e-12)
    w = np.array([0.0, math.log(rate / (1 - rate))])  # a = 0: every answer at the base rate
    loss, converged = nll(w), False
    for _ in range(PLATT_MAX_STEPS):
        p = 1 / (1 + np.exp(-(x @ w)))
        grad = x.T @ (p - y)  # [2]
        hess = (x * (p * (1 - p))[:, None]).T @ x  # [2, 2]
        try:
            step = np.linalg.solve(hess + 1e-12 * np.eye(2), grad)
        except np.linalg.LinAlgError:  # every p at 0 or 1: nothing more to gain
            break
        t = 1.0
        while t > 1e-10 and (new := nll(w - t * step)) > loss + 1e-4 * t * float(grad @ -step):
            t /= 2  # Armijo: halve until the loss falls by a share of what the step promised
        if t <= 1e-10:
            converged = bool(np.max(np.abs(grad)) <= 1e-8 * len(y))
            break
        w, loss = w - t * step, new
        if np.max(np.abs(t * step)) <= 1e-12 * (1 + np.max(np.abs(w))):
            converged = True
            break
    a, b = float(w[0]), float(w[1])
    p = 1 / (1 + np.exp(-(a * z + b)))
    return {
        "method": "platt",
        "a": a,
        "b": b,
        "fitted_on": "val",
        "n": int(len(y)),
        "converged": converged,
        "val_log_loss": loss / len(y),
        "val_brier": float(np.mean((p - y) ** 2)),
    }
