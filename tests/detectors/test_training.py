"""Training (halludetect/detectors/training.py) on synthetic bags: every method learns and is
deterministic for a seed, the paired sampler balances the classes, the MIL loss equals the
HaMI code's bag by bag, the authors' recipe adds their pooling code's extras to the logistic loop
and runs the HaMI code's loop (its loaders, its per-step schedule, a step per epoch) for the MIL
loss, and every epoch records the margins of its weights."""

import pytest
import torch
from detector_support import model, random_bags
from hypothesis import given, settings
from hypothesis import strategies as st
from support import synthetic

from halludetect.detectors.build import DETECTORS, build_detector, params_for
from halludetect.detectors.data import split_data
from halludetect.detectors.inference import score
from halludetect.detectors.loop import LoaderSampler
from halludetect.detectors.training import (
    RECIPES,
    PairedSampler,
    Recipe,
    epoch_batches,
    hami_mil_loss,
    logistic_loss,
    train_detector,
    train_layer,
)
from halludetect.methods import SP_METHODS
from halludetect.methods.pooling import PoolingParams
from halludetect.metrics import margin


def test_max_pooling_learns_a_single_token_signal():
    layer, labels = synthetic()
    train, val = split_data(layer, labels, "train"), split_data(layer, labels, "val")
    params = PoolingParams(dim=16, dropout=0.0, lr=1e-2, weight_decay=0.0)
    res = train_detector("max", params, train, val, epochs=30, batch_size=32, seed=0)
    assert res.best_val_auroc > 0.9
    assert len(res.curve) == 30 and 1 <= res.best_epoch <= 30
    assert res.curve[res.best_epoch - 1]["val_auroc"] == res.best_val_auroc == max(c["val_auroc"] for c in res.curve)


FAST = {"dim": 16, "lr": 1e-2}
SGD = sorted(m for m, spec in DETECTORS.items() if spec.fit.loop)


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


# ------------------------------------------------------------------------ recipes and margins
def data_and_params():
    layer, labels = synthetic()
    train, val = split_data(layer, labels, "train"), split_data(layer, labels, "val")
    return train, val


def same_weights(a, b) -> bool:
    return all(torch.equal(v, b[k]) for k, v in a.items())


def test_authors_recipe_differs_from_the_paper_where_it_should_and_only_there():
    """The authors' pooling code's three extras act on the logistic loss, the HaMI code's three on
    the MIL loss: each extra alone changes its own loss's training and leaves the other's alone."""
    train, val = data_and_params()
    kw = {"epochs": 6, "batch_size": 32, "seed": 0}
    hami = params_for("hami", FAST)
    assert hami.loss == "mil"
    paper_hami = train_detector("hami", hami, train, val, recipe="paper", **kw)
    for extra in (
        Recipe("l", mil_loaders=True),
        Recipe("p", mil_plateau={"factor": 0.1, "patience": 0, "min_lr": 1e-6}),
        Recipe("e", mil_loaders=True, mil_step_epochs=True),
        "authors",
    ):
        other = train_detector("hami", hami, train, val, recipe=extra, **kw)
        assert not same_weights(paper_hami.last_state_dict, other.last_state_dict), extra
    # the logistic loss's extras leave the MIL loop as the paper's, and the MIL loss's the logistic loop
    logistic_only = Recipe("x", pos_weight=0.3, plateau={"factor": 0.5, "patience": 0, "min_lr": 1e-7}, drop_last=True)
    same = train_detector("hami", hami, train, val, recipe=logistic_only, **kw)
    assert same_weights(paper_hami.last_state_dict, same.last_state_dict) and paper_hami.curve == same.curve
    # a learning rate high enough for the validation loss to rise, so that a schedule acts
    mx = params_for("max", {"dim": 16, "lr": 0.5})
    paper = train_detector("max", mx, train, val, recipe="paper", **kw)
    assert "val_loss" not in paper.curve[0] and {c["lr"] for c in paper.curve} == {mx.lr}
    mil_only = Recipe(
        "m", mil_loaders=True, mil_plateau={"factor": 0.1, "patience": 0, "min_lr": 1e-6}, mil_step_epochs=True
    )
    same = train_detector("max", mx, train, val, recipe=mil_only, **kw)
    assert same_weights(paper.last_state_dict, same.last_state_dict) and paper.curve == same.curve
    for extra in (
        Recipe("w", pos_weight=0.3),
        Recipe("p", plateau={"factor": 0.5, "patience": 0, "min_lr": 1e-7}),
        Recipe("d", drop_last=True),
        "authors",
    ):
        other = train_detector("max", mx, train, val, recipe=extra, **kw)
        assert not same_weights(paper.last_state_dict, other.last_state_dict), extra
    # each extra alone leaves the others' parts of the loop as the paper's
    w = train_detector("max", mx, train, val, recipe=Recipe("w", pos_weight=0.3), **kw)
    assert {c["lr"] for c in w.curve} == {mx.lr} and "val_loss" not in w.curve[0]


