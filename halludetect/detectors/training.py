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

Recipes (`train.recipe`): `paper` is the protocol the paper states (Adam at the method's fixed
learning rate, every batch of a shuffled pass). `authors` adds what the authors' training code
(github.com/FUJI1229/Hallucination_Detection, Detection/) does beyond it: a weight of 0.3 on the
hallucinated class in the logistic loss, ReduceLROnPlateau on the validation loss (factor 0.5,
patience 3, min lr 1e-7, stepped after every epoch) and dropping the last partial batch. That
code trains the embedding-based detectors with the logistic loss; HaMI's paired MIL loss is the
HaMI code's own loop (balanced pairs, no partial batch), which the recipe leaves as it is.

Per epoch, beside the loss and the validation AUROC, `curves.json` holds the margins mean(y z)
of the training and validation sets in eval mode (epoch_margins): the paper's Theorem 1 says
training expands them. The weights of the last epoch are scored too (the paper's margin table
is read after its 100 epochs; the AUROC tables at the best validation epoch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.core import numerics
from halludetect.core.atomic_io import atomic_path, write_json, write_parquet
from halludetect.core.errors import DataError
from halludetect.detectors.build import build_detector, origin_meta, save_detector
from halludetect.detectors.data import SplitData
from halludetect.detectors.gradient_ratio import GradientRatioTrace
from halludetect.detectors.inference import score
from halludetect.detectors.pooling import topk_mean
from halludetect.methods import method as lookup_method
from halludetect.metrics import auroc, margin, mean_se, split_metrics


@dataclass(frozen=True)
class Recipe:
    """What a training loop adds to the paper's protocol, for the logistic loss (module docstring)."""

    name: str
    pos_weight: float | None = None  # weight of the hallucinated class (y = 1) in the logistic loss
    plateau: dict | None = None  # ReduceLROnPlateau(mode="min", **plateau) on the validation loss
    drop_last: bool = False  # drop the last partial batch of every epoch


RECIPES = {
    "paper": Recipe("paper"),
    "authors": Recipe(
        "authors", pos_weight=0.3, plateau={"factor": 0.5, "patience": 3, "min_lr": 1e-7}, drop_last=True
    ),
}


def check_recipe(recipe: str | Recipe, method_params, n_train: int, batch_size: int) -> None:
    """A recipe that drops the last partial batch trains nothing on fewer bags than one batch:
    refused before any training (the MIL loss draws full batches of pairs and is not affected)."""
    rec = recipe_of(recipe)
    if rec.drop_last and getattr(method_params, "loss", "logistic") != "mil" and n_train < batch_size:
        raise DataError(
            f"train.recipe '{rec.name}' drops the last partial batch, and the training split has {n_train} "
            f"responses, fewer than train.batch_size {batch_size}: no step would run; lower train.batch_size "
            "or use train.recipe: paper"
        )


def recipe_of(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown training recipe '{recipe}'; choose from {sorted(RECIPES)}")
    return RECIPES[recipe]


def logistic_loss(z: torch.Tensor, y: torch.Tensor, pos_weight: float | None = None) -> torch.Tensor:
    """Mean over bags of log(1 + exp(-y z)), y in {-1, 1} (BCE with logits on y in {0, 1}), the
    hallucinated bags' terms weighted by `pos_weight` when given (the authors' 0.3)."""
    weight = None if pos_weight is None else torch.tensor([pos_weight], dtype=z.dtype, device=z.device)
    return nn.functional.binary_cross_entropy_with_logits(z, y, pos_weight=weight)


def epoch_batches(n: int, batch_size: int, gen: torch.Generator, drop_last: bool) -> list[torch.Tensor]:
    """One shuffled pass over n bags in batches; with drop_last the last partial batch is left out."""
    perm = torch.randperm(n, generator=gen)
    if drop_last:
        perm = perm[: n - n % batch_size]
    return list(perm.split(batch_size))


def epoch_margins(train_y: np.ndarray, train_z: np.ndarray, val_y: np.ndarray, val_z: np.ndarray) -> dict:
    """The margins mean(y z), y in {-1, 1}, of the training and validation sets after an epoch
    (eval mode): the quantity the paper's Theorem 1 says logistic-loss updates expand."""
    return {"train_margin": margin(train_y, train_z), "val_margin": margin(val_y, val_z)}


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
    curve: list[dict]  # per epoch: epoch, train_loss, val_auroc, lr, train_margin, val_margin (+ val_loss)
    last_state_dict: dict[str, torch.Tensor] = field(default_factory=dict)  # the weights after the last epoch
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
    recipe: str | Recipe = "paper",
    trace_gradient_ratio: bool = True,
) -> TrainResult:
    """The paper's protocol: Adam with the method's lr and weight decay, `epochs` epochs,
    best epoch by validation AUROC; `recipe` adds the authors' code's extras to the logistic
    loss (module docstring). Deterministic for a seed on a given device. For a mean or max
    pooling network, Theorem 2's gradient-norm ratio is traced after every epoch (it draws no
    random numbers: the weights are the same without it). A method fitted otherwise
    (`Method.fit`: a closed-form probe, an unsupervised score) goes to fitting.py."""
    if lookup_method(method).fit != "sgd":
        from halludetect.detectors.fitting import fit_detector

        state, val_auroc, info = fit_detector(method, method_params, train, val, device)
        return TrainResult(state, 1, val_auroc, [info], last_state_dict=state)  # one fit: the last is the best
    rec = recipe_of(recipe)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    train, val = train.to(device), val.to(device)
    model = build_detector(method, train.tokens.shape[-1], method_params).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=method_params.lr, weight_decay=method_params.weight_decay)
    mil = getattr(method_params, "loss", "logistic") == "mil"
    sampler = PairedSampler(train.y.cpu(), batch_size, gen) if mil else None
    # The recipe's extras belong to the logistic-loss loop; the MIL loss keeps the HaMI code's.
    pos_weight = None if mil else rec.pos_weight
    drop_last = rec.drop_last and not mil
    check_recipe(rec, method_params, len(train), batch_size)
    plateau = None
    if rec.plateau and not mil:
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", **rec.plateau)
    best = TrainResult({}, 0, -1.0, [])
    val_y, train_y = val.y.cpu().numpy(), train.y.cpu().numpy()
    trace = GradientRatioTrace.for_training(model, train) if trace_gradient_ratio else None
    for epoch in range(1, epochs + 1):
        lr = opt.param_groups[0]["lr"]
        model.train()
        total, n = 0.0, 0
        steps = sampler.epoch() if mil else epoch_batches(len(train), batch_size, gen, drop_last)
        for batch in steps:
            batch = batch.to(device)
            bags, y = train.bags(batch), train.y[batch]
            loss = hami_mil_loss(model, bags, y, method_params) if mil else logistic_loss(model(bags), y, pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
            n += len(batch)
        val_z = score(model, val)
        val_auroc = float(auroc(val_y, val_z))
        row = {"epoch": epoch, "train_loss": total / n, "val_auroc": val_auroc, "lr": lr}
        row |= epoch_margins(train_y, score(model, train), val_y, val_z)
        if plateau is not None:  # the authors' code steps it on the validation loss, every epoch
            row["val_loss"] = float(logistic_loss(torch.from_numpy(val_z), val.y.cpu(), pos_weight))
            plateau.step(row["val_loss"])
        best.curve.append(row)
        if val_auroc > best.best_val_auroc:
            best.best_val_auroc, best.best_epoch = val_auroc, epoch
            best.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if trace is not None:
            trace.record(epoch, model)
    best.last_state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if trace is not None:
        best.gradient_ratio = trace.result(best.best_epoch)
    return best


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
    from halludetect.detectors.batched import batchable, train_batched  # batched.py builds on this module

    d = int(train.tokens.shape[-1])
    with numerics.fixed_threads(1):  # a seed's numbers never depend on the machine's core count
        t0 = time.perf_counter()
        batched = device == "cpu" and lookup_method(method).fit == "sgd" and len(seeds) > 1
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
