"""Evaluation from HDF5 layer files, baselines, HaMI (SP) cost, and the stages' early errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import roc_auc_score
from test_training import D, synthetic

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.activations.layer_writer import LayerWriter
from halludetect.config import BaselinesParams
from halludetect.detectors.data import SPLITS, DataError, split_data
from halludetect.detectors.inference import score
from halludetect.detectors.training import train_layer
from halludetect.evaluation.baselines import baseline_scores, evaluate_baseline
from halludetect.evaluation.evaluate import detector_throughput, evaluate_detector, hami_sp_cost, load_models
from halludetect.methods.pooling import PoolingParams

ROOT = Path(__file__).resolve().parents[1]


def write_layers(directory: Path) -> pl.DataFrame:
    """layer 0: pure noise; layer 1: the synthetic signal. Returns the labels."""
    layer, labels = synthetic()
    noise = np.random.default_rng(9).normal(size=layer.states.shape).astype(np.float32)
    for index, states in ((0, noise), (1, layer.states)):
        w = LayerWriter(directory / layer_filename(index), D, "float16", {"layer": index})
        w.append(states, np.diff(layer.offsets), layer.response_ids)
        w.close(fsync=False)
    return labels


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two layers x two seeds of `max`, trained and scored as the per-layer train stage does."""
    root = tmp_path_factory.mktemp("cell")
    acts = root / "acts"
    acts.mkdir()
    labels = write_layers(acts)
    params = PoolingParams(dim=16, dropout=0.0, lr=1e-2, weight_decay=0.0)
    for index in (0, 1):
        layer = read_layer(acts / layer_filename(index), dtype=None, expect_layer=index)
        data = {s: split_data(layer, labels, s) for s in SPLITS}
        train_layer("max", params, data, [0, 1], layer=index, epochs=10, batch_size=32, device="cpu",
                    out_dir=root / "dets" / f"layer_{index}", scores_path=root / "scores" / f"layer_{index}.parquet",
                    metrics_path=root / "layers" / f"layer_{index}.json", log=lambda *_: None)
    return root, labels


def per_layer(root: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in sorted((root / "layers").glob("*.json"))}


def test_best_layer_is_chosen_on_validation_and_metrics_are_complete(trained):
    root, labels = trained
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
        (pl.col("split") == "test") & (pl.col("seed") == 1))
    assert saved["response_id"].to_list() == test_split.response_ids
    np.testing.assert_array_equal(saved["score"].to_numpy(), score(models[1], test_split))
    speed = detector_throughput(models, test_split, root / "acts" / layer_filename(1), repeats=2)
    assert speed["preloaded_samples_per_s"] > 0 and speed["end_to_end_samples_per_s"] > 0


def test_missing_seed_wrong_method_and_layers_from_other_dumps_are_named(trained, tmp_path):
    root, _ = trained
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


def test_bad_layer_files_stop_the_train_stage_before_any_training(tmp_path):
    import h5py

    acts = tmp_path / "acts"
    acts.mkdir()
    labels = write_layers(acts)
    labels.write_parquet(tmp_path / "labels.parquet")
    with h5py.File(acts / layer_filename(1), "r") as f:
        offsets = f["offsets"][:]
    layer, _ = synthetic()
    states = layer.states.copy()
    states[offsets[7] + 1, 3] = np.inf  # response 7: train7/0
    w = LayerWriter(acts / layer_filename(1), D, "float32", {"layer": 1})
    w.append(states, np.diff(offsets), layer.response_ids)
    w.close(fsync=False)
    out = tmp_path / "dets"

    def train(layer: int) -> subprocess.CompletedProcess:
        return stage("stages.train", "--method", "max", "--layer", str(layer), "--activations",
                     str(acts / layer_filename(1)), "--judgments", str(tmp_path / "labels.parquet"), "--out", str(out),
                     "--scores", str(tmp_path / "s.parquet"), "--metrics", str(tmp_path / "m.json"))

    res = train(1)
    assert res.returncode == 2, res.stderr
    assert f"{acts / layer_filename(1)}: non-finite hidden states (NaN or inf) in response train7/0" in res.stderr
    assert "seed 0" not in res.stderr and not out.exists()  # nothing trained, nothing written
    res = train(0)
    assert res.returncode == 2 and "holds layer 1, not layer 0: re-run dump" in res.stderr


def world_like_tables():
    rng = np.random.default_rng(0)
    rows, gens, clusters = [], [], []
    for split, nq in (("train", 10), ("val", 20), ("test", 30)):
        for q in range(nq):
            for s in range(2):
                y = int(rng.integers(0, 2))
                qid = f"{split}{q}"
                rows.append({"question_id": qid, "sample_index": s, "split": split, "label": y, "kept": True})
                gens.append({"question_id": qid, "sample_index": s, "n_tokens": 3 + 2 * y,
                             "token_logprobs": [-0.1 - y * rng.random()] * (3 + 2 * y)})
                clusters.append({"question_id": qid, "sample_index": s, "valid": qid != "test0",
                                 "p_sem_mean": 0.9 - 0.5 * y + 0.1 * rng.random(), "p_sem_sum": 0.5,
                                 "p_sem_count": 0.5, "semantic_entropy_mean": 0.2 + y,
                                 "semantic_entropy_sum": 0.0, "semantic_entropy_discrete": 0.0})
    return pl.DataFrame(rows), pl.DataFrame(gens), pl.DataFrame(clusters)


