"""Training MIL detectors on one layer's bags, with the best epoch chosen on validation.

Data flow: one packed `SplitData` per split (data.py) -> `epochs` of mini-batches
gathered by index arithmetic -> validation AUROC after every epoch -> the weights of the best
epoch (the first best on ties).

Losses:
  logistic  log(1 + exp(-y z)), y in {-1, 1}: every method but HaMI (and HaMI as an option).
  mil       the HaMI code's paired loss on sigmoid token scores s: each step draws as many
            hallucinated as correct bags, pairs them in order, and minimises
            mean_i (1 - topk_mean(s_hal_i)^2 + topk_mean(s_ok_i)^2)
            + w * sum over bags longer than `smooth_min_len` of sum_t (s_t - s_t+1)^2 / pairs.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import torch
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.core import numerics
from halludetect.core.atomic_io import atomic_path, write_json, write_parquet
from halludetect.detectors.build import build_detector, save_detector
from halludetect.detectors.data import SplitData
from halludetect.detectors.gradient_ratio import GradientRatioTrace
from halludetect.detectors.inference import score
from halludetect.detectors.pooling import topk_mean
from halludetect.metrics import auroc, split_metrics


def hami_mil_loss(model: nn.Module, bags: Bags, y: torch.Tensor, params) -> torch.Tensor:
    """The HaMI code's paired MIL loss (module docstring), batched over bags."""
    s = torch.sigmoid(model.token_logits(bags))  # [N]
    bag_score = topk_mean(bags.pad(s), bags.mask, params.k_ratio)  # [B]
    ok, hal = bag_score[y == 0], bag_score[y == 1]
    if len(ok) != len(hal):
        raise ValueError(f"the mil loss pairs bags: got {len(ok)} correct and {len(hal)} hallucinated")
    # consecutive tokens of one bag, in bags longer than smooth_min_len
    same = bags.bag_of_token[1:] == bags.bag_of_token[:-1]  # [N - 1]
    long = bags.lengths[bags.bag_of_token[1:]] > params.smooth_min_len  # [N - 1]
    smooth = ((s[1:] - s[:-1]) ** 2 * (same & long)).sum()
    return ((1 - hal**2 + ok**2).sum() + params.smoothness * smooth) / len(ok)


