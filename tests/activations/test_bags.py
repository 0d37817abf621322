"""Packed bags (halludetect/activations/bags.py), property-tested against per-bag references: padding
rebuilds every bag, gathering packs the chosen bags in order, and an empty bag is refused."""

import numpy as np
import pytest
import torch
from detector_support import D, ragged
from hypothesis import given
from hypothesis import strategies as st

from halludetect.activations.bags import Bags, gather_rows, pad_bags


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


@given(st.lists(st.integers(1, 9), min_size=1, max_size=10), st.randoms(use_true_random=False))
def test_gather_rows_packs_the_chosen_bags_in_order(lengths, rnd):
    states, offsets = ragged(lengths)
    index = list(range(len(lengths)))
    rnd.shuffle(index)
    index = index[: rnd.randint(1, len(index))]
    rows, got_lengths = gather_rows(torch.from_numpy(offsets), torch.tensor(index))
    want = np.concatenate([states[offsets[b] : offsets[b + 1]] for b in index])
    np.testing.assert_array_equal(states[rows.numpy()], want)
    assert got_lengths.tolist() == [lengths[b] for b in index]


def test_empty_bags_are_refused():
    with pytest.raises(ValueError, match="empty bag"):
        Bags(torch.zeros(3, D), torch.tensor([2, 0, 1]))
    states, offsets = ragged([2, 0, 3])
    with pytest.raises(ValueError, match="empty bag"):
        pad_bags(states, offsets, np.array([0, 1]))
