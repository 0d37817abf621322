"""Evaluating trained detectors: each layer's figures (written by its train stage), the best
layer chosen on validation only, its full metrics, inference throughput, and HaMI (SP)'s cost.

A layer's train stage scores its validation and test responses with every seed's best weights
(`scores_frame`, `layer_metrics`); the method's evaluation reads those small files for every
layer, picks the layer with the highest mean validation AUROC over seeds, and reads test
figures at that layer only (and per layer, for the AUROC-versus-layer plot). The metrics
themselves are in metrics.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import LayerReader
from halludetect.core.errors import DataError
from halludetect.detectors.build import load_detector
from halludetect.detectors.data import SplitData
from halludetect.detectors.inference import score
from halludetect.evaluation.score_tables import read_scores
from halludetect.metrics import question_groups, split_metrics


def _sync(device: torch.device) -> None:
    """CUDA runs asynchronously: a timer read before the kernels finish measures nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    return f"CPU, {torch.get_num_threads()} thread(s)"


@torch.no_grad()
def throughput(model, data: SplitData, repeats: int = 5, batch_size: int = 1024, device="cpu") -> float:
    """Samples/s of detector inference on a split preloaded on `device` (best of `repeats` passes,
    CUDA synchronised before and after each)."""
    device = torch.device(device)
    model = model.to(device).eval()
    data = data.to(device)
    score(model, data, batch_size)  # warm-up (kernel selection, caching allocator)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        score(model, data, batch_size)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return float(len(data) / best)


@torch.no_grad()
def single_response_seconds(model, data: SplitData, n: int = 256, device="cpu") -> float:
    """Median seconds to score one response alone (batch of one), over the first `n` responses:
    the detector's share of a one-request-at-a-time service. A method that scores a question's
    answers together needs them all for one: one question's answers are one batch."""
    device = torch.device(device)
    model = model.to(device).eval()
    data = data.to(device)
    alone = data.batches(1)[:n]  # (i, i + 1), or a question's answers
    model(data.slice(*alone[0]))  # warm-up
    times = []
    for a, b in alone:
        _sync(device)
        t0 = time.perf_counter()
        model(data.slice(a, b))
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


@torch.no_grad()
def end_to_end_throughput(
    model,
    path: Path,
    index: np.ndarray,
    p_sem: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 1024,
    device="cpu",
    ranges: list[tuple[int, int]] | None = None,
    groups: torch.Tensor | None = None,
) -> float:
    """Samples/s from opening the HDF5 layer file to the last logit on `device` (best of `repeats`).
    `ranges`: the batches (SplitData.batches, which keep a question's answers together)."""
    device = torch.device(device)
    model = model.to(device).eval()
    ranges = ranges or [(a, min(a + batch_size, len(index))) for a in range(0, len(index), batch_size)]
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        with LayerReader(path) as layer:
            for a, b in ranges:
                bags = layer.packed(index[a:b])
                bags = type(bags)(
                    bags.tokens.to(device),
                    bags.lengths.to(device),
                    None if p_sem is None else p_sem[a:b].to(device),
                    None if groups is None else groups[a:b].to(device),
                )
                model(bags)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return float(len(index) / best)


def load_models(detectors_dir: Path, method: str, layer: int, seeds: list[int], d: int) -> list:
    """The trained detectors of one layer, one per seed, checked against the method and d."""
    models = []
    for seed in seeds:
        weights = Path(detectors_dir) / f"seed_{seed}.safetensors"
        if not weights.exists():
            raise FileNotFoundError(
                f"{weights} is missing: train layer {layer} with seed {seed} first "
                "(train.seeds must list the seeds evaluated)"
            )
        model, meta = load_detector(weights)
        if meta["method"] != method or int(meta["d"]) != d or int(meta["layer"]) != layer:
            raise DataError(
                f"{weights} holds a '{meta['method']}' detector of layer {meta['layer']} for "
                f"d={meta['d']}, not '{method}' of layer {layer} for d={d}: re-run train"
            )
        models.append(model)
    return models