def test_baselines_score_with_a_fixed_sign_and_count_what_they_cannot_score():
    labels, gens, clusters = world_like_tables()
    params = BaselinesParams()
    scores = baseline_scores("p_sem", gens, clusters, params)
    m = evaluate_baseline(scores, labels, bootstrap=50, seed=0)
    assert m["excluded"]["test"] == {"no_score": 2}  # test0's question did not cluster
    joined = labels.filter((pl.col("split") == "test") & (pl.col("question_id") != "test0")).join(
        clusters, on=["question_id", "sample_index"])
    assert m["test"]["auroc"]["mean"] == pytest.approx(roc_auc_score(joined["label"], 1 - joined["p_sem_mean"]))
    assert m["test"]["margin"] is None and m["best_layer"] is None
    for name in ("semantic_entropy", "logprob", "length"):
        assert evaluate_baseline(baseline_scores(name, gens, clusters, params), labels, bootstrap=0,
                                 seed=0)["test"]["auroc"]["mean"] > 0.9
    with pytest.raises(KeyError, match="did you mean 'length'"):
        baseline_scores("lenght", gens, clusters, params)
    one_class = labels.with_columns(pl.when(pl.col("split") == "val").then(1).otherwise(pl.col("label")).alias("label"))
    with pytest.raises(DataError, match=r"split 'val' has one class only \(40 hallucinated of 40 kept\)"):
        evaluate_baseline(scores, one_class, bootstrap=0, seed=0)


def test_hami_sp_cost_adds_sampling_and_nli_per_response():
    timings = pl.DataFrame({"question_id": ["a", "b", "c"], "nli_calls": [2, 4, 100], "seconds": [1.0, 3.0, 99.0]})
    cost = hami_sp_cost({"samples": 50, "questions": 10, "seconds_per_sample": 0.5}, timings, ["a", "b"], 1000.0)
    assert cost["extra_seconds_per_response"] == pytest.approx(4 * 0.5 + 2.0)
    assert cost["nli_calls_per_question"] == 3.0
    assert cost["samples_per_s_with_sampling_and_nli"] == pytest.approx(1 / (4.0 + 0.001))
    assert "sequential" not in cost
    latency = {"seconds_per_question": 6.0, "nli_calls_per_question": 4.0}
    both = hami_sp_cost({"samples": 50, "questions": 10, "seconds_per_sample": 0.5}, timings, ["a", "b"], 1000.0,
                        latency, 0.002)
    assert both["sequential"]["seconds_per_response"] == pytest.approx(6.002)
    assert both["sequential_samples_per_s"] == pytest.approx(1 / 6.002)
    assert both["samples_per_s_with_sampling_and_nli"] == cost["samples_per_s_with_sampling_and_nli"]
    with pytest.raises(ValueError, match="one response alone"):
        hami_sp_cost({"samples": 50, "questions": 10, "seconds_per_sample": 0.5}, timings, ["a"], 1000.0, latency)


def test_throughput_is_timed_on_the_device_named(trained):
    import torch

    from halludetect.core.devices import DeviceError, resolve_device

    root, labels = trained
    layer = read_layer(root / "acts" / layer_filename(1), dtype=None)
    test_split = split_data(layer, labels, "test")
    models = load_models(root / "dets" / "layer_1", "max", 1, [0, 1], D)
    t = detector_throughput(models, test_split, root / "acts" / layer_filename(1), repeats=1,
                            device=resolve_device("cpu", "evaluate.device"))
    assert t["device"].startswith("CPU") and 0 < t["single_response_seconds"] < 1 and t["n"] == 60
    assert resolve_device("auto", "evaluate.device") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # tests never need a GPU; where there is none, asking for one is an error
        with pytest.raises(DeviceError, match="evaluate.device: 'cuda' was asked for but CUDA is not available"):
            resolve_device("cuda", "evaluate.device")


def stage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_stages_refuse_an_unknown_method_and_missing_p_sem_before_reading_data(tmp_path):
    outs = ["--out", str(tmp_path / "out"), "--scores", str(tmp_path / "s"), "--metrics", str(tmp_path / "m")]
    res = stage("stages.train", "--method", "hami-sp", "--layer", "0", "--activations", str(tmp_path), "--judgments",
                "none", *outs)
    assert res.returncode == 2 and "unknown detector 'hami-sp'; did you mean 'hami_sp'?" in res.stderr
    res = stage("stages.train", "--method", "hami_sp", "--layer", "0", "--activations", str(tmp_path), "--judgments",
                "none", *outs)
    assert res.returncode == 2 and "hami_sp reads P_sem: pass --clusters" in res.stderr
    assert not (tmp_path / "out").exists()
