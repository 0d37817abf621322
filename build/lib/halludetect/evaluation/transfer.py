"""Does a detector travel? One method's detectors trained on dataset A, evaluated on dataset B.

Everything about the detector is decided on A, exactly as `evaluate` and `export` decide it for
A itself: the layer (the highest mean validation AUROC over seeds, from A's per-layer figures),
the seeds (all of `train.seeds`: no seed is ever picked), the Platt calibration and the flag
thresholds (fitted on A's validation logits, as the bundle's are). B contributes its test
split only: its layer file at A's layer, its labels and, for a method that reads it, its P_sem.
B's validation split is never read. So a cell says what a user of A's bundle lives with on B.

The diagonal (B = A) runs the same code on A's own test split: the in-distribution cell, whose
AUROC equals `evaluate`'s (the same detectors, layer, responses and bootstrap).

Test questions of B whose text is among A's train or validation questions are left out (and
counted): a detector that saw a question's answers in training is no test of transfer. The
world's two datasets share the questions about the best-known people, so this matters there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.config import threshold_name
from halludetect.core.artifacts import read_parquet
from halludetect.core.errors import DataError
from halludetect.detectors.build import read_meta, trained_params
from halludetect.detectors.data import p_sem_for, split_data
from halludetect.detectors.inference import score
from halludetect.evaluation.evaluate import best_layer, load_models
from halludetect.evaluation.thresholds import (
    ensemble_scores,
    fit_platt,
    rates_at_threshold,
    threshold_at_fpr,
    threshold_best_f1,
)
from halludetect.methods import CLUSTER_METHODS
from halludetect.methods import method as lookup_method
from halludetect.metrics import auroc, check_two_classes, expected_calibration_error, question_groups, split_metrics


def pair_name(train: str, test: str) -> str:
    return f"{train} -> {test}"


def overlapping_questions(train_questions: pl.DataFrame, test_questions: pl.DataFrame) -> list[str]:
    """Ids of B's test questions whose text is one of A's train or validation questions."""
    seen = set(train_questions.filter(pl.col("split").is_in(["train", "val"]))["question"].to_list())
    test = test_questions.filter(pl.col("split") == "test")
    return sorted(test.filter(pl.col("question").is_in(seen))["id"].to_list())


def kept_test_judgments(judgments: pl.DataFrame, leave_out: list[str], pair: str, test: str) -> pl.DataFrame:
    """B's kept test judgments without the left-out questions; an error naming the pair when one
    class is left (checked before any detector or state is read)."""
    part = judgments.filter((pl.col("split") == "test") & pl.col("kept") & ~pl.col("question_id").is_in(leave_out))
    try:
        check_two_classes(part["label"].to_numpy(), f"{test} test")
    except DataError as e:
        raise DataError(f"transfer {pair}: {e}") from None
    return judgments.filter(~pl.col("question_id").is_in(leave_out))


def read_per_layer(layers_dir: Path, layers: list[int], pair: str, method: str) -> dict[int, dict]:
    missing = [str(p) for layer in layers if not (p := Path(layers_dir) / f"layer_{layer}.json").exists()]
    if missing:
        raise DataError(
            f"transfer {pair} ({method}): A's per-layer figures missing: {', '.join(missing)}; re-run train"
        )
    return {layer: json.loads((Path(layers_dir) / f"layer_{layer}.json").read_text()) for layer in layers}


def transfer_method(
    method: str,
    *,
    pair: str,
    train_layers: Path,
    train_scores: Path,
    train_detectors: Path,
    test_activations: Path,
    test_judgments: pl.DataFrame,
    test_clusters: Path | None,
    layers: list[int],
    seeds: list[int],
    bootstrap: int,
    seed: int,
    fpr_targets: list[float],
    ece_bins: int,
) -> dict:
    """One method's cell: A's detectors (layer and seeds chosen on A's validation) on B's test
    split. `train_*`: A's per-layer figures, scores and detectors of this method; `test_*`: B's
    layer files, judgments (already without the left-out questions) and clusters."""
    spec = lookup_method(method)
    layer = best_layer(read_per_layer(train_layers, layers, pair, method))  # A's validation only
    detectors = Path(train_detectors) / f"layer_{layer}"
    states = Path(test_activations) / layer_filename(layer)
    meta = read_meta(detectors / f"seed_{seeds[0]}.safetensors")
    data = read_layer(states, dtype=None, expect_layer=layer)
    if int(meta["d"]) != data.states.shape[1]:
        raise DataError(
            f"transfer {pair} ({method}): A's detectors read states of width {meta['d']}, B's layer file {states} "
            f"holds width {data.states.shape[1]}: a detector transfers between datasets of one model only"
        )
    method_params = trained_params(detectors, method)  # as A trained it (e.g. hami_sp's P_sem variant)
    p_sem = p_sem_for(method, test_clusters if method in CLUSTER_METHODS else None, method_params)
    test = split_data(data, test_judgments, "test", str(states), p_sem, method=method)
    del data
    models = load_models(detectors, method, layer, seeds, int(test.tokens.shape[-1]))
    per_seed = [score(m, test) for m in models]
    y = test.y.numpy().astype(np.int64)
    figures = split_metrics(
        y,
        per_seed,
        bootstrap=bootstrap,
        seed=seed,
        logits=spec.logits,
        groups=question_groups([r.rsplit("/", 1)[0] for r in test.response_ids]),
        lengths=test.lengths.numpy(),
    )
    # The bundle's view: the seeds' mean logit, calibrated and thresholded as fitted on A's validation.
    scores_path = Path(train_scores) / f"layer_{layer}.parquet"
    y_val, z_val = ensemble_scores(read_parquet(scores_path, "train", "scores table"), "val", seeds, str(scores_path))
    z = np.mean(per_seed, axis=0)
    platt = fit_platt(y_val, z_val)
    prob = lambda v: 1 / (1 + np.exp(-(platt["a"] * v + platt["b"])))  # noqa: E731
    thresholds = {}
    # the bundle's rules, as export fits them on A's validation logits
    rules = {threshold_name(t): threshold_at_fpr(y_val, z_val, t) for t in fpr_targets}
    rules["best_f1"] = threshold_best_f1(y_val, z_val)
    for name, fitted in rules.items():
        here = rates_at_threshold(y, z, fitted["threshold"])  # on B's test
        thresholds[name] = {
            "threshold": fitted["threshold"],
            "train_val_fpr": fitted["fpr"],
            "train_val_tpr": fitted["tpr"],
            "fpr": here["fpr"],
            "tpr": here["tpr"],
            "precision": here["precision"],
            "f1": here["f1"],
        }
    return {
        "method": method,
        "layer": layer,
        "layer_selection": "highest mean validation AUROC over seeds, on the training dataset",
        "seeds": seeds,
        "test": figures,
        "excluded": test.excluded,
        "ensemble_auroc": float(auroc(y, z)),
        "calibration": {
            "method": "platt",
            "a": platt["a"],
            "b": platt["b"],
            "fitted_on": "the training dataset's validation split (the bundle's)",
            "ece_train_val": expected_calibration_error(y_val, prob(z_val), ece_bins),
            "ece": expected_calibration_error(y, prob(z), ece_bins),
            "brier": float(np.mean((prob(z) - y) ** 2)),
            "mean_probability": float(np.mean(prob(z))),
            "hallucination_rate": float(np.mean(y)),
            "bins": ece_bins,
        },
        "thresholds": thresholds,
    }
