"""Detector bundles (halludetect/scoring/bundle.py): the file format and clear
errors for what cannot be loaded: damage, wrong types, older formats."""

import json

import pytest
import torch

from halludetect.core.errors import DataError
from halludetect.scoring.bundle import (
    BundleError,
    load_bundle,
    metadata_digest,
    save_bundle,
    tensor_digest,
)


def meta_of(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["bundle"])


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
