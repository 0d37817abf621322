"""Training MIL detectors on one layer's bags, with the best epoch chosen on validation.

Data flow: a layer file (packed states + offsets) + the judge's kept labels (+ P_sem for the
methods that read it) -> one packed tensor per split -> `epochs` of mini-batches gathered by
index arithmetic -> validation AUROC after every epoch -> the weights of the best epoch (the
first best on ties).

Losses:
  logistic  log(1 + exp(-y z)), y in {-1, 1}: every method but HaMI (and HaMI as an option).
  mil       the HaMI code's paired loss on sigmoid token scores s: each step draws as many
            hallucinated as correct bags, pairs them in order, and minimises
            mean_i (1 - topk_mean(s_hal_i)^2 + topk_mean(s_ok_i)^2)
            + w * sum over bags longer than `smooth_min_len` of sum_t (s_t - s_t+1)^2 / pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import polars as pl
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from halludetect.detectors import Bags, build_detector, gather_rows
from halludetect.detectors.pooling import topk_mean
from halludetect.layers import Layer, decode_ids
from halludetect.responses import response_ids


class DataError(ValueError):
    pass


@dataclass
class SplitData:
    """One split of one layer, packed: tokens [N, d], offsets [B + 1], y [B] in {0, 1}."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    y: torch.Tensor
    response_ids: list[str]
    p_sem: torch.Tensor | None = None  # [B], for the methods that read it
    excluded: dict = field(default_factory=dict)  # reason -> count of labelled responses left out
    layer_index: np.ndarray | None = None  # [B] each bag's position in the layer file

    def __len__(self) -> int:
        return len(self.y)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def bags(self, index: torch.Tensor) -> Bags:
        """Bags `index` (any order), gathered into a packed batch."""
        rows, lengths = gather_rows(self.offsets, index)
        p = None if self.p_sem is None else self.p_sem[index]
        return Bags(self.tokens[rows], lengths, p)

    def slice(self, start: int, stop: int) -> Bags:
        """Bags start..stop-1 in order: a view, no copy."""
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        p = None if self.p_sem is None else self.p_sem[start:stop]
        return Bags(self.tokens[a:b], self.lengths[start:stop], p)

    def to(self, device) -> SplitData:
        p = None if self.p_sem is None else self.p_sem.to(device)
        return SplitData(self.tokens.to(device), self.offsets.to(device), self.y.to(device), self.response_ids, p,
                         self.excluded, self.layer_index)


