"""The detector networks (halludetect/detectors/networks.py), property-tested: scores do not depend on
token order (but the probe's) or on padding, a batch scores each bag as alone, attention weights sum
to one over each bag, HaMI (SP) scales the states by P_sem, and dropout is seeded and unbiased."""

import pytest
import torch
from detector_support import D, model, random_bags
from hypothesis import given, settings
from hypothesis import strategies as st

from halludetect.activations.bags import Bags
from halludetect.detectors.build import DETECTORS

# The probe, SAPLMA and the SE probes read one position, so token order matters to them by design;
# EigenScore scores a question's answers together (tests/methods/test_eigenscore.py).
ONE_TOKEN = {"probe", "saplma", "sep_tbg", "sep_slt"}
PER_BAG = sorted(m for m in DETECTORS if not DETECTORS[m].reads.question)
ORDERLESS = sorted(set(PER_BAG) - ONE_TOKEN)


def long_enough(method, lengths):
    """Bag lengths a method can score (sep_slt reads the second-to-last token)."""
    return [max(n, DETECTORS[method].reads.min_tokens) for n in lengths]


@settings(max_examples=25, deadline=None)
@given(
    method=st.sampled_from(ORDERLESS),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    seed=st.integers(0, 10_000),
)
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
@given(
    method=st.sampled_from(PER_BAG),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    pad=st.integers(0, 6),
    seed=st.integers(0, 10_000),
)
def test_padding_never_changes_a_score(method, lengths, pad, seed):
    """Padded input with garbage (huge, inf, NaN) under the mask scores as the packed bags do."""
    lengths = long_enough(method, lengths)
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
@given(method=st.sampled_from(PER_BAG), lengths=st.lists(st.integers(1, 12), min_size=2, max_size=6))
def test_a_batch_scores_each_bag_as_alone(method, lengths):
    lengths = long_enough(method, lengths)
    bags = random_bags(lengths)
    m = model(method)
    with torch.no_grad():
        batched = m(bags)
        alone = [
            m(Bags(bags.tokens[bags.bag_of_token == i], bags.lengths[i : i + 1], bags.p_sem[i : i + 1]))
            for i in range(len(lengths))
        ]
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


def test_hami_bag_score_sigmoid_is_the_hami_codes_top_k_mean_of_sigmoid_token_scores():
    from halludetect.detectors.build import build_detector, params_for
    from halludetect.detectors.pooling import topk_mean

    bags = random_bags([3, 12, 1, 25])
    logits = model("hami")
    sig = build_detector("hami", D, params_for("hami", {"dim": 8, "bag_score": "sigmoid"}))
    sig.load_state_dict(logits.state_dict())
    sig.eval()
    with torch.no_grad():
        s = bags.pad(logits.token_logits(bags))  # [B, T]
        torch.testing.assert_close(logits(bags), topk_mean(s, bags.mask, 0.1))  # the paper's Z_B
        torch.testing.assert_close(torch.sigmoid(sig(bags)), topk_mean(torch.sigmoid(s), bags.mask, 0.1))
    with pytest.raises(ValueError, match="bag_score"):
        from halludetect.detectors.networks import HaMI

        HaMI(D, 8, 0.0, 0.1, bag_score="softmax")
