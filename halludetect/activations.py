"""Teacher-forced capture of per-layer hidden states, and the per-layer HDF5 store.

Layer numbering follows transformers' `output_hidden_states`: 0 is the embedding output,
i in 1..L the output of decoder block i, and L carries the model's final norm (that is
what `hidden_states[-1]` holds). Only the selected layers are hooked.

One HDF5 file per layer (so a colleague can `dvc pull` one layer):
    states      float16 [total_tokens, d]   bags concatenated in response order
    offsets     int64   [n_responses + 1]   bag r is states[offsets[r]:offsets[r+1]]
    response_id string  [n_responses]       "<question_id>/<sample_index>"
    attrs: model, revision, layer, positions, dtype, prompt_hash, excluded_empty_answers
Files are written without timestamps, so the same states give the same bytes and DVC
sees an unchanged layer as unchanged. Writes stream one batch at a time (memory does not
grow with the number of responses). Reading lives in `layers.py`, so that a change to the
readers never re-runs the dump stage.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import polars as pl
import torch
from torch import nn
from tqdm import tqdm

POSITIONS = ("predicting", "generated")


def _decoder_layers(model) -> nn.ModuleList:
    n = model.config.num_hidden_layers
    base = getattr(model, "model", None)
    if base is not None and isinstance(getattr(base, "layers", None), nn.ModuleList):
        return base.layers
    for module in model.modules():  # other architectures: the block list of the right length
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder blocks of {type(model).__name__}")


def _final_norm(model) -> nn.Module | None:
    base = getattr(model, "model", None)
    return getattr(base, "norm", None)


@contextlib.contextmanager
def capture(model, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Record the hidden states of `layers` during forward passes inside the block.

    Yields a dict filled on each forward: layer -> [batch, seq, d]. Hooks are removed on
    exit, also when the body raises.
    """
    blocks = _decoder_layers(model)
    top = len(blocks)
    store: dict[int, torch.Tensor] = {}
    handles = []

    def keep(layer: int):
        def hook(_module, _inputs, output):
            store[layer] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    try:
        for layer in layers:
            if layer == 0:
                module = model.get_input_embeddings()
            elif layer == top and _final_norm(model) is not None:
                module = _final_norm(model)
            else:
                module = blocks[layer - 1]
            handles.append(module.register_forward_hook(keep(layer)))
        yield store
    finally:
        for h in handles:
            h.remove()


def bag_slice(prompt_len: int, n_tokens: int, positions: str) -> slice:
    """Positions (in prompt + answer) whose states form the bag of an n-token answer.

    predicting: the states that predict each answer token, from the last prompt position to
    the second-to-last answer position (what the paper's code stored).
    generated: the states at the answer tokens themselves.
    """
    if positions == "predicting":
        return slice(prompt_len - 1, prompt_len - 1 + n_tokens)
    if positions == "generated":
        return slice(prompt_len, prompt_len + n_tokens)
    raise ValueError(f"unknown positions '{positions}'; choose from {POSITIONS}")


# --------------------------------------------------------------------------- store
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
            "states", shape=(0, hidden_size), maxshape=(None, hidden_size), dtype=self.np_dtype,
            chunks=(self.chunk, hidden_size), track_times=False,
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


def _decode(ids) -> list[str]:
    return [x.decode() if isinstance(x, bytes) else x for x in ids]


def layer_filename(layer: int) -> str:
    return f"layer_{layer:02d}.h5"


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
                    ids = _decode(f["response_id"][:])
                    bounds = np.concatenate([[0], np.cumsum(lengths)])
                    # Whole bags per block: cut at the first bag boundary past each block_rows step.
                    cuts = np.unique(np.searchsorted(bounds, np.arange(0, bounds[-1], block_rows), side="left"))
                    cuts = np.append(cuts[cuts < len(lengths)], len(lengths))
                    for a, b in zip(cuts[:-1], cuts[1:]):
                        writer.append(f["states"][bounds[a] : bounds[b]], lengths[a:b], ids[a:b])
        finally:
            writer.close(fsync=False)
    fsync_files([out_dir / layer_filename(layer) for layer in layers])