def test_authors_recipe_is_the_hami_code_s_loop_for_the_mil_loss():
    """github.com/mala-lab/HaMI at 3d27760: main.py:55-56 (a DataLoader per class, batch_size each,
    shuffle, drop_last), train.py:19-21 (ReduceLROnPlateau(min, 0.1, 20, 1e-6)), train.py:26-49
    (`--epoch` counts steps; the schedule steps on each step's training loss)."""
    authors = RECIPES["authors"]
    assert authors.mil_loaders and authors.mil_step_epochs
    assert authors.mil_plateau == {"factor": 0.1, "patience": 20, "min_lr": 1e-6}
    paper = RECIPES["paper"]
    assert not paper.mil_loaders and paper.mil_plateau is None and not paper.mil_step_epochs
    train, val = data_and_params()
    res = train_detector("hami", params_for("hami", FAST), train, val, epochs=7, batch_size=8, seed=0, recipe="authors")
    assert [c["epoch"] for c in res.curve] == list(range(1, 8))  # an epoch is one step: 7 steps, 7 validations
    assert {c["lr"] for c in res.curve} == {FAST["lr"]}  # patience 20: no cut in 7 steps


def assert_plateau_schedule(curve: list[dict], loss: str, lr: float, *, factor, patience, min_lr) -> None:
    """Each epoch's recorded lr is ReduceLROnPlateau's (mode min, threshold 1e-4 relative), replayed
    on the curve's `loss` column from the starting `lr`."""
    best, bad = float("inf"), 0
    for c in curve:
        assert c["lr"] == pytest.approx(lr)
        if c[loss] < best * (1 - 1e-4):
            best, bad = c[loss], 0
        else:
            bad += 1
            if bad > patience:
                lr, bad = max(lr * factor, min_lr), 0


def test_the_hami_code_s_schedule_cuts_the_lr_on_the_training_loss_of_every_step():
    train, val = data_and_params()
    hami = params_for("hami", {"dim": 16, "lr": 0.5})  # too high: the training loss goes up and down
    patience = 1
    rec = Recipe(
        "h", mil_loaders=True, mil_step_epochs=True, mil_plateau={"factor": 0.1, "patience": patience, "min_lr": 1e-6}
    )
    res = train_detector("hami", hami, train, val, epochs=15, batch_size=16, seed=0, recipe=rec)
    lrs = [c["lr"] for c in res.curve]
    assert lrs[0] == 0.5 and min(lrs) < 0.5
    # the schedule's rule, replayed on the recorded step losses (an epoch's lr is the one its step ran at)
    assert_plateau_schedule(res.curve, "train_loss", 0.5, factor=0.1, patience=patience, min_lr=1e-6)


def test_the_hami_code_s_loaders_draw_a_batch_of_each_class_per_step_and_drop_each_pass_s_remainder():
    y = torch.tensor([0] * 50 + [1] * 21)
    sampler = LoaderSampler(y, batch_size=8, gen=torch.Generator().manual_seed(0), steps=12)
    steps = list(sampler.epoch())
    assert len(steps) == 12 and all(len(b) == 16 and int(y[b].sum()) == 8 for b in steps)
    assert all(bool((y[b[:8]] == 0).all()) for b in steps)  # correct bags first, as the HaMI code's cat
    ok, hal = [b[:8] for b in steps], [b[8:] for b in steps]
    # a pass is floor(n / 8) batches of one shuffle: 6 for the 50 correct bags, 2 for the 21 hallucinated
    for chunks, per_pass, n in ((ok, 6, 50), (hal, 2, 21)):
        for start in range(0, 12 - per_pass + 1, per_pass):
            drawn = torch.cat(chunks[start : start + per_pass])
            assert len(set(drawn.tolist())) == per_pass * 8 < n  # no bag twice in a pass, the remainder left out
    assert not torch.equal(torch.cat(hal[0:2]), torch.cat(hal[2:4]))  # a new shuffle every pass


def test_a_class_smaller_than_a_batch_makes_both_classes_draw_its_count():
    """The HaMI code's loader of such a class has no batch (its step counter then divides by zero):
    here both classes draw as many bags as the smaller class has, the smaller all of them each step."""
    y = torch.tensor([0] * 40 + [1] * 5)
    sampler = LoaderSampler(y, batch_size=16, gen=torch.Generator().manual_seed(1), steps=4)
    for b in sampler.epoch():
        assert len(b) == 10 and set(b[5:].tolist()) == set(range(40, 45))
    train, val = data_and_params()
    res = train_detector(
        "hami", params_for("hami", FAST), train, val, epochs=2, batch_size=512, seed=0, recipe="authors"
    )
    assert len(res.curve) == 2


