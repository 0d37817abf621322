"""Metrics for trained detectors and baselines: AUROC with a bootstrap interval, AUPRC,
logit-space margin, per layer, plus inference throughput.

Labels: hallucination = 1. The margin is mean(y z) with y in {-1, +1} and z the bag logit,
as the paper defines it (logit space, before the sigmoid). Several seeds are summarised as
mean and standard error. The best layer is the one with the highest mean validation AUROC;
test figures are only read at that layer (and per layer, for the AUROC-versus-layer plot).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from halludetect.detectors import load_detector
from halludetect.layers import LayerReader, layer_files, read_layer
from halludetect.responses import response_ids
from halludetect.training import DataError, SplitData, check_layer_files, check_two_classes, score, split_data


def margin(y01: np.ndarray, z: np.ndarray) -> float:
    return float(np.mean((2 * y01 - 1) * z))


def mean_se(values: list[float]) -> dict:
    v = np.asarray(values, dtype=np.float64)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None
    return {"mean": float(v.mean()), "stderr": se, "per_seed": [float(x) for x in v]}


def bootstrap_auroc_ci(y: np.ndarray, scores: list[np.ndarray], n: int, seed: int) -> list[float] | None:
    """95% percentile interval of the seed-mean AUROC, resampling test responses."""
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(n):
        idx = rng.integers(0, len(y), len(y))
        if y[idx].min() == y[idx].max():
            continue  # a one-class resample has no AUROC; it is skipped, not scored
        stats.append(np.mean([roc_auc_score(y[idx], s[idx]) for s in scores]))
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return [float(lo), float(hi)]


def split_metrics(y: np.ndarray, scores: list[np.ndarray], bootstrap: int = 0, seed: int = 0,
                  logits: bool = True) -> dict:
    """Metrics of one split for per-seed scores (each [N]). The margin needs logits: for a
    score that is not one (a baseline), it is None rather than a number on another scale."""
    out = {
        "n": int(len(y)),
        "n_hallucinated": int(y.sum()),
        "auroc": mean_se([roc_auc_score(y, s) for s in scores]),
        "auprc": mean_se([average_precision_score(y, s) for s in scores]),
        "margin": mean_se([margin(y, s) for s in scores]) if logits else None,
        "scores_mean_by_label": {str(lab): float(np.mean([s[y == lab].mean() for s in scores])) for lab in (0, 1)},
    }
    if bootstrap:
        out["auroc_ci95"] = bootstrap_auroc_ci(y, scores, bootstrap, seed)
    return out


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


def evaluate_baseline(scores: pl.DataFrame, judgments: pl.DataFrame, *, bootstrap: int, seed: int) -> dict:
    """A baseline's val/test figures from its per-response scores (columns rid, score)."""
    labels = judgments.filter(pl.col("kept")).select(response_ids(judgments).alias("rid"), "split", "label")
    joined = labels.join(scores, on="rid", how="left")
    out = {"best_layer": None, "layers": [], "excluded": {}}
    for split in ("val", "test"):
        part = joined.filter(pl.col("split") == split)
        ok = part.filter(pl.col("score").is_not_null() & pl.col("score").is_finite())
        out["excluded"][split] = {"no_score": part.height - ok.height}
        y = ok["label"].to_numpy().astype(np.int64)
        check_two_classes(y, split)
        out[split] = split_metrics(y, [ok["score"].to_numpy()], bootstrap=bootstrap if split == "test" else 0,
                                   seed=seed, logits=False)
    return out


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
