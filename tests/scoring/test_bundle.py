"""Detector bundles (halludetect/scoring/bundle.py): thresholds and calibration chosen on validation,
the export from the per-layer DAG outputs, byte-stable files, the export stage, and clear errors for
what cannot be exported or loaded."""

import argparse
import hashlib
import json
import shutil

import numpy as np
import polars as pl
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from halludetect.config import load_params
from halludetect.core.errors import DataError
from halludetect.detectors.build import load_detector
from halludetect.prompts import GENERATION, template_hash
from halludetect.scoring.bundle import BundleError, choose_thresholds, export_bundle, fit_platt, load_bundle


def labelled_scores(n=400, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    return y, rng.normal(size=n) + 1.5 * y


def test_thresholds_meet_their_false_positive_rate_and_best_f1_is_the_best():
    y, z = labelled_scores()
    t = choose_thresholds(y, z, [0.01, 0.05, 0.1])
    assert sorted(t) == ["best_f1", "fpr_0.01", "fpr_0.05", "fpr_0.1"]
    neg = z[y == 0]
    for target in (0.01, 0.05, 0.1):
        entry = t[f"fpr_{target:g}"]
        assert np.mean(neg >= entry["threshold"]) == entry["val_fpr"] <= target
        # the lowest such threshold: one score lower and the target would be exceeded
        lower = z[z < entry["threshold"]].max()
        assert np.mean(neg >= lower) > target

    def f1(th):
        flag = z >= th
        tp = (flag & (y == 1)).sum()
        return 2 * tp / (flag.sum() + (y == 1).sum())

    assert t["best_f1"]["val_f1"] == pytest.approx(max(f1(th) for th in z))
    assert t["best_f1"]["val_f1"] == pytest.approx(f1(t["best_f1"]["threshold"]))


def test_unreachable_false_positive_rate_flags_nothing():
    y = np.array([0, 0, 1, 1])
    z = np.array([3.0, 0.0, 1.0, 2.0])  # the top score is a negative's: any flag has FPR >= 0.5
    entry = choose_thresholds(y, z, [0.1])["fpr_0.1"]
    assert entry["threshold"] > 3.0 and entry["val_fpr"] == 0.0 and entry["val_tpr"] == 0.0


def test_platt_scaling_is_an_unregularised_logistic_fit():
    y, z = labelled_scores()
    c = fit_platt(y, z)
    ref = LogisticRegression(C=np.inf).fit(z[:, None], y)
    assert c["a"] == pytest.approx(ref.coef_[0, 0]) and c["b"] == pytest.approx(ref.intercept_[0])
    assert c["a"] > 0 and 0 < c["val_brier"] < 0.25


def meta_of(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["bundle"])


def test_export_holds_everything_to_reproduce_the_detectors_input(contract, bundle_path):
    metrics = json.loads((contract / "metrics" / "max.json").read_text())
    manifest = json.loads((contract / "manifest.json").read_text())
    b = load_bundle(bundle_path)
    layer = metrics["best_layer"]
    assert (b.method, b.layer, b.n_layers, b.seeds, b.positions) == ("max", layer, 3, [0, 1], "predicting")
    base = b.meta["base_model"]
    assert base["files"] == manifest["files"] and base["path"] == manifest["preset"]["path"]
    assert base["hidden_size"] == 32 and b.meta["d"] == 32
    inputs = b.meta["inputs"]
    assert inputs == {
        "positions": "predicting",
        "prompt_template": GENERATION,
        "chat_template": False,
        "prompt_hash": template_hash(GENERATION),
        "states_dtype": "float16",
    }
    assert b.meta["evaluation"]["test_auroc_dag"] == metrics["test"]["auroc"]
    assert b.meta["combine"] == "mean_logit" and b.meta["default_threshold"] == "best_f1"
    # every seed's weights, equal to the trained files
    for seed in (0, 1):
        trained, _ = load_detector(contract / "detectors" / "max" / f"layer_{layer}" / f"seed_{seed}.safetensors")
        for k, v in trained.state_dict().items():
            assert torch.equal(b.detectors[seed].state_dict()[k], v)
    # thresholds, calibration and the ensemble's AUROC come from the scores table's mean logits
    scores = pl.read_parquet(contract / "scores" / "max" / f"layer_{layer}.parquet")
    for split, key in (("val", "val_auroc_ensemble"), ("test", "test_auroc_ensemble")):
        z = (
            scores.filter(pl.col("split") == split)
            .group_by("response_id")
            .agg(pl.col("score").mean(), pl.col("label").first())
        )
        assert b.meta["evaluation"][key] == pytest.approx(roc_auc_score(z["label"], z["score"]))
    val = (
        scores.filter(pl.col("split") == "val")
        .group_by("response_id")
        .agg(pl.col("score").mean(), pl.col("label").first())
    )
    platt = fit_platt(val["label"].to_numpy(), val["score"].to_numpy())  # rows in another order: the optimiser's noise
    assert (b.meta["calibration"]["a"], b.meta["calibration"]["b"]) == pytest.approx((platt["a"], platt["b"]), rel=1e-6)
    assert b.threshold() == ("best_f1", b.meta["thresholds"]["best_f1"]["threshold"])
    assert b.threshold("fpr_0.05")[1] == b.meta["thresholds"]["fpr_0.05"]["threshold"]
    assert b.threshold("0.25") == ("0.25", 0.25)
    with pytest.raises(BundleError, match="unknown threshold 'fpr_0.5'.*best_f1"):
        b.threshold("fpr_0.5")


def test_the_same_bundle_gives_the_same_bytes(contract, bundle_path, tmp_path):
    again = tmp_path / "again.safetensors"
    export_bundle(
        again,
        metrics=json.loads((contract / "metrics" / "max.json").read_text()),
        detectors_dir=contract / "detectors" / "max",
        scores_dir=contract / "scores" / "max",
        manifest=json.loads((contract / "manifest.json").read_text()),
        positions="predicting",
        states_dtype="float16",
        prompt_template=GENERATION,
        fpr_targets=[0.01, 0.05, 0.1],
        default_threshold="best_f1",
    )
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(bundle_path)


def export_args(contract, tmp_path, **change):
    kw = dict(
        metrics=json.loads((contract / "metrics" / "max.json").read_text()),
        detectors_dir=contract / "detectors" / "max",
        scores_dir=contract / "scores" / "max",
        manifest=json.loads((contract / "manifest.json").read_text()),
        positions="predicting",
        states_dtype="float16",
        prompt_template=GENERATION,
        fpr_targets=[0.05],
        default_threshold="best_f1",
    )
    return kw | change


def test_export_refuses_what_does_not_fit_together(contract, tmp_path):
    out = tmp_path / "b.safetensors"
    metrics = json.loads((contract / "metrics" / "max.json").read_text())
    with pytest.raises(FileNotFoundError, match="seed_7.safetensors is missing"):
        export_bundle(out, **export_args(contract, tmp_path, metrics={**metrics, "seeds": [0, 7]}))
    layers = [{**r, "val_auroc": r["val_auroc"] + 0.1} for r in metrics["layers"]]
    with pytest.raises(DataError, match="different runs"):
        export_bundle(out, **export_args(contract, tmp_path, metrics={**metrics, "layers": layers}))
    manifest = json.loads((contract / "manifest.json").read_text())
    with pytest.raises(DataError, match="hidden size 64"):
        export_bundle(out, **export_args(contract, tmp_path, manifest={**manifest, "hidden_size": 64}))
    # a seed's scores missing from the table
    scores_dir = tmp_path / "scores"
    shutil.copytree(contract / "scores" / "max", scores_dir)
    f = scores_dir / f"layer_{metrics['best_layer']}.parquet"
    t = pl.read_parquet(f)
    t.filter(~((pl.col("seed") == 1) & (pl.col("split") == "test"))).write_parquet(f)
    with pytest.raises(DataError, match=r"test scores hold seeds \[0\], the evaluation averaged \[0, 1\]"):
        export_bundle(out, **export_args(contract, tmp_path, scores_dir=scores_dir))
    assert not out.exists()


def test_load_refuses_files_that_are_not_bundles(contract, bundle_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such bundle"):
        load_bundle(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BundleError, match="not a readable safetensors file"):
        load_bundle(tmp_path / "junk.safetensors")
    single = next((contract / "detectors" / "max").rglob("seed_0.safetensors"))
    with pytest.raises(BundleError, match="without bundle metadata"):
        load_bundle(single)
    from safetensors.torch import load_file, save_file

    tensors = load_file(bundle_path)
    meta = meta_of(bundle_path)
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("seed_1.")},
        str(tmp_path / "cut.safetensors"),
        metadata={"bundle": json.dumps(meta)},
    )
    with pytest.raises(BundleError, match="seed 1's weights do not fit"):
        load_bundle(tmp_path / "cut.safetensors")
    save_file(tensors, str(tmp_path / "v9.safetensors"), metadata={"bundle": json.dumps({**meta, "format_version": 9})})
    with pytest.raises(BundleError, match="version 9"):
        load_bundle(tmp_path / "v9.safetensors")


def test_export_stage_writes_the_bundle(contract, tmp_path, capsys):
    from stages import export

    out = tmp_path / "data" / "bundles" / "tiny" / "mini" / "max.safetensors"
    args = argparse.Namespace(
        metrics=contract / "metrics" / "max.json",
        detectors=contract / "detectors" / "max",
        scores=contract / "scores" / "max",
        manifest=contract / "manifest.json",
        out=out,
        generation_metrics=None,  # a method that reads no P_sem: export_sp's alone pass them
        cluster_metrics=None,
    )
    export.run(args, load_params("params.yaml"))
    b = load_bundle(out)
    assert b.meta["default_threshold"] == "best_f1" and sorted(b.meta["thresholds"]) == [
        "best_f1",
        "fpr_0.01",
        "fpr_0.05",
        "fpr_0.1",
    ]