def test_the_plateau_schedule_halves_the_lr_when_the_validation_loss_stalls():
    # the authors' code: ReduceLROnPlateau(mode="min", factor=0.5, patience=3, min_lr=1e-7), on the val loss
    authors = RECIPES["authors"]
    assert (authors.pos_weight, authors.plateau, authors.drop_last) == (
        0.3,
        {"factor": 0.5, "patience": 3, "min_lr": 1e-7},
        True,
    )
    train, val = data_and_params()
    mx = params_for("max", {"dim": 16, "lr": 0.5})  # too high: the validation loss goes up and down
    patience = 1
    plateau = Recipe("p", plateau={"factor": 0.5, "patience": patience, "min_lr": 1e-7})
    res = train_detector("max", mx, train, val, epochs=12, batch_size=32, seed=0, recipe=plateau)
    lrs = [c["lr"] for c in res.curve]
    assert lrs[0] == 0.5 and min(lrs) < 0.5
    # the schedule's rule, replayed on the recorded validation losses (the lr of each epoch is the one it ran at)
    assert_plateau_schedule(res.curve, "val_loss", 0.5, factor=0.5, patience=patience, min_lr=1e-7)


def test_drop_last_leaves_out_the_partial_batch_of_the_same_shuffle():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    full = epoch_batches(70, 32, g1, drop_last=False)
    dropped = epoch_batches(70, 32, g2, drop_last=True)
    assert [len(b) for b in full] == [32, 32, 6] and [len(b) for b in dropped] == [32, 32]
    assert torch.equal(torch.cat(dropped), torch.cat(full)[:64])


@pytest.mark.hostile
def test_authors_recipe_refuses_a_training_split_smaller_than_one_batch(tmp_path):
    """drop_last would leave no step at all: one line naming train.batch_size, before training."""
    from halludetect.core.errors import DataError

    train, val = data_and_params()
    big = {"epochs": 1, "batch_size": 10_000, "seed": 0, "recipe": "authors"}
    with pytest.raises(DataError, match="fewer than train.batch_size 10000: no step would run"):
        train_detector("max", params_for("max", FAST), train, val, **big)
    layer, labels = synthetic()
    data = {s: split_data(layer, labels, s) for s in ("train", "val", "test")}
    with pytest.raises(DataError, match="train.recipe 'authors' drops the last partial batch"):
        train_layer(
            "max",
            params_for("max", FAST),
            data,
            [0],
            layer=0,
            epochs=1,
            batch_size=10_000,
            device="cpu",
            out_dir=tmp_path / "d",
            scores_path=tmp_path / "s.parquet",
            metrics_path=tmp_path / "m.json",
            recipe="authors",
        )
    assert not any(tmp_path.iterdir())  # refused before anything was written
    # the MIL loss draws pairs, as many of each class as the smaller class has: not refused
    train_detector("hami", params_for("hami", FAST), train, val, **big)


def test_the_positive_class_weight_scales_the_hallucinated_terms_only():
    z = torch.tensor([2.0, -1.0, 0.5, -3.0])
    y = torch.tensor([1.0, 1.0, 0.0, 0.0])
    soft = torch.nn.functional.softplus
    want = (0.3 * soft(-z[:2])).sum() + soft(z[2:]).sum()
    torch.testing.assert_close(logistic_loss(z, y, 0.3), want / 4)
    torch.testing.assert_close(logistic_loss(z, y), (soft(-z[:2]).sum() + soft(z[2:]).sum()) / 4)


def test_every_epoch_records_the_train_and_val_margins_of_its_weights():
    train, val = data_and_params()
    mx = params_for("max", FAST)
    res = train_detector("max", mx, train, val, epochs=5, batch_size=32, seed=0)
    model = build_detector("max", train.tokens.shape[-1], mx)
    model.load_state_dict(res.last_state_dict)
    assert res.curve[-1]["train_margin"] == pytest.approx(margin(train.y.numpy(), score(model, train)))
    assert res.curve[-1]["val_margin"] == pytest.approx(margin(val.y.numpy(), score(model, val)))
    model.load_state_dict(res.state_dict)
    assert res.curve[res.best_epoch - 1]["val_margin"] == pytest.approx(margin(val.y.numpy(), score(model, val)))
    # a logistic loss at the paper's rate: the training margin grows over the epochs (Theorem 1)
    assert res.curve[-1]["train_margin"] > res.curve[0]["train_margin"]


def test_the_sigmoid_bag_score_changes_hami_s_scores_and_its_logistic_training_not_its_mil_training():
    train, val = data_and_params()
    kw = {"epochs": 4, "batch_size": 32, "seed": 0}
    for loss, same in (("mil", True), ("logistic", False)):
        a, b = (
            train_detector("hami", params_for("hami", FAST | {"loss": loss, "bag_score": bag}), train, val, **kw)
            for bag in ("logits", "sigmoid")
        )
        # the MIL loss scores bags by its own sigmoid top-k mean whatever bag_score says
        assert same_weights(a.last_state_dict, b.last_state_dict) is same, loss
        assert [c["val_margin"] for c in a.curve] != [c["val_margin"] for c in b.curve]
