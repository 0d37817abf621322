"""HaMI and HaMI (SP): the instance-based MIL detector of the HaMI code.

Token MLP Linear(d, dim)-BatchNorm-ReLU-Dropout-Linear(dim, 1), bag logit = mean of the top
k = floor(k_ratio * n) + 1 token logits (the paper's Z_B). HaMI (SP) scales every token state of a
response by (1 + lam * P_sem) at train and test time (the paper's semantic-probability scaling).
`bag_score: sigmoid` scores a bag as the HaMI code does, by the top-k mean of the tokens' sigmoid
scores (the bag logit is then that probability's logit: the same ranking, a logit-space margin).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from halludetect.core.sections import Decay, DropoutRate, LearningRate, PositiveInt, PSemVariant, Section
from halludetect.methods.spec import Method, Reads, register


class HaMIParams(Section):
    """HaMI (the HaMI code): token MLP Linear-BN-ReLU-Dropout-Linear, bag = top-k mean of token logits."""

    dim: PositiveInt = 256
    dropout: DropoutRate = 0.3
    lr: LearningRate = 1e-3
    weight_decay: Decay = 5e-4
    k_ratio: Annotated[float, Field(gt=0, lt=1)] = 0.1  # k = floor(k_ratio * n) + 1 tokens per bag
    loss: Literal["mil", "logistic"] = "mil"  # mil: the HaMI code's paired loss; logistic: log(1 + exp(-y Z))
    smoothness: Decay = 8e-4  # weight of sum (s_t - s_t+1)^2 over bags longer than smooth_min_len (mil loss)
    smooth_min_len: Annotated[int, Field(ge=0)] = 8
    # logits: the paper's Z_B, the top-k mean of token logits. sigmoid: the HaMI code's score, the
    # top-k mean of sigmoid token scores (as a logit, logit(mean sigmoid)).
    bag_score: Literal["logits", "sigmoid"] = "logits"


class HaMISPParams(HaMIParams):
    """HaMI (SP): every token state scaled by (1 + lam * P_sem) of its response, at train and test."""

    lam: Annotated[float, Field(ge=0)] = 1.0  # the paper's lambda
    p_sem: PSemVariant = "sum"  # which clusters.parquet P_sem: sum (the paper's formula), mean, count


register(
    Method(
        "hami",
        "HaMI",
        HaMIParams,
        analysable=True,
        build=lambda net, d, p: net.HaMI(d, p.dim, p.dropout, p.k_ratio, bag_score=p.bag_score),
    ),
    Method(
        "hami_sp",
        "HaMI (SP)",
        HaMISPParams,
        analysable=True,
        reads=Reads(p_sem=True),
        build=lambda net, d, p: net.HaMI(d, p.dim, p.dropout, p.k_ratio, lam=p.lam, bag_score=p.bag_score),
    ),
)
