"""Random packed bags and detectors of every method, for the property tests of the batched detector
code (tests/activations/test_bags.py, tests/detectors/: networks, pooling, training)."""

from __future__ import annotations

import numpy as np
import torch

from halludetect.activations.bags import Bags
from halludetect.detectors.build import DETECTORS, build_detector, params_for

D = 6  # hidden size of the random bags


def ragged(lengths, seed=0):
    """Random states of bags of `lengths` tokens, packed, and their offsets."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.normal(size=(offsets[-1], D)).astype(np.float32), offsets


def random_bags(lengths, seed=0) -> Bags:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths)
    return Bags(torch.randn(int(lengths.sum()), D, generator=g), lengths, torch.rand(len(lengths), generator=g))


def model(method, seed=0):
    torch.manual_seed(seed)
    fields = DETECTORS[method].params.model_fields
    params = params_for(method, {"dim": 8} if "dim" in fields else {"hidden": [8, 4]} if "hidden" in fields else {})
    m = build_detector(method, D, params)
    for mod in m.modules():  # non-trivial batch-norm statistics, so eval mode is really tested
        if isinstance(mod, torch.nn.BatchNorm1d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
    return m.eval()
