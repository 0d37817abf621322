"""SAPLMA (Azaria and Mitchell, "The Internal State of an LLM Knows When It's Lying", Findings of
EMNLP 2023): a feed-forward classifier on the hidden state of one token of a statement, with three
ReLU hidden layers of 256, 128 and 64 units and a sigmoid output (here: its logit).

Which token: the last position of the bag (`bags.tokens[bags.last]`).
  dump.positions: generated   the state at the answer's last token, having read the whole
                              question and answer: the paper's token (the statement's last one);
  dump.positions: predicting  the state that predicts the answer's last token (at the
                              second-to-last answer token; the last prompt position for a
                              one-token answer): the last-token state is not in such a bag.

Where it departs from the paper: the "statement" is the prompt (question) and the model's own
answer rather than a stand-alone true or false sentence; it is trained under the shared protocol
(Adam with this section's lr and weight decay, train.epochs, batch train.batch_size, the best epoch
and the best layer on validation AUROC) instead of the paper's own short schedule and its layer
choice; `dropout` (0: none, as the paper) is offered for the small training sets of a demo.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from halludetect.core.sections import Decay, DropoutRate, LearningRate, PositiveInt, Section
from halludetect.methods.spec import Method, register


class SAPLMAParams(Section):
    """MLP on the last bag token: Linear(d, 256)-ReLU-Linear(256, 128)-ReLU-Linear(128, 64)-ReLU-Linear(64, 1)."""

    hidden: Annotated[list[PositiveInt], Field(min_length=1)] = [256, 128, 64]  # the paper's widths
    dropout: DropoutRate = 0.0  # after each hidden layer; the paper uses none
    lr: LearningRate = 1e-3  # Adam's default, as the paper's Keras optimiser
    weight_decay: Decay = 0.0


register(
    Method(
        "saplma",
        "SAPLMA",
        SAPLMAParams,
        family="field",
        build=lambda net, d, p: net.TokenMLP(d, p.hidden, p.dropout, index=-1),
    )
)
