"""The data a detector trains and is evaluated on: one split of one layer file, packed and checked.

A layer file (packed states + offsets) and the judge's kept labels (+ P_sem for the methods
that read it) give one `SplitData` per split: tokens [N, d], offsets [B + 1], y [B]. Responses
without tokens, or without P_sem when it is needed, are left out and counted. Bad input stops
here, before any training: labels without states, a split with one class, non-finite states,
layer files from different dumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from halludetect.activations.bags import Bags, gather_rows
from halludetect.activations.layer_reader import Layer
from halludetect.core.errors import DataError
from halludetect.labels.readers import read_clusters
from halludetect.methods import SP_METHODS
from halludetect.metrics import check_two_classes
from halludetect.qa.responses import response_ids

SPLITS = ("train", "val", "test")


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
        return SplitData(
            self.tokens.to(device),
            self.offsets.to(device),
            self.y.to(device),
            self.response_ids,
            p,
            self.excluded,
            self.layer_index,
        )


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


def select(
    ids: list[str],
    offsets: np.ndarray,
    judgments: pl.DataFrame,
    split: str,
    source: str,
    p_sem: dict[str, float] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
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


def p_sem_table(clusters: pl.DataFrame, variant: str) -> dict[str, float]:
    """response id -> P_sem (the `variant` column) of the responses whose question clustered."""
    ok = clusters.filter(pl.col("valid"))
    return dict(zip(ok.select(response_ids(ok)).to_series().to_list(), ok[f"p_sem_{variant}"].to_list()))


def split_data(
    layer: Layer, judgments: pl.DataFrame, split: str, source: str = "layer", p_sem: dict[str, float] | None = None
) -> SplitData:
    """The packed, checked data of one split. Responses without tokens, or (when `p_sem` is
    given) without a semantic probability, are left out and counted in `excluded`."""
    index, y, rids, excluded = select(layer.response_ids, layer.offsets, judgments, split, source, p_sem)
    offsets = torch.from_numpy(layer.offsets)
    rows, lengths = gather_rows(offsets, torch.from_numpy(index))
    tokens = torch.from_numpy(np.asarray(layer.states[rows.numpy()], dtype=np.float32))
    finite = torch.isfinite(tokens).all(1)  # [N]
    if not finite.all():
        bag = int(torch.repeat_interleave(torch.arange(len(index)), lengths)[~finite][0])
        raise DataError(
            f"{source}: non-finite hidden states (NaN or inf) in response {rids[bag]}; "
            "re-run dump (a float16 overflow? try dump.dtype: float32)"
        )
    return SplitData(
        tokens=tokens,
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]),
        y=torch.from_numpy(y).float(),
        response_ids=rids,
        p_sem=None if p_sem is None else torch.tensor([p_sem[r] for r in rids], dtype=torch.float32),
        excluded=excluded,
        layer_index=index,
    )


def p_sem_for(method: str, clusters: str | Path | None, method_params) -> dict[str, float] | None:
    """P_sem by response id for the methods that read it (None for the others); a missing or
    unexpected --clusters fails here, before any file of states is read."""
    if method in SP_METHODS:
        if not clusters:
            raise DataError(f"{method} reads P_sem: pass --clusters (the train_sp stage does)")
        return p_sem_table(read_clusters(clusters), method_params.p_sem)
    if clusters:
        raise DataError(f"{method} does not read P_sem: train it without --clusters (the train stage)")
    return None
