"""Evaluating trained detectors (halludetect/evaluation/evaluate.py) from a cell trained as the per-layer
train stages train it: the best layer chosen on validation, complete metrics, a seed's scores equal
to its saved detector's logits, missing seeds and mismatched layers named, HaMI (SP)'s cost, and
throughput timed on the device named."""

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from support import D, write_layers

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.detectors.data import SPLITS, DataError, split_data
from halludetect.detectors.inference import score
from halludetect.detectors.training import train_layer
from halludetect.evaluation.evaluate import detector_throughput, evaluate_detector, hami_sp_cost, load_models
from halludetect.methods.pooling import PoolingParams


@pytest.fixture(scope="module")
def trained_cell(tmp_path_factory):
    """Two layers x two seeds of `max`, trained and scored as the per-layer train stage does."""
    root = tmp_path_factory.mktemp("cell")
    acts = root / "acts"
    acts.mkdir()
    labels = write_layers(acts)
    params = PoolingParams(dim=16, dropout=0.0, lr=1e-2, weight_decay=0.0)
    for index in (0, 1):
        layer = read_layer(acts / layer_filename(index), dtype=None, expect_layer=index)
        data = {s: split_data(layer, labels, s) for s in SPLITS}
        train_layer(
            "max",
            params,
            data,
            [0, 1],
            layer=index,
            epochs=10,
            batch_size=32,
            device="cpu",
            out_dir=root / "dets" / f"layer_{index}",
            scores_path=root / "scores" / f"layer_{index}.parquet",
            metrics_path=root / "layers" / f"layer_{index}.json",
            timing_path=root / "timing" / f"layer_{index}.json",
            log=lambda *_: None,
        )
    return root, labels


def per_layer(root: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in sorted((root / "layers").glob("*.json"))}


def test_best_layer_is_chosen_on_validation_and_metrics_are_complete(trained_cell):
    root, labels = trained_cell
    m = evaluate_detector(per_layer(root), root / "scores", [0, 1], bootstrap=100, seed=0)
    assert [r["layer"] for r in m["layers"]] == [0, 1]
    assert m["best_layer"] == max(m["layers"], key=lambda r: r["val_auroc"])["layer"] == 1
    assert m["layers"][0]["test_auroc"] < 0.7 < m["layers"][1]["test_auroc"]
    test = m["test"]
    assert test["n"] == 60 and test["n_hallucinated"] == 30
    assert len(test["auroc"]["per_seed"]) == 2 and test["auroc"]["stderr"] is not None
    lo, hi = test["auroc_ci95"]
    assert lo <= test["auroc"]["mean"] <= hi
    assert test["auroc"]["mean"] == pytest.approx(m["layers"][1]["test_auroc"])
    assert m["excluded"] == {"train": {"empty_bag": 0}, "val": {"empty_bag": 0}, "test": {"empty_bag": 0}}
    # The scores of a seed are its saved detector's logits.
    layer = read_layer(root / "acts" / layer_filename(1), dtype=None)
    test_split = split_data(layer, labels, "test")
    models = load_models(root / "dets" / "layer_1", "max", 1, [0, 1], D)
    saved = pl.read_parquet(root / "scores" / "layer_1.parquet").filter(
        (pl.col("split") == "test") & (pl.col("seed") == 1)
    )
    assert saved["response_id"].to_list() == test_split.response_ids
    np.testing.assert_array_equal(saved["score"].to_numpy(), score(models[1], test_split))
    speed = detector_throughput(models, test_split, root / "acts" / layer_filename(1), repeats=2)
    assert speed["preloaded_samples_per_s"] > 0 and speed["end_to_end_samples_per_s"] > 0


