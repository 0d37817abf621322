"""Theorem 2's quantity (halludetect/detectors/gradient_ratio.py): the closed-form squared gradient
norms of max and mean pooling equal autograd's, bag by bag; training traces them for the mean and
max networks without changing a weight; the layer's trace is written beside its detectors."""

import json

import numpy as np
import pytest
import torch
from detector_support import model, random_bags
from hypothesis import given, settings
from hypothesis import strategies as st
from support import synthetic

from halludetect.activations.bags import Bags
from halludetect.detectors.build import build_detector
from halludetect.detectors.data import split_data
from halludetect.detectors.gradient_ratio import (
    WIDTH_RATIO,
    GradientRatioTrace,
    TracedBatch,
    _grouped_quad,
    _max_quad,
    _quad,
    _weights,
    gram,
    squared_gradient_norms,
    summarise,
)
from halludetect.detectors.pooling import segment_max
from halludetect.detectors.training import train_detector, write_gradient_ratio
from halludetect.methods.pooling import PoolingParams


def autograd_norm(net, bags: Bags) -> torch.Tensor:
    """||grad_theta z||^2 of every parameter, one bag at a time."""
    out = []
    for b in range(len(bags)):
        one = Bags(bags.tokens[bags.bag_of_token == b], bags.lengths[b : b + 1])
        net.zero_grad()
        net(one).sum().backward()
        out.append(sum(float((p.grad.double() ** 2).sum()) for p in net.parameters()))
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 25), min_size=1, max_size=5), seed=st.integers(0, 999))
def test_closed_form_norms_equal_autograd_for_max_and_mean(lengths, seed):
    bags = random_bags(lengths, seed)
    max_net = model("max", seed)
    mean_net = model("mean", seed)
    mean_net.load_state_dict(max_net.state_dict())  # the same theta, the other pooling
    norms = squared_gradient_norms(max_net, bags)
    for pool, net in (("max", max_net), ("mean", mean_net)):  # autograd's gradients are float32
        torch.testing.assert_close(norms[pool], autograd_norm(net, bags), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 25), min_size=1, max_size=6), seed=st.integers(0, 999), repeat=st.booleans())
def test_max_norms_take_the_peak_tokens_gram_entry_with_the_bits_of_the_full_form(lengths, seed, repeat):
    """Max pooling's quadratic form read at each feature's peak token (or the full form where a
    positive peak is shared: a repeated token at layer 0 has the same state) gives the bits of the
    full [B, T, T] x [B, T, D] form with _weights' 1/count per holder."""
    bags = random_bags(lengths, seed)
    if repeat:  # every bag's first token again at its end: every peak it holds is shared
        own = [bags.tokens[bags.bag_of_token == b] for b in range(len(bags))]
        rows = torch.cat([torch.cat([t, t[:1]]) for t in own])
        bags = Bags(rows, bags.lengths + 1)
    net = model("max", seed)
    linear = net.feature[0]
    pre = bags.tokens.double() @ linear.weight.double().T + linear.bias.double()
    u, on = pre.clamp(min=0), pre > 0
    g = gram(bags)
    full = _quad(_weights(u, bags, "max") * on, bags, g)
    assert torch.equal(_max_quad(u, on, segment_max(u, bags), bags, g), full)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 999))
def test_the_mean_form_by_groups_of_similar_length_is_the_whole_batchs_form(lengths, seed):
    """Each group of bags is padded to its own longest (its longest at most WIDTH_RATIO x its
    shortest), every bag in exactly one group; the quadratic forms are the whole padded batch's,
    to the rounding of the shorter sums."""
    bags = random_bags(lengths, seed)
    batch = TracedBatch.of(bags)
    members = torch.cat([grp.bags for grp in batch.groups])
    assert sorted(members.tolist()) == list(range(len(bags)))
    for grp in batch.groups:
        n = bags.lengths[grp.bags]
        assert int(n.max()) <= WIDTH_RATIO * int(n.min()) and grp.mask.shape[1] == int(n.max())
        assert torch.equal(grp.mask.sum(1), n)
    net = model("mean", seed)
    linear = net.feature[0]
    pre = bags.tokens.double() @ linear.weight.double().T + linear.bias.double()
    qa = _weights(pre.clamp(min=0), bags, "mean") * (pre > 0)
    torch.testing.assert_close(_grouped_quad(qa, batch.groups), _quad(qa, bags, gram(bags)), rtol=1e-12, atol=0)


