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

The last-token linear probe is trained on hidden states, so it is a method (`probe`), not a score.
"""

from __future__ import annotations

from halludetect.methods.spec import Score, register_scores

_B = "halludetect.evaluation.baselines"

register_scores(
    Score("p_sem", "P_sem", ("sampling + NLI",), f"{_B}:p_sem", family="paper"),
    Score("semantic_entropy", "Semantic entropy", ("sampling + NLI",), f"{_B}:semantic_entropy"),
    Score("logprob", "Mean token log-prob", ("token log-probs",), f"{_B}:logprob"),
    Score("length", "Answer length", (), f"{_B}:length"),
    Score("lexical_similarity", "Lexical similarity (ROUGE-L)", ("sampling",), f"{_B}:lexical_similarity"),
    Score("semantic_sets", "Number of semantic sets", ("sampling + NLI",), f"{_B}:semantic_sets"),
    Score(
        "p_true",
        "p(True)",
        ("sampling", "a forward pass"),
        "halludetect.evaluation.p_true:p_true_scores",
        source="model",
    ),
)