def test_the_last_epoch_the_margins_by_epoch_and_the_training_time_of_the_best_layer(trained_cell):
    """The paper reads its margins after the last epoch: the best layer's last-epoch figures are
    those of the last epoch's weights (curves.json's last row), beside the margins by epoch."""
    root, labels = trained_cell
    layers = per_layer(root)
    timing = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in (root / "timing").glob("*.json")}
    assert all("training_time" not in m and "seconds" not in json.dumps(m) for m in layers.values())  # kept apart
    assert "training_time" not in evaluate_detector(layers, root / "scores", [0, 1], bootstrap=0, seed=0)
    m = evaluate_detector(layers, root / "scores", [0, 1], bootstrap=0, seed=0, timing=timing)
    assert m["train"] == {"recipe": "paper", "epochs": 10, "batch_size": 32}
    last = m["last_epoch"]
    assert last["epoch"] == 10 and len(last["test"]["margin"]["per_seed"]) == 2
    curves = json.loads((root / "dets" / "layer_1" / "curves.json").read_text())
    for key in ("train", "val"):
        assert len(m["margin_by_epoch"][key]) == 10
        per_epoch = np.mean([[row[f"{key}_margin"] for row in curves[f"seed_{s}"]] for s in (0, 1)], axis=0)
        np.testing.assert_allclose(m["margin_by_epoch"][key], per_epoch)
    assert last["val"]["margin"]["mean"] == pytest.approx(m["margin_by_epoch"]["val"][-1])
    best = {
        s: curves[f"seed_{s}"][json.loads((root / "layers" / "layer_1.json").read_text())["best_epoch"][str(s)] - 1]
        for s in (0, 1)
    }
    assert m["val"]["margin"]["mean"] == pytest.approx(np.mean([b["val_margin"] for b in best.values()]))
    t = m["training_time"]
    assert t["layer"] == 1 and t["layers"] == 2 and t["parallel_workers"] == 2 and t["device"] == "cpu"
    assert t["all_layers_mean_seconds_per_seed"] == pytest.approx(
        sum(p["mean_seconds_per_seed"] for p in timing.values())
    )
    assert set(t["seconds_per_seed"]) == {"0", "1"} and all(v > 0 for v in t["seconds_per_seed"].values())


def test_missing_seed_wrong_method_and_layers_from_other_dumps_are_named(trained_cell, tmp_path):
    root, _ = trained_cell
    with pytest.raises(FileNotFoundError, match="seed_7.safetensors is missing"):
        load_models(root / "dets" / "layer_0", "max", 0, [7], D)
    with pytest.raises(DataError, match="holds a 'max' detector of layer 0"):
        load_models(root / "dets" / "layer_0", "mean", 0, [0], D)
    with pytest.raises(DataError, match=r"holds seeds \[0, 1\], not train.seeds \[0\]"):
        evaluate_detector(per_layer(root), root / "scores", [0], bootstrap=0, seed=0)
    layers = per_layer(root)
    layers[0]["test"]["n"] -= 1  # as if layer 0 had been scored on another dump
    with pytest.raises(DataError, match="scored on different responses"):
        evaluate_detector(layers, root / "scores", [0, 1], bootstrap=0, seed=0)


def test_hami_sp_cost_adds_sampling_and_nli_per_response():
    timings = pl.DataFrame({"question_id": ["a", "b", "c"], "nli_calls": [2, 4, 100], "seconds": [1.0, 3.0, 99.0]})
    cost = hami_sp_cost({"samples": 50, "questions": 10, "seconds_per_sample": 0.5}, timings, ["a", "b"], 1000.0)
    assert cost["extra_seconds_per_response"] == pytest.approx(4 * 0.5 + 2.0)
    assert cost["nli_calls_per_question"] == 3.0
    assert cost["samples_per_s_with_sampling_and_nli"] == pytest.approx(1 / (4.0 + 0.001))
    assert "sequential" not in cost
    latency = {"seconds_per_question": 6.0, "nli_calls_per_question": 4.0}
    both = hami_sp_cost(
        {"samples": 50, "questions": 10, "seconds_per_sample": 0.5}, timings, ["a", "b"], 1000.0, latency, 0.002
    )
    assert both["sequential"]["seconds_per_response"] == pytest.approx(6.002)
    assert both["sequential_samples_per_s"] == pytest.approx(1 / 6.002)
    assert both["samples_per_s_with_sampling_and_nli"] == cost["samples_per_s_with_sampling_and_nli"]
    with pytest.raises(ValueError, match="one response alone"):
        hami_sp_cost({"samples": 50, "questions": 10, "seconds_per_sample": 0.5}, timings, ["a"], 1000.0, latency)


def test_throughput_is_timed_on_the_device_named(trained_cell):
    import torch

    from halludetect.core.devices import DeviceError, resolve_device

    root, labels = trained_cell
    layer = read_layer(root / "acts" / layer_filename(1), dtype=None)
    test_split = split_data(layer, labels, "test")
    models = load_models(root / "dets" / "layer_1", "max", 1, [0, 1], D)
    t = detector_throughput(
        models,
        test_split,
        root / "acts" / layer_filename(1),
        repeats=1,
        device=resolve_device("cpu", "evaluate.device"),
    )
    assert t["device"].startswith("CPU") and 0 < t["single_response_seconds"] < 1 and t["n"] == 60
    assert resolve_device("auto", "evaluate.device") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # tests never need a GPU; where there is none, asking for one is an error
        with pytest.raises(DeviceError, match="evaluate.device: 'cuda' was asked for but CUDA is not available"):
            resolve_device("cuda", "evaluate.device")
