"""Cross-dataset transfer (halludetect/evaluation/transfer.py) on the miniature DAG of
tests/contract_layout.py: the layer is chosen on A's validation figures and B's validation split is
never read; the diagonal reproduces the DAG's own test scores; the calibration and the thresholds
are the bundle's; and the bad pairs (one class left in B's test split, detectors of another width)
are errors naming the pair before any scoring."""

from __future__ import annotations

import json
import shutil

import numpy as np
import polars as pl
import pytest

from halludetect.core.errors import DataError
from halludetect.detectors.build import read_meta, save_detector
from halludetect.evaluation.transfer import kept_test_judgments, overlapping_questions, transfer_method
from halludetect.metrics import auroc, expected_calibration_error

PAIR = "mini -> other"


def per_layer_dir(root, tmp_path, val_aurocs: dict[int, float]):
    """A's per-layer figures as the train stage writes them, with the validation AUROCs given."""
    out = tmp_path / "layers"
    out.mkdir(exist_ok=True)
    for layer, v in val_aurocs.items():
        (out / f"layer_{layer}.json").write_text(json.dumps({"val": {"auroc": {"mean": v}}}))
    return out


def run(root, layers_dir, judgments, detectors=None, seeds=(0, 1)):
    return transfer_method(
        "max",
        pair=PAIR,
        train_layers=layers_dir,
        train_scores=root / "scores" / "max",
        train_detectors=detectors or root / "detectors" / "max",
        test_activations=root / "activations",
        test_judgments=judgments,
        test_clusters=None,
        layers=sorted(int(p.stem.split("_")[1]) for p in layers_dir.glob("layer_*.json")),
        seeds=list(seeds),
        bootstrap=20,
        seed=0,
        fpr_targets=[0.1],
        ece_bins=10,
    )


def layers_of(root) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (root / "detectors" / "max").glob("layer_*"))


def test_the_layer_is_chosen_on_a_validation_and_b_validation_is_never_read(contract, tmp_path):
    layers = layers_of(contract)
    judgments = pl.read_parquet(contract / "judgments.parquet")
    for chosen in (layers[0], layers[-1]):
        figures = per_layer_dir(contract, tmp_path, {layer: 0.9 if layer == chosen else 0.6 for layer in layers})
        full = run(contract, figures, judgments)
        assert full["layer"] == chosen  # A's figures decide, whatever B's test would say
        # B without its validation split, or with its validation labels inverted: the same cell.
        no_val = run(contract, figures, judgments.filter(pl.col("split") != "val"))
        flipped = run(
            contract,
            figures,
            judgments.with_columns(
                label=pl.when(pl.col("split") == "val").then(1 - pl.col("label")).otherwise(pl.col("label"))
            ),
        )
        assert no_val == full and flipped == full


def test_the_diagonal_is_the_dags_own_test_scores_and_the_bundles_calibration(contract, tmp_path, bundle_path):
    from halludetect.scoring.bundle import load_bundle

    meta = load_bundle(bundle_path).meta
    best = meta["layer"]
    figures = per_layer_dir(contract, tmp_path, {layer: 0.9 if layer == best else 0.6 for layer in layers_of(contract)})
    cell = run(contract, figures, pl.read_parquet(contract / "judgments.parquet"))
    scores = pl.read_parquet(contract / "scores" / "max" / f"layer_{best}.parquet").filter(pl.col("split") == "test")
    per_seed = [
        auroc(s["label"].to_numpy(), s["score"].to_numpy())
        for s in (scores.filter(pl.col("seed") == seed).sort("response_id") for seed in (0, 1))
    ]
    assert cell["test"]["auroc"]["per_seed"] == pytest.approx(per_seed, abs=1e-9)
    # The bundle's Platt scaling and thresholds (fitted on A's validation at the same layer).
    assert (cell["calibration"]["a"], cell["calibration"]["b"]) == pytest.approx(
        (meta["calibration"]["a"], meta["calibration"]["b"])
    )
    for name in ("best_f1", "fpr_0.1"):
        t = cell["thresholds"][name]
        assert t["threshold"] == pytest.approx(meta["thresholds"][name]["threshold"])
        assert t["train_val_fpr"] == pytest.approx(meta["thresholds"][name]["val_fpr"])
        assert 0 <= t["fpr"] <= 1 and 0 <= t["tpr"] <= 1
    assert cell["calibration"]["ece"] == pytest.approx(
        expected_calibration_error(scores.filter(pl.col("seed") == 0)["label"].to_numpy(), _probs(cell, scores), 10)
    )


def _probs(cell, scores):
    z = np.mean(
        [scores.filter(pl.col("seed") == s).sort("response_id")["score"].to_numpy() for s in (0, 1)],
        axis=0,
    )
    return 1 / (1 + np.exp(-(cell["calibration"]["a"] * z + cell["calibration"]["b"])))


def test_expected_calibration_error_weighs_each_bin_by_its_answers():
    y = np.array([1, 0, 1, 1])
    p = np.array([0.05, 0.05, 0.95, 1.0])  # bin 0: rate 0.5 vs 0.05; bin 9: rate 1 vs 0.975
    assert expected_calibration_error(y, p, 10) == pytest.approx(0.5 * 0.45 + 0.5 * 0.025)


def test_b_test_questions_that_a_trained_or_validated_on_are_left_out():
    a = pl.DataFrame({"id": ["a1", "a2", "a3"], "question": ["Q1", "Q2", "Q3"], "split": ["train", "val", "test"]})
    b = pl.DataFrame({"id": ["b1", "b2", "b3", "b4"], "question": ["Q1", "Q2", "Q3", "Q4"], "split": ["test"] * 4})
    assert overlapping_questions(a, b) == ["b1", "b2"]  # A's test question Q3 stays: A never fitted on it


@pytest.mark.hostile
def test_transfer_test_split_with_one_class_names_the_pair():
    judgments = pl.DataFrame(
        {
            "question_id": ["q1", "q1", "q2", "q3"],
            "split": ["test", "test", "test", "val"],
            "kept": [True, True, True, True],
            "label": [0, 0, 1, 1],
        }
    )
    assert kept_test_judgments(judgments, [], PAIR, "other").height == 4
    with pytest.raises(DataError, match=r"transfer mini -> other: split 'other test' has one class only"):
        kept_test_judgments(judgments, ["q2"], PAIR, "other")  # q2 left out: no hallucination remains


@pytest.mark.hostile
def test_transfer_between_models_of_other_widths_names_the_pair(contract, tmp_path):
    """A's detectors read another width than B's states (another model): refused before scoring."""
    layers = layers_of(contract)
    figures = per_layer_dir(contract, tmp_path, {layer: 0.9 if layer == layers[0] else 0.6 for layer in layers})
    other = tmp_path / "other"
    shutil.copytree(contract / "detectors" / "max", other)
    for f in other.rglob("seed_*.safetensors"):
        from safetensors.torch import load_file

        save_detector(f, load_file(f), read_meta(f) | {"d": 4096})
    with pytest.raises(DataError, match=r"transfer mini -> other \(max\): A's detectors read states of width 4096"):
        run(contract, figures, pl.read_parquet(contract / "judgments.parquet"), detectors=other)
