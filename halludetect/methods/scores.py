"""Scores with nothing to train and no hidden states: one number per response, higher = more
likely hallucinated, each sign fixed by definition and never fitted on the test labels. Declared
here with the detectors of hidden states; computed by halludetect/evaluation/baselines.py (from the
sampled answers and their clustering) and evaluation/p_true.py (the model again).

  p_sem               1 - P_sem (the response's semantic cluster probability)
  semantic_entropy    the question's semantic entropy (Farquhar et al., Nature 2024)
  logprob             minus the mean token log-probability of the response
  length              the number of answer tokens
  lexical_similarity  1 - the mean pairwise ROUGE-L F-measure among the question's K answers
                      (Lin, Trivedi and Sun, "Generating with Confidence", 2023; lm-polygraph's
                      LexicalSimilarity)
  semantic_sets       the number of semantic clusters among the question's K answers (Lin et al.
                      2023's NumSemSets, with our entailment clustering)
  p_true              -log p(True) of the model asked whether its answer is true, shown the
                      question's other answers (Kadavath et al. 2022): one more forward pass

They are detectors like the trained ones: named in grid.detectors, each with its section
detectors.<name>, and run by the same train and evaluate stages, which hand them over to
stages/train_score.py (it computes them) and stages/evaluate_score.py (it evaluates them and
writes a bundle `halludetect score` reads). The last-token linear probe is
trained on hidden states, so it is a method (`probe`), not a score.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from halludetect.core.sections import Device, PositiveInt, PSemVariant, Section
from halludetect.methods.spec import Score, register_scores


class NoParams(Section):
    """A score with no setting: its section is empty (`{}`)."""


class PSemParams(Section):
    variant: PSemVariant = "sum"  # 1 - which P_sem of clusters.parquet (sum: the paper's formula)


class SemanticEntropyParams(Section):
    # Two conventions. mean | sum | discrete: the entropy of the clusters' probabilities *normalised
    # over the K answers* (clusters.parquet; the answer likelihood exp(mean) or exp(sum) of its token
    # log-probs, or the cluster's count / K). polygraph: lm-polygraph's SemanticEntropy as it ships
    # (estimators/semantic_entropy.py): -mean over the K answers of log sum of exp(sum of token
    # log-probs) over the answers of its cluster, the likelihoods *not* normalised.
    variant: Literal["mean", "sum", "discrete", "polygraph"] = "mean"


class PTrueParams(Section):
    """p(True) (Kadavath et al. 2022, the semantic-entropy code's prompt): one more forward pass per answer."""

    few_shot: Annotated[int, Field(ge=0)] = 0  # labelled train questions shown first (the SE code: 20)
    batch_size: PositiveInt = 32  # answers per forward pass
    device: Device = "auto"


register_scores(
    Score("p_sem", "P_sem", ("sampling + NLI",), "halludetect.evaluation.baselines:p_sem", PSemParams, family="paper"),
    Score(
        "semantic_entropy",
        "Semantic entropy",
        ("sampling + NLI",),
        "halludetect.evaluation.baselines:semantic_entropy",
        SemanticEntropyParams,
    ),
    Score("logprob", "Mean token log-prob", ("token log-probs",), "halludetect.evaluation.baselines:logprob", NoParams),
    Score("length", "Answer length", (), "halludetect.evaluation.baselines:length", NoParams),
    Score(
        "lexical_similarity",
        "Lexical similarity (ROUGE-L)",
        ("sampling",),
        "halludetect.evaluation.baselines:lexical_similarity",
        NoParams,
    ),
    Score(
        "semantic_sets",
        "Number of semantic sets",
        ("sampling + NLI",),
        "halludetect.evaluation.baselines:semantic_sets",
        NoParams,
    ),
    Score(
        "p_true",
        "p(True)",
        ("sampling", "a forward pass"),
        "halludetect.evaluation.p_true:p_true",
        PTrueParams,
        source="model",
    ),
)