def labelled_index(
    ids: list[str], judgments: pl.DataFrame, split: str, source: str = "layer"
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Positions in a layer file (response `ids`), labels and ids of the kept responses of `split`."""
    kept = judgments.filter(pl.col("kept") & (pl.col("split") == split)).select(
        response_ids(judgments).alias("rid"), "label"
    )
    position = {rid: i for i, rid in enumerate(ids)}
    missing = [rid for rid in kept["rid"] if rid not in position]
    if missing:
        raise DataError(
            f"{len(missing)} labelled {split} responses have no states in {source} "
            f"(e.g. {missing[:3]}): labels and activations disagree; re-run dump and judge"
        )
    index = np.asarray([position[rid] for rid in kept["rid"]], dtype=np.int64)
    return index, kept["label"].to_numpy().astype(np.int64), kept["rid"].to_list()


def select(ids: list[str], offsets: np.ndarray, judgments: pl.DataFrame, split: str, source: str,
           p_sem: dict[str, float] | None = None) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
    """The responses of `split` a detector can use: labelled, with tokens, with P_sem when it
    is needed. Returns positions, labels, ids and the counts left out, by reason."""
    index, y, rids = labelled_index(ids, judgments, split, source)
    keep = np.diff(offsets)[index] > 0
    excluded = {"empty_bag": int((~keep).sum())}
    if p_sem is not None:
        has = np.asarray([rid in p_sem for rid in rids], dtype=bool)
        excluded["no_p_sem"] = int((keep & ~has).sum())
        keep &= has
    index, y, rids = index[keep], y[keep], [r for r, k in zip(rids, keep) if k]
    check_two_classes(y, split)
    return index, y, rids, excluded


def check_two_classes(y: np.ndarray, split: str) -> None:
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == len(y):
        raise DataError(
            f"split '{split}' has one class only ({n_pos} hallucinated of {len(y)} kept): AUROC is "
            "undefined. Use more questions, or a model/dataset with both right and wrong answers"
        )


def p_sem_table(clusters: pl.DataFrame, variant: str) -> dict[str, float]:
    """response id -> P_sem (the `variant` column) of the responses whose question clustered."""
    ok = clusters.filter(pl.col("valid"))
    return dict(zip(ok.select(response_ids(ok)).to_series().to_list(), ok[f"p_sem_{variant}"].to_list()))


def split_data(layer: Layer, judgments: pl.DataFrame, split: str, source: str = "layer",
               p_sem: dict[str, float] | None = None) -> SplitData:
    """The packed, checked data of one split. Responses without tokens, or (when `p_sem` is
    given) without a semantic probability, are left out and counted in `excluded`."""
    index, y, rids, excluded = select(layer.response_ids, layer.offsets, judgments, split, source, p_sem)
    offsets = torch.from_numpy(layer.offsets)
    rows, lengths = gather_rows(offsets, torch.from_numpy(index))
    tokens = torch.from_numpy(np.asarray(layer.states[rows.numpy()], dtype=np.float32))
    finite = torch.isfinite(tokens).all(1)  # [N]
    if not finite.all():
        bag = int(torch.repeat_interleave(torch.arange(len(index)), lengths)[~finite][0])
        raise DataError(f"{source}: non-finite hidden states (NaN or inf) in response {rids[bag]}; "
                        "re-run dump (a float16 overflow? try dump.dtype: float32)")
    return SplitData(
        tokens=tokens,
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]),
        y=torch.from_numpy(y).float(),
        response_ids=rids,
        p_sem=None if p_sem is None else torch.tensor([p_sem[r] for r in rids], dtype=torch.float32),
        excluded=excluded,
        layer_index=index,
    )


def check_layer_files(files: dict[int, Path], judgments: pl.DataFrame, splits: tuple[str, ...],
                      p_sem: dict[str, float] | None = None, block_rows: int = 1 << 20) -> None:
    """Every layer file checked before any training: the same responses in each, every label
    covered, two classes per split, finite states. Streams the states in blocks, so memory
    stays bounded; at paper scale it reads the files once more, minutes against hours."""
    first_path, first_ids = None, None
    for path in files.values():
        with h5py.File(path, "r") as f:
            ids, offsets = decode_ids(f["response_id"][:]), f["offsets"][:]
            if first_ids is None:
                first_path, first_ids = path, ids
                for split in splits:
                    select(ids, offsets, judgments, split, str(path), p_sem)
            elif ids != first_ids:
                raise DataError(f"{path} holds other responses than {first_path}: the layer files come from "
                                "different dumps; re-run dump")
            states = f["states"]
            for start in range(0, states.shape[0], block_rows):
                bad = ~np.isfinite(states[start : start + block_rows]).all(1)
                if bad.any():
                    row = start + int(np.argmax(bad))
                    response = ids[int(np.searchsorted(offsets, row, side="right")) - 1]
                    raise DataError(f"{path}: non-finite hidden states (NaN or inf) in response {response}; "
                                    "re-run dump (a float16 overflow? try dump.dtype: float32)")


@torch.no_grad()
def score(model: nn.Module, data: SplitData, batch_size: int = 2048) -> np.ndarray:
    """Logits for every bag of a split, in eval mode, in order (contiguous slices, no copy)."""
    model.eval()
    out = [model(data.slice(a, min(a + batch_size, len(data)))) for a in range(0, len(data), batch_size)]
    return torch.cat(out).cpu().numpy()


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

