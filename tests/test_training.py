"""Training on synthetic bags: it learns, it is deterministic, and bad input stops it early."""

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.activations import Layer
from halludetect.config import PoolingParams
from halludetect.training import DataError, split_data, train_detector

D = 8


def synthetic(n_per_split=60, seed=0):
    """Bags of 2-6 tokens; a hallucinated bag hides one token with a shifted first feature."""
    rng = np.random.default_rng(seed)
    bags, rows = [], []
    for split in ("train", "val", "test"):
        for i in range(n_per_split):
            y = i % 2
            bag = rng.normal(size=(rng.integers(2, 7), D)).astype(np.float32)
            if y:
                bag[rng.integers(len(bag)), 0] += 4.0
            bags.append(bag)
            rows.append({"question_id": f"{split}{i}", "sample_index": 0, "split": split, "label": y, "kept": True})
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])])
    ids = [f"{r['question_id']}/0" for r in rows]
    layer = Layer(np.concatenate(bags), offsets, ids, {})
    return layer, pl.DataFrame(rows).with_columns(pl.col("sample_index").cast(pl.Int32))


def test_max_pooling_learns_a_single_token_signal():
    layer, labels = synthetic()
    train, val = split_data(layer, labels, "train"), split_data(layer, labels, "val")
    params = PoolingParams(dim=16, dropout=0.0, lr=1e-2, weight_decay=0.0)
    res = train_detector("max", params, train, val, epochs=30, batch_size=32, seed=0)
    assert res.best_val_auroc > 0.9
    assert len(res.curve) == 30 and 1 <= res.best_epoch <= 30
    again = train_detector("max", params, train, val, epochs=30, batch_size=32, seed=0)
    for k, v in res.state_dict.items():  # deterministic for a seed
        torch.testing.assert_close(v, again.state_dict[k])


def test_one_class_split_names_split_and_counts():
    layer, labels = synthetic()
    labels = labels.with_columns(pl.when(pl.col("split") == "val").then(0).otherwise(pl.col("label")).alias("label"))
    with pytest.raises(DataError, match=r"split 'val' has one class only \(0 hallucinated of 60 kept\)"):
        split_data(layer, labels, "val")


def test_labels_without_states_are_an_error():
    layer, labels = synthetic()
    extra = pl.DataFrame([{"question_id": "ghost", "sample_index": 0, "split": "train", "label": 1, "kept": True}])
    with pytest.raises(DataError, match="labels and activations disagree"):
        split_data(layer, pl.concat([labels, extra.with_columns(pl.col("sample_index").cast(pl.Int32))]), "train")


def test_non_finite_states_name_the_response():
    layer, labels = synthetic()
    layer.states[layer.offsets[3] + 1, 2] = np.nan
    with pytest.raises(DataError, match="non-finite hidden states in response train3/0"):
        split_data(layer, labels, "train")


def test_dropped_answers_are_not_used():
    layer, labels = synthetic()
    labels = labels.with_columns((pl.col("question_id") != "train0").alias("kept"))
    data = split_data(layer, labels, "train")
    assert "train0/0" not in data.response_ids and len(data.y) == 59


def test_saved_detector_round_trips_with_stable_bytes(tmp_path):
    import hashlib

    from halludetect.detectors import build_detector, load_detector, save_detector

    params = PoolingParams(dim=4)
    torch.manual_seed(0)
    model = build_detector("max", D, params).eval()
    meta = {"method": "max", "layer": 3, "seed": 0, "best_epoch": 7, "d": D, "params": params.model_dump()}
    digests = set()
    for i in range(5):  # safetensors writes a multi-key metadata map in a different order each time
        save_detector(tmp_path / f"{i}.safetensors", model.state_dict(), meta)
        digests.add(hashlib.sha256((tmp_path / f"{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    loaded, got = load_detector(tmp_path / "0.safetensors")
    assert got == meta
    x, mask = torch.randn(5, 6, D), torch.ones(5, 6, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, mask), model(x, mask))
