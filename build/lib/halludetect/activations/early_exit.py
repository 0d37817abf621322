"""Early exit: the hidden states of one layer without computing, or even loading, the blocks above it.

A detector reads one layer L. The dump runs the whole model (every layer it keeps, plus the
LM head); scoring needs only blocks 1..L, so it costs about L / n_layers of a full forward:

- `load_until(preset, L)` loads the base model (no LM head) with its config cut to L blocks:
  the checkpoint's tensors of blocks L+1.. and of the LM head are never read. For L equal to
  the top layer the final norm is kept, because that layer's state carries it (as
  `output_hidden_states` and the dump record it).
- `states_until(model, L, n_layers, ...)` runs a forward that stops right after the module
  whose output is layer L (a hook raises once it has the states): nothing after it runs,
  whether `model` was cut by `load_until` or is a whole causal LM.

The blocks that do run are the same modules with the same weights on the same inputs, so the
states equal the dump's bit for bit (tests/test_scoring.py checks it on the CPU).
"""

from __future__ import annotations

import contextlib

import torch

from halludetect.activations.capture import layer_module
from halludetect.config import ModelPreset
from halludetect.lm.hf_models import (
    ModelError,
    hub_hint,
    load_config,
    model_kwargs,
    place,
)


class _ExitReached(Exception):
    """Raised by the exit hook once layer L's states are stored: the rest of the forward is skipped."""


def cut_config(config, layer: int):
    """`config` for a model of `layer` blocks (all of them when `layer` is the top one).

    Per-layer lists (`layer_types` of models with sliding-window layers) are cut with it, so
    the blocks that remain keep their own attention type.
    """
    cfg = config.get_text_config()  # the language model's own config (the whole config of a plain LM)
    top = int(cfg.num_hidden_layers)
    if not 0 <= layer <= top:
        raise ModelError(f"layer {layer} out of range: this model has layers 0..{top} (0 = embeddings)")
    if layer < top:
        cfg.num_hidden_layers = layer
        if isinstance(getattr(cfg, "layer_types", None), list):
            cfg.layer_types = cfg.layer_types[:layer]
    return config


@contextlib.contextmanager
def _quiet_transformers():
    """transformers logs a table of the checkpoint tensors it did not load; here they are the
    blocks we leave out on purpose, so the table is noise (missing tensors are checked instead)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_until(preset: ModelPreset, layer: int, device: str = "auto"):
    """The base model of `preset` with blocks 1..`layer` only, ready for `states_until`.

    Same placement options as `hf_models.load_model` (dtype, device_map, quantization,
    attention implementation). A checkpoint that lacks any tensor of the kept part is an error.
    """
    from transformers import AutoModel

    src, kw = model_kwargs(preset, device)
    config = cut_config(load_config(preset), layer)
    try:
        with _quiet_transformers():
            model, info = AutoModel.from_pretrained(src, config=config, output_loading_info=True, **kw)
    except OSError as e:
        raise hub_hint(preset, e) from None
    if info["missing_keys"]:
        raise ModelError(
            f"{preset.path}: the checkpoint lacks {len(info['missing_keys'])} tensors of blocks "
            f"1..{layer} (e.g. {sorted(info['missing_keys'])[:3]}): is it a complete model?"
        )
    return place(model, kw, device)


@torch.no_grad()
def states_until(
    model, layer: int, n_layers_full: int, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Hidden state `layer` [B, W, d] of a plain forward over right-padded inputs, skipping
    everything after it. `n_layers_full` is the complete model's number of blocks (layer
    numbering as in `activations.layer_module`)."""
    store: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        store.append((output[0] if isinstance(output, tuple) else output).detach())
        raise _ExitReached

    handle = layer_module(model, layer, n_layers_full).register_forward_hook(hook)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _ExitReached:
        pass
    finally:
        handle.remove()
    if not store:
        raise RuntimeError(f"the forward pass never reached layer {layer}")
    return store[0]
