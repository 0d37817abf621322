"""Evaluating trained detectors from the layer files: every layer's figures, the best layer
chosen on validation only, inference throughput, and HaMI (SP)'s extra cost.

The best layer is the one with the highest mean validation AUROC over seeds; test figures
are only read at that layer (and per layer, for the AUROC-versus-layer plot). The metrics
themselves are in metrics.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from halludetect.detector_data import SplitData, check_layer_files, split_data
from halludetect.detectors import load_detector
from halludetect.detectors.inference import score
from halludetect.detectors.registry import trained_layers
from halludetect.errors import DataError
from halludetect.layer_format import layer_filename, layer_files
from halludetect.layer_reader import LayerReader, read_layer
from halludetect.metrics import margin, split_metrics


@torch.no_grad()
def throughput(model, data: SplitData, repeats: int = 5, batch_size: int = 1024) -> float:
    """Samples/s of detector inference on a preloaded split (best of `repeats` passes)."""
    model.eval()
    score(model, data, batch_size)  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        score(model, data, batch_size)
        best = min(best, time.perf_counter() - t0)
    return float(len(data) / best)


@torch.no_grad()
def end_to_end_throughput(model, path: Path, index: np.ndarray, p_sem: torch.Tensor | None = None,
                          repeats: int = 3, batch_size: int = 1024) -> float:
    """Samples/s from opening the HDF5 layer file to the last logit (best of `repeats`)."""
    model.eval()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        with LayerReader(path) as layer:
            for a in range(0, len(index), batch_size):
                bags = layer.packed(index[a : a + batch_size])
                if p_sem is not None:
                    bags.p_sem = p_sem[a : a + batch_size]
                model(bags)
        best = min(best, time.perf_counter() - t0)
    return float(len(index) / best)


def load_models(detectors_dir: Path, method: str, layer: int, seeds: list[int], d: int) -> list:
    models = []
    for seed in seeds:
        weights = Path(detectors_dir) / f"layer_{layer:02d}_seed_{seed}.safetensors"
        if not weights.exists():
            raise FileNotFoundError(f"{weights} is missing: train layer {layer} with seed {seed} first "
                                    "(train.seeds must list the seeds evaluated)")
        model, meta = load_detector(weights)
        if meta["method"] != method or int(meta["d"]) != d:
            raise DataError(f"{weights} holds a '{meta['method']}' detector for d={meta['d']}, "
                            f"not '{method}' for d={d}: re-run train")
        models.append(model)
    return models


def evaluate_detector(method: str, activations: Path, detectors: Path, judgments: pl.DataFrame,
                      seeds: list[int], *, bootstrap: int, seed: int, repeats: int,
                      p_sem: dict[str, float] | None = None) -> dict:
    """Every layer's val/test figures, the best layer's full metrics and its throughput."""
    files = layer_files(activations)
    # A trained layer whose states are gone is an error, not a layer silently left out of the
    # choice of the best layer.
    if gone := {layer: paths for layer, paths in trained_layers(detectors).items() if layer not in files}:
        layer, paths = next(iter(gone.items()))
        raise DataError(f"{len(gone)} trained layer(s) {sorted(gone)} have no layer file in {activations} (e.g. "
                        f"{Path(activations) / layer_filename(layer)} for {paths[0]}): re-run dump (or dvc pull "
                        "that file); a best layer chosen without them would not be the best layer")
    check_layer_files(files, judgments, ("val", "test"), p_sem)
    per_layer, best = [], None
    for layer, path in files.items():
        data = read_layer(path, dtype=None)
        splits = {s: split_data(data, judgments, s, str(path), p_sem) for s in ("val", "test")}
        models = load_models(detectors, method, layer, seeds, data.states.shape[1])
        scores = {s: [score(m, d) for m in models] for s, d in splits.items()}
        y = {s: d.y.numpy() for s, d in splits.items()}
        row = {"layer": layer, "val_auroc": float(np.mean([roc_auc_score(y["val"], z) for z in scores["val"]])),
               "test_auroc": float(np.mean([roc_auc_score(y["test"], z) for z in scores["test"]])),
               "test_auprc": float(np.mean([average_precision_score(y["test"], z) for z in scores["test"]])),
               "test_margin": float(np.mean([margin(y["test"], z) for z in scores["test"]]))}
        per_layer.append(row)
        if best is None or row["val_auroc"] > best[0]["val_auroc"]:  # chosen on validation only
            best = (row, path, splits, scores, models)
        del data
    row, path, splits, scores, models = best
    test = splits["test"]
    return {
        "best_layer": row["layer"],
        "layer_selection": "highest mean validation AUROC over seeds",
        "val": split_metrics(splits["val"].y.numpy(), scores["val"]),
        "test": split_metrics(test.y.numpy(), scores["test"], bootstrap=bootstrap, seed=seed),
        "excluded": {s: d.excluded for s, d in splits.items()},
        "layers": per_layer,
        "throughput": {
            "preloaded_samples_per_s": throughput(models[0], test, repeats),
            "end_to_end_samples_per_s": end_to_end_throughput(models[0], path, test.layer_index, test.p_sem),
            "n": len(test),
            "what": "detector inference on the best layer's test responses, batches of 1024, best of "
                    f"{repeats} (preloaded float32 tensors) and of 3 (from opening the HDF5 file), "
                    f"{torch.get_num_threads()} CPU threads",
        },
    }


def hami_sp_cost(generation_metrics: dict, timings: pl.DataFrame, question_ids: list[str],
                 detector_samples_per_s: float) -> dict:
    """What one more response costs HaMI (SP) beyond the detector: sampling K - 1 more answers
    to get its P_sem, and clustering the K answers (the recorded NLI time of its question)."""
    k = generation_metrics["samples"] / generation_metrics["questions"]
    per_sample = generation_metrics["seconds_per_sample"]
    t = timings.filter(pl.col("question_id").is_in(question_ids))
    nli_seconds = float(t["seconds"].mean())
    extra = (k - 1) * per_sample + nli_seconds
    return {
        "samples_per_question": k,
        "seconds_per_sample": per_sample,
        "nli_seconds_per_question": nli_seconds,
        "nli_calls_per_question": float(t["nli_calls"].mean()),
        "extra_seconds_per_response": extra,
        "samples_per_s_with_sampling_and_nli": 1.0 / (extra + 1.0 / detector_samples_per_s),
        "what": "(K - 1) extra samples at generate's seconds_per_sample + the mean clustering seconds of the "
                "test questions (cluster_timings.parquet), added to the preloaded detector time",
    }