class PairedSampler:
    """Batches of batch_size/2 correct + batch_size/2 hallucinated bags, each class drawn
    from its own endlessly reshuffled stream (as the HaMI code's two loaders); an epoch has
    as many steps as a plain pass over the training set."""

    def __init__(self, y: torch.Tensor, batch_size: int, gen: torch.Generator):
        self.pools = [torch.nonzero(y == c).squeeze(1) for c in (0, 1)]
        self.queues = [torch.empty(0, dtype=torch.int64)] * 2
        self.half = max(1, batch_size // 2)
        self.steps = -(-len(y) // batch_size)
        self.gen = gen

    def _take(self, c: int) -> torch.Tensor:
        while len(self.queues[c]) < self.half:
            pool = self.pools[c]
            self.queues[c] = torch.cat([self.queues[c], pool[torch.randperm(len(pool), generator=self.gen)]])
        out, self.queues[c] = self.queues[c][: self.half], self.queues[c][self.half :]
        return out

    def epoch(self):
        for _ in range(self.steps):
            yield torch.cat([self._take(0), self._take(1)])


@dataclass
class TrainResult:
    state_dict: dict[str, torch.Tensor]
    best_epoch: int  # 1-based
    best_val_auroc: float
    curve: list[dict]  # per epoch: epoch, train_loss, val_auroc
    gradient_ratio: dict | None = None  # Theorem 2's trace (mean and max networks): gradient_ratio.py


def train_detector(
    method: str,
    method_params,
    train: SplitData,
    val: SplitData,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    device: str = "cpu",
    trace_gradient_ratio: bool = True,
) -> TrainResult:
    """The paper's protocol: Adam with the method's lr and weight decay, `epochs` epochs,
    best epoch by validation AUROC. Deterministic for a seed on a given device. For a mean or max
    pooling network, Theorem 2's gradient-norm ratio is traced after every epoch (it draws no
    random numbers: the weights are the same without it)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    train, val = train.to(device), val.to(device)
    model = build_detector(method, train.tokens.shape[-1], method_params).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=method_params.lr, weight_decay=method_params.weight_decay)
    mil = getattr(method_params, "loss", "logistic") == "mil"
    sampler = PairedSampler(train.y.cpu(), batch_size, gen) if mil else None
    # log(1 + exp(-y z)) with y in {-1, 1} equals BCE-with-logits with y in {0, 1}.
    bce = nn.BCEWithLogitsLoss()
    best = TrainResult({}, 0, -1.0, [])
    val_y = val.y.cpu().numpy()
    trace = GradientRatioTrace.for_training(model, train) if trace_gradient_ratio else None
    for epoch in range(1, epochs + 1):
        model.train()
        total, n = 0.0, 0
        steps = sampler.epoch() if mil else torch.randperm(len(train), generator=gen).split(batch_size)
        for batch in steps:
            batch = batch.to(device)
            bags, y = train.bags(batch), train.y[batch]
            loss = hami_mil_loss(model, bags, y, method_params) if mil else bce(model(bags), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
            n += len(batch)
        val_auroc = float(auroc(val_y, score(model, val)))
        best.curve.append({"epoch": epoch, "train_loss": total / n, "val_auroc": val_auroc})
        if val_auroc > best.best_val_auroc:
            best.best_val_auroc, best.best_epoch = val_auroc, epoch
            best.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if trace is not None:
            trace.record(epoch, model)
    if trace is not None:
        best.gradient_ratio = trace.result(best.best_epoch)
    return best


# ------------------------------------------------------------------- several seeds at once
@dataclass
class SeedResult:
    seed: int
    result: TrainResult
    scores: dict[str, np.ndarray]  # split -> [B] logits of the best epoch's weights, in the split's order


_JOB: dict = {}  # what forked workers read: set before the pool starts, inherited copy-on-write


def _train_one(seed: int) -> SeedResult:
    job = _JOB
    with numerics.fixed_threads(1):  # a seed's numbers never depend on how many run beside it
        res = train_detector(
            job["method"],
            job["params"],
            job["train"],
            job["val"],
            epochs=job["epochs"],
            batch_size=job["batch_size"],
            seed=seed,
            device=job["device"],
        )
        model = build_detector(job["method"], job["train"].tokens.shape[-1], job["params"])
        model.load_state_dict(res.state_dict)
        scores = {split: score(model, data) for split, data in job["score"].items()}
    return SeedResult(seed, res, scores)


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
) -> list[SeedResult]:
    """`train_detector` for every seed, then each seed's best weights scored on `score_splits`.

    On the CPU the seeds train side by side in forked single-threaded worker processes, one per
    seed by default (`workers`): independent small trainings keep every core busy where one
    training's small matrices cannot, and with a process per seed the cores are shared evenly
    (3 seeds on 2 cores take 1.5 trainings' time, not 2). A seed gives the same bytes whatever
    the number of workers (tested). On a GPU they train one after another in this process.
    """
    _JOB.update(
        method=method,
        params=method_params,
        train=train,
        val=val,
        score=score_splits,
        epochs=epochs,
        batch_size=batch_size,
        device=device,
    )
    try:
        n = min(len(seeds), workers or len(seeds))
        if device != "cpu" or n <= 1:
            return [_train_one(s) for s in seeds]
        # fork: the workers inherit the data without copying or pickling it (at paper scale a
        # layer's states are gigabytes). A forked child must not use the parent's OpenMP pool:
        # each worker runs on one thread from its first instruction.
        with ProcessPoolExecutor(
            n, mp_context=multiprocessing.get_context("fork"), initializer=torch.set_num_threads, initargs=(1,)
        ) as pool:
            return list(pool.map(_train_one, seeds))
    finally:
        _JOB.clear()


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


def layer_metrics(splits: dict[str, SplitData], results: list, *, n_train: int, excluded: dict) -> dict:
    """A layer's figures: val and test metrics over seeds (no bootstrap: that is for the chosen
    layer only), each seed's best epoch, and what was left out."""
    out = {
        "seeds": [r.seed for r in results],
        "n_train": n_train,
        "excluded": excluded,
        "best_epoch": {str(r.seed): r.result.best_epoch for r in results},
    }
    for split, data in splits.items():
        out[split] = split_metrics(data.y.numpy(), [r.scores[split] for r in results])
    return out


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
    log=print,
) -> list[SeedResult]:
    """Train every seed on one layer's train split (best epoch on val), then write the layer's
    three outputs: `out_dir/seed_<S>.safetensors` (+ curves.json, summary.json), the val/test
    scores of every seed (Parquet), and the layer's figures (JSON). Each is written atomically."""
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
    )
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
            **layer_metrics(
                scored, results, n_train=len(data["train"]), excluded={s: d.excluded for s, d in data.items()}
            ),
        },
    )
    return results