# --------------------------------------------------------------------- one method
def missing_layer_files(
    layers: list[int],
    seeds: list[int],
    dirs: dict[str, Path],
    stages: dict[str, str],
) -> list[str]:
    """Every file a trained layer of `layers` should have and lacks, each naming its layer and the
    stage that writes it. `dirs`: layer_metrics, scores, detectors, activations; `stages`: train
    (the method's train stage) and dump. The evaluation chooses among all of
    them, and DVC records the whole dump directory as its input: a missing file is no layer to
    leave out quietly."""
    problems = []
    for layer in layers:
        train = stages["train"].format(layer=layer)
        wanted = [
            (Path(dirs["layer_metrics"]) / f"layer_{layer}.json", train),
            (Path(dirs["scores"]) / f"layer_{layer}.parquet", train),
            *((Path(dirs["detectors"]) / f"layer_{layer}" / f"seed_{s}.safetensors", train) for s in seeds),
            (Path(dirs["activations"]) / layer_filename(layer), stages["dump"]),
        ]
        for path, stage in wanted:
            if not path.exists():
                problems.append(f"layer {layer}: {path} is missing (re-run {stage}, or `dvc pull {path}`)")
    return problems


def best_layer(per_layer: dict[int, dict]) -> int:
    """The layer with the highest mean validation AUROC over seeds (the lowest on ties)."""
    return max(sorted(per_layer), key=lambda layer: per_layer[layer]["val"]["auroc"]["mean"])


def evaluate_detector(
    per_layer: dict[int, dict],
    scores_dir: Path,
    seeds: list[int],
    *,
    bootstrap: int,
    seed: int,
    logits: bool = True,
    timing: dict[int, dict] | None = None,
) -> dict:
    """The method's figures: every layer's val/test AUROC (the plot), the layer chosen on
    validation, and its full val/test metrics from its scores (the test AUROC with a bootstrap
    interval); with every layer's training time (`timing`), the method's."""
    counts = {layer: (m["val"]["n"], m["test"]["n"]) for layer, m in per_layer.items()}
    if len(set(counts.values())) > 1:
        raise DataError(
            f"the layers were scored on different responses (val, test counts by layer: {counts}): "
            "they come from different dumps or labels; re-run train for every layer"
        )
    best = best_layer(per_layer)
    scores = read_scores(Path(scores_dir) / f"layer_{best}.parquet", seeds)
    figures = {}
    for split, (y, per_seed, rows) in scores.items():
        # The bootstrap resamples questions; margins are also reported by answer length (the bag's tokens).
        figures[split] = split_metrics(
            y,
            per_seed,
            bootstrap=bootstrap if split == "test" else 0,
            seed=seed,
            groups=question_groups(rows["question_id"].to_list()),
            lengths=rows["n_tokens"].to_numpy(),
            logits=logits,  # a score that is no logit (EigenScore) has no margin
        )
    return {
        "best_layer": best,
        "layer_selection": "highest mean validation AUROC over seeds",
        "val": figures["val"],
        "test": figures["test"],
        "excluded": per_layer[best]["excluded"],
        **training_figures(per_layer, best, timing),
        "layers": [
            {
                "layer": layer,
                "val_auroc": m["val"]["auroc"]["mean"],
                "test_auroc": m["test"]["auroc"]["mean"],
                "test_auprc": m["test"]["auprc"]["mean"],
                "test_margin": m["test"]["margin"]["mean"] if m["test"]["margin"] else None,
            }
            for layer, m in sorted(per_layer.items())
        ],
    }


