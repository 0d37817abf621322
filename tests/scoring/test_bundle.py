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
from sklearn.metrics import log_loss, roc_auc_score

from halludetect.config import load_params
from halludetect.core.errors import DataError
from halludetect.detectors.build import load_detector
from halludetect.prompts import GENERATION, template_hash
from halludetect.scoring.answer_range import kept_answers
from halludetect.scoring.bundle import (
    BundleError,
    choose_thresholds,
    export_bundle,
    fit_platt,
    load_bundle,
    metadata_digest,
    rates_at_threshold,
    save_bundle,
    tensor_digest,
    threshold_at_fpr,
    threshold_best_f1,
)


def labelled_scores(n=400, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    return y, rng.normal(size=n) + 1.5 * y


def test_thresholds_meet_their_false_positive_rate_and_best_f1_is_the_best():
    y, z = labelled_scores()
    yt, zt = labelled_scores(seed=1)
    t = choose_thresholds(y, z, [0.01, 0.05, 0.1], (yt, zt))
    assert sorted(t) == ["best_f1", "fpr_0.01", "fpr_0.05", "fpr_0.1"]
    neg = z[y == 0]
    for target in (0.01, 0.05, 0.1):
        entry = t[f"fpr_{target:g}"]
        assert np.mean(neg >= entry["threshold"]) == entry["val_fpr"] <= target == entry["target_fpr"]
        assert np.mean(z[y == 1] >= entry["threshold"]) == entry["val_tpr"]
        # the lowest such threshold: one score lower and the target would be exceeded
        lower = z[z < entry["threshold"]].max()
        assert np.mean(neg >= lower) > target
        # test figures of the same threshold, for the reader
        assert entry["test_fpr"] == np.mean(zt[yt == 0] >= entry["threshold"])
        assert entry["test_tpr"] == np.mean(zt[yt == 1] >= entry["threshold"])

    def f1(th):
        flag = z >= th
        tp = (flag & (y == 1)).sum()
        return 2 * tp / (flag.sum() + (y == 1).sum())

    assert t["best_f1"]["val_f1"] == pytest.approx(max(f1(th) for th in z))
    assert t["best_f1"]["val_f1"] == pytest.approx(f1(t["best_f1"]["threshold"]))
    assert "target_fpr" not in t["best_f1"]


# Worked out by hand: 10 correct answers (0) and 5 hallucinated (1); three scores tie at 5.
HAND_Y = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
HAND_Z = np.array([9.0, 5, 5, 4, 3, 2, 1, 0, -1, -2, 8, 6, 5, 3.5, -3])


@pytest.mark.parametrize(
    ("target", "threshold", "fpr", "tpr", "flagged"),
    [
        # at most 1 correct answer: 9 (correct), 8 and 6 (hallucinated); flagging 5 would add the
        # two correct 5s with the hallucinated one (ties go together): FPR 0.3
        (0.1, 6.0, 0.1, 0.4, 3),
        (0.3, 5.0, 0.3, 0.6, 6),  # the tie included: exactly at the target
        (0.35, 5.0, 0.3, 0.6, 6),  # 4 (correct) would make it 0.4
        (0.5, 3.0, 0.5, 0.8, 9),  # 9, 8, 6, 5 x3, 4, 3.5, 3
    ],
)
def test_threshold_at_a_target_false_positive_rate_on_scores_worked_out_by_hand(target, threshold, fpr, tpr, flagged):
    got = threshold_at_fpr(HAND_Y, HAND_Z, target)
    assert got["threshold"] == threshold and got["target_fpr"] == target
    assert (got["fpr"], got["tpr"], got["flagged"], got["negatives"], got["positives"]) == (fpr, tpr, flagged, 10, 5)
    # another set's rates at that threshold (a transfer check): its own counts
    other = rates_at_threshold([0, 0, 1, 1], [threshold + 1, threshold - 1, threshold, threshold - 1], threshold)
    assert (other["fpr"], other["tpr"], other["flagged"], other["precision"]) == (0.5, 0.5, 2, 0.5)


def test_a_false_positive_rate_no_flag_reaches_flags_nothing():
    """The highest score, 9, is a correct answer's: any flag costs FPR >= 0.1, above 5%. The threshold
    then sits just above it: nothing is flagged (no threshold is ever missing)."""
    got = threshold_at_fpr(HAND_Y, HAND_Z, 0.05)
    assert got["threshold"] == np.nextafter(9.0, np.inf) and got["flagged"] == 0
    assert (got["fpr"], got["tpr"], got["f1"]) == (0.0, 0.0, 0.0)


def test_best_f1_is_still_there_worked_out_by_hand():
    # F1 = 2 TP / (TP + FP + 5) at each distinct score: 8 -> 2/7, 6 -> 4/8, 5 -> 6/11, 3.5 -> 8/13 (best), 3 -> 8/14
    got = threshold_best_f1(HAND_Y, HAND_Z)
    assert got["threshold"] == 3.5 and got["f1"] == pytest.approx(8 / 13) and (got["fpr"], got["tpr"]) == (0.4, 0.8)
    # a tie in F1: the lowest threshold, as before (sklearn's precision_recall_curve order)
    assert threshold_best_f1([1, 0, 0, 1], [4.0, 3.0, 2.0, 1.0])["threshold"] == 1.0  # F1 2/3 at 4 and at 1


@pytest.mark.parametrize(
    ("y", "z", "target", "match"),
    [
        ([0, 0, 1], [1.0, 2.0, 3.0], 1.0, "target false-positive rate 1.0 is not strictly between 0 and 1"),
        ([0, 0, 1], [1.0, 2.0, 3.0], 0.0, "target false-positive rate 0.0 is not strictly between 0 and 1"),
        ([0, 0, 0], [1.0, 2.0, 3.0], 0.05, "0 hallucinated and 3 correct answer.s.: .* need both classes"),
        ([0, 1, 1], [1.0, float("nan"), 3.0], 0.05, "1 score.s. are not finite"),
    ],
)
def test_threshold_choice_refuses_what_has_no_rate(y, z, target, match):
    with pytest.raises(ValueError, match=match):
        threshold_at_fpr(y, z, target)


def test_platt_scaling_is_an_unregularised_logistic_fit():
    """Newton's fit is the maximum-likelihood one: sklearn's unregularised fit run to a tight
    tolerance agrees to 1e-7, and the likelihood's gradient is zero there."""
    y, z = labelled_scores()
    c = fit_platt(y, z)
    ref = LogisticRegression(C=np.inf, tol=1e-12, max_iter=10_000).fit(z[:, None], y)
    assert c["a"] == pytest.approx(ref.coef_[0, 0], rel=1e-7) and c["b"] == pytest.approx(ref.intercept_[0], rel=1e-7)
    p = 1 / (1 + np.exp(-(c["a"] * z + c["b"])))
    np.testing.assert_allclose([np.sum((p - y) * z), np.sum(p - y)], 0, atol=1e-9 * len(y))
    assert c["converged"] and c["a"] > 0 and 0 < c["val_brier"] < 0.25
    assert c["val_log_loss"] == pytest.approx(log_loss(y, p), rel=1e-12)


def test_platt_scaling_of_separated_scores_stops_and_says_it_did_not_converge():
    """Validation logits that separate the classes have no maximum-likelihood fit: a finite slope
    after the step limit, `converged: false`, and the bundle's summary says what that means."""
    c = fit_platt(np.array([0, 0, 1, 1]), np.array([-1.0, -0.5, 0.5, 1.0]))
    assert not c["converged"] and np.isfinite(c["a"]) and c["a"] > 10
    assert fit_platt(np.array([0, 1, 0, 1]), np.ones(4))["a"] == 0  # one score for all: the base rate


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


def show(path, capsys, *extra: str) -> tuple[int, str, str]:
    """`halludetect show PATH [extra]`: exit code, stdout, stderr."""
    from halludetect import cli

    try:
        cli.main(["show", str(path), *extra])
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
        # format 3: each threshold's rates, each split's hallucinated count, and how they fit together
        (
            lambda m: m["thresholds"]["fpr_0.05"].pop("test_fpr"),
            r"'thresholds.fpr_0.05.test_fpr' is missing \(format 3 records it\)",
        ),
        (lambda m: m["evaluation"].pop("n_val_hallucinated"), r"'evaluation.n_val_hallucinated' is missing"),
        (lambda m: m["evaluation"].update(n_test_hallucinated="3"), r"'evaluation.n_test_hallucinated': input should"),
        (lambda m: m["thresholds"]["best_f1"].update(val_tpr=1.5), r"'thresholds.best_f1.val_tpr': input should be"),
        (
            lambda m: m["thresholds"]["fpr_0.05"].update(val_fpr=0.2),
            r"'thresholds.fpr_0.05.val_fpr' 0.2 is above its 'target_fpr' 0.05",
        ),
        (
            lambda m: m["thresholds"]["fpr_0.05"].update(target_fpr=0.1),
            r"'thresholds.fpr_0.05.target_fpr' is 0.1, not the rate its name says",
        ),
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
        "to its bytes cannot be detected; re-export it (dvc repro evaluate@<model>-<dataset>-<method>) to add one"
    ]
    code, out, err = show(tmp_path / "v1.safetensors", capsys, "--json")
    assert code == 0 and json.loads(out)["format_version"] == 1 and err == f"warning: {b.warnings[0]}\n"
    tensors["seed_0.head.bias"][0] = float("nan")  # its weights are still checked
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={"bundle": json.dumps(old)})
    with pytest.raises(BundleError, match="tensor 'seed_0.head.bias' holds 1 NaN"):
        load_bundle(tmp_path / "v1.safetensors")
    assert load_bundle(bundle_path).warnings == []  # format 3: checked, nothing to warn of


