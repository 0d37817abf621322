"""Reading the per-layer HDF5 files that the dump writes (format: `layer_format.py`).

Kept apart from the writer so that training and evaluation code can change without DVC
re-running the dump stage, and the dump never imports the detectors.

Every file is checked when it is opened (`open_layer`), before any training: the three
datasets present, `states` 2-D, `offsets` one longer than the ids, starting at 0, never
decreasing, and ending at the number of state rows. A truncated, empty, garbage or
inconsistent file is a `DataError` naming it and the fix (re-run dump), never an h5py
`OSError` or an `IndexError` after the first layer has trained.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from halludetect.activations.bags import Bags, gather_rows
from halludetect.activations.layer_format import decode_ids
from halludetect.core.artifacts import ArtifactError, damaged, open_hdf5
from halludetect.core.errors import DataError

WHAT = "HDF5 layer file"


def layer_problem(path: str | Path, problem: str) -> ArtifactError:
    return damaged(path, WHAT, "dump", problem)


def open_layer(path: str | Path) -> tuple[h5py.File, np.ndarray, list[str]]:
    """An opened, structurally checked layer file: (file, offsets [n + 1], response ids [n])."""
    f = open_hdf5(path, "dump", WHAT)
    try:
        missing = [k for k in ("states", "offsets", "response_id") if k not in f]
        if missing:
            raise layer_problem(path, f"no dataset {', '.join(missing)}")
        states = f["states"]
        if states.ndim != 2:
            raise layer_problem(path, f"states has shape {states.shape}, not [tokens, d]")
        try:
            offsets, ids = f["offsets"][:], decode_ids(f["response_id"][:])
        except (OSError, UnicodeDecodeError) as e:
            raise layer_problem(path, f"offsets or response_id unreadable: {type(e).__name__}: {e}") from None
        if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
            raise layer_problem(path, f"offsets is {offsets.dtype} {offsets.shape}, not a 1-D integer array")
        if len(offsets) != len(ids) + 1:
            raise layer_problem(path, f"{len(offsets)} offsets for {len(ids)} response ids (there must be one more)")
        if len(offsets) and offsets[0] != 0:
            raise layer_problem(path, f"offsets start at {offsets[0]}, not 0")
        if (down := np.flatnonzero(np.diff(offsets) < 0)).size:
            raise layer_problem(path, f"offsets decrease at response {down[0]} ({ids[down[0]]})")
        if len(offsets) and offsets[-1] != states.shape[0]:
            raise layer_problem(
                path,
                f"the last offset is {offsets[-1]} but states has {states.shape[0]} rows "
                f"(offsets {'past the end of' if offsets[-1] > states.shape[0] else 'short of'} "
                "states)",
            )
    except BaseException:
        f.close()
        raise
    return f, offsets, ids


def read_states(path: str | Path, states, rows=slice(None)) -> np.ndarray:
    """states[rows], with a damaged chunk reported as a `DataError` naming the file."""
    try:
        return states[rows]
    except OSError as e:
        raise layer_problem(path, f"states unreadable: {type(e).__name__}: {e}") from None


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
    f, offsets, ids = open_layer(path)
    with f:
        if expect_layer is not None and "layer" in f.attrs and int(f.attrs["layer"]) != expect_layer:
            raise DataError(f"{path} holds layer {int(f.attrs['layer'])}, not layer {expect_layer}: re-run dump")
        states = read_states(path, f["states"])
        return Layer(
            states=states if dtype is None else states.astype(dtype, copy=False),
            offsets=offsets,
            response_ids=ids,
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
        self.f, self.offsets, self.response_ids = open_layer(self.path)
        self.states = self.f["states"]
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

    def batches(
        self, batch_size: int, index: np.ndarray | None = None
    ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        index = np.arange(len(self)) if index is None else np.asarray(index, dtype=np.int64)
        for start in range(0, len(index), batch_size):
            part = index[start : start + batch_size]
            yield (part, *self.bags(part))
