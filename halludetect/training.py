"""Training MIL detectors on one layer's bags, with the best epoch chosen on validation.

Data flow: one packed `SplitData` per split (detector_data.py) -> `epochs` of mini-batches
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

from dataclasses import dataclass

import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from halludetect.detector_data import SplitData
from halludetect.detectors import Bags, build_detector
from halludetect.detectors.inference import score
from halludetect.detectors.pooling import topk_mean


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


def train_detector(method: str, method_params, train: SplitData, val: SplitData, *, epochs: int,
                   batch_size: int, seed: int, device: str = "cpu") -> TrainResult:
    """The paper's protocol: Adam with the method's lr and weight decay, `epochs` epochs,
    best epoch by validation AUROC. Deterministic for a seed on a given device."""
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
        val_auroc = float(roc_auc_score(val_y, score(model, val)))
        best.curve.append({"epoch": epoch, "train_loss": total / n, "val_auroc": val_auroc})
        if val_auroc > best.best_val_auroc:
            best.best_val_auroc, best.best_epoch = val_auroc, epoch
            best.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return best

