"""The seeds of one cell trained together as one batched model (halludetect/detectors/batched.py):
every seed of every built-in SGD method gets what `train_detector` gives it alone (weights of the
best and the last epoch, best epoch, curves, gradient-ratio trace, scores), under both recipes and
both losses (the MIL loss's per-step schedule of the authors' recipe included), whatever seeds
train beside it; a network with no batched form trains its seeds one
after another instead.

Observed on this synthetic cell (AMD EPYC, pinned numerics): the batched weights equal the
sequential ones bit for bit for every method and recipe; the tolerance below is what the module
promises (reduction-order noise), not what it needs here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import synthetic

from halludetect.detectors.batched import batchable, train_batched
from halludetect.detectors.build import DETECTORS, build_detector, params_for
from halludetect.detectors.data import split_data
from halludetect.detectors.inference import score
from halludetect.detectors.networks import PoolingNet
from halludetect.detectors.training import Recipe, train_detector, train_seeds
from halludetect.methods import METHODS, SP_METHODS, Method
from halludetect.methods.pooling import PoolingParams

SGD = sorted(m for m, spec in DETECTORS.items() if spec.fit.loop)
SEEDS = [0, 1, 2]
ATOL = 1e-5  # weights; curves and scores: the same relative to their size
KW = {"epochs": 4, "batch_size": 32}


def small(method: str, **extra):
    fields = DETECTORS[method].params.model_fields
    return params_for(
        method,
        {
            "lr": 1e-2,
            **({"dim": 16} if "dim" in fields else {}),
            **({"attention_dim": 8} if "attention_dim" in fields else {}),
            **({"hidden": [16, 8]} if "hidden" in fields else {}),
            **({"dropout": 0.2} if "dropout" in fields else {}),  # SAPLMA's default is none: draw masks too
            **extra,
        },
    )


def splits(method: str) -> dict:
    layer, labels = synthetic()
    p_sem = {rid: 0.3 + 0.1 * (i % 5) for i, rid in enumerate(layer.response_ids)} if method in SP_METHODS else None
    return {s: split_data(layer, labels, s, p_sem=p_sem) for s in ("train", "val", "test")}


def assert_same_result(got, want) -> None:
    """One seed's TrainResult against train_detector's, to float tolerance."""
    assert got.best_epoch == want.best_epoch
    assert got.best_val_auroc == pytest.approx(want.best_val_auroc, abs=1e-6)
    for mine, ref in ((got.state_dict, want.state_dict), (got.last_state_dict, want.last_state_dict)):
        assert list(mine) == list(ref)  # the same keys in the same order: the same safetensors files
        for k, v in ref.items():
            torch.testing.assert_close(mine[k], v, rtol=0, atol=ATOL)
    assert [sorted(r) for r in got.curve] == [sorted(r) for r in want.curve]
    for a, b in zip(got.curve, want.curve, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert (got.gradient_ratio is None) == (want.gradient_ratio is None)
    if want.gradient_ratio is not None:
        assert got.gradient_ratio["best_epoch"] == want.gradient_ratio["best_epoch"]
        for a, b in zip(got.gradient_ratio["epochs"], want.gradient_ratio["epochs"], strict=True):
            numbers = {k for k, v in b.items() if isinstance(v, float)}
            assert {k: v for k, v in a.items() if k not in numbers} == {k: v for k, v in b.items() if k not in numbers}
            assert {k: a[k] for k in numbers} == pytest.approx({k: b[k] for k in numbers}, rel=1e-5, abs=1e-6)


def sequential(method, params, data, seeds=SEEDS, **kw):
    return [train_detector(method, params, data["train"], data["val"], seed=s, **(KW | kw)) for s in seeds]


@pytest.mark.parametrize("recipe", ["paper", "authors"])
@pytest.mark.parametrize("method", SGD)
def test_every_seed_of_every_method_trains_batched_to_its_own_weights(method, recipe):
    data = splits(method)
    params = small(method)
    want = sequential(method, params, data, recipe=recipe)
    got = train_seeds(method, params, data["train"], data["val"], {"test": data["test"]}, SEEDS, recipe=recipe, **KW)
    model = build_detector(method, data["train"].tokens.shape[-1], params)
    for r, ref in zip(got, want, strict=True):
        assert_same_result(r.result, ref)
        for which, state in (("best", ref.state_dict), ("last", ref.last_state_dict)):
            model.load_state_dict(state)
            mine = r.scores if which == "best" else r.last_scores
            np.testing.assert_allclose(mine["test"], score(model, data["test"]), rtol=1e-5, atol=1e-6)
    assert not torch.equal(*(r.result.last_state_dict[next(iter(want[0].last_state_dict))] for r in got[:2]))


@pytest.mark.parametrize("extra", [{"loss": "logistic"}, {"loss": "logistic", "bag_score": "sigmoid"}])
def test_hami_with_the_logistic_loss_trains_batched_to_its_own_weights(extra):
    data = splits("hami")
    params = small("hami", **extra)
    for recipe in ("paper", "authors"):
        want = sequential("hami", params, data, recipe=recipe)
        got = train_batched("hami", params, data["train"], data["val"], SEEDS, recipe=recipe, **KW)
        for a, b in zip(got, want, strict=True):
            assert_same_result(a, b)


def test_each_seed_keeps_its_own_learning_rate_under_the_plateau_schedule():
    """A rate high enough for the validation loss to stall, a schedule with no patience: the seeds'
    rates part ways, and each seed's stays the one it had alone."""
    data = splits("max")
    params = small("max", lr=0.5)
    plateau = Recipe("p", plateau={"factor": 0.5, "patience": 0, "min_lr": 1e-7}, pos_weight=0.3, drop_last=True)
    kw = {"epochs": 8, "batch_size": 32, "recipe": plateau}
    want = [train_detector("max", params, data["train"], data["val"], seed=s, **kw) for s in SEEDS]
    got = train_batched("max", params, data["train"], data["val"], SEEDS, **kw)
    lrs = [[row["lr"] for row in r.curve] for r in got]
    assert any(len({seed[e] for seed in lrs}) > 1 for e in range(8)), lrs  # the rates differ somewhere
    for a, b in zip(got, want, strict=True):
        assert_same_result(a, b)