# ---------------------------------------------------------------------------- dump
@torch.no_grad()
def dump(model, tokenizer, questions, generations, out_dir: Path, layers: list[int], *,
         positions: str, dtype: str, batch_size: int, attrs: dict, chat_template: bool = False,
         workers=None, log=print) -> None:
    """Teacher-forced pass over prompt + answer ids; one HDF5 file per layer in `out_dir`.

    Responses go in (question_id, sample_index) order. With several `workers`, this process
    writes its contiguous block of batches; `merge_parts` joins the blocks in order.
    """
    # Imported here, not at the top: readers of layer files (train, evaluate) need none of
    # the model-side code, and DVC need not re-run them when it changes.
    from halludetect.generation import check_context, encode_prompt, pad_ids
    from halludetect.modeling import input_device
    from halludetect.parallel import Workers
    from halludetect.responses import response_id

    workers = workers or Workers()
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions '{positions}'; choose from {POSITIONS}")
    generations = generations.sort("question_id", "sample_index")
    question_text = dict(zip(questions["id"], questions["question"]))
    prompts = {q: encode_prompt(tokenizer, question_text[q], chat_template)
               for q in generations["question_id"].unique().to_list()}
    longest = generations.group_by("question_id").agg(pl.col("n_tokens").max())
    check_context(model, {q: len(prompts[q]) + n for q, n in longest.iter_rows()}, 0, "their answers")
    hidden = model.config.get_text_config().hidden_size
    writers = {
        layer: LayerWriter(out_dir / layer_filename(layer), hidden, dtype, {**attrs, "layer": layer})
        for layer in layers
    }
    device = input_device(model)
    torch_dtype = {"float16": torch.float16, "float32": torch.float32}[dtype]
    n_batches = -(-generations.height // batch_size)
    try:
        with capture(model, layers) as store:
            for b in tqdm(workers.span(n_batches), desc=f"dump[{workers.rank}]", unit="batch",
                          disable=not workers.main):
                # One batch's rows only: memory does not grow with the number of responses.
                batch = generations.slice(b * batch_size, batch_size).select(
                    "question_id", "sample_index", "token_ids", "n_tokens").to_dicts()
                seqs = [prompts[r["question_id"]] + list(r["token_ids"]) for r in batch]
                starts = np.asarray([bag_slice(len(prompts[r["question_id"]]), r["n_tokens"], positions).start
                                     for r in batch])  # [B]
                lengths = np.asarray([r["n_tokens"] for r in batch])  # [B]
                # Right padding: a plain forward numbers positions from 0, so real tokens keep
                # the positions they had unpadded and causal attention never sees the pads.
                ids, mask = pad_ids(seqs, tokenizer.pad_token_id, left=False)  # [B, W]
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                # Every bag token of the batch as (row, position), gathered on the device at once.
                row = np.repeat(np.arange(len(batch)), lengths)  # [N]
                first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # [B] first flat index of each bag
                col = np.repeat(starts, lengths) + np.arange(len(row)) - np.repeat(first, lengths)  # [N]
                row_t, col_t = torch.from_numpy(row).to(device), torch.from_numpy(col).to(device)
                response_ids = [response_id(r["question_id"], r["sample_index"]) for r in batch]
                for layer, writer in writers.items():
                    block = store[layer][row_t, col_t].to(torch_dtype).cpu().numpy()  # [N, d]
                    writer.append(block, lengths, response_ids)
    finally:
        for writer in writers.values():
            writer.close(fsync=False)
    fsync_files([w.path for w in writers.values()])
    n_mine = sum(len(w.ids) for w in writers.values()) // max(1, len(writers))
    log(f"process {workers.rank}: dumped {n_mine} of {generations.height} responses x {len(layers)} layers")
