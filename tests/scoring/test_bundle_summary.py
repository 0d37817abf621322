"""`halludetect show`'s summary (halludetect/scoring/bundle_summary.py): every figure is the
bundle's metadata, the default threshold says how it was chosen and what it does, and what a
bundle does not record is said to be missing."""

import json

from halludetect.scoring.bundle import load_bundle
from halludetect.scoring.bundle_summary import summary_text


def test_the_summary_says_what_the_metadata_says(bundle_path):
    """Each line of the summary read back against the metadata (no figure typed into the test)."""
    b = load_bundle(bundle_path)
    text = summary_text(b)
    lines = {}  # label -> its text; a prose line wrapped under its label joined again
    for line in text.splitlines():
        if line[:13].strip():
            label = line[:13].strip()
            lines[label] = line[13:]
        elif label in ("trained on", "input") and not line[13:].startswith(("prompt ", "rows: ")):
            lines[label] += " " + line[13:]
    m, ev = b.meta, b.meta["evaluation"]
    assert lines["bundle"] == f"{bundle_path} (format 3, sha256 {b.sha256[:16]}...)"
    assert lines["detector"] == "max (Max pooling): the mean logit of 2 seeds (0, 1)"
    files = len(m["base_model"]["files"])
    pinned = f"(a local directory, pinned by the sha256 of its {files} files)"
    assert lines["base model"] == f"tiny: {m['base_model']['path']} {pinned}"
    assert lines["layer"].startswith(f"{m['layer']} of 3 (")
    assert lines["positions"].startswith("predicting: each answer token's state is read at the position that predicted")
    assert lines["trained on"].startswith("dataset 'mini', its train split (its size is not recorded in the bundle);")
    assert lines["validation"] == (
        f"{ev['n_val']:,} answers, {ev['n_val_hallucinated']:,} hallucinated: AUROC "
        f"{ev['val_auroc_ensemble']:.3f} (the seeds' mean logit)"
    )
    assert lines["test"].startswith(f"{ev['n_test']:,} answers, {ev['n_test_hallucinated']:,} hallucinated: AUROC")
    t = m["thresholds"]["fpr_0.05"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    assert lines["threshold"] == (
        f"fpr_0.05 = {t['threshold']:.4g} (the default): the lowest validation logit whose false-positive rate "
        "is at most 5.0%"
    )
    at = text.splitlines().index(f"threshold    {lines['threshold']}")
    rows = text.splitlines()[at + 1 :]
    assert rows[0].strip() == (
        f"validation FPR {pct(t['val_fpr'])}, TPR {pct(t['val_tpr'])}; test FPR {pct(t['test_fpr'])}, "
        f"TPR {pct(t['test_tpr'])}"
    )
    flags_none = t["val_fpr"] == t["val_tpr"] == 0.0  # the miniature DAG's detector: maybe nothing within 5%
    assert (
        rows[1].strip() == "it flags no validation answer: no threshold that flags one stays within the rate"
    ) == flags_none
    head = next(i for i, r in enumerate(rows) if r.split()[:2] == ["name", "logit"])
    table = [
        r.split() for r in rows[head + 1 : head + 5]
    ]  # every stored threshold: the rates from the lowest, then best F1
    assert [r[-6] for r in table] == ["fpr_0.01", "fpr_0.05", "fpr_0.1", "best_f1"] and table[1][0] == "*"
    f1 = m["thresholds"]["best_f1"]
    rates = [pct(f1[k]) for k in ("val_fpr", "val_tpr", "test_fpr", "test_tpr")]
    assert table[3][-5:] == [f"{f1['threshold']:.4g}", *rates]
    c = m["calibration"]
    assert lines["calibration"].startswith(f"Platt: probability = sigmoid({c['a']:.4g} score ")
    assert lines["input"].startswith("the base model's own answers: sampled from this model with the prompt below")
    assert "out of its distribution" in lines["input"]
    assert json.dumps(m["inputs"]["prompt_template"]) in text and "needs" not in text


def test_the_summary_says_when_the_calibration_did_not_converge(bundle_path):
    """A Platt fit on separated validation scores (fit_platt's `converged: false`) is said, with what it means."""
    b = load_bundle(bundle_path)
    assert "did not converge" not in summary_text(b)
    b.meta["calibration"]["converged"] = False
    assert "the fit did not converge: the validation scores separate the classes" in summary_text(b)
