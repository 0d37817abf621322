"""Property tests of the batched detector code, against per-bag reference implementations."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

from halludetect.activations.bags import Bags, gather_rows, pad_bags
from halludetect.config import DetectorsParams
from halludetect.detectors.build import DETECTORS, build_detector, params_for
from halludetect.detectors.pooling import segment_max, segment_softmax, topk_count, topk_mean
from halludetect.detectors.training import hami_mil_loss
from halludetect.metrics import auroc, average_precision, margin, split_metrics

D = 6
# The probe reads the last position, so token order matters to it by design.
ORDERLESS = sorted(set(DETECTORS) - {"probe"})


def ragged(lengths, seed=0):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.normal(size=(offsets[-1], D)).astype(np.float32), offsets


def random_bags(lengths, seed=0) -> Bags:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths)
    return Bags(torch.randn(int(lengths.sum()), D, generator=g), lengths, torch.rand(len(lengths), generator=g))


def model(method, seed=0):
    torch.manual_seed(seed)
    params = params_for(method, {} if method == "probe" else {"dim": 8})
    m = build_detector(method, D, params)
    for mod in m.modules():  # non-trivial batch-norm statistics, so eval mode is really tested
        if isinstance(mod, torch.nn.BatchNorm1d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
    return m.eval()


def test_registry_covers_every_params_section():
    assert set(DETECTORS) == set(DetectorsParams.model_fields)


def test_unknown_method_suggests_the_closest():
    with pytest.raises(KeyError, match="did you mean 'max'"):
        build_detector("maxx", D, params_for("max"))
    with pytest.raises(KeyError, match="did you mean 'hami_sp'"):
        params_for("hami-sp")


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


@settings(max_examples=25, deadline=None)
@given(method=st.sampled_from(ORDERLESS), lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
       seed=st.integers(0, 10_000))
def test_scores_do_not_depend_on_token_order(method, lengths, seed):
    bags = random_bags(lengths, seed)
    g = torch.Generator().manual_seed(seed)
    # a permutation inside every bag: sort by (bag, random key)
    perm = torch.argsort(bags.bag_of_token * 2.0 + torch.rand(len(bags.tokens), generator=g))
    shuffled = Bags(bags.tokens[perm], bags.lengths, bags.p_sem)
    m = model(method)
    with torch.no_grad():
        torch.testing.assert_close(m(shuffled), m(bags), rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(method=st.sampled_from(sorted(DETECTORS)), lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
       pad=st.integers(0, 6), seed=st.integers(0, 10_000))
def test_padding_never_changes_a_score(method, lengths, pad, seed):
    """Padded input with garbage (huge, inf, NaN) under the mask scores as the packed bags do."""
    bags = random_bags(lengths, seed)
    width = max(lengths) + pad
    garbage = torch.full((len(lengths), width, D), float("nan"))
    garbage[:, ::2] = 1e30
    garbage[:, 1::3] = float("inf")
    mask = torch.arange(width)[None, :] < bags.lengths[:, None]
    garbage[mask] = bags.tokens
    m = model(method)
    with torch.no_grad():
        torch.testing.assert_close(m(Bags.from_padded(garbage, mask, bags.p_sem)), m(bags))


@settings(max_examples=20, deadline=None)
@given(method=st.sampled_from(sorted(DETECTORS)), lengths=st.lists(st.integers(1, 12), min_size=2, max_size=6))
def test_a_batch_scores_each_bag_as_alone(method, lengths):
    bags = random_bags(lengths)
    m = model(method)
    with torch.no_grad():
        batched = m(bags)
        alone = [m(Bags(bags.tokens[bags.bag_of_token == i], bags.lengths[i : i + 1], bags.p_sem[i : i + 1]))
                 for i in range(len(lengths))]
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(gated=st.booleans(), lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_attention_weights_sum_to_one_over_each_bag(gated, lengths, seed):
    bags = random_bags(lengths, seed)
    m = model("gated_attention" if gated else "attention", seed)
    with torch.no_grad():
        w = m.weights(bags)
    assert (w >= 0).all()
    sums = torch.zeros(len(lengths)).index_add_(0, bags.bag_of_token, w)
    torch.testing.assert_close(sums, torch.ones(len(lengths)))


def test_segment_softmax_is_stable_for_large_scores():
    bags = Bags(torch.zeros(5, 1), torch.tensor([2, 3]))
    w = segment_softmax(torch.tensor([1000.0, 999.0, -1000.0, 0.0, 0.0]), bags)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w[2:], torch.tensor([0.0, 0.5, 0.5]))


def test_topk_picks_the_right_tokens_at_every_length():
    """k = int(n * 0.1) + 1 (the HaMI code) and the k largest scores, for n = 1..200 in one batch."""
    lengths = torch.arange(1, 201)
    g = torch.Generator().manual_seed(0)
    s = torch.randn(len(lengths), 200, generator=g)
    mask = torch.arange(200)[None, :] < lengths[:, None]
    s_garbage = s.masked_fill(~mask, 1e9)  # padding that would win every top-k if it were read
    got = topk_mean(s_garbage, mask, 0.1)
    for n in lengths.tolist():
        k = int(n * 0.1) + 1
        assert topk_count(torch.tensor([n]), 0.1).item() == k
        want = torch.sort(s[n - 1, :n], descending=True).values[:k].mean()
        torch.testing.assert_close(got[n - 1], want)


def test_segment_max_gradient_matches_padded_max():
    bags = random_bags([3, 1, 5, 2])
    u = bags.tokens.clone().requires_grad_(True)
    segment_max(u, bags).pow(2).sum().backward()
    u2 = bags.tokens.clone().requires_grad_(True)
    bags.pad(u2, float("-inf")).amax(1).pow(2).sum().backward()
    torch.testing.assert_close(u.grad, u2.grad)


def reference_hami_loss(scores_ok, scores_hal, k_ratio=0.1, weight=8e-4, min_len=8):
    """The HaMI code's MIL_loss, bag by bag, transcribed for comparison."""
    smooth, loss, ok_means = 0.0, 0.0, []
    for s in scores_ok:
        ok_means.append(torch.topk(s, int(len(s) * k_ratio) + 1).values.mean())
        if len(s) > min_len:
            smooth = smooth + ((s[:-1] - s[1:]) ** 2).sum() * weight
    for i, s in enumerate(scores_hal):
        a = torch.topk(s, int(len(s) * k_ratio) + 1).values.mean()
        if len(s) > min_len:
            smooth = smooth + ((s[:-1] - s[1:]) ** 2).sum() * weight
        loss = loss + (1 - a**2 + ok_means[i] ** 2)
    return loss / len(scores_ok) + smooth / len(scores_ok)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 25), min_size=4, max_size=12).filter(lambda x: len(x) % 2 == 0),
       seed=st.integers(0, 999))
