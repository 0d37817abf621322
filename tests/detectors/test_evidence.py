"""Token evidence (halludetect/detectors/evidence.py): for every registered method, the contributions
plus the bias rebuild the bag logit exactly, on random bags; each network's split is the one its
docstring states; the sparsity count is right on hand-made bags."""

import pytest
import torch
from detector_support import D, model, random_bags
from hypothesis import given, settings
from hypothesis import strategies as st

from halludetect.activations.bags import Bags
from halludetect.detectors import evidence as ev
from halludetect.methods import METHODS


def declared_without_evidence(net) -> str | None:
    """The reason evidence.py declares for a network that has no token evidence, else None."""
    return next((r for c in type(net).__mro__ if isinstance(r := ev.EXPLAINERS.get(c), str)), None)


# Every registered method with token evidence (EigenScore scores a question's answers together).
EXPLAINED = sorted(m for m in METHODS if declared_without_evidence(model(m)) is None)


def shortest(net) -> int:
    """The fewest tokens a bag needs for `net`: 2 for a probe on the second-last token (SEP (SLT))."""
    index = getattr(net, "index", -1)
    return index + 1 if index >= 0 else -index


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_declares_token_evidence(method):
    """A new method is covered here by being registered; one whose network has no decomposition
    fails here, by name, until evidence.py gives it one (or declares what it reports instead)."""
    net = model(method)
    if (reason := declared_without_evidence(net)) is not None:
        assert not ev.has_evidence(net) and "reports" in reason
        with pytest.raises(ev.NoEvidence, match=f"an? {type(net).__name__} detector has no token evidence: "):
            ev.evidence(net, random_bags([3, 2]))
        return
    assert ev.has_evidence(net), (
        f"method '{method}' builds a {type(net).__name__}, which has no token evidence: add its "
        "decomposition to halludetect/detectors/evidence.py (EXPLAINERS), or declare what it reports "
        "instead with no_evidence()"
    )
    assert ev.describe(net)


def test_only_eigenscore_has_no_token_evidence():
    assert sorted(set(METHODS) - set(EXPLAINED)) == ["eigenscore"]


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(EXPLAINED),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    seed=st.integers(0, 10_000),
)
def test_contributions_sum_to_the_bag_logit_for_every_method(method, lengths, seed):
    lengths = [max(n, shortest(model(method))) for n in lengths]
    bags = random_bags(lengths, seed)
    net = model(method, seed)
    e = ev.evidence(net, bags)
    assert e.contributions.shape == (len(bags.tokens),) and e.bias.shape == (len(lengths),)
    with torch.no_grad():
        z = net(bags)
    torch.testing.assert_close(e.logits(bags), z, rtol=1e-5, atol=1e-5)
    if not e.bias_varies:  # one bias for every bag: the network's own
        assert torch.unique(e.bias).numel() == 1


@pytest.mark.parametrize("method", [m for m in EXPLAINED if shortest(model(m)) == 1])
def test_the_sum_is_exact_when_tokens_tie(method):
    """Repeated tokens tie at every max: the tied tokens share the term, and the sum stays exact."""
    base = random_bags([3, 1, 4], seed=3)
    tokens = torch.cat([base.tokens[:3], base.tokens[:3], base.tokens[3:4], base.tokens[4:], base.tokens[4:6]])
    bags = Bags(tokens, torch.tensor([6, 1, 6]), base.p_sem)
    net = model(method)
    e = ev.evidence(net, bags)
    with torch.no_grad():
        torch.testing.assert_close(e.logits(bags), net(bags), rtol=1e-5, atol=1e-5)
    if method in ("max", "mean", "raw_max", "raw_mean", "attention", "gated_attention"):
        # orderless and tie-shared: a token and its copy get the same contribution
        torch.testing.assert_close(e.contributions[:3], e.contributions[3:6])


def test_max_pooling_gives_each_feature_term_to_its_peak_token():
    bags = random_bags([5, 2], seed=1)
    net = model("max")
    with torch.no_grad():
        u = net.feature(bags.tokens)  # [N, D]
        w = net.head.weight[0]
    want = torch.zeros(len(u))
    for b in range(2):
        rows = torch.nonzero(bags.bag_of_token == b).squeeze(1)
        for j in range(u.shape[1]):
            peak = rows[int(torch.argmax(u[rows, j]))]
            want[peak] += w[j] * u[peak, j]
    torch.testing.assert_close(ev.evidence(net, bags).contributions, want)
    torch.testing.assert_close(ev.evidence(net, bags).bias, net.head.bias.detach().expand(2))


def test_mean_pooling_gives_each_token_its_own_score_over_t():
    bags = random_bags([4, 1], seed=2)
    net = model("mean")
    with torch.no_grad():
        want = (net.feature(bags.tokens) @ net.head.weight[0]) / torch.tensor([4.0] * 4 + [1.0])
    torch.testing.assert_close(ev.evidence(net, bags).contributions, want)


@pytest.mark.parametrize("method", ["hami", "hami_sp"])
def test_hami_puts_the_top_k_logits_over_k_on_k_tokens(method):
    lengths = [1, 9, 10, 25]
    bags = random_bags(lengths, seed=4)
    net = model(method)
    c = ev.evidence(net, bags).contributions
    with torch.no_grad():
        s = net.token_logits(bags)
    for b, n in enumerate(lengths):
        k = int(n * net.k_ratio) + 1
        mine, logits = c[bags.bag_of_token == b], s[bags.bag_of_token == b]
        top = torch.topk(logits, k).indices
        assert int((mine != 0).sum()) == k
        torch.testing.assert_close(mine[top], logits[top] / k)


