"""A bundle from the DAG's outputs (the evaluate stage's last step): the best layer's detectors of
every seed, its thresholds and calibration fitted on validation (evaluation/thresholds.py), what
its input must be, and the range of the answers it was fit on; written in bundle.py's format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from halludetect.core.errors import DataError
from halludetect.detectors.build import load_detector, origin_meta
from halludetect.evaluation.thresholds import choose_thresholds, ensemble_scores, fit_platt
from halludetect.methods import SP_METHODS
from halludetect.metrics import auroc
from halludetect.prompts import template_hash
from halludetect.scoring.answer_range import answer_range
from halludetect.scoring.bundle import COMBINE, FORMAT, FORMAT_VERSION, save_bundle


def check_scores_match_metrics(scores: pl.DataFrame, metrics: dict, layer: int, source: str) -> None:
    """The scores table and the metrics JSON must come from the same evaluation."""
    row = next((r for r in metrics["layers"] if r["layer"] == layer), None)
    if row is None:
        raise DataError(f"{source}: the metrics list no layer {layer}")
    per_seed = []
    for _, part in scores.filter(pl.col("split") == "val").group_by("seed"):
        per_seed.append(auroc(part["label"].to_numpy(), part["score"].to_numpy()))
    if abs(float(np.mean(per_seed)) - row["val_auroc"]) > 1e-4:
        raise DataError(
            f"{source}: validation AUROC {np.mean(per_seed):.6f} from the scores, "
            f"{row['val_auroc']:.6f} in the metrics: they come from different runs; re-run evaluate"
        )


def p_sem_inputs(method: str, params: dict, given: dict | None) -> dict:
    """{"p_sem": ...} for a method that reads P_sem: which variant and lam (its params), and how
    many answers per question and which clustering made it (`given`); {} for the others."""
    if method not in SP_METHODS:
        return {}
    if not given or "samples_per_question" not in given:
        raise DataError(
            f"'{method}' reads P_sem: its bundle must say how P_sem was made (K answers per question, "
            "the clustering); pass p_sem_input"
        )
    return {"p_sem": {"variant": params["p_sem"], "lam": params["lam"], **given}}


def base_model_meta(manifest: dict) -> dict:
    """A bundle's `base_model`, from the model manifest (data/models/<m>.json): what pins the model."""
    preset = manifest["preset"]
    return {
        "name": manifest["name"],
        "path": preset["path"],
        "revision": preset.get("revision"),
        "resolved_revision": manifest.get("resolved_revision"),
        "files": manifest.get("files"),
        "hidden_size": int(manifest["hidden_size"]),
        "num_hidden_layers": int(manifest["num_hidden_layers"]),
        "preset": preset,
    }


def bundle_thresholds(
    val: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    fpr_targets: list[float],
    default_threshold: str,
    source: str,
    fix: str,
) -> dict[str, dict]:
    """A bundle's thresholds, chosen on validation (labels, scores) and measured on test: at each
    rate of `fpr_targets`, at export.threshold's (`default_threshold`) and at the best F1; each
    split must hold both classes (`source` and `fix` name where and what to re-run)."""
    for split, (y, _) in (("val", val), ("test", test)):
        if y.min() == y.max():
            raise DataError(
                f"{source}: every {split} answer is {'hallucinated' if y[0] else 'correct'}: a flag "
                f"threshold's false- and true-positive rates need both; {fix}"
            )
    # export.threshold may name a rate that fpr_targets does not list: it is stored too
    targets = sorted({*fpr_targets, *([float(default_threshold[4:])] if default_threshold != "best_f1" else [])})
    thresholds = choose_thresholds(*val, targets, test)
    if default_threshold not in thresholds:
        raise DataError(f"export.threshold '{default_threshold}' is none of {sorted(thresholds)}")
    return thresholds


