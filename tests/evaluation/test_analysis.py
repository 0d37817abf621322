"""The analyze stage (halludetect/evaluation/analysis.py) on a small synthetic cell: trained HaMI (SP)
detectors, the per-response sensitivities, class expectations averaged over seeds, the distribution
data, and its errors."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from support import ROOT, write_layers

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.detectors.data import split_data
from halludetect.detectors.training import train_layer
from halludetect.evaluation.analysis import analyze_split, mean_over_seeds
from halludetect.methods.hami import HaMISPParams

D = 8
SEEDS = (0, 1)


def clusters_for(labels: pl.DataFrame) -> pl.DataFrame:
    """P_sem higher for correct answers, as on real data."""
    rng = np.random.default_rng(3)
    p = np.clip(np.where(labels["label"].to_numpy() == 1, 0.4, 0.9) + 0.1 * rng.normal(size=labels.height), 0.05, 1)
    return labels.select("question_id", "sample_index", "split").with_columns(
        pl.lit(True).alias("valid"),
        pl.Series("p_sem_sum", p),  # the default variant, which the detectors are trained with
        pl.lit(0.5).alias("p_sem_mean"),
        pl.lit(0.5).alias("p_sem_count"),
        *(pl.lit(0.3).alias(f"semantic_entropy_{v}") for v in ("mean", "sum", "discrete")),
    )


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    acts, dets = root / "acts", root / "dets" / "hami_sp"
    acts.mkdir(), dets.mkdir(parents=True)
    labels = write_layers(acts)
    clusters = clusters_for(labels)
    labels.write_parquet(root / "judgments.parquet")
    clusters.write_parquet(root / "clusters.parquet")
    p_sem = dict(
        zip([f"{q}/{s}" for q, s in clusters.select("question_id", "sample_index").iter_rows()], clusters["p_sem_sum"])
    )
    params = HaMISPParams(dim=16, lr=1e-2)
    for index in (0, 1):  # as the per-layer train stage lays them out: layer_<L>/seed_<S>.safetensors
        layer = read_layer(acts / layer_filename(index), dtype=None, expect_layer=index)
        data = {s: split_data(layer, labels, s, p_sem=p_sem) for s in ("train", "val", "test")}
        train_layer(
            "hami_sp",
            params,
            data,
            list(SEEDS),
            layer=index,
            epochs=4,
            batch_size=32,
            device="cpu",
            out_dir=dets / f"layer_{index}",
            scores_path=root / "scores" / f"layer_{index}.parquet",
            metrics_path=root / "layers" / f"layer_{index}.json",
            log=lambda *_: None,
        )
    (root / "eval.json").write_text(json.dumps({"best_layer": 1}))
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["train"]["seeds"] = list(SEEDS)
    data["analyze"] |= {"steps": 200, "layers": [0], "bins": 10}
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    return root, p_sem


def run_stage(root: Path, method="hami_sp", params="params.yaml", out="out"):
    out = root / out
    args = [
        "--params",
        str(root / params),
        "--model",
        "m",
        "--dataset",
        "d",
        "--method",
        method,
        "--evaluation",
        str(root / "eval.json"),
        "--activations",
        str(root / "acts"),
        "--judgments",
        str(root / "judgments.parquet"),
        "--clusters",
        str(root / "clusters.parquet"),
        "--detectors",
        str(root / "dets" / method),
        "--out",
        str(out / "analysis.json"),
        "--responses",
        str(out / "responses.parquet"),
        "--plots",
        str(out / "plots.csv"),
        "--figure",
        str(out / "sensitivity.png"),
    ]
    res = subprocess.run([sys.executable, "-m", "stages.analyze", *args], cwd=ROOT, capture_output=True, text=True)
    return res, out


def test_analyze_stage_writes_every_layer_split_and_seed(cell):
    root, _ = cell
    res, out = run_stage(root)
    assert res.returncode == 0, res.stderr
    a = json.loads((out / "analysis.json").read_text())
    assert a["best_layer"] == 1 and sorted(a["layers"]) == ["0", "1"] and a["lam"] == 1.0 and a["steps"] == 200
    assert "trained with" in a["lam_source"]
    test = a["layers"]["1"]["test"]
    assert test["n"] == 60 and sorted(test["per_seed"]) == ["0", "1"]
    for seed in test["per_seed"].values():
        assert seed["path_check"]["max_abs_c_int_minus_exact"] < 1e-2  # 200 steps
        assert seed["margin"]["change_from_c_int"] == pytest.approx(seed["margin"]["change"], abs=1e-3)
    mean = test["mean"]["c_int"]
    assert mean["neg"]["p_sem_c"] == pytest.approx(
        np.mean([s["c_int"]["neg"]["p_sem_c"] for s in test["per_seed"].values()])
    )
    assert mean["gamma"] == pytest.approx(mean["neg"]["p_sem_c"] / mean["pos"]["p_sem_c"])
    rows = pl.read_parquet(out / "responses.parquet")
    assert rows.height == 2 * 2 * (60 + 60)  # layers x seeds x (train + test responses)
    assert set(rows["split"]) == {"train", "test"} and set(rows["layer"]) == {0, 1}
    plots = pl.read_csv(out / "plots.csv")  # one chart, a panel per quantity and split
    assert plots.columns == ["value", "series", "density", "panel"]
    assert sorted(set(plots["panel"])) == sorted(
        f"{q} ({s})" for s in ("train", "test") for q in ("C_B", "C_B^int", "P_sem C_B", "P_sem C_B^int")
    )
    assert (out / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    hist = plots.filter(pl.col("panel") == "C_B^int (test)")
    assert hist.height == 2 * 10 and set(hist["series"]) == {"correct (neg)", "hallucinated (pos)"}


def test_analyze_refuses_what_it_cannot_analyse(cell, tmp_path):
    from halludetect.config import ParamsError, load_params

    root, _ = cell
    res, out = run_stage(root, method="max", out="refused")
    assert res.returncode == 2 and "applies to HaMI networks" in res.stderr and not out.exists()
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["analyze"]["layers"] = [7]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ParamsError, match=r"analyze.layers: \[7\] are not trained \(grid.layers is"):
        load_params(tmp_path / "bad.yaml")


def test_mean_over_seeds_counts_the_condition(cell):
    root, p_sem = cell
    from halludetect.detectors.build import load_detector

    labels = pl.read_parquet(root / "judgments.parquet")
    data = split_data(
        read_layer(root / "acts" / layer_filename(1), dtype=None, expect_layer=1), labels, "test", p_sem=p_sem
    )
    models = {s: load_detector(root / "dets" / "hami_sp" / "layer_1" / f"seed_{s}.safetensors")[0] for s in SEEDS}
    rows, summary = analyze_split(models, data, lam=1.0, steps=50, batch_size=7)  # batches of 7 bags
    whole, again = analyze_split(models, data, lam=1.0, steps=50)
    np.testing.assert_allclose(rows["c_int"].to_numpy(), whole["c_int"].to_numpy(), rtol=1e-5, atol=1e-6)
    m = summary["mean"]["c_int"]
    holds, applies = m["condition_holds_seeds"]
    assert applies == sum(s["c_int"]["condition_applies"] for s in summary["per_seed"].values())
    assert holds == sum(s["c_int"]["condition_holds"] is True for s in summary["per_seed"].values())
    assert m["margin_widens_seeds"][1] == len(SEEDS)
    assert mean_over_seeds([summary["per_seed"]["0"]["c0"]])["gamma"] == summary["per_seed"]["0"]["c0"]["gamma"]


def test_the_path_identity_is_checked_against_the_tolerance_and_the_margins_averaged(cell):
    """Z(p_B) = Z(0) - p_B C_B^int holds up to the N steps' discretisation: few steps and a tight
    tolerance give the warning's flag, many steps pass; the margin's change is averaged over seeds
    with its predictions from C_B^int and from C_B."""
    root, p_sem = cell
    from halludetect.detectors.build import load_detector

    labels = pl.read_parquet(root / "judgments.parquet")
    data = split_data(
        read_layer(root / "acts" / layer_filename(1), dtype=None, expect_layer=1), labels, "test", p_sem=p_sem
    )
    models = {s: load_detector(root / "dets" / "hami_sp" / "layer_1" / f"seed_{s}.safetensors")[0] for s in SEEDS}
    rows, coarse = analyze_split(models, data, lam=1.0, steps=1, tolerance=1e-9)
    identity = np.abs(rows["z_p"] - (rows["z0"] - rows["p"] * rows["c_int"])).max()
    assert coarse["path_check"]["max_abs_identity_gap"] == pytest.approx(identity)
    assert identity > 1e-9 and not coarse["path_check"]["within_tolerance"]
    assert sum(s["path_check"]["bags_over_tolerance"] for s in coarse["per_seed"].values()) > 0
    _, fine = analyze_split(models, data, lam=1.0, steps=400, tolerance=1e-2)
    assert fine["path_check"]["within_tolerance"] and fine["path_check"]["tolerance"] == 1e-2
    per_seed = [s["margin"] for s in fine["per_seed"].values()]
    for key in ("change", "change_from_c_int", "change_from_c0"):
        assert fine["margin"][key] == pytest.approx(np.mean([m[key] for m in per_seed]))
    assert fine["margin"]["change"] == pytest.approx(fine["margin"]["change_from_c_int"], abs=1e-2)