@pytest.mark.hostile
@pytest.mark.parametrize("choice", ["nan", "inf", "-Infinity", "1e999", float("nan"), float("-inf")])
def test_a_non_finite_threshold_is_refused(bundle_path, choice):
    with pytest.raises(BundleError, match=rf"^threshold {choice!r} is not a finite logit: give one this bundle "):
        load_bundle(bundle_path).threshold(choice)


def saved_as_version(bundle_path, out, version: int, change_meta) -> None:
    """The bundle's tensors with changed metadata stamped `version`, with a valid digest (as that
    version's export wrote it)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(bundle_path)
    meta = {k: v for k, v in meta_of(bundle_path).items() if k != "digest"} | {"format_version": version}
    change_meta(meta)
    meta["digest"] = {
        "algorithm": "sha256",
        "tensors": {name: tensor_digest(t) for name, t in sorted(tensors.items())},
        "metadata": metadata_digest(meta),
    }
    save_file(tensors, str(out), metadata={"bundle": json.dumps(meta, sort_keys=True)})


def as_format_2(meta: dict) -> None:
    """What the format 2 export wrote: no test rates, no hallucinated counts, best F1 the default."""
    for entry in meta["thresholds"].values():
        del entry["test_fpr"], entry["test_tpr"]
    del meta["evaluation"]["n_val_hallucinated"], meta["evaluation"]["n_test_hallucinated"]
    meta["default_threshold"] = "best_f1"


@pytest.mark.hostile
def test_a_format_2_bundle_is_read_with_a_warning_saying_what_it_lacks(bundle_path, tmp_path, capsys):
    """Format 3 added each threshold's test rates: a format 2 bundle is read with every check and a
    warning on every load, which also says what its best-F1 default flags on validation."""
    out = tmp_path / "v2.safetensors"
    saved_as_version(bundle_path, out, 2, as_format_2)
    b = load_bundle(out)
    fpr = b.meta["thresholds"]["best_f1"]["val_fpr"]
    assert b.warnings == [
        f"{out} is a format 2 bundle, written before bundles recorded how each threshold does on test: "
        "`halludetect show` prints validation figures only; re-export it (dvc repro "
        f"evaluate@<model>-<dataset>-<method>) to add them; its default threshold, best_f1, flags {fpr:.0%} of "
        "validation's correct answers (pass --threshold fpr_0.05 or re-export it for a default chosen at a "
        "false-positive rate)"
    ]
    assert b.threshold() == ("best_f1", b.meta["thresholds"]["best_f1"]["threshold"])
    code, text, err = show(out, capsys)
    assert code == 0 and err == f"warning: {b.warnings[0]}\n"
    assert "test: not recorded (format 2: re-export the bundle)" in text
    assert "validation   " in text and " hallucinated" not in text.split("validation", 1)[1].splitlines()[0]
    # a format 2 bundle without its digest is damaged, as before
    saved_as_version(bundle_path, out, 2, lambda m: as_format_2(m))
    raw = meta_of(out)
    del raw["digest"]
    from safetensors.torch import load_file, save_file

    save_file(load_file(out), str(out), metadata={"bundle": json.dumps(raw)})
    with pytest.raises(BundleError, match=r"'digest' is missing \(format version 2 records it\)"):
        load_bundle(out)
