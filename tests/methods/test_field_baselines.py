"""The field's baselines on hidden states (methods/saplma.py, sep.py, eigenscore.py, probe.py):
which token of a bag each reads under both position conventions, checked on states that carry
their absolute position, and each formula against a small case computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from halludetect.activations.bags import Bags
from halludetect.activations.capture import bag_slice
from halludetect.config import ParamsError, load_params, parse_params
from halludetect.detectors.build import build_detector, params_for

P, N, D = 3, 4, 2  # prompt tokens, answer tokens (a_0..a_3 at positions 3..6), state width
STATES = torch.stack([torch.tensor([float(t), 1.0]) for t in range(P + N)])  # state at position t = [t, 1]


def bag(positions: str, n: int = N) -> Bags:
    return Bags(STATES[bag_slice(P, n, positions)], torch.tensor([n]))


def reading(method: str) -> torch.nn.Module:
    """The method's network with weights that output feature 0 of the state it reads: its position."""
    net = build_detector(method, D, params_for(method))
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
        for lin in linears:
            lin.weight[0, 0] = 1.0  # pass feature 0 through every layer (positions are >= 0: ReLU keeps them)
    return net.eval()


# Absolute positions read (prompt positions 0..2, answer a_0..a_3 at 3..6), per convention.
EXPECTED = {
    "probe": {"predicting": P + N - 2, "generated": P + N - 1},
    "saplma": {"predicting": P + N - 2, "generated": P + N - 1},  # generated: the last answer token, SAPLMA's
    "sep_slt": {"predicting": P + N - 3, "generated": P + N - 2},  # predicting: the SEP code's hidden_states[n - 2]
    "sep_tbg": {"predicting": P - 1},  # the last prompt position; not in a generated bag
}


@pytest.mark.parametrize(("method", "positions"), [(m, p) for m, e in sorted(EXPECTED.items()) for p in e])
def test_each_one_token_baseline_reads_its_token(method, positions):
    with torch.no_grad():
        got = reading(method)(bag(positions))
    assert got.tolist() == [EXPECTED[method][positions]]


def test_eigenscore_reads_the_last_bag_token():
    """Two answers whose states differ only at one position: EigenScore sees the difference when it
    reads that position (the last bag token: P+n-2 predicting, P+n-1 generated), and nothing elsewhere."""
    net = build_detector("eigenscore", D, params_for("eigenscore"))
    for positions, last in (("predicting", P + N - 2), ("generated", P + N - 1)):
        scores = {}
        for moved in (None, last, last - 1):
            other = STATES.clone()
            if moved is not None:
                other[moved] = torch.tensor([-7.0, 5.0])
            tokens = torch.cat([STATES[bag_slice(P, N, positions)], other[bag_slice(P, N, positions)]])
            bags = Bags(tokens, torch.tensor([N, N]), groups=torch.tensor([0, 0]))
            scores[moved] = float(net(bags)[0])
        assert scores[last] > scores[None] + 0.1 and scores[last - 1] == scores[None]


def test_sep_tbg_needs_predicting_bags():
    data = load_params("params.yaml").model_dump(mode="json")
    data["grid"]["detectors"] = ["sep_tbg"]
    data["dump"]["positions"] = "generated"
    with pytest.raises(
        ParamsError,
        match="'sep_tbg' reads a state that a 'generated' bag does not hold: set dump.positions: predicting",
    ):
        parse_params(data)


def test_a_bag_too_short_for_the_token_is_an_error_never_another_bags_token():
    with pytest.raises(ValueError, match="a bag of 1 token"):
        reading("sep_slt")(Bags(STATES[:3], torch.tensor([2, 1])))


def test_eigenscore_equals_the_hand_computed_case_and_the_inside_code():
    """K = 2, d = 3: Z = [[1, 2, 3], [2, 2, 2]]; each row centred over its features: [-1, 0, 1] and
    [0, 0, 0]; Sigma = Zc Zc^T / (d - 1) = [[1, 0], [0, 0]]; eigenvalues of Sigma + 1e-3 I: 1.001
    and 0.001; EigenScore = (log10 1.001 + log10 0.001) / 2."""
    net = build_detector("eigenscore", 3, params_for("eigenscore"))
    tokens = torch.tensor([[9.0, 9, 9], [1, 2, 3], [5.0, 5, 5], [2, 2, 2]])  # two 2-token bags: the last rows count
    bags = Bags(tokens, torch.tensor([2, 2]), groups=torch.tensor([4, 4]))
    hand = (math.log10(1.001) + math.log10(0.001)) / 2
    torch.testing.assert_close(net(bags), torch.tensor([hand, hand], dtype=torch.float64))
    # the INSIDE code (getEigenIndicator_v0): torch.cov of the K rows, SVD of Cov + alpha I, mean log10
    z = torch.tensor([[1.0, 2, 3], [2, 2, 2]])
    s = np.linalg.svd(torch.cov(z).numpy().astype(float) + 1e-3 * np.eye(2))[1]
    assert float(np.mean(np.log10(s))) == pytest.approx(hand, rel=1e-6)


def test_eigenscore_scores_each_question_apart_whatever_the_order_and_sizes():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(7, 4, generator=g)
    groups = torch.tensor([1, 0, 1, 1, 0, 2, 2])  # questions of 3, 2 and 2 answers, interleaved
    net = build_detector("eigenscore", 4, params_for("eigenscore"))
    together = net(Bags(tokens, torch.ones(7, dtype=torch.int64), groups=groups))
    for q in (0, 1, 2):
        idx = torch.nonzero(groups == q).squeeze(1)
        alone = net(Bags(tokens[idx], torch.ones(len(idx), dtype=torch.int64), groups=groups[idx]))
        torch.testing.assert_close(together[idx], alone)
        assert len(set(alone.tolist())) == 1  # every answer of a question gets its question's score
    with pytest.raises(ValueError, match="at least two answers"):
        net(Bags(tokens[:1], torch.ones(1, dtype=torch.int64), groups=groups[:1]))


def test_saplma_is_the_papers_mlp():
    net = build_detector("saplma", 16, params_for("saplma"))
    shapes = [tuple(m.weight.shape) for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert shapes == [(256, 16), (128, 256), (64, 128), (1, 64)]
    assert sum(isinstance(m, torch.nn.ReLU) for m in net.modules()) == 3
