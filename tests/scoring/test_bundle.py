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
from halludetect.scoring.bundle import (
    BundleError,
    choose_thresholds,
    export_bundle,
    fit_platt,
    load_bundle,
    save_bundle,
)


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
    with pytest.raises(
        BundleError,
        match=r"cut.safetensors: lacks 4 tensor\(s\) \(seed_1.feature.0.bias, .*\) that its digest lists: damaged",
    ):
        load_bundle(tmp_path / "cut.safetensors")
    # written whole (its digest matching) but with weights of another shape
    b = load_bundle(bundle_path)
    state = {s: d.state_dict() for s, d in b.detectors.items()}
    state[1] = {k: v[..., :1] if k.endswith("weight") else v for k, v in state[1].items()}
    save_bundle(tmp_path / "cut.safetensors", state, meta)
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


# ------------------------------------------------------------------ damaged bundles are named, not used
def resaved(bundle_path, out, change_meta=None, change_state=None):
    """The bundle written again by save_bundle (a valid digest of what it holds), changed."""
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    state = {s: {k: v.clone() for k, v in d.state_dict().items()} for s, d in b.detectors.items()}
    if change_meta:
        change_meta(meta)
    if change_state:
        change_state(state)
    save_bundle(out, state, meta)
    return out


def show(path, capsys) -> tuple[int, str, str]:
    """`halludetect show PATH`: exit code, stdout, stderr."""
    from halludetect import cli

    try:
        cli.main(["show", str(path)])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.hostile
def test_a_bundle_with_nan_or_infinite_weights_is_named_not_used(bundle_path, tmp_path, capsys):
    """Before: every row scored NaN, nothing flagged, exit 0."""

    def poison(state):
        state[1]["head.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])

    bad = resaved(bundle_path, tmp_path / "nan.safetensors", change_state=poison)
    want = f"{bad}: tensor 'seed_1.head.weight' holds 2 NaN and 1 infinite value(s) of "
    with pytest.raises(BundleError) as e:
        load_bundle(bad)
    assert str(e.value).startswith(want) and "every score would be NaN; re-export it" in str(e.value)
    code, out, err = show(bad, capsys)
    assert code == 2 and out == "" and err.startswith(f"error: {want}") and err.count("\n") == 1


@pytest.mark.hostile
def test_a_flipped_byte_in_a_bundle_is_named(bundle_path, tmp_path, capsys):
    """Before: a flipped byte in the weights shifted every score silently."""
    data = bytearray(bundle_path.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor's data
    (tmp_path / "flipped.safetensors").write_bytes(bytes(data))
    last = sorted(meta_of(bundle_path)["digest"]["tensors"])[-1]  # safetensors lays the tensors out by name
    with pytest.raises(BundleError, match=rf"tensor '{last}' does not match the digest recorded with it: damaged"):
        load_bundle(tmp_path / "flipped.safetensors")
    # a digit of the calibration in the metadata: still valid JSON, still a number
    meta = meta_of(bundle_path)
    text = json.dumps(meta["calibration"]["a"]).encode()
    key = b'\\"a\\": '  # the metadata is a JSON string inside safetensors' JSON header: quotes escaped
    at = bytes(data).index(key + text) + len(key) + len(text) - 1  # its last digit
    data = bytearray(bundle_path.read_bytes())
    data[at] = ord("7") if data[at] != ord("7") else ord("3")
    (tmp_path / "meta.safetensors").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="its metadata does not match the digest recorded with it: damaged"):
        load_bundle(tmp_path / "meta.safetensors")
    code, _, err = show(tmp_path / "meta.safetensors", capsys)
    assert code == 2 and "its metadata does not match the digest" in err and err.count("\n") == 1


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda m: m["calibration"].update(a="1.5"),
            r"'calibration.a': input should be a valid number \(got \"1.5\"\)",
        ),
        (lambda m: m.update(seeds="0,1"), r"'seeds': input should be a valid list \(got \"0,1\"\)"),
        (lambda m: m["thresholds"]["best_f1"].update(threshold=None), r"'thresholds.best_f1.threshold': input should"),
        (lambda m: m["inputs"].update(positions="middle"), r"'inputs.positions': input should be 'predicting' or"),
        (lambda m: m.pop("calibration"), r"'calibration': field required"),
        (lambda m: m.update(layer=9), r"'layer' 9 is above 'n_layers' 3"),
        (lambda m: m.update(default_threshold="fpr_0.5"), r"'default_threshold' 'fpr_0.5' is none of 'thresholds'"),
        (lambda m: m["inputs"].update(prompt_template="Q: {question}"), r"'inputs.prompt_template' does not match"),
        (lambda m: m.update(params={"dim": "wide"}), r"'params.dim': input should be a valid integer"),
    ],
)
def test_bundle_metadata_of_the_wrong_type_or_shape_is_named_with_its_key(bundle_path, tmp_path, change, match):
    """Written with a valid digest (an exporter's bug, a hand edit): the metadata is checked too."""
    bad = resaved(bundle_path, tmp_path / "bad.safetensors", change_meta=change)
    with pytest.raises(DataError, match=rf"^{bad}: bundle metadata {match}.*: re-export it"):
        load_bundle(bad)


@pytest.mark.hostile
def test_bundle_metadata_that_is_not_json_is_named(bundle_path, tmp_path):
    from safetensors.torch import load_file, save_file

    save_file(load_file(bundle_path), str(tmp_path / "b.safetensors"), metadata={"bundle": '{"format": "halludetect'})
    with pytest.raises(BundleError, match=r"b.safetensors: the bundle metadata is not valid JSON \(Unterminated"):
        load_bundle(tmp_path / "b.safetensors")


@pytest.mark.hostile
def test_a_format_1_bundle_without_a_digest_is_read_with_a_warning(bundle_path, tmp_path, capsys):
    """The stated rule for bundles written before the digest: every check but the digest's, and a
    warning on every load (score and show) that damage to them cannot be detected."""
    from safetensors.torch import load_file, save_file

    old = {k: v for k, v in meta_of(bundle_path).items() if k != "digest"} | {"format_version": 1}
    tensors = load_file(bundle_path)
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={"bundle": json.dumps(old)})
    b = load_bundle(tmp_path / "v1.safetensors")
    assert b.warnings == [
        f"{tmp_path / 'v1.safetensors'} is a format 1 bundle, written before bundles recorded a digest: damage "
        "to its bytes cannot be detected; re-export it (dvc repro export@<model>-<dataset>-<method>) to add one"
    ]
    code, out, err = show(tmp_path / "v1.safetensors", capsys)
    assert code == 0 and json.loads(out)["format_version"] == 1 and err == f"warning: {b.warnings[0]}\n"
    tensors["seed_0.head.bias"][0] = float("nan")  # its weights are still checked
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={"bundle": json.dumps(old)})
    with pytest.raises(BundleError, match="tensor 'seed_0.head.bias' holds 1 NaN"):
        load_bundle(tmp_path / "v1.safetensors")
    assert load_bundle(bundle_path).warnings == []  # format 2: checked, nothing to warn of


@pytest.mark.hostile
@pytest.mark.parametrize("choice", ["nan", "inf", "-Infinity", "1e999", float("nan"), float("-inf")])
def test_a_non_finite_threshold_is_refused(bundle_path, choice):
    with pytest.raises(BundleError, match=rf"^threshold {choice!r} is not a finite logit: give one this bundle "):
        load_bundle(bundle_path).threshold(choice)
