"""HaMI and HaMI (SP): the instance-based MIL detector of the HaMI code.

Token MLP Linear(d, dim)-BatchNorm-ReLU-Dropout-Linear(dim, 1), bag logit = mean of the top
k = floor(k_ratio * n) + 1 token logits. HaMI (SP) scales every token state of a response by
(1 + lam * P_sem) at train and test time (the paper's semantic-probability scaling).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from halludetect.core.sections import Decay, DropoutRate, LearningRate, PositiveInt, PSemVariant, Section
from halludetect.methods.spec import Method, register


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


class HaMISPParams(HaMIParams):
    """HaMI (SP): every token state scaled by (1 + lam * P_sem) of its response, at train and test."""

    lam: Annotated[float, Field(ge=0)] = 1.0  # the paper's lambda
    p_sem: PSemVariant = "mean"  # which clusters.parquet P_sem (length-normalised, summed, count)


register(
    Method(
        "hami", "HaMI", HaMIParams, analysable=True, build=lambda net, d, p: net.HaMI(d, p.dim, p.dropout, p.k_ratio)
    ),
    Method(
        "hami_sp",
        "HaMI (SP)",
        HaMISPParams,
        analysable=True,
        reads_p_sem=True,
        build=lambda net, d, p: net.HaMI(d, p.dim, p.dropout, p.k_ratio, lam=p.lam),
    ),
)
