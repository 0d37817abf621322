"""The export of a bundle from the per-layer DAG outputs (halludetect/scoring/export.py): what it
holds, byte-stable files, the export stage, and clear errors for what cannot be exported."""

import argparse
import hashlib
import json
import shutil

import polars as pl
import pytest
import torch
from sklearn.metrics import roc_auc_score

from halludetect.config import load_params
from halludetect.core.errors import DataError
from halludetect.detectors.build import load_detector
from halludetect.evaluation.thresholds import fit_platt
from halludetect.prompts import GENERATION, template_hash
from halludetect.scoring.answer_range import kept_answers
from halludetect.scoring.bundle import BundleError, load_bundle
from halludetect.scoring.export import export_bundle


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
    assert b.meta["combine"] == "mean_logit" and b.meta["default_threshold"] == "fpr_0.05"
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
    # each threshold's validation and test rates, from the same mean logits
    ensemble = {}
    for split in ("val", "test"):
        z = (
            scores.filter(pl.col("split") == split)
            .group_by("response_id")
            .agg(pl.col("score").mean(), pl.col("label").first())
        )
        ensemble[split] = (z["label"].to_numpy(), z["score"].to_numpy())
        assert b.meta["evaluation"][f"n_{split}_hallucinated"] == int(z["label"].sum())
    for name, entry in b.meta["thresholds"].items():
        for split in ("val", "test"):
            y, z = ensemble[split]
            flag = z >= entry["threshold"]
            assert entry[f"{split}_fpr"] == pytest.approx(flag[y == 0].mean(), abs=1e-12), name
            assert entry[f"{split}_tpr"] == pytest.approx(flag[y == 1].mean(), abs=1e-12), name
    assert b.threshold() == ("fpr_0.05", b.meta["thresholds"]["fpr_0.05"]["threshold"])
    assert b.threshold("best_f1")[1] == b.meta["thresholds"]["best_f1"]["threshold"]
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
        default_threshold="fpr_0.05",
        answers=kept_answers(*(pl.read_parquet(contract / f) for f in ("generations.parquet", "judgments.parquet"))),
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


def test_export_stage_writes_the_bundle(contract, tmp_path, caplog):
    from stages import export

    caplog.set_level("INFO", "halludetect")
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
    params = load_params("params.yaml")
    export.run(args, params)
    b = load_bundle(out)
    assert b.meta["default_threshold"] == params.export.threshold == "fpr_0.05"
    assert sorted(b.meta["thresholds"]) == ["best_f1", "fpr_0.01", "fpr_0.05", "fpr_0.1"]
    t = b.meta["thresholds"]["fpr_0.05"]
    assert f"default threshold fpr_0.05 = {t['threshold']:.3f}: validation FPR {t['val_fpr']:.3f}" in caplog.text


def test_best_f1_stays_selectable_and_a_rate_outside_fpr_targets_is_stored(contract, tmp_path):
    out = tmp_path / "b.safetensors"
    export_bundle(out, **export_args(contract, tmp_path, fpr_targets=[0.1], default_threshold="best_f1"))
    b = load_bundle(out)
    assert b.threshold()[0] == "best_f1" and sorted(b.meta["thresholds"]) == ["best_f1", "fpr_0.1"]
    export_bundle(out, **export_args(contract, tmp_path, fpr_targets=[0.1], default_threshold="fpr_0.2"))
    b = load_bundle(out)
    assert b.threshold()[0] == "fpr_0.2" and sorted(b.meta["thresholds"]) == ["best_f1", "fpr_0.1", "fpr_0.2"]
    assert b.meta["thresholds"]["fpr_0.2"]["val_fpr"] <= 0.2


# ------------------------------------------------------------------ damaged bundles are named, not used