def export_bundle(
    out: str | Path,
    *,
    metrics: dict,
    detectors_dir: str | Path,
    scores_dir: str | Path,
    manifest: dict,
    positions: str,
    states_dtype: str,
    prompt_template: str,
    fpr_targets: list[float],
    default_threshold: str,
    p_sem_input: dict | None = None,
    answers: pl.DataFrame | None = None,
) -> dict:
    """The bundle of an evaluated method's best layer, from the DAG's outputs:
    detectors `<detectors_dir>/layer_LL/seed_S.safetensors`, scores `<scores_dir>/layer_LL.parquet`
    (val and test rows per seed), the evaluation metrics and the model manifest; for a method that
    reads P_sem, `p_sem_input` says how its P_sem was made (K answers per question, the
    clustering; the variant and lam are added from the detector's params). `answers`: the kept
    answers' token log-probs by split (`answer_range.kept_answers`), for the range `score` checks
    rows against; without them the bundle records none. Returns its metadata."""
    layer = int(metrics["best_layer"])
    seeds = [int(s) for s in metrics["seeds"]]
    weights, params, d = {}, None, None
    for seed in seeds:
        f = Path(detectors_dir) / f"layer_{layer}" / f"seed_{seed}.safetensors"
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: the evaluation used seed {seed} at layer {layer}; re-run train")
        model, meta = load_detector(f)
        if meta["method"] != metrics["method"] or int(meta["layer"]) != layer:
            raise DataError(
                f"{f} holds a '{meta['method']}' detector of layer {meta['layer']}, not "
                f"'{metrics['method']}' of layer {layer}: re-run train"
            )
        if params is not None and (meta["params"] != params or int(meta["d"]) != d):
            raise DataError(f"{f}: trained with other params than seed {seeds[0]}'s: re-run train")
        params, d = meta["params"], int(meta["d"])
        weights[seed] = model.state_dict()
    if d != int(manifest["hidden_size"]):
        raise DataError(
            f"detectors of d={d} for a model of hidden size {manifest['hidden_size']}: "
            "the manifest and the detectors come from different models"
        )
    scores_path = Path(scores_dir) / f"layer_{layer}.parquet"
    scores = pl.read_parquet(scores_path)
    check_scores_match_metrics(scores, metrics, layer, str(scores_path))
    y_val, z_val = ensemble_scores(scores, "val", seeds, str(scores_path))
    y_test, z_test = ensemble_scores(scores, "test", seeds, str(scores_path))
    thresholds = bundle_thresholds(
        (y_val, z_val), (y_test, z_test), fpr_targets, default_threshold, str(scores_path), "re-run judge and train"
    )
    preset = manifest["preset"]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": metrics["method"],
        **({"origin": o} if (o := origin_meta(metrics["method"])) else {}),
        "params": params,
        "d": d,
        "layer": layer,
        "n_layers": int(manifest["num_hidden_layers"]),
        "base_model": base_model_meta(manifest),
        "inputs": {
            "positions": positions,
            "prompt_template": prompt_template,
            "prompt_hash": template_hash(prompt_template),
            "chat_template": bool(preset["chat_template"]),
            "states_dtype": states_dtype,
            **p_sem_inputs(metrics["method"], params, p_sem_input),
        },
        "seeds": seeds,
        "combine": COMBINE,
        "thresholds": thresholds,
        "default_threshold": default_threshold,
        "calibration": fit_platt(y_val, z_val),
        "evaluation": {
            "dataset": metrics.get("dataset"),
            "test_auroc_dag": metrics["test"]["auroc"],
            "val_auroc_ensemble": float(auroc(y_val, z_val)),
            "test_auroc_ensemble": float(auroc(y_test, z_test)),
            "n_val": int(len(y_val)),
            "n_test": int(len(y_test)),
            "n_val_hallucinated": int(y_val.sum()),
            "n_test_hallucinated": int(y_test.sum()),
            "layer_selection": metrics.get("layer_selection", "highest mean validation AUROC over seeds"),
        },
    }
    if answers is not None:
        meta["answer_range"] = answer_range(answers)
    save_bundle(out, weights, meta)
    return meta