def test_the_probe_puts_everything_on_the_last_position():
    bags = random_bags([3, 1, 2], seed=5)
    c = ev.evidence(model("probe"), bags).contributions
    last = torch.zeros(6, dtype=torch.bool)
    last[[2, 3, 5]] = True
    assert (c[~last] == 0).all() and (c[last] != 0).all()


@pytest.mark.parametrize("method", ["raw_mean", "raw_max", "attention", "gated_attention"])
def test_a_head_after_pooling_reads_against_its_bags_own_bias(method):
    """The MLP's bias through the active units differs between bags; the sum is still exact."""
    bags = random_bags([3, 5, 2, 7], seed=6)
    e = ev.evidence(model(method), bags)
    assert e.bias_varies and torch.unique(e.bias).numel() > 1


@pytest.mark.parametrize(("method", "index"), [("saplma", -1), ("sep_tbg", 0), ("sep_slt", -2)])
def test_a_one_token_reader_puts_everything_on_its_token(method, index):
    """SAPLMA and the SEP probes read one state per bag: the logit less the output bias sits there."""
    bags = random_bags([3, 2, 5], seed=9)
    net = model(method)
    assert net.index == index
    e = ev.evidence(net, bags)
    read = torch.zeros(10, dtype=torch.bool)
    read[bags.token_rows(index)] = True
    assert (e.contributions[~read] == 0).all() and not e.bias_varies
    with torch.no_grad():
        torch.testing.assert_close(e.contributions[read] + e.bias, net(bags))


# Orderless networks: the last-token probe and the one-token readers depend on the order by design.
ORDERLESS = [m for m in EXPLAINED if m != "probe" and not hasattr(model(m), "index")]


@pytest.mark.parametrize("method", ORDERLESS)
def test_contributions_follow_their_tokens_when_the_order_changes(method):
    bags = random_bags([6, 4], seed=7)
    perm = torch.tensor([3, 0, 5, 1, 4, 2, 9, 7, 6, 8])
    shuffled = Bags(bags.tokens[perm], bags.lengths, bags.p_sem)
    net = model(method)
    torch.testing.assert_close(
        ev.evidence(net, shuffled).contributions, ev.evidence(net, bags).contributions[perm], rtol=1e-5, atol=1e-6
    )


def test_an_ensemble_sums_to_the_mean_of_its_logits():
    bags = random_bags([4, 7, 1], seed=8)
    nets = [model("max", seed) for seed in range(3)]
    e = ev.ensemble_evidence(nets, bags)
    with torch.no_grad():
        z = torch.stack([n(bags) for n in nets]).mean(0)
    torch.testing.assert_close(e.logits(bags), z)


def test_a_network_without_evidence_is_named_and_says_what_it_reports():
    class Plain(torch.nn.Module):
        def forward(self, bags):
            return bags.tokens.sum()

    with pytest.raises(ev.NoEvidence, match="a Plain detector has no token evidence: it reports its bag logit"):
        ev.evidence(Plain().eval(), random_bags([2]))

    class Declared(torch.nn.Module):
        pass

    ev.no_evidence(Declared, "its score is a kernel density, reported per answer only")
    try:
        assert not ev.has_evidence(Declared())
        with pytest.raises(ev.NoEvidence, match="kernel density, reported per answer only"):
            ev.evidence(Declared().eval(), random_bags([2]))
    finally:
        del ev.EXPLAINERS[Declared]


def test_evidence_is_read_in_eval_mode_only():
    with pytest.raises(ValueError, match="eval mode"):
        ev.evidence(model("max").train(), random_bags([3]))


def test_tokens_carrying_a_share_of_the_positive_evidence():
    bags = Bags(torch.zeros(9, D), torch.tensor([4, 3, 2]))
    c = torch.tensor([0.5, -2.0, 0.375, 0.125, 0.0, -1.0, -0.5, 1.0, 1.0])
    # bag 0: positives 0.5, 0.375, 0.125 (total 1): 50% by one token, 90% by three
    # bag 1: no positive evidence; bag 2: two equal tokens: one carries 50%, both 90%
    half = ev.tokens_carrying(c, bags, 0.5)
    most = ev.tokens_carrying(c, bags, 0.9)
    assert half[0] == 1 and most[0] == 3 and half[2] == 1 and most[2] == 2
    assert torch.isnan(half[1]) and torch.isnan(most[1])
    assert ev.tokens_carrying(c, bags, 0.875)[0] == 2  # 0.5 + 0.375 reaches 87.5% exactly
    with pytest.raises(ValueError, match="share"):
        ev.tokens_carrying(c, bags, 0.0)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5), seed=st.integers(0, 999))
def test_tokens_carrying_is_within_the_bag_and_grows_with_the_share(lengths, seed):
    bags = random_bags(lengths, seed)
    c = ev.evidence(model("max", seed), bags).contributions
    s50, s90 = ev.tokens_carrying(c, bags, 0.5), ev.tokens_carrying(c, bags, 0.9)
    positive = torch.zeros(len(lengths)).index_add_(0, bags.bag_of_token, (c > 0).float())
    ok = ~torch.isnan(s50)
    assert torch.equal(ok, positive > 0)
    assert (s50[ok] >= 1).all() and (s50[ok] <= s90[ok]).all() and (s90[ok] <= positive[ok]).all()
