"""Training a layer's detectors: every seed (batched.py trains them together, loop.py one at a
time), each seed's best weights scored on validation and test, and the layer's outputs written
(weights, curves, scores, figures). The loop itself, its losses and recipes are in loop.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from halludetect.core import numerics
from halludetect.core.atomic_io import atomic_path, write_json, write_parquet
from halludetect.detectors.batched import batchable, train_batched
from halludetect.detectors.build import build_detector, origin_meta, save_detector
from halludetect.detectors.data import SplitData
from halludetect.detectors.inference import score
from halludetect.detectors.loop import (  # noqa: F401 - the loop's names, as callers import them from here
    RECIPES,
    PairedSampler,
    Recipe,
    TrainResult,
    check_recipe,
    epoch_batches,
    epoch_margins,
    hami_mil_loss,
    logistic_loss,
    recipe_of,
    train_detector,
)
from halludetect.methods import method as lookup_method
from halludetect.metrics import auroc, margin, mean_se, split_metrics


# ------------------------------------------------------------------- several seeds at once
@dataclass
class SeedResult:
    seed: int
    result: TrainResult
    scores: dict[str, np.ndarray]  # split -> [B] logits of the best epoch's weights, in the split's order
    last_scores: dict[str, np.ndarray] = field(default_factory=dict)  # the same for the last epoch's weights
    seconds: float = 0.0  # wall time of this seed's training (its epochs, with their evaluations)


def _scored(method: str, method_params, d: int, seed: int, res: TrainResult, splits: dict, seconds: float):
    """A seed's result with its best and last weights scored on `splits`."""
    model = build_detector(method, d, method_params)
    scores = {}
    for which, state in (("best", res.state_dict), ("last", res.last_state_dict)):
        model.load_state_dict(state)
        scores[which] = {split: score(model, data) for split, data in splits.items()}
    return SeedResult(seed, res, scores["best"], scores["last"], seconds)


def train_seeds(
    method: str,
    method_params,
    train: SplitData,
    val: SplitData,
    score_splits: dict[str, SplitData],
    seeds: list[int],
    *,
    epochs: int,
    batch_size: int,
    device: str = "cpu",
    workers: int | None = None,
    recipe: str | Recipe = "paper",
) -> list[SeedResult]:
    """`train_detector` for every seed, then each seed's best and last weights scored on `score_splits`.

    On the CPU the seeds of a built-in network train together in this process as one batched model,
    on one thread (batched.py: each seed gets its `train_detector` weights, to float tolerance):
    the seeds share every op but the few that mix a seed's rows, instead of each paying them in a
    process of its own. Any other network (a user's plugin), a method fitted in closed form, and any
    GPU run train their seeds one after another in this process, as `train_detector` does.
    `workers` is accepted for callers of the former worker pool and no longer used. A seed's
    numbers never depend on the thread count or on the seeds beside it (tested).
    """

    d = int(train.tokens.shape[-1])
    with numerics.fixed_threads(1):  # a seed's numbers never depend on the machine's core count
        t0 = time.perf_counter()
        batched = device == "cpu" and lookup_method(method).fit.loop and len(seeds) > 1
        if batched:
            with torch.random.fork_rng(devices=[]):  # building a network draws its initial weights
                batched = batchable(build_detector(method, d, method_params))
        if batched:
            results = train_batched(
                method, method_params, train, val, seeds, epochs=epochs, batch_size=batch_size, recipe=recipe
            )
            seconds = time.perf_counter() - t0  # the seeds trained together: each took the whole run
            return [
                _scored(method, method_params, d, s, r, score_splits, seconds)
                for s, r in zip(seeds, results, strict=True)
            ]
        # one after another: a network with no batched form here is never given other numbers
        out = []
        for seed in seeds:
            t0 = time.perf_counter()
            res = train_detector(
                method,
                method_params,
                train,
                val,
                epochs=epochs,
                batch_size=batch_size,
                seed=seed,
                device=device,
                recipe=recipe,
            )
            out.append(_scored(method, method_params, d, seed, res, score_splits, time.perf_counter() - t0))
        return out


# ------------------------------------------------------------------ a layer's outputs
def write_gradient_ratio(path: Path, results: list) -> None:
    """Theorem 2's trace of every seed (`seed_<S>`: per-epoch summaries, the best epoch's per-bag
    values), for the methods that have one (mean, max); nothing for the others."""
    traced = {f"seed_{r.seed}": r.result.gradient_ratio for r in results if r.result.gradient_ratio is not None}
    if traced:
        write_json(path, traced)


def scores_frame(splits: dict[str, SplitData], results: list) -> pl.DataFrame:
    """One row per scored response and seed: what the layer's detectors said, with the label."""
    frames = []
    for split, data in splits.items():
        qid, sample = zip(*(rid.rsplit("/", 1) for rid in data.response_ids), strict=True)
        base = {
            "response_id": data.response_ids,
            "question_id": list(qid),
            "sample_index": [int(s) for s in sample],
            "split": [split] * len(data),
            "label": data.y.numpy().astype(np.int8),
            "n_tokens": data.lengths.numpy().astype(np.int32),
            "p_sem": [None] * len(data) if data.p_sem is None else data.p_sem.numpy().astype(np.float64),
        }
        for r in results:
            frames.append(
                pl.DataFrame({**base, "seed": [r.seed] * len(data), "score": r.scores[split]}, schema=SCORES_SCHEMA)
            )
    return pl.concat(frames)


SCORES_SCHEMA = {
    "response_id": pl.String,
    "question_id": pl.String,
    "sample_index": pl.Int32,
    "split": pl.String,
    "label": pl.Int8,
    "n_tokens": pl.Int32,
    "p_sem": pl.Float64,
    "seed": pl.Int32,
    "score": pl.Float64,
}