def training_figures(per_layer: dict[int, dict], best: int, timing: dict[int, dict] | None = None) -> dict:
    """What training did at the best layer (layer files written before these keys existed give
    none): the recipe, the last epoch's AUROC and margin (the paper reads its margins after the
    last epoch, its AUROCs at the best), the margins by epoch, and, given every layer's training
    time, the best layer's, also summed over every layer (one seed's epochs per layer, as the
    paper's appendix totals it)."""
    m = per_layer[best]
    out = {k: m[k] for k in ("train", "last_epoch", "margin_by_epoch") if k in m}
    if timing and set(timing) >= set(per_layer):
        out["training_time"] = {
            **timing[best],
            "layer": best,
            "all_layers_mean_seconds_per_seed": float(sum(timing[k]["mean_seconds_per_seed"] for k in per_layer)),
            "all_layers_wall_seconds": float(sum(timing[k]["wall_seconds"] for k in per_layer)),
            "layers": len(per_layer),
        }
    return out


def detector_throughput(models: list, test: SplitData, layer_file: Path, repeats: int, device: str = "cpu") -> dict:
    """Inference speed of the chosen layer's detector on its test responses, on `device` (a
    resolved one: cpu, cuda, cuda:N)."""
    device = torch.device(device)
    where = device_name(device)
    return {
        "preloaded_samples_per_s": throughput(models[0], test, repeats, device=device),
        "end_to_end_samples_per_s": end_to_end_throughput(
            models[0],
            layer_file,
            test.layer_index,
            test.p_sem,
            device=device,
            ranges=test.batches(1024),
            groups=test.groups,
        ),
        "single_response_seconds": single_response_seconds(models[0], test, device=device),
        "n": len(test),
        "device": where,
        "what": "detector inference on the best layer's test responses, batches of 1024, best of "
        f"{repeats} (preloaded float32 tensors) and of 3 (from opening the HDF5 file), on {where}"
        f"{', synchronised' if device.type == 'cuda' else ''}; single_response_seconds: median of 256 "
        "responses scored one at a time",
    }


def hami_sp_cost(
    generation_metrics: dict,
    timings: pl.DataFrame,
    question_ids: list[str],
    detector_samples_per_s: float,
    latency: dict | None = None,
    detector_single_seconds: float | None = None,
) -> dict:
    """What one more response costs HaMI (SP) beyond the detector: sampling K - 1 more answers
    to get its P_sem, and clustering the K answers.

    amortised:  at generate's batched seconds per sample and the question's share of the batched
                NLI rounds (cluster_timings), added to the batched detector time: a throughput.
    sequential: one response at a time, as the `latency` stage timed it (K - 1 answers to that
                question alone, its NLI calls one after the other), plus the detector on that
                response alone: what a service answering one request at a time pays.
    """
    k = generation_metrics["samples"] / generation_metrics["questions"]
    per_sample = generation_metrics["seconds_per_sample"]
    t = timings.filter(pl.col("question_id").is_in(question_ids))
    nli_seconds = float(t["seconds"].mean())
    extra = (k - 1) * per_sample + nli_seconds
    out = {
        "samples_per_question": k,
        "seconds_per_sample": per_sample,
        "nli_seconds_per_question": nli_seconds,
        "nli_calls_per_question": float(t["nli_calls"].mean()),
        "extra_seconds_per_response": extra,
        "samples_per_s_with_sampling_and_nli": 1.0 / (extra + 1.0 / detector_samples_per_s),
        "what": "amortised: (K - 1) extra samples at generate's seconds_per_sample + the mean clustering seconds "
        "of the test questions (cluster_timings.parquet), added to the preloaded detector time",
    }
    if latency is not None:
        if detector_single_seconds is None:
            raise ValueError("the sequential cost needs the detector's time for one response alone")
        seq = latency["seconds_per_question"] + detector_single_seconds
        out["sequential"] = {**latency, "detector_seconds": detector_single_seconds, "seconds_per_response": seq}
        out["sequential_samples_per_s"] = 1.0 / seq
        out["what"] += (
            "; sequential: one response at a time, K - 1 answers to its question alone and its NLI "
            "calls one by one (the latency stage), plus the detector on that response alone"
        )
    return out
