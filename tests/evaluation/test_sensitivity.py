"""The paper's sensitivity analysis of HaMI (halludetect/evaluation/sensitivity.py): C_B against its
closed form, the path integral against the exact difference, gamma and the margin condition on
hand-built cases."""

import numpy as np
import pytest
import torch

from halludetect.activations.bags import Bags
from halludetect.detectors.networks import HaMI
from halludetect.evaluation import sensitivity
from halludetect.evaluation.sensitivity import bag_sensitivity, class_expectations, closed_form_c, margin_change

D, DIM = 5, 12
LENGTHS = [1, 3, 7, 12, 20, 31]


def bags(lengths=LENGTHS, seed=0) -> Bags:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths)
    return Bags(torch.randn(int(lengths.sum()), D, generator=g), lengths)


def random_hami(seed=0, lam=0.0) -> HaMI:
    """A HaMI net with non-trivial batch-norm statistics: scaling moves units across zero."""
    torch.manual_seed(seed)
    m = HaMI(D, DIM, dropout=0.3, k_ratio=0.1, lam=lam)
    bn = m.net[1]
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(-1.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return m.eval()


def invariant_hami(seed=0) -> HaMI:
    """No offset before the ReLU (bias = running mean = beta = 0): the pre-activation of unit j is
    g_j (1 + p) x_j / s_j, whose sign never changes for p > -1, so neither does the active set,
    and every token logit is (1 + p) u_i + b2, so neither does the top-k order."""
    m = random_hami(seed)
    with torch.no_grad():
        m.net[0].bias.zero_()
        m.net[1].running_mean.zero_()
        m.net[1].bias.zero_()
    return m


def test_invariant_active_set_gives_the_closed_form_everywhere():
    m, b = invariant_hami(), bags()
    p = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0, 0.7])
    s = bag_sensitivity(m, b, p, steps=1000)
    # The paper's closed form, written out with explicit active and top-k sets.
    reference = closed_form_c(m, b)
    np.testing.assert_allclose(s.c0, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.c_int, reference, rtol=1e-5, atol=1e-5)  # Z is linear: no change on the path
    ok = s.p > 0
    np.testing.assert_allclose(s.c_exact[ok], reference[ok], rtol=1e-4, atol=1e-4)
    assert np.isnan(s.c_exact[~ok]).all()  # (Z(0) - Z(0)) / 0 is undefined, not 0
    # and the closed form is not trivially zero: the test can fail
    assert np.abs(reference).min() > 1e-3


def test_closed_form_holds_at_zero_for_any_network():
    """At p = 0 the active set is whatever it is: the derivative is local, so the closed form
    with that set is exact for a generic network too."""
    for seed in range(3):
        m, b = random_hami(seed), bags(seed=seed)
        s = bag_sensitivity(m, b, torch.full((len(b),), 0.8), steps=10)
        np.testing.assert_allclose(s.c0, closed_form_c(m, b), rtol=1e-5, atol=1e-5)


def test_path_integral_equals_the_exact_difference_when_the_active_set_changes():
    m, b = random_hami(1), bags(seed=1)
    p = torch.tensor([1.0, 0.9, 0.6, 1.0, 0.3, 0.8])
    s = bag_sensitivity(m, b, p, steps=1000)
    np.testing.assert_allclose(s.c_int, s.c_exact, atol=1e-4, rtol=0)
    # non-trivial: along the path the slope changes, so C at 0 is not the average slope
    assert np.abs(s.c_int - s.c0).max() > 1e-2
    # with a coarse path the midpoint sum misses the kinks: the check has teeth
    coarse = bag_sensitivity(m, b, p, steps=2)
    assert np.abs(coarse.c_int - coarse.c_exact).max() > 1e-4


def test_scaled_logit_is_what_hami_sp_computes():
    """Z_B(p_B) of the analysis is the logit the trained HaMI (SP) network outputs."""
    plain = random_hami(2)
    sp = random_hami(2, lam=1.0)
    b = bags(seed=2)
    p_sem = torch.tensor([0.1, 0.4, 1.0, 0.0, 0.6, 0.25])
    s = bag_sensitivity(plain, b, p_sem, steps=4)
    with torch.no_grad():
        expected = sp(Bags(b.tokens, b.lengths, p_sem)).double().numpy()
        unscaled = plain(b).double().numpy()
    np.testing.assert_allclose(s.z_p, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.z0, unscaled, rtol=1e-5, atol=1e-5)


def test_batched_and_chunked_equal_bag_by_bag(monkeypatch):
    m, b = random_hami(3), bags(seed=3)
    p = torch.linspace(0.1, 1.0, len(b))
    whole = bag_sensitivity(m, b, p, steps=50)
    monkeypatch.setattr(sensitivity, "CHUNK_ELEMENTS", 7)  # one step per pass
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    for i, n in enumerate(LENGTHS):
        one = Bags(b.tokens[offsets[i] : offsets[i] + n], torch.tensor([n]))
        alone = bag_sensitivity(m, one, p[i : i + 1], steps=50)
        for field in ("z0", "z_p", "c0", "c_int"):
            np.testing.assert_allclose(getattr(alone, field), getattr(whole, field)[i : i + 1], rtol=1e-5, atol=1e-5)