@pytest.mark.parametrize("method", ["hami", "hami_sp"])
def test_each_seed_keeps_its_own_learning_rate_under_the_hami_code_s_step_schedule(method):
    """The authors' recipe for the MIL loss (the HaMI code's loaders, a step per epoch, the plateau
    schedule on every step's training loss), with no patience and a rate high enough for the loss
    to stall: the seeds' rates part ways, and each seed's steps are the ones it took alone."""
    data = splits(method)
    params = small(method, lr=0.5)
    rec = Recipe(
        "h", mil_loaders=True, mil_step_epochs=True, mil_plateau={"factor": 0.1, "patience": 0, "min_lr": 1e-6}
    )
    kw = {"epochs": 10, "batch_size": 16, "recipe": rec}
    want = [train_detector(method, params, data["train"], data["val"], seed=s, **kw) for s in SEEDS]
    got = train_batched(method, params, data["train"], data["val"], SEEDS, **kw)
    lrs = [[row["lr"] for row in r.curve] for r in got]
    assert any(len({seed[e] for seed in lrs}) > 1 for e in range(10)), lrs  # the rates differ somewhere
    for a, b in zip(got, want, strict=True):
        assert len(a.curve) == 10  # one step per epoch
        assert_same_result(a, b)
    # the authors' recipe itself, batched: batch_size bags of each class per step (16 of the 30)
    for recipe in ("authors", "paper"):
        want = sequential(method, small(method), data, recipe=recipe, epochs=6, batch_size=16)
        got = train_batched(
            method, small(method), data["train"], data["val"], SEEDS, recipe=recipe, epochs=6, batch_size=16
        )
        for a, b in zip(got, want, strict=True):
            assert_same_result(a, b)


@pytest.mark.parametrize("method", ["hami", "max", "gated_attention"])
def test_a_seed_trains_to_the_same_bytes_whatever_seeds_train_beside_it(method):
    data = splits(method)
    params = small(method)
    alone = train_batched(method, params, data["train"], data["val"], [2, 7], **KW)[0]
    among = train_batched(method, params, data["train"], data["val"], [5, 2, 0], **KW)[1]
    for k, v in alone.last_state_dict.items():
        assert torch.equal(v, among.last_state_dict[k]), k
    assert alone.curve == among.curve


def test_batched_training_leaves_the_callers_random_numbers_alone():
    data = splits("max")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    train_batched("max", small("max"), data["train"], data["val"], SEEDS, epochs=1, batch_size=32)
    assert torch.equal(torch.get_rng_state(), before)


class Doubled(PoolingNet):
    """A user's network: a subclass whose forward is not its parent's."""

    def forward(self, bags):
        return 2 * super().forward(bags)


def test_a_network_with_no_batched_form_trains_its_seeds_one_after_another(monkeypatch):
    spec = Method(
        "doubled_max", "Doubled max", PoolingParams, build=lambda net, d, p: Doubled(d, p.dim, p.dropout, "max")
    )
    monkeypatch.setitem(METHODS, "doubled_max", spec)
    data = splits("max")
    params = PoolingParams(dim=16, dropout=0.2, lr=1e-2)
    assert not batchable(build_detector("doubled_max", data["train"].tokens.shape[-1], params))
    assert batchable(build_detector("max", data["train"].tokens.shape[-1], params))
    want = sequential("doubled_max", params, data)
    got = train_seeds("doubled_max", params, data["train"], data["val"], {"test": data["test"]}, SEEDS, **KW)
    for r, ref in zip(got, want, strict=True):
        for k, v in ref.state_dict.items():
            assert torch.equal(r.result.state_dict[k], v)
    with pytest.raises(TypeError, match="no batched form"):
        train_batched("doubled_max", params, data["train"], data["val"], SEEDS, **KW)
