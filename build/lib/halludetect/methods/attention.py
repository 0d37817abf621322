"""Attention-based deep MIL (Ilse et al. 2018) on the raw states, plain and gated.

a_i = softmax_i(w^T tanh(V h_i)), gated: softmax_i(w^T (tanh(V h_i) * sigmoid(U h_i))),
bag logit = MLP(sum_i a_i h_i) with the MLP of the raw pooling rows.
"""

from __future__ import annotations

from halludetect.core.sections import PositiveInt
from halludetect.methods.pooling import PoolingParams
from halludetect.methods.spec import Method, register


class AttentionParams(PoolingParams):
    """ABMIL (Ilse et al.) on raw states: softmax(w^T tanh(V h)) [* sigmoid(U h) gated], then the MLP head."""

    attention_dim: PositiveInt = 256  # the paper's L


register(
    Method(
        "attention",
        "Attention pooling",
        AttentionParams,
        build=lambda net, d, p: net.AttentionNet(d, p.dim, p.dropout, p.attention_dim, gated=False),
    ),
    Method(
        "gated_attention",
        "Gated attention pooling",
        AttentionParams,
        build=lambda net, d, p: net.AttentionNet(d, p.dim, p.dropout, p.attention_dim, gated=True),
    ),
)
