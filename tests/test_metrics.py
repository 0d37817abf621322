"""Split metrics (halludetect/metrics.py): AUROC and average precision equal sklearn's (ties included),
the margin as the paper defines it, PRR as lm-polygraph defines it, FPR at 95% TPR, SD and SE over
seeds, margins by answer length, and a bootstrap that resamples questions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

from halludetect.metrics import (
    _resampled_aurocs,
    auroc,
    average_precision,
    bootstrap_auroc_ci,
    fpr_at_tpr,
    margin,
    margin_by_length,
    mean_se,
    prr,
    question_groups,
    split_metrics,
)


def brute_force_prr(y, score, max_rejection=1.0, shuffles=2000, seed=0):
    """The definition written out: reject the r most uncertain answers for r = 0 .. n_rej - 1,
    average the accuracy of what is kept; normalise between random order and the oracle."""
    quality = 1.0 - y

    def area(order):
        n = len(order)
        return np.mean([quality[order[: n - r]].mean() for r in range(int(max_rejection * n))])

    ours = area(np.argsort(score, kind="stable"))
    oracle = area(np.argsort(-quality, kind="stable"))
    rng = np.random.default_rng(seed)
    random = np.mean([area(rng.permutation(len(y))) for _ in range(shuffles)])
    return (ours - random) / (oracle - random)


def test_prr_matches_its_definition():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 60)
    score = y + rng.normal(size=60)
    for max_rejection in (1.0, 0.5):
        assert prr(y, score, max_rejection) == pytest.approx(brute_force_prr(y, score, max_rejection), abs=0.02)
    assert prr(y, y.astype(float)) == pytest.approx(1.0)  # rejects every hallucination first
    assert prr(y, -y.astype(float)) < 0  # worse than random
    with pytest.raises(ValueError, match="both correct and hallucinated"):
        prr(np.ones(4), np.arange(4.0))


def test_prr_with_ties_is_the_mean_over_every_order_of_the_ties():
    """P_sem and the answer length have many ties: the area is averaged over the orders of each
    tie (exactly, by their mean quality), so it never depends on the input order."""
    from halludetect.metrics import prediction_rejection_area

    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 40)
    score = rng.integers(0, 4, 40).astype(float)  # four values: big ties
    quality = 1.0 - y
    for max_rejection in (1.0, 0.5):
        n_rej, draws = int(max_rejection * 40), []
        for _ in range(3000):  # break the ties at random: a random order, then a stable sort by score
            perm = rng.permutation(40)
            kept = quality[perm[np.argsort(score[perm], kind="stable")]]  # least uncertain first
            draws.append(np.mean([kept[: 40 - r].mean() for r in range(n_rej)]))  # the definition
        assert prediction_rejection_area(score, quality, max_rejection) == pytest.approx(np.mean(draws), abs=2e-3)
    shuffled = rng.permutation(40)
    assert prr(y[shuffled], score[shuffled]) == pytest.approx(prr(y, score), abs=1e-12)


def test_fpr_at_95_tpr_on_a_hand_built_case():
    # catching 95% of 4 hallucinations means all 4: threshold 0.1 flags 3 of 4 correct answers
    y = np.array([1, 1, 1, 1, 0, 0, 0, 0])
    score = np.array([0.9, 0.8, 0.7, 0.1, 0.6, 0.5, 0.2, 0.05])
    assert fpr_at_tpr(y, score) == pytest.approx(0.75)
    assert fpr_at_tpr(y, score, 0.75) == pytest.approx(0.0)


def test_sd_and_se_over_seeds():
    s = mean_se([0.8, 0.9, 1.0])
    assert s["mean"] == pytest.approx(0.9) and s["sd"] == pytest.approx(0.1)
    assert s["stderr"] == pytest.approx(0.1 / np.sqrt(3))
    assert mean_se([0.5])["sd"] is None and mean_se([0.5])["stderr"] is None


def test_margin_by_length_buckets():
    y = np.array([1, 0, 1, 0, 1])
    z = np.array([2.0, -1.0, 3.0, 1.0, -2.0])
    lengths = np.array([5, 1, 6, 30, 31])  # <=5: two, 6-30: two, >30: one
    m = margin_by_length(y, [z], lengths)
    assert m["<=5"]["n"] == 2 and m["<=5"]["margin"]["mean"] == pytest.approx((2 + 1) / 2)
    assert m["6-30"]["n"] == 2 and m["6-30"]["margin"]["mean"] == pytest.approx((3 - 1) / 2)
    assert m[">30"] == {"n": 1, "n_hallucinated": 1, "margin": mean_se([-2.0])}
    empty = margin_by_length(y, [z], np.array([1, 2, 3, 4, 5]))
    assert empty[">30"] == {"n": 0, "n_hallucinated": 0, "margin": None}


def test_question_groups_are_dense_and_ordered():
    assert question_groups(["q9", "q9", "q1", "q5", "q1"]).tolist() == [0, 0, 1, 2, 1]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 60),
    seed=st.integers(0, 10_000),
    decimals=st.sampled_from([0, 1, 6]),
    nan=st.booleans(),
)
def test_each_resamples_auroc_has_the_bits_of_the_resample_built_out(n, seed, decimals, nan):
    """The bootstrap counts each response as often as its question is drawn, without building the
    resample: every AUROC equals `auroc` on the resample built out, bit for bit (ties, one-class
    resamples as nan, NaN scores)."""
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.4
    s = np.round(rng.normal(size=n) + y, decimals)
    if nan:
        s[rng.random(n) < 0.2] = np.nan
    weights = rng.integers(0, 3, (25, n))
    got = _resampled_aurocs(y, s, weights)
    for w, value in zip(weights, got, strict=True):
        idx = np.repeat(np.arange(n), w)
        if len(idx) == 0 or y[idx].min() == y[idx].max():
            assert np.isnan(value)
        else:
            assert value == auroc(y[idx], s[idx])


def test_bootstrap_resamples_questions_not_responses():
    """Five identical responses per question carry one question's information: resampling
    responses treats them as five and gives an interval about sqrt(5) too narrow; resampling
    questions gives the width of the one-response data."""
    rng = np.random.default_rng(0)
    q = 300
    y1 = rng.integers(0, 2, q)
    s1 = y1 + 1.5 * rng.normal(size=q)
    y, s = np.repeat(y1, 5), np.repeat(s1, 5)
    by_question = bootstrap_auroc_ci(y, [s], 400, 0, np.repeat(np.arange(q), 5))
    by_response = bootstrap_auroc_ci(y, [s], 400, 0, np.arange(5 * q))
    honest = bootstrap_auroc_ci(y1, [s1], 400, 0, np.arange(q))
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(by_question) == pytest.approx(width(honest), rel=0.2)
    assert width(by_response) < 0.6 * width(by_question)
    assert by_question[0] < roc_auc_score(y, s) < by_question[1]


def test_split_metrics_has_every_figure():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 100)
    scores = [y + rng.normal(size=100) for _ in range(3)]
    groups = np.repeat(np.arange(20), 5)
    m = split_metrics(y, scores, bootstrap=50, seed=0, groups=groups, lengths=rng.integers(1, 40, 100))
    for key in ("auroc", "auprc", "prr", "prr_0.5", "fpr_at_95_tpr", "margin"):
        assert len(m[key]["per_seed"]) == 3 and m[key]["sd"] is not None, key
    assert m["bootstrap"] == {"resamples": 50, "unit": "question", "questions": 20}
    assert set(m["margin_by_length"]) == {"<=5", "6-30", ">30"}
    assert sum(b["n"] for b in m["margin_by_length"].values()) == 100
    with pytest.raises(ValueError, match="resamples questions"):
        split_metrics(y, scores, bootstrap=10)
    assert "margin_by_length" not in split_metrics(y, scores, logits=False, lengths=np.ones(100))


def test_roc_points_and_fpr_match_sklearn_with_ties():
    from sklearn.metrics import roc_curve

    from halludetect.metrics import roc_points

    rng = np.random.default_rng(4)
    for _ in range(5):
        y = rng.integers(0, 2, 300)
        score = np.round(y + rng.normal(size=300), 1)  # rounded: many ties, mixed labels among them
        fpr, tpr, _ = roc_curve(y, score, drop_intermediate=False)
        ours_fpr, ours_tpr = roc_points(y, score)
        np.testing.assert_allclose(ours_fpr, fpr[1:])
        np.testing.assert_allclose(ours_tpr, tpr[1:])
        for level in (0.5, 0.9, 0.95):
            assert fpr_at_tpr(y, score, level) == pytest.approx(fpr[np.searchsorted(tpr, level, side="left")])


def test_metrics_match_sklearn_and_margin_definition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    z = rng.normal(size=200) + y
    m = split_metrics(y, [z], bootstrap=200, seed=0, groups=np.arange(200))
    assert m["auroc"]["mean"] == pytest.approx(roc_auc_score(y, z))
    assert m["margin"]["mean"] == pytest.approx(np.mean(np.where(y == 1, 1, -1) * z))
    lo, hi = m["auroc_ci95"]
    assert lo < m["auroc"]["mean"] < hi
    assert margin(np.array([1, 0]), np.array([2.0, -3.0])) == pytest.approx(2.5)
    assert split_metrics(y, [z], logits=False)["margin"] is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(-3, 3)), min_size=2, max_size=60), st.booleans())
def test_auroc_and_average_precision_equal_sklearns_with_ties(pairs, continuous):
    """Our numpy AUROC and AP (metrics.py) are sklearn's, ties included (integer scores tie often)."""
    from sklearn.metrics import average_precision_score

    y = np.array([p[0] for p in pairs])
    if y.min() == y.max():
        y[0] = 1 - y[0]
    s = np.array([p[1] for p in pairs], dtype=np.float64)
    if continuous:
        s = s + np.random.default_rng(len(pairs)).normal(size=len(s))
    assert auroc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert average_precision(y, s) == pytest.approx(average_precision_score(y, s), abs=1e-12)
