"""bench/hami_code.py's transcription of the HaMI code: its loss is ours, a seed starts both loops
from the same weights, and its loop runs (on synthetic bags, a few steps)."""

from __future__ import annotations

import numpy as np
import torch
from detector_support import model, random_bags
from support import synthetic

from bench.hami_code import bag_list, hami_code, hami_net, init_seed, mil_loss
from halludetect.detectors.build import build_detector, params_for
from halludetect.detectors.data import split_data
from halludetect.detectors.loop import hami_mil_loss


def test_the_transcribed_loss_is_ours():
    lengths = [3, 12, 1, 9, 20, 5]
    bags = random_bags(lengths, 4)
    y = torch.tensor([0, 1, 0, 1, 0, 1])
    m = model("hami", 4)
    ours = hami_mil_loss(m, bags, y, params_for("hami"))
    s = torch.sigmoid(m.token_logits(bags))
    per_bag = [s[bags.bag_of_token == i] for i in range(len(lengths))]
    ok, hal = [b for b, c in zip(per_bag, y) if c == 0], [b for b, c in zip(per_bag, y) if c == 1]
    theirs = mil_loss(torch.cat(ok + hal), [len(b) for b in ok], [len(b) for b in hal], 0.1)
    torch.testing.assert_close(ours, theirs)


def test_a_seed_starts_both_loops_from_the_same_weights():
    init_seed(3)
    theirs = hami_net(16).state_dict()
    torch.manual_seed(3)
    ours = build_detector("hami", 16, params_for("hami")).state_dict()
    assert [k.removeprefix("net.") for k in ours] == list(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours.values(), theirs.values(), strict=True))


def test_the_transcribed_loop_runs_and_keeps_its_best_step():
    layer, labels = synthetic()
    data = {s: split_data(layer, labels, s) for s in ("train", "val", "test")}
    bags, y = bag_list(data["train"], 0.0), data["train"].y.tolist()
    train = ([b for b, c in zip(bags, y) if c == 0], [b for b, c in zip(bags, y) if c == 1])
    val = (bag_list(data["val"], 0.0), data["val"].y.numpy())
    test = (bag_list(data["test"], 0.0), data["test"].y.numpy())
    out = hami_code(train, val, test, seed=0, steps=6, batch_size=8, k_ratio=0.1)
    assert 1 <= out["best_step"] <= 6 and 0.0 <= out["test_auroc"] <= 1.0 and out["last_lr"] == 1e-3
    assert np.isfinite(out["test_auroc"])