def test_mil_loss_equals_the_hami_code_bag_by_bag(lengths, seed):
    bags = random_bags(lengths, seed)
    y = torch.tensor([i % 2 for i in range(len(lengths))])  # interleaved: pairing is by order within a class
    m = model("hami", seed)
    params = params_for("hami")
    got = hami_mil_loss(m, bags, y, params)
    s = torch.sigmoid(m.token_logits(bags))
    per_bag = [s[bags.bag_of_token == i] for i in range(len(lengths))]
    want = reference_hami_loss([b for b, c in zip(per_bag, y) if c == 0], [b for b, c in zip(per_bag, y) if c == 1])
    torch.testing.assert_close(got, want)


def test_hami_sp_scales_states_by_semantic_probability():
    bags = random_bags([4, 2])
    sp = model("hami_sp")
    base = model("hami")
    base.load_state_dict(sp.state_dict())
    scaled = Bags(bags.tokens * (1 + 1.0 * bags.p_sem)[bags.bag_of_token][:, None], bags.lengths)  # lam = 1
    with torch.no_grad():
        torch.testing.assert_close(sp(bags), base(scaled))
    with pytest.raises(ValueError, match="semantic probability"):
        sp(Bags(bags.tokens, bags.lengths))


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


def test_dropout_zeroes_a_p_share_scales_the_rest_and_is_seeded():
    from halludetect.detectors.networks import Dropout

    x = torch.ones(400, 250, requires_grad=True)
    drop = Dropout(0.3).train()
    torch.manual_seed(0)
    y = drop(x)
    zero = (y == 0).float().mean().item()
    assert abs(zero - 0.3) < 0.01  # 100,000 draws: 4.6 sigma is 0.0067
    assert torch.allclose(y[y != 0], torch.tensor(1 / 0.7))
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0) / 0.7)  # the gradient flows through kept elements only
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)
    assert torch.equal(drop.eval()(x), x)
    with pytest.raises(ValueError, match="not in"):
        Dropout(1.0)
