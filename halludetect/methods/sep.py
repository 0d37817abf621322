"""Semantic-entropy probes (Kossen, Han, Razzak, Schut, Malik and Gal, "Semantic Entropy Probes:
Robust and Cheap Hallucination Detection in LLMs", 2024): a logistic regression on one hidden
state, trained to predict the *binarised semantic entropy* of the question, not the judge's label.
Both of the paper's token positions are registered:

  sep_tbg  the token before generation (TBG): the state at the last prompt position, bag[0] of a
           `predicting` bag; a `generated` bag does not hold it (the method needs
           dump.positions: predicting, which the params check says before any stage runs);
  sep_slt  the "second-last token" (SLT), bag[-2]. Under `predicting` that is the state their code
           stores as `emb_tok_before_eos` (generate's hidden_states[n_generated - 2]: the state that
           predicts the answer's second-to-last token); under `generated` it is the state at the
           answer's second-to-last token, one position later. One-token answers have no such state:
           they are left out, counted (`too_short`).

Training, as the SEP code: semantic entropy of the question's K answers (the clustering's
`semantic_entropy_discrete` by default, their `cluster_assignment_entropy`), binarised at the
threshold that minimises the summed squared error of the two sides around their means among 100
thresholds from 1e-10 to the largest entropy (their `best_split`); then scikit-learn's
LogisticRegression with its defaults (L2, C = 1, lbfgs, 100 iterations) on the raw states. A
one-class binarisation stops the stage with the counts.

Where it departs: the threshold is chosen on the train split's answers only (their notebook pools
every dataset, test included); the probe is fitted per layer and the layer is chosen on
validation AUROC against the judge's labels (the shared protocol) rather than fitted on a
concatenated layer range; train answers are sample 0 of each question (only sample 0 is dumped
for train), with the entropy of all K samples of its question. The logit is the regression's
decision function, so z > 0 means "high semantic entropy" (a hallucination).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from halludetect.core.sections import PositiveInt, Section
from halludetect.methods.spec import SE_PROBE, Method, Reads, register


class SEPParams(Section):
    """Logistic regression (scikit-learn defaults) on one state, fitted to the binarised semantic entropy."""

    entropy: Literal["discrete", "mean", "sum"] = "discrete"  # clusters.parquet's; discrete: the SEP code's
    C: Annotated[float, Field(gt=0)] = 1.0  # inverse L2 strength (scikit-learn's default, the SEP code's)
    max_iter: PositiveInt = 100  # lbfgs iterations (scikit-learn's default); non-convergence is recorded
    thresholds: PositiveInt = 100  # candidate binarisation thresholds (their best_split)


register(
    Method(
        "sep_tbg",
        "SEP (TBG)",
        SEPParams,
        family="field",
        fit=SE_PROBE,
        reads=Reads(positions=("predicting",)),
        build=lambda net, d, p: net.TokenLinear(d, index=0),
    ),
    Method(
        "sep_slt",
        "SEP (SLT)",
        SEPParams,
        family="field",
        fit=SE_PROBE,
        reads=Reads(min_tokens=2),
        build=lambda net, d, p: net.TokenLinear(d, index=-2),
    ),
)
