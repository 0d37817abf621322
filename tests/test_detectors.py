"""Property tests of the masked, batched detector code."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

from halludetect.config import PoolingParams
from halludetect.detectors import build_detector, pad_bags
from halludetect.evaluation import margin, split_metrics

D = 6


def ragged(lengths, seed=0):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.normal(size=(offsets[-1], D)).astype(np.float32), offsets


@given(st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_pad_bags_rebuilds_every_bag(lengths):
    states, offsets = ragged(lengths)
    index = np.arange(len(lengths))[::-1].copy()
    x, mask = pad_bags(states, offsets, index)
    assert x.shape == (len(lengths), max(lengths), D)
    for row, b in enumerate(index):
        n = lengths[b]
        assert mask[row].sum() == n
        np.testing.assert_array_equal(x[row, :n].numpy(), states[offsets[b] : offsets[b + 1]])


def test_pad_bags_rejects_empty_bag():
    states, offsets = ragged([2, 0, 3])
    with pytest.raises(ValueError, match="empty bag"):
        pad_bags(states, offsets, np.array([0, 1]))


def _model(method, seed=0):
    torch.manual_seed(seed)
    m = build_detector(method, D, PoolingParams(dim=8, dropout=0.2))
    return m.eval()


@settings(max_examples=30, deadline=None)
@given(method=st.sampled_from(["mean", "max"]), n=st.integers(1, 12), pad=st.integers(0, 5),
       seed=st.integers(0, 10_000))
def test_pooling_is_permutation_invariant_and_ignores_padding(method, n, pad, seed):
    model = _model(method)
    g = torch.Generator().manual_seed(seed)
    bag = torch.randn(1, n, D, generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    with torch.no_grad():
        z = model(bag, mask)
        perm = torch.randperm(n, generator=g)
        z_perm = model(bag[:, perm], mask)
        # padding with huge garbage values must not move the score
        padded = torch.cat([bag, 1e6 * torch.randn(1, pad, D, generator=g)], dim=1)
        pmask = torch.cat([mask, torch.zeros(1, pad, dtype=torch.bool)], dim=1)
        z_pad = model(padded, pmask)
    torch.testing.assert_close(z_perm, z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_pad, z, rtol=1e-5, atol=1e-5)


def test_batched_scores_equal_one_bag_at_a_time():
    lengths = [3, 1, 7, 4]
    states, offsets = ragged(lengths, seed=3)
    for method in ("mean", "max"):
        model = _model(method)
        x, mask = pad_bags(states, offsets, np.arange(len(lengths)))
        with torch.no_grad():
            batched = model(x, mask)
            single = torch.cat([model(x[i : i + 1, : lengths[i]], mask[i : i + 1, : lengths[i]])
                                for i in range(len(lengths))])
        torch.testing.assert_close(batched, single)


def test_unknown_method():
    with pytest.raises(KeyError, match="did you mean 'max'"):
        build_detector("maxx", D, PoolingParams())


def test_metrics_match_sklearn_and_margin_definition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    z = rng.normal(size=200) + y
    m = split_metrics(y, [z], bootstrap=200, seed=0)
    assert m["auroc"]["mean"] == pytest.approx(roc_auc_score(y, z))
    assert m["margin"]["mean"] == pytest.approx(np.mean(np.where(y == 1, 1, -1) * z))
    lo, hi = m["auroc_ci95"]
    assert lo < m["auroc"]["mean"] < hi
    assert margin(np.array([1, 0]), np.array([2.0, -3.0])) == pytest.approx(2.5)
