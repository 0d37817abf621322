"""A grid cell's figures (halludetect/report/cell_figures.py, stage figures) on a small synthetic cell laid
out as the pipeline writes it: every figure and its DVC plot data, and a missing scores file named."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from support import ROOT, layers


def write_cell(root: Path) -> list[str]:
    """A cell as the pipeline lays it out: evaluate metrics, train's per-response scores (the
    layer_<L>.parquet contract), labels, clusters and generations."""
    rng = np.random.default_rng(1)
    rows = []
    for split, n in (("train", 40), ("val", 30), ("test", 60)):
        for q in range(n // 2):
            for s in range(2 if split != "train" else 1):
                rows.append(
                    {
                        "question_id": f"{split}{q}",
                        "sample_index": s,
                        "split": split,
                        "label": int(rng.integers(0, 2)),
                        "kept": True,
                    }
                )
    labels = pl.DataFrame(rows).with_columns(pl.col("sample_index").cast(pl.Int32))
    labels.write_parquet(root / "judgments.parquet")
    y = labels["label"].to_numpy()
    base = labels.select("question_id", "sample_index")
    base.with_columns(
        pl.Series("n_tokens", rng.integers(1, 40, labels.height)),
        pl.Series("token_logprobs", [[-0.1 - 0.5 * v] * 3 for v in y]),
    ).write_parquet(root / "generations.parquet")
    labels.select("question_id", "sample_index", "split").with_columns(
        pl.lit(True).alias("valid"),
        pl.Series("p_sem_sum", np.clip(0.9 - 0.5 * y + 0.1 * rng.random(len(y)), 0, 1)),
        pl.lit(0.5).alias("p_sem_mean"),
        pl.lit(0.5).alias("p_sem_count"),
        *(pl.lit(0.3).alias(f"semantic_entropy_{v}") for v in ("mean", "sum", "discrete")),
    ).write_parquet(root / "clusters.parquet")
    methods = ["max", "hami_sp"]
    for k, m in enumerate(methods):
        (root / "eval").mkdir(exist_ok=True)
        epochs = np.arange(1, 11)
        by_epoch = {"train": (0.1 * (k + 1) * epochs).tolist(), "val": (0.05 * (k + 1) * epochs).tolist()}
        (root / "eval" / f"{m}.json").write_text(
            json.dumps(
                {
                    "best_layer": 1,
                    "layers": layers()["max"],
                    "test": {"auroc": {"mean": 0.7, "stderr": 0.01}},
                    "margin_by_epoch": by_epoch,
                }
            )
        )
        test = labels.filter(pl.col("split").is_in(["val", "test"]))
        frames = [
            test.select(
                pl.concat_str(["question_id", pl.col("sample_index").cast(pl.String)], separator="/").alias(
                    "response_id"
                ),
                "split",
                "label",
            ).with_columns(
                pl.lit(seed).alias("seed"),
                pl.Series("score", test["label"].to_numpy() + rng.normal(size=test.height)),
                pl.lit(5).alias("n_tokens"),
            )
            for seed in (0, 1)
        ]
        (root / "scores" / m).mkdir(parents=True)
        pl.concat(frames).write_parquet(root / "scores" / m / "layer_1.parquet")
    # the scores with nothing to train: their train stage's answers.parquet (stages/train_score.py), one null
    answers = labels.filter(pl.col("split").is_in(["val", "test"]))
    for name in ("p_sem", "length"):
        (root / "scores" / name).mkdir(parents=True)
        answers.select(
            pl.concat_str(["question_id", pl.col("sample_index").cast(pl.String)], separator="/").alias("response_id"),
            "question_id",
            "sample_index",
            "split",
            "label",
            pl.Series("score", np.where(np.arange(answers.height) == 0, np.nan, rng.random(answers.height))),
        ).with_columns(pl.col("score").fill_nan(None)).write_parquet(root / "scores" / name / "answers.parquet")
    return methods


def test_figures_stage_draws_every_figure_and_writes_the_plot_data(tmp_path):
    methods = write_cell(tmp_path)
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["grid"] |= {
        "detectors": ["max", "hami_sp", "p_sem", "length"],
        "analyze": ["hami_sp"],
    }
    data["train"]["seeds"] = [0, 1]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    args = [
        "--params",
        str(tmp_path / "params.yaml"),
        "--model",
        "m",
        "--dataset",
        "d",
        "--eval-dir",
        str(tmp_path / "eval"),
        "--scores-dir",
        str(tmp_path / "scores"),
        "--judgments",
        str(tmp_path / "judgments.parquet"),
        "--clusters",
        str(tmp_path / "clusters.parquet"),
        "--generations",
        str(tmp_path / "generations.parquet"),
        "--figures",
        str(tmp_path / "figures"),
        "--plots",
        str(tmp_path / "plots"),
    ]
    res = subprocess.run([sys.executable, "-m", "stages.figures", *args], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == [
        "auroc_by_layer.png",
        "margins_by_epoch.png",
        "responses.png",
        "roc.png",
        "scores.png",
        "selection.png",
    ]
    chosen = pl.read_csv(tmp_path / "plots" / "selection" / "m" / "d.csv")  # a curve per method scoring every answer
    assert chosen.columns == ["coverage", "series", "accuracy", "colour"] and set(chosen["series"]) <= {
        *methods,
        "p_sem",
        "length",
    }
    assert chosen.height and chosen["accuracy"].is_between(0, 1).all()
    epochs = pl.read_csv(tmp_path / "plots" / "epochs" / "m" / "d.csv")
    assert epochs.columns == ["epoch", "series", "margin", "colour"] and epochs.height == 2 * 2 * 10
    assert epochs.filter(pl.col("series") == "hami_sp (train)")["margin"].to_list()[-1] == pytest.approx(2.0)
    roc = pl.read_csv(tmp_path / "plots" / "roc" / "m" / "d.csv")
    assert set(roc["series"]) == {*methods, "p_sem", "length"} and roc.columns == ["fpr", "series", "tpr", "colour"]
    assert set(pl.read_csv(tmp_path / "plots" / "layers" / "m" / "d.csv")["series"]) == set(methods)
    scores = pl.read_csv(tmp_path / "plots" / "scores" / "m" / "d.csv")  # one chart, a panel per method
    assert scores.columns == ["value", "series", "density", "panel"]
    assert set(scores["panel"]) == {
        f"{m} (layer {json.loads((tmp_path / 'eval' / f'{m}.json').read_text())['best_layer']})" for m in methods
    }
    responses = pl.read_csv(tmp_path / "plots" / "responses" / "m" / "d.csv")
    assert set(responses["panel"]) == {f"{q} ({s})" for q in ("answer tokens", "P_sem") for s in ("train", "test")}
    from halludetect.core.artifacts import ArtifactError
    from halludetect.evaluation.evaluate import read_scores

    for m in methods:  # an evaluation from before the margins were recorded: named, not drawn blank
        path = tmp_path / "eval" / f"{m}.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "margin_by_epoch"}))
    res = subprocess.run([sys.executable, "-m", "stages.figures", *args], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "no margins by epoch in the evaluation of ['max', 'hami_sp']" in res.stderr

    (tmp_path / "scores" / "max" / "layer_1.parquet").unlink()
    with pytest.raises(ArtifactError, match=r"layer_1.parquet does not exist: run the train stage first"):
        read_scores(tmp_path / "scores" / "max" / "layer_1.parquet", [0, 1])