def test_closed_form_path_slopes_equal_autograd():
    """The fast path slopes of C_B^int are autograd's derivative of the model's own forward pass."""
    for seed in range(3):
        m, b = random_hami(seed), bags(seed=seed)
        p = torch.rand(7, len(b), generator=torch.Generator().manual_seed(seed))  # 7 points of the path per bag
        with torch.no_grad():
            projected = b.tokens @ m.net[0].weight.T
            fast = sensitivity._path_slopes(sensitivity._fold(m, projected), b, m.k_ratio, p)
        torch.testing.assert_close(fast, sensitivity._slopes(m, projected, b, p), rtol=1e-5, atol=1e-5)


def test_crossing_path_sum_equals_the_dense_path():
    """Following the units that cross zero gives the same slopes as evaluating every unit at
    every step (whose slopes are autograd's, above), chunked or not."""
    for seed in range(3):
        m, b = random_hami(seed), bags(seed=seed)
        p = torch.rand(len(b), generator=torch.Generator().manual_seed(seed)) * 2
        steps = 64
        t = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
        with torch.no_grad():
            f = sensitivity._fold(m, b.tokens @ m.net[0].weight.T)
            dense = sensitivity._path_slopes(f, b, m.k_ratio, t[:, None] * p[None]).sum(0)
            sparse = sensitivity._crossing_path_sum(f, b, m.k_ratio, p, steps)
        torch.testing.assert_close(sparse.float(), dense, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            f.c.zero_()  # no offsets: nothing crosses, the slope is constant along the path
            n_cross = int(((f.xg + f.c > 0) != ((1 + b.per_token(p))[:, None] * f.xg + f.c > 0)).sum())
        assert n_cross == 0


def test_bad_input_is_refused():
    m, b = random_hami(), bags()
    with pytest.raises(ValueError, match="eval mode"):
        bag_sensitivity(m.train(), b, torch.zeros(len(b)))
    m.eval()
    with pytest.raises(ValueError, match="one scaling per bag"):
        bag_sensitivity(m, b, torch.zeros(2))
    with pytest.raises(ValueError, match=">= 0"):
        bag_sensitivity(m, b, -torch.ones(len(b)))
    with pytest.raises(TypeError, match="HaMI networks"):
        bag_sensitivity(torch.nn.Linear(2, 1).eval(), b, torch.zeros(len(b)))


def test_gamma_and_the_condition_on_a_hand_built_case():
    # neg (correct): P_sem C = 0.9*10, 0.8*20 -> E = 12.5; pos: 0.3*5, 0.2*5 -> E = 1.25
    p_sem = np.array([0.9, 0.8, 0.3, 0.2])
    c = np.array([10.0, 20.0, 5.0, 5.0])
    y = np.array([0, 0, 1, 1])
    e = class_expectations(p_sem, c, y)
    assert e["neg"] == {"n": 2, "p_sem": pytest.approx(0.85), "c": 15.0, "p_sem_c": pytest.approx(12.5)}
    assert e["pos"]["p_sem"] == pytest.approx(0.25) and e["pos"]["p_sem_c"] == pytest.approx(1.25)
    assert e["gamma"] == pytest.approx(10.0) and e["inv_gamma"] == pytest.approx(0.1)
    assert e["class_ratio"] == 1.0 and e["condition_applies"] and e["condition_holds"] and e["margin_widens"]


def test_condition_fails_when_positives_dominate():
    p_sem, c = np.full(4, 0.5), np.full(4, 2.0)
    e = class_expectations(p_sem, c, np.array([0, 1, 1, 1]))
    assert e["gamma"] == pytest.approx(1.0) and e["class_ratio"] == pytest.approx(1 / 3)
    assert e["condition_holds"] is False and e["margin_widens"] is False


def test_gamma_is_undefined_without_a_positive_cost():
    e = class_expectations(np.array([0.5, 0.5]), np.array([1.0, 0.0]), np.array([0, 1]))
    assert e["gamma"] is None and e["inv_gamma"] is None and e["condition_holds"] is None
    assert e["condition_applies"] is False and e["margin_widens"] is True


def test_the_ratio_form_does_not_apply_when_the_scaling_raises_logits():
    # C < 0 in both classes (the scaling raises logits): gamma = (-2.4) / (-3.2) > 0 and the class
    # ratio exceeds 1/gamma, yet the margin shrinks: 1054 * -2.4 < 746 * -3.2
    p_sem, y = np.ones(1800), np.r_[np.zeros(1054), np.ones(746)]
    c = np.where(y == 0, -2.4, -3.2)
    e = class_expectations(p_sem, c, y)
    assert e["class_ratio"] > e["inv_gamma"] > 0
    assert e["condition_applies"] is False and e["condition_holds"] is None and e["margin_widens"] is False
    with pytest.raises(ValueError, match="both classes"):
        class_expectations(np.ones(2), np.ones(2), np.ones(2))


def test_margin_change_is_predicted_by_the_integrated_sensitivity():
    m, b = random_hami(4), bags(seed=4)
    p = torch.tensor([0.9, 0.2, 0.7, 0.5, 1.0, 0.4])
    y = np.array([0, 1, 0, 1, 0, 1])
    s = bag_sensitivity(m, b, p, steps=1000)
    mc = margin_change(s, y)
    assert mc["change"] == pytest.approx(mc["scaled"] - mc["unscaled"])
    assert mc["change_from_c_int"] == pytest.approx(mc["change"], abs=1e-4)
    e = class_expectations(s.p, s.c_int, y)  # p = P_sem here (lam = 1)
    assert e["margin_widens"] == (mc["change"] > 0)
