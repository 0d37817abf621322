"""Reading the per-layer HDF5 files that the dump writes (format: `layer_format.py`).

Kept apart from the writer so that training and evaluation code can change without DVC
re-running the dump stage, and the dump never imports the detectors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from halludetect.detectors.bags import Bags, gather_rows
from halludetect.errors import DataError
from halludetect.layer_format import decode_ids


@dataclass
class Layer:
    """One layer file in memory: ragged bags as concatenated states + offsets."""

    states: np.ndarray  # [total_tokens, d]
    offsets: np.ndarray  # [n + 1]
    response_ids: list[str]
    attrs: dict

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_layer(path: str | Path, dtype=np.float32, expect_layer: int | None = None) -> Layer:
    """A whole layer file in memory; dtype None keeps the stored one (half the memory of float32).
    With `expect_layer`, a file whose `layer` attribute says otherwise is refused."""
    with h5py.File(path, "r") as f:
        if expect_layer is not None and "layer" in f.attrs and int(f.attrs["layer"]) != expect_layer:
            raise DataError(f"{path} holds layer {int(f.attrs['layer'])}, not layer {expect_layer}: re-run dump")
        states = f["states"][:]
        return Layer(
            states=states if dtype is None else states.astype(dtype, copy=False),
            offsets=f["offsets"][:],
            response_ids=decode_ids(f["response_id"][:]),
            attrs=dict(f.attrs),
        )


class LayerReader:
    """Streams a layer file as padded batches, reading only the bags asked for.

        with LayerReader(path) as layer:
            for index, x, mask in layer.batches(128):   # x [B, T, d] float32, mask [B, T]
                ...
    """

    def __init__(self, path: str | Path, dtype=np.float32):
        self.path = Path(path)
        self.f = h5py.File(self.path, "r")
        self.states = self.f["states"]
        self.offsets = self.f["offsets"][:]
        self.response_ids = decode_ids(self.f["response_id"][:])
        self.attrs = dict(self.f.attrs)
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.response_ids)

    def __enter__(self) -> LayerReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.f.close()

    def bags(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Bags `index` as x [B, T, d] (zeros at padding) and mask [B, T] (True at real tokens)."""
        bags = self.packed(index)
        return bags.pad(bags.tokens), bags.mask

    def packed(self, index: np.ndarray) -> Bags:
        """Bags `index` as packed `Bags` (no padding), in the order asked."""
        index = np.asarray(index, dtype=np.int64)
        starts, ends = self.offsets[index], self.offsets[index + 1]
        lo, hi = int(starts.min()), int(ends.max())
        if hi - lo <= 2 * int((ends - starts).sum()):
            # Nearby bags (the usual, in-order case): one contiguous read, then rows picked from it.
            rows, lengths = gather_rows(torch.from_numpy(self.offsets - lo), torch.from_numpy(index))
            tokens = self.states[lo:hi][rows.numpy()]
        else:  # scattered bags: one read each, concatenated in the order asked
            tokens = np.concatenate([self.states[a:b] for a, b in zip(starts, ends)])
            lengths = torch.from_numpy(ends - starts)
        return Bags(torch.from_numpy(tokens.astype(self.dtype, copy=False)), lengths)

    def batches(self, batch_size: int, index: np.ndarray | None = None
                ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        index = np.arange(len(self)) if index is None else np.asarray(index, dtype=np.int64)
        for start in range(0, len(index), batch_size):
            part = index[start : start + batch_size]
            yield (part, *self.bags(part))
