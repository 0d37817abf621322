"""Detectors fitted without the SGD loop (halludetect/detectors/fitting.py): the semantic-entropy
probes' binarisation against the SEP code's best_split and a hand-computed case, and their
logistic regression against scikit-learn fitted directly."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from sklearn.linear_model import LogisticRegression

from halludetect.activations.layer_reader import Layer
from halludetect.core.errors import DataError
from halludetect.detectors.build import params_for
from halludetect.detectors.data import split_data
from halludetect.detectors.fitting import best_split, binarise, fit_detector


def sep_code_best_split(ents: np.ndarray) -> float:
    """The SEP notebook's best_split, transcribed (an empty side adds 0, as np.sum of nothing)."""
    splits = np.linspace(1e-10, ents.max(), 100)
    mses = []
    for split in splits:
        low, high = ents[ents < split], ents[ents >= split]
        mse = (np.sum((low - low.mean()) ** 2) if len(low) else 0.0) + (
            np.sum((high - high.mean()) ** 2) if len(high) else 0.0
        )
        mses.append(mse)
    return float(splits[np.argmin(mses)])


def test_best_split_by_hand():
    """Entropies 0, 0.1, 0.9, 1: the split between 0.1 and 0.9 leaves squared errors 4 x 0.05^2 =
    0.01 (between 0 and 0.1: 0.487); the first of the 100 thresholds above 0.1 is 1e-10 + 10 x (1 -
    1e-10) / 99 = 0.10101..."""
    h = np.array([0.0, 0.1, 0.9, 1.0])
    t = best_split(h)
    assert t == pytest.approx(1e-10 + 10 * (1 - 1e-10) / 99)
    assert binarise(h, t).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("seed", range(5))
def test_best_split_equals_the_sep_code(seed):
    rng = np.random.default_rng(seed)
    h = np.round(rng.choice([0.0, 0.5004, 0.6931, 1.0549, 1.3322, 1.6094], size=200), 4)  # K = 5 entropies
    assert best_split(h) == pytest.approx(sep_code_best_split(h), abs=0)


def layer_and_labels(n=80, d=5, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 5, size=3 * n)
    states = rng.normal(size=(int(lengths.sum()), d)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    splits = ["train"] * n + ["val"] * n + ["test"] * n
    y = np.arange(3 * n) % 2
    first = offsets[:-1]
    states[first, 0] += 2.0 * y  # the signal sits at the first bag token (TBG)
    ids = [f"q{i}/0" for i in range(3 * n)]
    labels = pl.DataFrame(
        {
            "question_id": [f"q{i}" for i in range(3 * n)],
            "sample_index": [0] * (3 * n),
            "split": splits,
            "label": y,
            "kept": [True] * (3 * n),
        }
    ).with_columns(pl.col("sample_index").cast(pl.Int32))
    entropy = {rid: float(y[i]) * 1.2 + 0.05 * (i % 3) for i, rid in enumerate(ids)}
    return Layer(states, offsets, ids, {}), labels, entropy


def test_sep_fits_scikit_learns_regression_on_its_token_to_the_binarised_entropy():
    layer, labels, entropy = layer_and_labels()
    train = split_data(layer, labels, "train", method="sep_tbg", entropy=entropy)
    val = split_data(layer, labels, "val", method="sep_tbg")
    state, val_auroc, info = fit_detector("sep_tbg", params_for("sep_tbg"), train, val)
    h = train.entropy.numpy()
    target = binarise(h, best_split(h))
    x = layer.states[layer.offsets[:-1][:80]].astype(np.float64)  # the first token of each train bag
    ref = LogisticRegression().fit(x, target)
    np.testing.assert_allclose(state["linear.weight"].numpy()[0], ref.coef_[0], rtol=1e-5)
    np.testing.assert_allclose(state["linear.bias"].numpy(), ref.intercept_, rtol=1e-5)
    assert info["threshold"] == best_split(h) and info["positives"] == int(target.sum()) and info["converged"]
    assert val_auroc > 0.8


@pytest.mark.hostile
def test_a_one_class_binarised_entropy_stops_with_the_counts():
    layer, labels, _ = layer_and_labels()
    flat = dict.fromkeys(layer.response_ids, 0.0)
    train = split_data(layer, labels, "train", method="sep_tbg", entropy=flat)
    val = split_data(layer, labels, "val", method="sep_tbg")
    with pytest.raises(DataError, match="binarised semantic entropy of the 80 train answers is one class"):
        fit_detector("sep_tbg", params_for("sep_tbg"), train, val)


def test_train_answers_without_entropy_and_one_token_answers_are_left_out_and_counted():
    layer, labels, entropy = layer_and_labels()
    del entropy["q0/0"], entropy["q1/0"]
    train = split_data(layer, labels, "train", method="sep_tbg", entropy=entropy)
    assert train.excluded == {"empty_bag": 0, "no_semantic_entropy": 2} and len(train) == 78
    short = Layer(layer.states, np.concatenate([[0, 1], layer.offsets[2:]]), layer.response_ids, {})
    val = split_data(short, labels, "train", method="sep_slt")  # q0 now has one token
    assert val.excluded == {"empty_bag": 0, "too_short": 1}
    assert int(val.lengths.min()) >= 2
