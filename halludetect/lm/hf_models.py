"""Loading the base models (Hugging Face causal LMs) from a local directory or the hub, with clear errors.

The same function loads the demo world's 2M-parameter Llama and Llama-3.3-70B in 4-bit:
what differs is the preset in params.yaml.
"""

from __future__ import annotations

from pathlib import Path

import torch

from halludetect.config import ModelPreset
from halludetect.core.devices import hold_gpu, resolve_device
from halludetect.core.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(UserError, ValueError):
    """A model that cannot be loaded or used as asked (path, device, quantization, context)."""


def is_local(preset: ModelPreset) -> bool:
    """A path that exists, or one written like a path, is local; anything else is a hub id."""
    p = preset.path
    return Path(p).exists() or p.startswith((".", "/", "~")) or p.startswith("data/")


def _source_kwargs(preset: ModelPreset) -> tuple[str, dict]:
    if is_local(preset):
        path = Path(preset.path).expanduser()
        if not path.exists():
            raise ModelError(f"model directory {path} does not exist (check models.<name>.path)")
        return str(path), {"trust_remote_code": preset.trust_remote_code}
    return preset.path, {"revision": preset.revision, "trust_remote_code": preset.trust_remote_code}


def hub_hint(preset: ModelPreset, e: Exception) -> ModelError:
    return ModelError(
        f"could not load '{preset.path}' ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
        "If this machine is offline, download the model where there is network "
        "(huggingface-cli download ID --local-dir DIR), copy DIR here and set the preset's 'path' "
        "to it, or fill the Hugging Face cache and set HF_HUB_OFFLINE=1"
    )


def load_config(preset: ModelPreset):
    from transformers import AutoConfig

    src, kw = _source_kwargs(preset)
    try:
        return AutoConfig.from_pretrained(src, **kw)
    except OSError as e:
        raise hub_hint(preset, e) from None


def n_layers(config) -> int:
    cfg = getattr(config, "text_config", None) or config
    return int(cfg.num_hidden_layers)


def check_layers(layers: list[int] | str, config) -> list[int]:
    """Resolve 'all' and check indices against the config, before any weights are loaded.

    Layer 0 is the embedding output; layer i (1..L) the output of decoder block i, with the
    final norm applied to block L, as in transformers' `output_hidden_states`.
    """
    top = n_layers(config)
    if layers == "all":
        return list(range(top + 1))
    bad = [x for x in layers if not 0 <= x <= top]
    if bad:
        raise ModelError(f"dump.layers {bad} out of range: this model has layers 0..{top} (0 = embeddings)")
    return sorted(set(layers))


def load_tokenizer(preset: ModelPreset):
    from transformers import AutoTokenizer

    src, kw = _source_kwargs(preset)
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except OSError as e:
        raise hub_hint(preset, e) from None
    tok.padding_side = "left"  # batched generation appends on the right
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def quantization_config(preset: ModelPreset):
    """The bitsandbytes config of a preset; a clear error where there is no CUDA GPU."""
    q = preset.quantization
    if q is None:
        return None
    if not torch.cuda.is_available():
        raise ModelError(
            f"preset '{preset.path}' asks for {q.bits}-bit quantization (bitsandbytes), which needs a CUDA GPU; "
            "this machine has none. Use an unquantized preset here (remove 'quantization')"
        )
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=DTYPES[q.compute_dtype],
    )


def model_kwargs(preset: ModelPreset, device: str = "auto") -> tuple[str, dict]:
    """The source and `from_pretrained` arguments of `preset`: revision, dtype, quantization,
    attention implementation and placement. One place for both the full model (`load_model`) and
    the model cut after a layer (activations/early_exit.py), so the two never load differently."""
    src, kw = _source_kwargs(preset)
    quant = quantization_config(preset)
    if quant is not None:
        kw["quantization_config"] = quant
    if preset.dtype != "auto":
        kw["dtype"] = DTYPES[preset.dtype]
    if preset.attn_implementation:
        kw["attn_implementation"] = preset.attn_implementation
    if preset.device_map:
        kw["device_map"] = preset.device_map
        if torch.cuda.is_available():
            hold_gpu()  # a device_map places the model on the GPUs
        if preset.max_memory:
            kw["max_memory"] = dict(preset.max_memory)
    elif quant is not None:
        kw["device_map"] = {"": resolve_device(device)}  # bitsandbytes quantizes while placing
    return src, kw


def place(model, kw: dict, device: str = "auto"):
    """An unsplit model moved to `device`, in eval mode (a device_map has placed it already)."""
    if "device_map" not in kw:
        model = model.to(resolve_device(device))
    return model.eval()


def load_model(preset: ModelPreset, device: str = "auto"):
    """Load for inference. `device` places an unsplit model; a preset's `device_map` splits it instead."""
    from transformers import AutoModelForCausalLM

    src, kw = model_kwargs(preset, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kw)
    except OSError as e:
        raise hub_hint(preset, e) from None
    return place(model, kw, device)


def context_length(config) -> int | None:
    """The longest sequence the model was built for (prompt + answer), if the config says."""
    cfg = getattr(config, "text_config", None) or config
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else None


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends an answer: the generation config's EOS list (Llama 3.1 has three) and the tokenizer's."""
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(ids)


def load_generation_eos(preset: ModelPreset, config) -> list[int]:
    """The EOS ids of the model's generation config, as `model.generation_config` would hold them,
    without loading the weights: generation_config.json, or (without one) what transformers derives
    from the model config. For a sampler that only talks to an endpoint."""
    from transformers import GenerationConfig

    src, kw = _source_kwargs(preset)
    try:
        gen = GenerationConfig.from_pretrained(src, revision=kw.get("revision"))
    except (OSError, ValueError):  # no generation_config.json
        gen = GenerationConfig.from_model_config(config)
    eos = gen.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [] if eos is None else [eos]))


def input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def cache_kwarg(model) -> str:
    """The name a model's `forward` (and `generate`) takes its KV cache by.

    transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in
    5.40); earlier 5.x releases know only `past_key_values`. The signature says which this
    installation has (`inspect` follows the deprecation wrapper to the real forward)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def passed_cache(kwargs: dict):
    """The KV cache in a forward call's keyword arguments, under either name (see `cache_kwarg`)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))
