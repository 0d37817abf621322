"""Semantic entropy in its two conventions on the built world, scored and evaluated as the evaluate
stage does (question bootstrap, the test split), beside the answer's log-prob (the strongest baseline
there).

- `mean`, `sum`, `discrete` (ours, `detectors.semantic_entropy.variant`; `mean` by default): the
  entropy of the clusters' probabilities, normalised over the question's K answers (each answer's
  likelihood exp(mean) or exp(sum) of its token log-probs, or the cluster's count / K);
- `polygraph`: lm-polygraph's SemanticEntropy as it ships: -mean over the K answers of log sum exp of
  the summed token log-probs over the answers of its cluster, the likelihoods not normalised. With one
  cluster it is about minus the likeliest answer's log-likelihood: a likelihood score more than an
  entropy, which is why it lands beside the log-prob.

    python -m bench.semantic_entropy            # from a built world (make repro)
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from bench.common import emit, need


def main() -> None:
    from halludetect.config import load_params
    from halludetect.evaluation.baselines import baseline_scores, evaluate_baseline
    from halludetect.labels.readers import read_judgments
    from halludetect.methods import SCORES

    params = load_params("params.yaml")
    ep = params.evaluate
    for model in params.grid.models:
        for dataset in params.grid.datasets:
            gens_path = Path(f"data/generations/{model}/{dataset}.parquet")
            labels = Path(f"data/labels/{model}/{dataset}")
            need(gens_path, labels / "clusters.parquet", labels / "judgments.parquet")
            gens, clusters = pl.read_parquet(gens_path), pl.read_parquet(labels / "clusters.parquet")
            judgments = read_judgments(labels / "judgments.parquet")
            runs = [("semantic_entropy", v) for v in ("mean", "sum", "discrete", "polygraph")] + [("logprob", None)]
            for name, variant in runs:
                p = SCORES[name].params(**({"variant": variant} if variant else {}))
                test = evaluate_baseline(baseline_scores(name, gens, clusters, p), judgments, bootstrap=ep.bootstrap,
                                         seed=ep.seed)["test"]  # fmt: skip
                emit(
                    {
                        "bench": "semantic_entropy",
                        "model": model,
                        "dataset": dataset,
                        "score": name if variant is None else f"{name}:{variant}",
                        "test_auroc": round(test["auroc"]["mean"], 3),
                        "auroc_ci95": [round(x, 3) for x in test["auroc_ci95"]],
                        "prr": round(test["prr"]["mean"], 3),
                        "fpr_at_95_tpr": round(test["fpr_at_95_tpr"]["mean"], 3),
                    }
                )


if __name__ == "__main__":
    main()
