"""A streamed answer's pieces (halludetect/scoring/streaming.py): the text sent token by token is
always a prefix of the answer trimmed as without streaming, and ends as it; the running score of the
max and mean pooling networks, kept token by token, is the network on the answer so far."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halludetect.activations.bags import Bags
from halludetect.detectors.networks import PoolingNet
from halludetect.lm.generation import trim_answer
from halludetect.scoring.streaming import RowText, RunningPool

STOP = ["\n", "Question:"]


def streamed(tokenizer, ids: list[int], stop: list[str], ends: set[int]) -> tuple[str, list[int], RowText]:
    row, text, sent_ids = RowText(tokenizer, stop, ends), "", []
    for t in ids:
        out = row.push(t)
        if out is not None:
            assert (text + out[0]).startswith(text)
            text, sent_ids = text + out[0], sent_ids + out[1]
    return text, sent_ids, row


@pytest.mark.parametrize(
    "answer",
    [
        " Tavo Mir was born in Qelbo.",
        "  Born in Qelbo.\nQuestion: who else?",  # leading spaces, then a stop string
        " Qelbo, in the north   ",  # trailing spaces: stripped in the end, never sent
        " Born in Qu",  # cut by max_new_tokens in the middle of a word
        "\nQuestion: nothing before the stop",  # an empty answer: nothing is ever sent
        " Zürich — 北京 🙂 at the end",  # characters of several bytes, spelled over several tokens
    ],
)
def test_what_is_sent_is_the_trimmed_answer_token_by_token(tiny, answer):
    _, tok = tiny
    ids = tok.encode(answer, add_special_tokens=False)
    ends = {tok.eos_token_id, tok.pad_token_id}
    final = trim_answer(tok, ids, STOP, len(ids) + 1, list(ends))
    text, sent_ids, row = streamed(tok, ids, STOP, ends)
    assert final.text.startswith(text)
    rest, rest_ids = row.rest(final.text, final.token_ids)
    assert text + rest == final.text and sent_ids + rest_ids == final.token_ids
    if not final.token_ids:
        assert text == ""


def test_random_token_streams_always_send_a_prefix_and_end_as_the_trimmed_answer(tiny):
    """Hostile: 300 random token sequences (end tokens and stop strings among them): whatever comes,
    the text sent is a prefix of the answer and the last chunk completes it exactly."""
    _, tok = tiny
    rng = np.random.default_rng(0)
    ends = {tok.eos_token_id, tok.pad_token_id}
    stop = ["\n", "Question:", "a"]
    for _ in range(300):
        ids = rng.integers(0, len(tok), size=int(rng.integers(1, 20))).tolist()
        final = trim_answer(tok, ids, stop, 40, list(ends))
        text, sent_ids, row = streamed(tok, ids, stop, ends)
        rest, rest_ids = row.rest(final.text, final.token_ids)
        assert text + rest == final.text and sent_ids + rest_ids == final.token_ids, ids


@pytest.mark.parametrize("pool", ["max", "mean"])
def test_the_kept_running_score_is_the_network_on_the_answer_so_far(pool):
    torch.manual_seed(0)
    nets = [PoolingNet(16, 8, 0.2, pool).eval() for _ in range(3)]

    class Bundle:  # what RunningPool reads of a bundle
        seeds = [0, 1, 2]
        detectors = dict(enumerate(nets))

    running = RunningPool.of(Bundle)
    assert running is not None
    h = torch.randn(7, 16)
    pooled: dict = {}
    for k, chunk in ((1, h[:1]), (3, h[1:3]), (7, h[3:])):  # states arrive one or several at a time
        z = running.add(pooled, chunk)
        bag = Bags(h[:k], torch.tensor([k]))
        with torch.no_grad():
            expected = torch.stack([n(bag) for n in nets]).mean().item()
        assert z == pytest.approx(expected, abs=1e-5)
    # several rows at once, one or several states each: each row's score is its own network's
    g = torch.randn(9, 16)
    rows, bags = [{}, {}, {}], [g[:1], g[1:2], g[2:4]]
    running.add_rows(rows, torch.cat(bags), [1, 1, 2])
    more = [g[4:5], g[5:8], g[8:9]]
    zs = running.add_rows(rows, torch.cat(more), [1, 3, 1])
    for z, a, b in zip(zs, bags, more):
        whole = torch.cat([a, b])
        with torch.no_grad():
            expected = torch.stack([n(Bags(whole, torch.tensor([len(whole)]))) for n in nets]).mean().item()
        assert z == pytest.approx(expected, abs=1e-5)


def test_a_network_of_another_shape_is_not_kept_running():
    class Wider(PoolingNet):  # a plugin's subclass may pool otherwise
        pass

    class Bundle:
        seeds = [0]
        detectors = {0: Wider(16, 8, 0.0, "max")}

    assert RunningPool.of(Bundle) is None
