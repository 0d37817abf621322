"""Training (halludetect/detectors/training.py) on synthetic bags: every method learns and is
deterministic for a seed, the paired sampler balances the classes, and the MIL loss equals the
HaMI code's bag by bag."""

import pytest
import torch
from detector_support import model, random_bags
from hypothesis import given, settings
from hypothesis import strategies as st
from support import synthetic

from halludetect.detectors.build import DETECTORS, params_for
from halludetect.detectors.data import split_data
from halludetect.detectors.training import PairedSampler, hami_mil_loss, train_detector
from halludetect.methods import SP_METHODS
from halludetect.methods.pooling import PoolingParams


def test_max_pooling_learns_a_single_token_signal():
    layer, labels = synthetic()
    train, val = split_data(layer, labels, "train"), split_data(layer, labels, "val")
    params = PoolingParams(dim=16, dropout=0.0, lr=1e-2, weight_decay=0.0)
    res = train_detector("max", params, train, val, epochs=30, batch_size=32, seed=0)
    assert res.best_val_auroc > 0.9
    assert len(res.curve) == 30 and 1 <= res.best_epoch <= 30
    assert res.curve[res.best_epoch - 1]["val_auroc"] == res.best_val_auroc == max(c["val_auroc"] for c in res.curve)


FAST = {"dim": 16, "lr": 1e-2}
SGD = sorted(m for m, spec in DETECTORS.items() if spec.fit == "sgd")


def fast(method):
    fields = DETECTORS[method].params.model_fields
    return {
        "lr": 1e-2,
        **({"dim": 16} if "dim" in fields else {}),
        **({"hidden": [16, 8]} if "hidden" in fields else {}),
    }


@pytest.mark.parametrize("method", SGD)
def test_every_method_learns_and_is_deterministic_for_a_seed(method):
    layer, labels = synthetic()
    p_sem = {rid: 0.5 for rid in layer.response_ids} if method in SP_METHODS else None
    train, val = (split_data(layer, labels, s, p_sem=p_sem) for s in ("train", "val"))
    params = params_for(method, fast(method))
    res = train_detector(method, params, train, val, epochs=15, batch_size=32, seed=0)
    again = train_detector(method, params, train, val, epochs=15, batch_size=32, seed=0)
    other = train_detector(method, params, train, val, epochs=15, batch_size=32, seed=1)
    for k, v in res.state_dict.items():
        torch.testing.assert_close(v, again.state_dict[k], rtol=0, atol=0)
    assert any(not torch.equal(v, other.state_dict[k]) for k, v in res.state_dict.items())
    # the signal is one token with a shifted feature: the last token only by chance, so the probes lag
    assert res.best_val_auroc > (0.55 if method in ("probe", "saplma") else 0.8), res.curve


def test_a_method_fitted_in_closed_form_is_the_same_for_every_seed():
    """sep_* (logistic regression) and eigenscore (nothing to fit) are deterministic: the seeds
    give one detector, and train_detector does not run the SGD loop for them."""
    layer, labels = synthetic()
    entropy = {rid: float(i % 2) + 0.1 * (i % 3) for i, rid in enumerate(layer.response_ids)}
    train = split_data(layer, labels, "train", method="sep_tbg", entropy=entropy)
    val = split_data(layer, labels, "val", method="sep_tbg")
    a = train_detector("sep_tbg", params_for("sep_tbg"), train, val, epochs=15, batch_size=32, seed=0)
    b = train_detector("sep_tbg", params_for("sep_tbg"), train, val, epochs=15, batch_size=32, seed=1)
    assert len(a.curve) == 1 and a.best_epoch == 1 and a.curve[0]["target"] == "semantic_entropy"
    for k, v in a.state_dict.items():
        torch.testing.assert_close(v, b.state_dict[k], rtol=0, atol=0)


def test_paired_sampler_balances_classes_and_covers_both():
    y = torch.tensor([0] * 50 + [1] * 7, dtype=torch.float32)
    sampler = PairedSampler(y, batch_size=16, gen=torch.Generator().manual_seed(0))
    seen = []
    for batch in sampler.epoch():
        assert len(batch) == 16 and int(y[batch].sum()) == 8
        seen.append(batch)
    assert len(seen) == 4  # ceil(57 / 16): as many steps as a plain epoch
    assert set(torch.cat(seen).tolist()) >= set(range(50, 57))


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
@given(
    lengths=st.lists(st.integers(1, 25), min_size=4, max_size=12).filter(lambda x: len(x) % 2 == 0),
    seed=st.integers(0, 999),
)
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
