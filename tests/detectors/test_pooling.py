"""Poolings over packed bags (halludetect/detectors/pooling.py): a stable segment softmax, the HaMI code's
top-k at every bag length with padding never read, and segment max's gradient equal to a padded max's."""

import torch
from detector_support import random_bags

from halludetect.activations.bags import Bags
from halludetect.detectors.pooling import segment_max, segment_softmax, topk_count, topk_mean, topk_sigmoid_logit


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


def test_topk_sigmoid_logit_is_the_logit_of_the_hami_codes_bag_score():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 4, 9, 20])
    s = torch.randn(4, 20, generator=g) * 3
    mask = torch.arange(20)[None, :] < lengths[:, None]
    z = topk_sigmoid_logit(s.masked_fill(~mask, float("nan")), mask, 0.1)  # what padding holds never matters
    torch.testing.assert_close(torch.sigmoid(z), topk_mean(torch.sigmoid(s), mask, 0.1))
    # finite where the mean sigmoid rounds to 0 or 1 in float32, and still ordered
    big = torch.tensor([[200.0, 300.0], [-300.0, -200.0], [30.0, 40.0]])
    z = topk_sigmoid_logit(big, torch.ones_like(big, dtype=torch.bool), 0.5)
    assert torch.isfinite(z).all() and z[0] > z[2] > 0 > z[1]
    torch.testing.assert_close(z[0], torch.tensor(200.0 + torch.log(torch.tensor(2.0)).item()), atol=1e-3, rtol=0)
