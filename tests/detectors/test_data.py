"""A split's training data (halludetect/detectors/data.py): empty bags and answers without P_sem are
excluded and counted, dropped answers are not used, and a one-class split, labels without states
and non-finite states stop it early, naming the split or the response."""

import numpy as np
import polars as pl
import pytest
from support import synthetic

from halludetect.activations.layer_reader import Layer
from halludetect.detectors.data import DataError, split_data


def test_empty_bags_and_missing_p_sem_are_excluded_and_counted():
    layer, labels = synthetic()
    lengths = np.diff(layer.offsets)
    lengths[[0, 2]] = 0  # train0/0, train2/0 lose their tokens
    starts = layer.offsets[:-1]
    keep = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)])
    empty = Layer(layer.states[keep], np.concatenate([[0], np.cumsum(lengths)]), layer.response_ids, {})
    data = split_data(empty, labels, "train")
    assert data.excluded == {"empty_bag": 2} and len(data) == 58
    p_sem = {rid: 0.3 for rid in layer.response_ids if rid != "train5/0"}
    data = split_data(empty, labels, "train", p_sem=p_sem)
    assert data.excluded == {"empty_bag": 2, "no_p_sem": 1} and len(data) == 57
    assert "train5/0" not in data.response_ids and data.p_sem.tolist() == pytest.approx([0.3] * 57)


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
    with pytest.raises(DataError, match=r"non-finite hidden states \(NaN or inf\) in response train3/0"):
        split_data(layer, labels, "train")


def test_dropped_answers_are_not_used():
    layer, labels = synthetic()
    labels = labels.with_columns((pl.col("question_id") != "train0").alias("kept"))
    data = split_data(layer, labels, "train")
    assert "train0/0" not in data.response_ids and len(data.y) == 59
