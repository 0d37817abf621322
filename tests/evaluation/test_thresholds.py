"""Thresholds and calibration of a bundle (halludetect/evaluation/thresholds.py): each threshold
meets its false-positive rate on scores worked out by hand, the best F1 is the best, and Platt
scaling is the maximum-likelihood logistic fit."""

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss

from halludetect.evaluation.thresholds import (
    choose_thresholds,
    fit_platt,
    rates_at_threshold,
    threshold_at_fpr,
    threshold_best_f1,
)


def labelled_scores(n=400, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    return y, rng.normal(size=n) + 1.5 * y


def test_thresholds_meet_their_false_positive_rate_and_best_f1_is_the_best():
    y, z = labelled_scores()
    yt, zt = labelled_scores(seed=1)
    t = choose_thresholds(y, z, [0.01, 0.05, 0.1], (yt, zt))
    assert sorted(t) == ["best_f1", "fpr_0.01", "fpr_0.05", "fpr_0.1"]
    neg = z[y == 0]
    for target in (0.01, 0.05, 0.1):
        entry = t[f"fpr_{target:g}"]
        assert np.mean(neg >= entry["threshold"]) == entry["val_fpr"] <= target == entry["target_fpr"]
        assert np.mean(z[y == 1] >= entry["threshold"]) == entry["val_tpr"]
        # the lowest such threshold: one score lower and the target would be exceeded
        lower = z[z < entry["threshold"]].max()
        assert np.mean(neg >= lower) > target
        # test figures of the same threshold, for the reader
        assert entry["test_fpr"] == np.mean(zt[yt == 0] >= entry["threshold"])
        assert entry["test_tpr"] == np.mean(zt[yt == 1] >= entry["threshold"])

    def f1(th):
        flag = z >= th
        tp = (flag & (y == 1)).sum()
        return 2 * tp / (flag.sum() + (y == 1).sum())

    assert t["best_f1"]["val_f1"] == pytest.approx(max(f1(th) for th in z))
    assert t["best_f1"]["val_f1"] == pytest.approx(f1(t["best_f1"]["threshold"]))
    assert "target_fpr" not in t["best_f1"]


# Worked out by hand: 10 correct answers (0) and 5 hallucinated (1); three scores tie at 5.
HAND_Y = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
HAND_Z = np.array([9.0, 5, 5, 4, 3, 2, 1, 0, -1, -2, 8, 6, 5, 3.5, -3])


@pytest.mark.parametrize(
    ("target", "threshold", "fpr", "tpr", "flagged"),
    [
        # at most 1 correct answer: 9 (correct), 8 and 6 (hallucinated); flagging 5 would add the
        # two correct 5s with the hallucinated one (ties go together): FPR 0.3
        (0.1, 6.0, 0.1, 0.4, 3),
        (0.3, 5.0, 0.3, 0.6, 6),  # the tie included: exactly at the target
        (0.35, 5.0, 0.3, 0.6, 6),  # 4 (correct) would make it 0.4
        (0.5, 3.0, 0.5, 0.8, 9),  # 9, 8, 6, 5 x3, 4, 3.5, 3
    ],
)
def test_threshold_at_a_target_false_positive_rate_on_scores_worked_out_by_hand(target, threshold, fpr, tpr, flagged):
    got = threshold_at_fpr(HAND_Y, HAND_Z, target)
    assert got["threshold"] == threshold and got["target_fpr"] == target
    assert (got["fpr"], got["tpr"], got["flagged"], got["negatives"], got["positives"]) == (fpr, tpr, flagged, 10, 5)
    # another set's rates at that threshold (a transfer check): its own counts
    other = rates_at_threshold([0, 0, 1, 1], [threshold + 1, threshold - 1, threshold, threshold - 1], threshold)
    assert (other["fpr"], other["tpr"], other["flagged"], other["precision"]) == (0.5, 0.5, 2, 0.5)


def test_a_false_positive_rate_no_flag_reaches_flags_nothing():
    """The highest score, 9, is a correct answer's: any flag costs FPR >= 0.1, above 5%. The threshold
    then sits just above it: nothing is flagged (no threshold is ever missing)."""
    got = threshold_at_fpr(HAND_Y, HAND_Z, 0.05)
    assert got["threshold"] == np.nextafter(9.0, np.inf) and got["flagged"] == 0
    assert (got["fpr"], got["tpr"], got["f1"]) == (0.0, 0.0, 0.0)


def test_best_f1_is_still_there_worked_out_by_hand():
    # F1 = 2 TP / (TP + FP + 5) at each distinct score: 8 -> 2/7, 6 -> 4/8, 5 -> 6/11, 3.5 -> 8/13 (best), 3 -> 8/14
    got = threshold_best_f1(HAND_Y, HAND_Z)
    assert got["threshold"] == 3.5 and got["f1"] == pytest.approx(8 / 13) and (got["fpr"], got["tpr"]) == (0.4, 0.8)
    # a tie in F1: the lowest threshold, as before (sklearn's precision_recall_curve order)
    assert threshold_best_f1([1, 0, 0, 1], [4.0, 3.0, 2.0, 1.0])["threshold"] == 1.0  # F1 2/3 at 4 and at 1


@pytest.mark.parametrize(
    ("y", "z", "target", "match"),
    [
        ([0, 0, 1], [1.0, 2.0, 3.0], 1.0, "target false-positive rate 1.0 is not strictly between 0 and 1"),
        ([0, 0, 1], [1.0, 2.0, 3.0], 0.0, "target false-positive rate 0.0 is not strictly between 0 and 1"),
        ([0, 0, 0], [1.0, 2.0, 3.0], 0.05, "0 hallucinated and 3 correct answer.s.: .* need both classes"),
        ([0, 1, 1], [1.0, float("nan"), 3.0], 0.05, "1 score.s. are not finite"),
    ],
)
def test_threshold_choice_refuses_what_has_no_rate(y, z, target, match):
    with pytest.raises(ValueError, match=match):
        threshold_at_fpr(y, z, target)


def test_platt_scaling_is_an_unregularised_logistic_fit():
    """Newton's fit is the maximum-likelihood one: sklearn's unregularised fit run to a tight
    tolerance agrees to 1e-7, and the likelihood's gradient is zero there."""
    y, z = labelled_scores()
    c = fit_platt(y, z)
    ref = LogisticRegression(C=np.inf, tol=1e-12, max_iter=10_000).fit(z[:, None], y)
    assert c["a"] == pytest.approx(ref.coef_[0, 0], rel=1e-7) and c["b"] == pytest.approx(ref.intercept_[0], rel=1e-7)
    p = 1 / (1 + np.exp(-(c["a"] * z + c["b"])))
    np.testing.assert_allclose([np.sum((p - y) * z), np.sum(p - y)], 0, atol=1e-9 * len(y))
    assert c["converged"] and c["a"] > 0 and 0 < c["val_brier"] < 0.25
    assert c["val_log_loss"] == pytest.approx(log_loss(y, p), rel=1e-12)


def test_platt_scaling_of_separated_scores_stops_and_says_it_did_not_converge():
    """Validation logits that separate the classes have no maximum-likelihood fit: a finite slope
    after the step limit, `converged: false`, and the bundle's summary says what that means."""
    c = fit_platt(np.array([0, 0, 1, 1]), np.array([-1.0, -0.5, 0.5, 1.0]))
    assert not c["converged"] and np.isfinite(c["a"]) and c["a"] > 10
    assert fit_platt(np.array([0, 1, 0, 1]), np.ones(4))["a"] == 0  # one score for all: the base rate
