"""Writing the per-layer HDF5 files (format: `layer_format.py`): streamed, bounded memory, byte-stable.

Files are written without timestamps, and states go to disk in whole chunks only, so the same
states give the same bytes however they were batched (one process or several, any dump batch
size): DVC sees an unchanged layer as unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from halludetect.activations.layer_format import decode_ids, layer_filename


def _chunk_rows(hidden: int, itemsize: int) -> int:
    # ~1 MiB chunks: small enough for HDF5's chunk cache, large enough for sequential I/O.
    return max(16, (1 << 20) // (hidden * itemsize))


class LayerWriter:
    """Appends bags to one layer file; memory is bounded by one chunk plus one appended block.

    States are written to HDF5 in whole chunks only (the remainder at close), so the file's
    bytes depend on the states alone, not on how they were batched: one process or several,
    any dump batch size.
    """

    def __init__(self, path: Path, hidden_size: int, dtype: str, attrs: dict):
        self.path = Path(path)
        self.f = h5py.File(self.path, "w", libver="latest", track_order=False)
        self.np_dtype = np.dtype(dtype)
        self.chunk = _chunk_rows(hidden_size, self.np_dtype.itemsize)
        self.states = self.f.create_dataset(
            "states",
            shape=(0, hidden_size),
            maxshape=(None, hidden_size),
            dtype=self.np_dtype,
            chunks=(self.chunk, hidden_size),
            track_times=False,
        )
        self.pending: list[np.ndarray] = []  # rows not yet written, fewer than a chunk after each append
        self.n_pending = 0
        self.offsets = [0]
        self.ids: list[str] = []
        for k in sorted(attrs):  # creation order is in the bytes: make it canonical
            self.f.attrs[k] = attrs[k]

    def append(self, block: np.ndarray, lengths, response_ids: list[str]) -> None:
        """block: [sum(lengths), d], the bags of `response_ids` concatenated."""
        if not len(response_ids):
            return
        self.pending.append(block.astype(self.np_dtype, copy=False))
        self.n_pending += len(block)
        self.offsets.extend((self.offsets[-1] + np.cumsum(lengths)).tolist())
        self.ids += response_ids
        if self.n_pending >= self.chunk:
            self._flush(whole_chunks=True)

    def _flush(self, whole_chunks: bool) -> None:
        rows = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        n = len(rows) - len(rows) % self.chunk if whole_chunks else len(rows)
        n0 = self.states.shape[0]  # always a multiple of the chunk: only the last flush is partial
        self.states.resize(n0 + n, axis=0)
        full = n - n % self.chunk
        for a in range(0, full, self.chunk):
            # Whole, uncompressed chunks go to the file as they are: no chunk cache, no copy.
            self.states.id.write_direct_chunk((n0 + a, 0), np.ascontiguousarray(rows[a : a + self.chunk]))
        if full < n:
            self.states[n0 + full : n0 + n] = rows[full:n]
        self.pending = [rows[n:]] if n < len(rows) else []
        self.n_pending = len(rows) - n

    def close(self, fsync: bool = True) -> None:
        if self.n_pending:
            self._flush(whole_chunks=False)
        self.f.create_dataset("offsets", data=np.asarray(self.offsets, dtype=np.int64), track_times=False)
        self.f.create_dataset(
            "response_id", data=np.asarray(self.ids, dtype=object), dtype=h5py.string_dtype(), track_times=False
        )
        self.f.close()
        if fsync:
            fsync_files([self.path])


def fsync_files(paths: list[Path]) -> None:
    """Flush files to disk before their directory is renamed into place.

    Concurrently: the file system commits its journal once for all of them instead of once
    per layer file (33 of them for Llama-3.1-8B).
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(path: Path) -> None:
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())

    with ThreadPoolExecutor(max_workers=min(16, len(paths) or 1)) as pool:
        list(pool.map(one, paths))


def merge_parts(part_dirs: list[Path], out_dir: Path, layers: list[int], block_rows: int = 1 << 16) -> None:
    """Concatenate per-process layer files, in process order, streaming blocks of states."""
    for layer in layers:
        parts = [d / layer_filename(layer) for d in part_dirs]
        with h5py.File(parts[0], "r") as first:
            attrs, hidden, dtype = dict(first.attrs), first["states"].shape[1], first["states"].dtype
        writer = LayerWriter(out_dir / layer_filename(layer), hidden, dtype.name, attrs)
        try:
            for part in parts:
                with h5py.File(part, "r") as f:
                    lengths = np.diff(f["offsets"][:])
                    ids = decode_ids(f["response_id"][:])
                    bounds = np.concatenate([[0], np.cumsum(lengths)])
                    # Whole bags per block: cut at the first bag boundary past each block_rows step.
                    cuts = np.unique(np.searchsorted(bounds, np.arange(0, bounds[-1], block_rows), side="left"))
                    cuts = np.append(cuts[cuts < len(lengths)], len(lengths))
                    for a, b in zip(cuts[:-1], cuts[1:]):
                        writer.append(f["states"][bounds[a] : bounds[b]], lengths[a:b], ids[a:b])
        finally:
            writer.close(fsync=False)
    fsync_files([out_dir / layer_filename(layer) for layer in layers])
