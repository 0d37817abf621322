"""Teacher-forced capture of per-layer hidden states, and the per-layer HDF5 store.

Layer numbering follows transformers' `output_hidden_states`: 0 is the embedding output,
i in 1..L the output of decoder block i, and L carries the model's final norm (that is
what `hidden_states[-1]` holds). Only the selected layers are hooked.

One HDF5 file per layer (so a colleague can `dvc pull` one layer):
    states      float16 [total_tokens, d]   bags concatenated in response order
    offsets     int64   [n_responses + 1]   bag r is states[offsets[r]:offsets[r+1]]
    response_id string  [n_responses]       "<question_id>/<sample_index>"
    attrs: model, revision, layer, positions, dtype, prompt_hash, hidden_size
Files are written without timestamps, so the same states give the same bytes and DVC
sees an unchanged layer as unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import nn

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
class LayerWriter:
    """Appends bags to one layer file; memory is bounded by one batch."""

    def __init__(self, path: Path, hidden_size: int, dtype: str, attrs: dict, chunk_rows: int = 4096):
        self.f = h5py.File(path, "w", libver="latest", track_order=False)
        self.np_dtype = np.dtype(dtype)
        self.states = self.f.create_dataset(
            "states", shape=(0, hidden_size), maxshape=(None, hidden_size), dtype=self.np_dtype,
            chunks=(min(chunk_rows, 1 << 20), hidden_size), track_times=False,
        )
        self.offsets = [0]
        self.ids: list[str] = []
        for k, v in attrs.items():
            self.f.attrs[k] = v

    def append(self, bags: list[np.ndarray], response_ids: list[str]) -> None:
        if not bags:
            return
        block = np.concatenate(bags).astype(self.np_dtype, copy=False)
        n0 = self.states.shape[0]
        self.states.resize(n0 + len(block), axis=0)
        self.states[n0:] = block
        for b in bags:
            self.offsets.append(self.offsets[-1] + len(b))
        self.ids += response_ids

    def close(self) -> None:
        self.f.create_dataset("offsets", data=np.asarray(self.offsets, dtype=np.int64), track_times=False)
        self.f.create_dataset(
            "response_id", data=np.asarray(self.ids, dtype=object), dtype=h5py.string_dtype(), track_times=False
        )
        self.f.close()


@dataclass
class Layer:
    """One layer file in memory: ragged bags as concatenated states + offsets."""

    states: np.ndarray  # [total_tokens, d]
    offsets: np.ndarray  # [n + 1]
    response_ids: list[str]
    attrs: dict

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_layer(path: str | Path, dtype=np.float32) -> Layer:
    with h5py.File(path, "r") as f:
        return Layer(
            states=f["states"][:].astype(dtype),
            offsets=f["offsets"][:],
            response_ids=[x.decode() if isinstance(x, bytes) else x for x in f["response_id"][:]],
            attrs=dict(f.attrs),
        )


def layer_files(directory: str | Path) -> dict[int, Path]:
    files = {int(p.stem.split("_")[1]): p for p in Path(directory).glob("layer_*.h5")}
    if not files:
        raise FileNotFoundError(f"no layer_*.h5 files in {directory}; run the dump stage first")
    return dict(sorted(files.items()))


def layer_filename(layer: int) -> str:
    return f"layer_{layer:02d}.h5"


# ---------------------------------------------------------------------------- dump
@torch.no_grad()
def dump(model, tokenizer, questions, generations, out_dir: Path, layers: list[int], *,
         positions: str, dtype: str, batch_size: int, attrs: dict, chat_template: bool = False, log=print):
    """Teacher-forced pass over prompt + answer ids; one HDF5 file per layer in `out_dir`."""
    from tqdm import tqdm

    from halludetect.generation import encode_prompt
    from halludetect.modeling import input_device
    from halludetect.responses import response_id

    if positions not in POSITIONS:
        raise ValueError(f"unknown positions '{positions}'; choose from {POSITIONS}")
    question_text = dict(zip(questions["id"], questions["question"]))
    rows = generations.sort("question_id", "sample_index").to_dicts()
    prompt_cache: dict[str, list[int]] = {}
    hidden = model.config.get_text_config().hidden_size
    writers = {
        layer: LayerWriter(out_dir / layer_filename(layer), hidden, dtype, {**attrs, "layer": layer})
        for layer in layers
    }
    device = input_device(model)
    torch_dtype = {"float16": torch.float16, "float32": torch.float32}[dtype]
    try:
        with capture(model, layers) as store:
            for start in tqdm(range(0, len(rows), batch_size), desc="dump", unit="batch"):
                batch = rows[start : start + batch_size]
                seqs, slices = [], []
                for r in batch:
                    qid = r["question_id"]
                    if qid not in prompt_cache:
                        prompt_cache[qid] = encode_prompt(tokenizer, question_text[qid], chat_template)
                    prompt = prompt_cache[qid]
                    seqs.append(prompt + list(r["token_ids"]))
                    slices.append(bag_slice(len(prompt), r["n_tokens"], positions))
                width = max(map(len, seqs))
                # Right padding: a plain forward numbers positions from 0, so real tokens keep
                # the positions they had unpadded and causal attention never sees the pads.
                ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, s in enumerate(seqs):
                    ids[i, : len(s)] = torch.tensor(s)
                    mask[i, : len(s)] = 1
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                response_ids = [response_id(r["question_id"], r["sample_index"]) for r in batch]
                for layer, writer in writers.items():
                    h = store[layer].to(torch_dtype).cpu()
                    writer.append([h[i, sl].numpy() for i, sl in enumerate(slices)], response_ids)
    finally:
        for writer in writers.values():
            writer.close()
    log(f"dumped {len(rows)} responses x {len(layers)} layers")
