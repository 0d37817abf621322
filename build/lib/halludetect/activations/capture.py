"""Teacher-forced capture of per-layer hidden states, and the dump that writes them to layer files.

Layer numbering follows transformers' `output_hidden_states`: 0 is the embedding output,
i in 1..L the output of decoder block i, and L carries the model's final norm (that is
what `hidden_states[-1]` holds). Only the selected layers are hooked.

One HDF5 file per layer (so a colleague can `dvc pull` one layer); the format is in
`layer_format.py`, writing in `layer_writer.py`, reading in `layer_reader.py`, so that a change
to the readers never re-runs the dump stage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import torch
from torch import nn
from tqdm import tqdm

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_writer import LayerWriter, fsync_files
from halludetect.activations.logprob_check import LogprobCheck, teacher_forced_logprobs
from halludetect.lm.hf_models import DTYPES, input_device
from halludetect.lm.model_inputs import check_context, encode_prompt, pad_ids
from halludetect.lm.parallel import Workers
from halludetect.qa.responses import response_id

POSITIONS = ("predicting", "generated")


def _base(model) -> nn.Module:
    """The decoder of a causal LM (`model.model`), or the model itself when it is one (`AutoModel`)."""
    return getattr(model, "model", model)


def _decoder_layers(model) -> nn.ModuleList:
    n = model.config.num_hidden_layers
    base = _base(model)
    if isinstance(getattr(base, "layers", None), nn.ModuleList):
        return base.layers
    for module in model.modules():  # other architectures: the block list of the right length
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder blocks of {type(model).__name__}")


_FINAL_NORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its final norm (or None)


@torch.no_grad()
def _final_norm(model) -> nn.Module | None:
    """The module whose output is the top hidden state (`hidden_states[-1]`) when that is not the
    last block's output: the final norm, wherever the architecture puts it and whatever it is
    called (Llama's `model.norm`, GPT-2's `transformer.ln_f`, OPT's `decoder.final_layer_norm`,
    registered before its blocks). Found by what the model computes, not by a name: one forward
    pass of one token with every module outside the blocks hooked, keeping the last one whose
    output equals `hidden_states[-1]`. None when the top block's own output is that state."""
    if model in _FINAL_NORMS:
        return _FINAL_NORMS[model]
    blocks = _decoder_layers(model)
    inside = {id(m) for b in blocks for m in b.modules()} | {id(blocks)}
    outputs: list[tuple[nn.Module, torch.Tensor]] = []

    def keep(module):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) and output else output  # a block may return a tuple
            if isinstance(out, torch.Tensor):
                outputs.append((module, out))

        return hook

    handles = [m.register_forward_hook(keep(m)) for m in model.modules() if id(m) not in inside and m is not model]
    handles.append(blocks[-1].register_forward_hook(keep(blocks[-1])))
    try:
        ids = torch.zeros((1, 1), dtype=torch.long, device=input_device(model))  # token 0: in every vocabulary
        top = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
    finally:
        for h in handles:
            h.remove()
    found = None
    for module, out in outputs:  # in call order: the last match is what the model returned
        if out.shape == top.shape and torch.equal(out, top):
            found = module
    if found is blocks[-1]:
        found = None  # no final norm: the top state is the last block's output
    _FINAL_NORMS[model] = found
    return found


def layer_module(model, layer: int, n_layers: int | None = None) -> nn.Module:
    """The module whose output is hidden state `layer`, in the numbering of a model of `n_layers` blocks.

    0: the input embeddings; i < n_layers: decoder block i; n_layers: the final norm (what
    `hidden_states[-1]` holds), or block n_layers for a model without one. `n_layers` defaults
    to the blocks `model` has; a model loaded with its top blocks cut off (`early_exit`) passes
    the full model's count, so that its last block is not taken for the top of the model.
    """
    blocks = _decoder_layers(model)
    top = len(blocks) if n_layers is None else n_layers
    if not 0 <= layer <= top:
        raise ValueError(f"layer {layer} out of range: the model has layers 0..{top} (0 = embeddings)")
    if layer == 0:
        return model.get_input_embeddings()
    if layer == top and _final_norm(model) is not None:
        return _final_norm(model)
    if layer > len(blocks):
        raise ValueError(f"layer {layer} needs decoder block {layer}, but only {len(blocks)} blocks are loaded")
    return blocks[layer - 1]


