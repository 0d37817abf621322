"""The label tables as train and evaluate read them (halludetect/labels/readers.py), the
hostile cases: a kept label of 2 or null, one answer twice with opposite labels, a judgments file
that is not Parquet, and P_sem outside [0, 1] are each named with the file, the rows and the fix,
before any training."""

from pathlib import Path

import polars as pl
import pytest
from support import cell, stage, synthetic, train_stage

from halludetect.detectors.data import DataError


@pytest.mark.hostile
def test_train_rejects_a_kept_label_of_2_naming_file_and_row(tmp_path):
    acts, labels, params = cell(tmp_path)
    path = tmp_path / "judgments.parquet"
    labels.with_columns(
        pl.when(pl.col("question_id") == "val3").then(2).otherwise(pl.col("label")).alias("label")
    ).write_parquet(path)
    res = train_stage(tmp_path, acts, path, params)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {path}: 1 problem(s):" in res.stderr
    assert "label: not 0 (correct) or 1 (hallucinated) on kept row(s) row 64 (val3/0: 2)" in res.stderr
    assert "Re-run judge to rewrite it" in res.stderr and not (tmp_path / "dets").exists()


def judgments_error(path: Path) -> str:
    """What train and evaluate say about a judgments file (they all read it so)."""
    from halludetect.labels.readers import read_judgments

    with pytest.raises(DataError) as e:
        read_judgments(path)
    return str(e.value)


@pytest.mark.hostile
def test_train_rejects_a_kept_row_with_a_null_label_naming_file_and_row(tmp_path):
    _, labels = synthetic()
    path = tmp_path / "judgments.parquet"
    labels.with_columns(
        pl.when(pl.col("question_id") == "train5").then(None).otherwise(pl.col("label")).alias("label")
    ).write_parquet(path)
    assert (
        f"{path}: 1 problem(s):\n  label: null on kept row(s) row 6 (train5/0) (a kept answer needs 0 or 1; "
        "an answer without a label has kept = false)"
    ) in judgments_error(path)


@pytest.mark.hostile
def test_train_rejects_duplicate_rows_with_opposite_labels_naming_both_rows(tmp_path):
    _, labels = synthetic()
    path = tmp_path / "judgments.parquet"
    twin = labels.filter(pl.col("question_id") == "train2").with_columns((1 - pl.col("label")).alias("label"))
    pl.concat([labels, twin]).write_parquet(path)
    assert (
        "the same response on more than one row (one row per question_id and sample_index): row 3 "
        "(train2/0: 0), row 181 (train2/0: 1)"
    ) in judgments_error(path)


@pytest.mark.hostile
def test_train_names_a_judgments_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "judgments.parquet"
    path.write_text("question_id,sample_index,label\nq1,0,1\n")
    msg = judgments_error(path)
    assert msg.startswith(f"{path}: not a readable judgments table (ComputeError: parquet: File out of specification")
    assert "re-run judge to rewrite it" in msg


@pytest.mark.hostile
def test_the_p_sem_score_rejects_a_clusters_table_with_p_sem_outside_0_1_naming_the_row(tmp_path):
    from support import world_like_tables

    labels, gens, clusters = world_like_tables()
    for name, df in (("j", labels), ("g", gens)):
        df.with_columns(pl.lit("test").alias("split")).write_parquet(
            tmp_path / f"{name}.parquet"
        ) if name == "g" else df.write_parquet(tmp_path / f"{name}.parquet")
    bad = clusters.join(labels.select("question_id", "sample_index", "split"), on=["question_id", "sample_index"])
    bad = bad.with_columns(
        pl.when(pl.col("question_id") == "val1").then(1.7).otherwise(pl.col("p_sem_mean")).alias("p_sem_mean")
    )
    bad.write_parquet(tmp_path / "c.parquet")
    res = stage(  # a score with nothing to train, in its train stage (stages/train_score.py)
        "stages.train",
        "--method",
        "p_sem",
        "--activations",
        str(tmp_path / "activations"),
        "--generations",
        str(tmp_path / "g.parquet"),
        "--judgments",
        str(tmp_path / "j.parquet"),
        "--clusters",
        str(tmp_path / "c.parquet"),
        "--out",
        str(tmp_path / "detectors"),
        "--scores",
        str(tmp_path / "scores"),
        "--metrics",
        str(tmp_path / "layers"),
        "--timing",
        str(tmp_path / "timing.json"),
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "p_sem_mean: null or outside [0, 1] on valid row(s) row 23 (val1/0: 1.7), row 24 (val1/1: 1.7)" in res.stderr
        and "Re-run cluster to rewrite it" in res.stderr
    )