def test_a_sparse_positive_bag_gets_the_larger_ratio():
    """One token carries the signal: the longer the bag of silent tokens around it, the larger
    max pooling's gradient against mean pooling's (the theorem's (T/s)^2 growth)."""
    net = model("max")
    with torch.no_grad():  # a silent token: every feature off; the signal token: every feature on
        net.feature[0].weight.copy_(torch.eye(8, 6))
        net.feature[0].bias.fill_(-0.5)
    signal, silent = torch.ones(1, 6), torch.zeros(1, 6)
    ratios = []
    for t in (1, 4, 16):
        bags = Bags(torch.cat([signal, silent.expand(t - 1, 6)]), torch.tensor([t]))
        norms = squared_gradient_norms(net, bags)
        ratios.append(float(norms["max"] / norms["mean"]))
    assert ratios[0] == pytest.approx(1.0)
    assert ratios[0] < ratios[1] < ratios[2]


def test_training_traces_the_ratio_for_pooling_networks_and_changes_no_weight():
    layer, labels = synthetic()
    train, val = split_data(layer, labels, "train"), split_data(layer, labels, "val")
    params = PoolingParams(dim=16, dropout=0.2, lr=1e-2, weight_decay=0.0)
    traced = train_detector("max", params, train, val, epochs=4, batch_size=32, seed=0)
    plain = train_detector("max", params, train, val, epochs=4, batch_size=32, seed=0, trace_gradient_ratio=False)
    for k, v in traced.state_dict.items():
        torch.testing.assert_close(v, plain.state_dict[k], rtol=0, atol=0)
    assert plain.gradient_ratio is None
    g = traced.gradient_ratio
    assert [e["epoch"] for e in g["epochs"]] == [1, 2, 3, 4] and g["best_epoch"] == traced.best_epoch
    n_pos = int(train.y.sum())
    assert all(e["n_bags"] == n_pos and e["pooling"] == "max" and e["median_ratio"] >= 1 for e in g["epochs"])
    assert len(g["bags"]["ratio"]) == n_pos
    # the best epoch's per-bag values are the weights' own: measured again from them, the same
    net = build_detector("max", train.tokens.shape[1], params)
    net.load_state_dict(traced.state_dict)
    again = GradientRatioTrace.for_training(net, train).measure(net)
    np.testing.assert_allclose(g["bags"]["ratio"], again["ratio"])
    mean = train_detector("mean", params, train, val, epochs=2, batch_size=32, seed=0)
    assert mean.gradient_ratio["epochs"][0]["pooling"] == "mean"
    assert train_detector("raw_max", params, train, val, epochs=1, batch_size=32, seed=0).gradient_ratio is None


def test_the_trace_file_holds_traced_seeds_only(tmp_path):
    class R:
        def __init__(self, seed, trace):
            self.seed, self.result = seed, type("T", (), {"gradient_ratio": trace})()

    write_gradient_ratio(tmp_path / "none.json", [R(0, None)])
    assert not (tmp_path / "none.json").exists()
    write_gradient_ratio(tmp_path / "g.json", [R(0, {"epochs": []}), R(1, {"epochs": [1]})])
    assert json.loads((tmp_path / "g.json").read_text()) == {"seed_0": {"epochs": []}, "seed_1": {"epochs": [1]}}


def test_summaries_count_bags_without_positive_evidence_out():
    m = {
        "T": np.array([4.0, 8.0, 2.0]),
        "ratio": np.array([20.0, 3.0, 1.0]),
        "s50": np.array([1.0, 2.0, np.nan]),
        "s90": np.array([1.0, 4.0, np.nan]),
        "s_paper": np.array([2.0, 8.0, 2.0]),
    }
    s = summarise(m)
    assert s["n_bags"] == 3 and s["n_s90"] == 2 and s["median_ratio"] == 3.0
    assert s["median_t_over_s90_sq"] == pytest.approx((16 + 4) / 2)
    assert s["share_ratio_at_least_t_over_s90_sq"] == 0.5  # 20 >= 16, 3 < 4
    assert s["spearman_ratio_t_over_s90_sq"] is None  # two bags: no correlation reported