@contextlib.contextmanager
def capture(model, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Record the hidden states of `layers` during forward passes inside the block.

    Yields a dict filled on each forward: layer -> [batch, seq, d]. Hooks are removed on
    exit, also when the body raises.
    """
    store: dict[int, torch.Tensor] = {}
    handles = []

    def keep(layer: int):
        def hook(_module, _inputs, output):
            store[layer] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    try:
        for layer in layers:
            handles.append(layer_module(model, layer).register_forward_hook(keep(layer)))
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


def bag_positions(starts, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """Every bag token of a batch as (row, position) in the padded inputs, bags back to back.

    starts [B]: where each row's bag begins (`bag_slice(...).start`); lengths [B]: its tokens.
    Returns row [N] and col [N], N = sum(lengths), to gather the packed bags at once:
    `states[row, col]` -> [N, d].
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    row = np.repeat(np.arange(len(lengths)), lengths)  # [N]
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # [B] first flat index of each bag
    col = np.repeat(np.asarray(starts, dtype=np.int64), lengths) + np.arange(len(row)) - np.repeat(first, lengths)
    return torch.from_numpy(row), torch.from_numpy(col)


# ---------------------------------------------------------------------------- dump
@torch.no_grad()
def dump(
    model,
    tokenizer,
    questions,
    generations,
    out_dir: Path,
    layers: list[int],
    *,
    positions: str,
    dtype: str,
    batch_size: int,
    attrs: dict,
    chat_template: bool = False,
    workers=None,
    log=print,
    check: LogprobCheck | None = None,
) -> None:
    """Teacher-forced pass over prompt + answer ids; one HDF5 file per layer in `out_dir`.

    Responses go in (question_id, sample_index) order. With several `workers`, this process
    writes its contiguous block of batches; `merge_parts` joins the blocks in order. With a
    `check`, every answer token's log-prob is recomputed from the logits of the same pass and
    compared with the generations' (activations/logprob_check.py); a mismatch stops the dump.
    """
    workers = workers or Workers()
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions '{positions}'; choose from {POSITIONS}")
    generations = generations.sort("question_id", "sample_index")
    question_text = dict(zip(questions["id"], questions["question"]))
    prompts = {
        q: encode_prompt(tokenizer, question_text[q], chat_template)
        for q in generations["question_id"].unique().to_list()
    }
    longest = generations.group_by("question_id").agg(pl.col("n_tokens").max())
    check_context(model, {q: len(prompts[q]) + n for q, n in longest.iter_rows()}, 0, "their answers")
    hidden = model.config.get_text_config().hidden_size
    writers = {
        layer: LayerWriter(out_dir / layer_filename(layer), hidden, dtype, {**attrs, "layer": layer})
        for layer in layers
    }
    device = input_device(model)
    torch_dtype = DTYPES[dtype]
    n_batches = -(-generations.height // batch_size)
    if check is not None:  # the answers this process checks: the share's denominator
        mine = workers.span(n_batches)
        check.answers_expected = min(generations.height, mine.stop * batch_size) - mine.start * batch_size
    try:
        with capture(model, layers) as store:
            for b in tqdm(
                workers.span(n_batches), desc=f"dump[{workers.rank}]", unit="batch", disable=not workers.main
            ):
                # One batch's rows only: memory does not grow with the number of responses.
                batch = (
                    generations.slice(b * batch_size, batch_size)
                    .select(
                        "question_id", "sample_index", "token_ids", "n_tokens", *(["token_logprobs"] if check else [])
                    )
                    .to_dicts()
                )
                seqs = [prompts[r["question_id"]] + list(r["token_ids"]) for r in batch]
                starts = [bag_slice(len(prompts[r["question_id"]]), r["n_tokens"], positions).start for r in batch]
                lengths = np.asarray([r["n_tokens"] for r in batch])  # [B]
                # Right padding: a plain forward numbers positions from 0, so real tokens keep
                # the positions they had unpadded and causal attention never sees the pads.
                ids, mask = pad_ids(seqs, tokenizer.pad_token_id, left=False)  # [B, W]
                out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                row_t, col_t = (t.to(device) for t in bag_positions(starts, lengths))
                response_ids = [response_id(r["question_id"], r["sample_index"]) for r in batch]
                if check is not None:  # the positions that predict each answer token, whatever `positions`
                    p_row, p_col = (
                        t.to(device)
                        for t in bag_positions([len(prompts[r["question_id"]]) - 1 for r in batch], lengths)
                    )
                    tokens = torch.tensor([t for r in batch for t in r["token_ids"]], device=device)  # [N]
                    recorded = np.asarray([x for r in batch for x in r["token_logprobs"]], dtype=np.float64)  # [N]
                    check.add(
                        recorded,
                        teacher_forced_logprobs(out.logits, p_row, p_col, tokens).numpy(),
                        lengths,
                        response_ids,
                    )
                for layer, writer in writers.items():
                    block = store[layer][row_t, col_t].to(torch_dtype).cpu().numpy()  # [N, d]
                    writer.append(block, lengths, response_ids)
    finally:
        for writer in writers.values():
            writer.close(fsync=False)
    fsync_files([w.path for w in writers.values()])
    if check is not None:
        log(check.finish())
    n_mine = sum(len(w.ids) for w in writers.values()) // max(1, len(writers))
    log(f"process {workers.rank}: dumped {n_mine} of {generations.height} responses x {len(layers)} layers")
