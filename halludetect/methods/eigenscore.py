"""EigenScore (Chen, Liu, Chen, Gu, Wu, Tao, Fu and Ye, "INSIDE: LLMs' Internal States Retain the
Power of Hallucination Detection", ICLR 2024): unsupervised, from the K answers to a question.

Each answer's sentence embedding z_k is one hidden state of the layer; with Z = [z_1 .. z_K]
(K x d), Sigma = cov(Z) is the K x K covariance of the answers, each embedding centred over its
d features (the paper's Z^T J_d Z; torch.cov over features, divided by d - 1, as the INSIDE code
`getEigenIndicator_v0`), and

    EigenScore = (1 / K) sum_k log10(lambda_k(Sigma + alpha I_K)),  alpha = 1e-3,

the mean log-eigenvalue of the regularised covariance: diverse answers (hallucination) give a
larger volume. The INSIDE code takes log10 (the paper writes log det; the bases differ by a
constant factor, which changes no AUROC, PRR or FPR). Every answer of a question gets its
question's score; it is no logit (no margin).

Which token: the last position of the bag, as SAPLMA. Under dump.positions `generated` that is
the state at the answer's last token, the state the INSIDE code reads (hidden_states[num_tokens
- 2] of generate, with num_tokens counting the stop token it keeps); under `predicting` it is the
state that predicts the last token, one position earlier.

Where it departs: the layer is chosen on validation AUROC among grid.layers (the shared
protocol) instead of the paper's fixed middle layer (its figure is in the metrics' `layers`);
the K answers are the question's evaluated answers of the split (non-empty, kept by the judge),
not every sample; the paper's test-time feature clipping is not applied. A question with fewer
than two such answers has no covariance: its answers are left out, counted (`one_answer`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from halludetect.core.sections import Section
from halludetect.methods.spec import UNSUPERVISED, Method, Reads, register


class EigenScoreParams(Section):
    """(1/K) sum log10 eig(cov(Z) + alpha I) over a question's K answer embeddings (the last bag token)."""

    alpha: Annotated[float, Field(gt=0)] = 1e-3  # the paper's regulariser


register(
    Method(
        "eigenscore",
        "EigenScore",
        EigenScoreParams,
        family="field",
        fit=UNSUPERVISED,
        reads=Reads(question=True),
        logits=False,
        build=lambda net, d, p: net.EigenScore(p.alpha, index=-1),
    )
)
