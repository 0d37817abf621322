"""Training MIL detectors on one layer's bags, with the best epoch chosen on validation.

Data flow: a layer file (ragged bags) + the judge's kept labels -> padded tensors for the
train and val splits -> `epochs` of shuffled mini-batches -> validation AUROC after every
epoch -> the weights of the best epoch (the first best on ties).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from halludetect.activations import Layer
from halludetect.detectors import build_detector, pad_bags
from halludetect.responses import response_ids


class DataError(ValueError):
    pass


@dataclass
class SplitData:
    """One split of one layer, padded: x [N, T, d], mask [N, T], y [N] in {0, 1}."""

    x: torch.Tensor
    mask: torch.Tensor
    y: torch.Tensor
    response_ids: list[str]

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1)


def labelled_index(
    layer: Layer, judgments: pl.DataFrame, split: str, source: str = "layer"
) -> tuple[np.ndarray, np.ndarray]:
    """Indices into the layer's bags and labels of the kept, labelled responses of `split`."""
    kept = judgments.filter(pl.col("kept") & (pl.col("split") == split)).select(
        response_ids(judgments).alias("rid"), "label"
    )
    position = {rid: i for i, rid in enumerate(layer.response_ids)}
    missing = [rid for rid in kept["rid"] if rid not in position]
    if missing:
        raise DataError(
            f"{len(missing)} labelled {split} responses have no states in {source} "
            f"(e.g. {missing[:3]}): labels and activations disagree; re-run dump and judge"
        )
    index = np.asarray([position[rid] for rid in kept["rid"]], dtype=np.int64)
    return index, kept["label"].to_numpy().astype(np.int64)


def check_two_classes(y: np.ndarray, split: str) -> None:
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == len(y):
        raise DataError(
            f"split '{split}' has one class only ({n_pos} hallucinated of {len(y)} kept): AUROC is "
            "undefined. Use more questions, or a model/dataset with both right and wrong answers"
        )


def split_data(layer: Layer, judgments: pl.DataFrame, split: str, source: str = "layer") -> SplitData:
    index, y = labelled_index(layer, judgments, split, source)
    check_two_classes(y, split)
    x, mask = pad_bags(layer.states, layer.offsets, index)
    if not torch.isfinite(x).all():
        bad = int(torch.nonzero(~torch.isfinite(x).all(-1).all(-1))[0, 0])
        raise DataError(f"{source}: non-finite hidden states in response {layer.response_ids[index[bad]]}")
    return SplitData(x.float(), mask, torch.from_numpy(y).float(), [layer.response_ids[i] for i in index])


@torch.no_grad()
def score(model: nn.Module, data: SplitData, batch_size: int = 1024) -> np.ndarray:
    """Logits for every bag of a split, in eval mode, batches trimmed to their longest bag."""
    model.eval()
    out = []
    for start in range(0, len(data.y), batch_size):
        sl = slice(start, start + batch_size)
        width = int(data.lengths[sl].max())
        out.append(model(data.x[sl, :width], data.mask[sl, :width]))
    return torch.cat(out).numpy()


@dataclass
class TrainResult:
    state_dict: dict[str, torch.Tensor]
    best_epoch: int  # 1-based
    best_val_auroc: float
    curve: list[dict]  # per epoch: epoch, train_loss, val_auroc


def train_detector(method: str, method_params, train: SplitData, val: SplitData, *, epochs: int,
                   batch_size: int, seed: int) -> TrainResult:
    """The paper's protocol: Adam, logistic loss, `epochs` epochs, best epoch by val AUROC."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_detector(method, train.x.shape[-1], method_params)
    opt = torch.optim.Adam(model.parameters(), lr=method_params.lr, weight_decay=method_params.weight_decay)
    # log(1 + exp(-y z)) with y in {-1, 1} equals BCE-with-logits with y in {0, 1}.
    loss_fn = nn.BCEWithLogitsLoss()
    best = TrainResult({}, 0, -1.0, [])
    lengths = train.lengths
    for epoch in range(1, epochs + 1):
        model.train()
        total, n = 0.0, 0
        for batch in torch.randperm(len(train.y), generator=gen).split(batch_size):
            width = int(lengths[batch].max())
            z = model(train.x[batch, :width], train.mask[batch, :width])
            loss = loss_fn(z, train.y[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
            n += len(batch)
        val_auroc = float(roc_auc_score(val.y.numpy(), score(model, val)))
        best.curve.append({"epoch": epoch, "train_loss": total / n, "val_auroc": val_auroc})
        if val_auroc > best.best_val_auroc:
            best.best_val_auroc, best.best_epoch = val_auroc, epoch
            best.state_dict = copy.deepcopy(model.state_dict())
    return best
