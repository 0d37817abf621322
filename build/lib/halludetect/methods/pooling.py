"""Embedding-based MIL with mean or max pooling, on extracted features or on the raw states.

mean, max: u_i = Dropout(ReLU(W h_i)), bag logit = w^T pool_i(u_i) + b (the paper's max-pooling
network and its mean twin). raw_mean, raw_max: pooling on the raw d-dimensional states, the
MLP Linear(d, dim)-ReLU-Dropout-Linear(dim, 1) after it (the paper's "Raw (d)" rows).
"""

from __future__ import annotations

from halludetect.core.sections import Decay, DropoutRate, LearningRate, PositiveInt, Section
from halludetect.methods.spec import Method, register


class PoolingParams(Section):
    """Embedding-based MIL: Linear(d, dim)-ReLU-Dropout per token, mean/max pooling, Linear(dim, 1)."""

    dim: PositiveInt = 256
    dropout: DropoutRate = 0.2
    lr: LearningRate = 2e-4
    weight_decay: Decay = 5e-3


register(
    Method("mean", "Mean pooling", PoolingParams, build=lambda net, d, p: net.PoolingNet(d, p.dim, p.dropout, "mean")),
    Method("max", "Max pooling", PoolingParams, build=lambda net, d, p: net.PoolingNet(d, p.dim, p.dropout, "max")),
    Method(
        "raw_mean",
        "Raw (d) mean",
        PoolingParams,
        build=lambda net, d, p: net.RawPoolingNet(d, p.dim, p.dropout, "mean"),
    ),
    Method(
        "raw_max", "Raw (d) max", PoolingParams, build=lambda net, d, p: net.RawPoolingNet(d, p.dim, p.dropout, "max")
    ),
)