def layer_metrics(
    splits: dict[str, SplitData], results: list, *, n_train: int, excluded: dict, method: str | None = None
) -> dict:
    """A layer's figures: val and test metrics over seeds (no bootstrap: that is for the chosen
    layer only), each seed's best epoch, the last epoch's AUROC and margin, the margins by epoch,
    and what was left out."""
    out = {
        "seeds": [r.seed for r in results],
        "n_train": n_train,
        "excluded": excluded,
        "best_epoch": {str(r.seed): r.result.best_epoch for r in results},
    }
    logits = lookup_method(method).logits if method else True
    for split, data in splits.items():
        out[split] = split_metrics(data.y.numpy(), [r.scores[split] for r in results], logits=logits)
    out |= epoch_figures(splits, results, logits=logits)
    return out


def epoch_figures(splits: dict[str, SplitData], results: list, logits: bool = True) -> dict:
    """What the paper reads after its last epoch and what training did epoch by epoch:
    `last_epoch` (AUROC and margin of the last epoch's weights per split, over seeds; the paper's
    margin table is this, after 100 epochs) and `margin_by_epoch` (train and val margins, mean
    over seeds, one value per epoch: Theorem 1's expansion). A method fitted in one step (SEP,
    EigenScore) has one epoch and no per-epoch margins; a score that is no logit has no margin."""
    last = {"epoch": len(results[0].result.curve)}
    for split, data in splits.items():
        y = data.y.numpy()
        last[split] = {
            "auroc": mean_se([auroc(y, r.last_scores[split]) for r in results]),
            "margin": mean_se([margin(y, r.last_scores[split]) for r in results]) if logits else None,
        }
    rows = [row for r in results for row in r.result.curve]
    if not logits or not all("train_margin" in row for row in rows):
        return {"last_epoch": last}
    by_epoch = {
        key: np.mean([[row[f"{key}_margin"] for row in r.result.curve] for r in results], axis=0).tolist()
        for key in ("train", "val")
    }
    return {"last_epoch": last, "margin_by_epoch": by_epoch}


def training_time(results: list, wall_seconds: float, workers: int, device: str) -> dict:
    """How long a layer's training took: each seed's own wall time, and all seeds' together."""
    return {
        "seconds_per_seed": {str(r.seed): r.seconds for r in results},
        "mean_seconds_per_seed": float(np.mean([r.seconds for r in results])),
        "wall_seconds": wall_seconds,
        "parallel_workers": workers,
        "device": device,
        "what": "wall time of each seed's epochs with their per-epoch evaluations (on the CPU the seeds train "
        "together as one batched model in one process, so each seed's time is that whole run), and of all seeds; "
        "parallel_workers: how many such processes (layers) shared the cores",
    }


def train_layer(
    method: str,
    method_params,
    data: dict[str, SplitData],
    seeds: list[int],
    *,
    layer: int,
    epochs: int,
    batch_size: int,
    device: str,
    out_dir: Path,
    scores_path: Path,
    metrics_path: Path,
    timing_path: Path | None = None,
    recipe: str = "paper",
    log=print,
) -> list[SeedResult]:
    """Train every seed on one layer's train split (best epoch on val), then write the layer's
    outputs: `out_dir/seed_<S>.safetensors` (+ curves.json, summary.json), the val/test scores of
    every seed (Parquet), the layer's figures (JSON) and, to `timing_path`, its training time
    (JSON: wall times differ on every run, so they are kept apart from the figures, which give
    the same bytes on every run, as the clustering keeps its times apart). Each is written
    atomically."""
    check_recipe(recipe, method_params, len(data["train"]), batch_size)  # before any training starts
    t0 = time.perf_counter()
    results = train_seeds(
        method,
        method_params,
        data["train"],
        data["val"],
        {s: data[s] for s in ("val", "test")},
        seeds,
        epochs=epochs,
        batch_size=batch_size,
        device=device,
        recipe=recipe,
    )
    wall = time.perf_counter() - t0
    curves, summary = {}, {}
    with atomic_path(out_dir, is_dir=True) as tmp:
        for r in results:
            save_detector(
                tmp / f"seed_{r.seed}.safetensors",
                r.result.state_dict,
                {
                    "method": method,
                    "layer": layer,
                    "seed": r.seed,
                    "best_epoch": r.result.best_epoch,
                    "d": int(data["train"].tokens.shape[-1]),
                    "params": method_params.model_dump(),
                    **({"origin": o} if (o := origin_meta(method)) else {}),
                    "recipe": recipe,
                },
            )
            curves[f"seed_{r.seed}"] = r.result.curve
            summary[f"seed_{r.seed}"] = {"best_epoch": r.result.best_epoch, "val_auroc": r.result.best_val_auroc}
            log(
                f"{method} layer {layer} seed {r.seed}: best epoch {r.result.best_epoch}, "
                f"val AUROC {r.result.best_val_auroc:.3f}"
            )
        write_json(tmp / "curves.json", curves)
        write_json(tmp / "summary.json", summary)
        write_gradient_ratio(tmp / "gradient_ratio.json", results)
    scored = {s: data[s] for s in ("val", "test")}
    write_parquet(scores_path, scores_frame(scored, results))
    write_json(
        metrics_path,
        {
            "method": method,
            "layer": layer,
            "train": {"recipe": recipe, "epochs": epochs, "batch_size": batch_size},
            **layer_metrics(
                scored,
                results,
                n_train=len(data["train"]),
                excluded={s: d.excluded for s, d in data.items()},
                method=method,
            ),
        },
    )
    if timing_path is not None:
        workers = 1 if device != "cpu" else len(seeds)  # seeds trained at once (batched.py)
        write_json(timing_path, training_time(results, wall, workers, device))
    return results
