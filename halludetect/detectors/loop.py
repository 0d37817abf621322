"""One detector's training loop: `train_detector`, the paper's protocol for one seed on one layer's
bags, with the best epoch chosen on validation; its losses, batch orders and recipes. training.py
trains a layer's seeds with it (or with batched.py, which builds on these pieces and gives every
seed the same numbers) and writes the layer's outputs.


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
learning rate, every batch of a shuffled pass; the MIL loss draws batch_size/2 bags of each class
per step from endlessly reshuffled streams, as many steps per epoch as a plain pass). `authors`
runs what the authors' code runs. For the logistic loss, their pooling code
(github.com/FUJI1229/Hallucination_Detection, Detection/): a weight of 0.3 on the hallucinated
class, ReduceLROnPlateau on the validation loss (factor 0.5, patience 3, min lr 1e-7, stepped
after every epoch) and dropping the last partial batch. For HaMI's MIL loss, the HaMI code
(github.com/mala-lab/HaMI at 3d27760, main.py:55-56 and train.py:16-61): each class from its own
DataLoader(batch_size, shuffle=True, drop_last=True), so batch_size bags of each class per step,
a class reshuffled once its full batches are used up and its remainder left out
(`LoaderSampler`); ReduceLROnPlateau(factor 0.1, patience 20, min lr 1e-6) stepped after every
step on that step's training loss; and one step per "epoch" (its `--epoch 100` counts steps, with
validation and the best-model choice after each). Where a class has fewer than batch_size
training bags (the HaMI code's loader then has no batch and its step count divides by zero),
both classes draw as many as the smaller class has.

Per epoch, beside the loss and the validation AUROC, `curves.json` holds the margins mean(y z)
of the training and validation sets in eval mode (epoch_margins): the paper's Theorem 1 says
training expands them. The weights of the last epoch are scored too (the paper's margin table
is read after its 100 epochs; the AUROC tables at the best validation epoch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.core.errors import DataError
from halludetect.detectors.build import build_detector, check_scores
from halludetect.detectors.data import SplitData
from halludetect.detectors.gradient_ratio import GradientRatioTrace
from halludetect.detectors.inference import score
from halludetect.detectors.pooling import topk_mean
from halludetect.methods import method as lookup_method
from halludetect.metrics import auroc, margin


@dataclass(frozen=True)
class Recipe:
    """What a training loop adds to the paper's protocol (module docstring): the first three act
    on the logistic loss, the last three on HaMI's MIL loss."""

    name: str
    pos_weight: float | None = None  # weight of the hallucinated class (y = 1) in the logistic loss
    plateau: dict | None = None  # ReduceLROnPlateau(mode="min", **plateau) on the validation loss, per epoch
    drop_last: bool = False  # drop the last partial batch of every epoch
    mil_loaders: bool = False  # the HaMI code's two loaders: batch_size bags of each class per step (LoaderSampler)
    mil_plateau: dict | None = None  # ReduceLROnPlateau(mode="min", **mil_plateau) on each step's training loss
    mil_step_epochs: bool = False  # one step per epoch: validation and the best-weights choice after every step


RECIPES = {
    "paper": Recipe("paper"),
    "authors": Recipe(
        "authors",
        pos_weight=0.3,
        plateau={"factor": 0.5, "patience": 3, "min_lr": 1e-7},
        drop_last=True,
        mil_loaders=True,
        mil_plateau={"factor": 0.1, "patience": 20, "min_lr": 1e-6},
        mil_step_epochs=True,
    ),
}


def check_recipe(recipe: str | Recipe, method_params, n_train: int, batch_size: int) -> None:
    """A recipe that drops the last partial batch trains nothing on fewer bags than one batch:
    refused before any training (the MIL loss draws pairs of bags and is not affected: under
    `mil_loaders` a class with fewer bags than a batch makes both classes draw its count)."""
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


class LoaderSampler:
    """The HaMI code's two loaders (main.py:55-56, train.py:28-36): each class is its own
    DataLoader(batch_size, shuffle=True, drop_last=True), restarted (a new shuffle) once its full
    batches are used up; each step takes the next batch of each, correct bags first. `per_class`
    is batch_size, or the smaller class's count where that is less (module docstring); an epoch
    is `steps` steps (1 under `mil_step_epochs`)."""

    def __init__(self, y: torch.Tensor, batch_size: int, gen: torch.Generator, steps: int = 1):
        self.pools = [torch.nonzero(y == c).squeeze(1) for c in (0, 1)]
        self.per_class = min(batch_size, *(len(p) for p in self.pools))
        self.batches: list[list[torch.Tensor]] = [[], []]
        self.steps = steps
        self.gen = gen

    def _take(self, c: int) -> torch.Tensor:
        if not self.batches[c]:  # a new pass: one shuffle, its full batches, the remainder left out
            pool = self.pools[c]
            perm = pool[torch.randperm(len(pool), generator=self.gen)]
            self.batches[c] = list(perm[: len(perm) - len(perm) % self.per_class].split(self.per_class))
        return self.batches[c].pop(0)

    def epoch(self):
        for _ in range(self.steps):
            yield torch.cat([self._take(0), self._take(1)])


def mil_sampler(rec: Recipe, y: torch.Tensor, batch_size: int, gen: torch.Generator):
    """The recipe's MIL batches: the HaMI code's loaders (`mil_loaders`: one step per epoch under
    `mil_step_epochs`, else a plain pass's count of steps) or the paper's paired streams."""
    if not rec.mil_loaders:
        return PairedSampler(y, batch_size, gen)
    return LoaderSampler(y, batch_size, gen, steps=1 if rec.mil_step_epochs else -(-len(y) // batch_size))


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
    loss and the HaMI code's loop to the MIL loss (module docstring). Deterministic for a seed
    on a given device. For a mean or max pooling network, Theorem 2's gradient-norm ratio is
    traced after every epoch (it draws no random numbers: the weights are the same without it).
    A method of another kind (`Method.fit`: a closed-form probe, an unsupervised score) is fitted
    by its kind's `fitter` (fitting.py)."""
    if not lookup_method(method).fit.loop:
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
    sampler = mil_sampler(rec, train.y.cpu(), batch_size, gen) if mil else None
    # The logistic loss's extras (pos_weight, plateau, drop_last) and the MIL loss's (mil_*) apart
    pos_weight = None if mil else rec.pos_weight
    drop_last = rec.drop_last and not mil
    check_recipe(rec, method_params, len(train), batch_size)
    plateau = None
    if rec.plateau and not mil:
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", **rec.plateau)
    step_plateau = None  # the HaMI code's: stepped on every step's training loss (train.py:49)
    if rec.mil_plateau and mil:
        step_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", **rec.mil_plateau)
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
            if mil:
                loss = hami_mil_loss(model, bags, y, method_params)
            else:
                z = model(bags)  # [B]
                if epoch == 1 and n == 0:  # a plugin's output, once: shape and finite (build.check_scores)
                    check_scores(method, z, len(batch), "the first training batch")
                loss = logistic_loss(z, y, pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step_plateau is not None:
                step_plateau.step(loss.item())
            total += loss.item() * len(batch)
            n += len(batch)
        val_z = score(model, val)
        check_scores(method, val_z, len(val), f"the validation split after epoch {epoch}")  # eval mode may differ
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
