"""Loading causal LMs from a local directory or the Hugging Face hub, with clear errors.

The same function loads the demo world's 2M-parameter Llama and Llama-3.3-70B in 4-bit:
what differs is the preset in params.yaml.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from halludetect.config import ModelPreset

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    pass


def is_local(preset: ModelPreset) -> bool:
    """A path that exists, or one written like a path, is local; anything else is a hub id."""
    p = preset.path
    return Path(p).exists() or p.startswith((".", "/", "~")) or p.startswith("data/")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' was asked for but CUDA is not available; use 'cpu' or 'auto'")
    return device


def _source_kwargs(preset: ModelPreset) -> tuple[str, dict]:
    if is_local(preset):
        path = Path(preset.path).expanduser()
        if not path.exists():
            raise ModelError(f"model directory {path} does not exist (check models.<name>.path)")
        return str(path), {"trust_remote_code": preset.trust_remote_code}
    return preset.path, {"revision": preset.revision, "trust_remote_code": preset.trust_remote_code}


def _hub_hint(preset: ModelPreset, e: Exception) -> ModelError:
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
        raise _hub_hint(preset, e) from None


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
        raise _hub_hint(preset, e) from None
    tok.padding_side = "left"  # batched generation appends on the right
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(preset: ModelPreset, device: str = "auto"):
    from transformers import AutoModelForCausalLM

    src, kw = _source_kwargs(preset)
    if preset.quantization:
        if not torch.cuda.is_available():
            raise ModelError(
                f"preset '{preset.path}' asks for {preset.quantization} quantization (bitsandbytes), "
                "which needs a CUDA GPU; this machine has none. Use an unquantized preset here"
            )
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = (
            BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )
            if preset.quantization == "4bit"
            else BitsAndBytesConfig(load_in_8bit=True)
        )
    if preset.dtype != "auto":
        kw["dtype"] = DTYPES[preset.dtype]
    if preset.device_map:
        kw["device_map"] = preset.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kw)
    except OSError as e:
        raise _hub_hint(preset, e) from None
    if not preset.device_map and not preset.quantization:
        model = model.to(resolve_device(device))
    model.eval()
    return model


def input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def dir_fingerprint(path: str | Path) -> dict[str, str]:
    """sha256 of every file of a local model directory (for the model manifest)."""
    path = Path(path)
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[str(f.relative_to(path))] = h.hexdigest()
    return out


def resolve_hub_revision(preset: ModelPreset) -> str:
    """The commit a hub preset resolves to: online from the hub, offline from the HF cache."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        return HfApi().model_info(preset.path, revision=preset.revision).sha
    except Exception as online_error:  # offline or unreachable: try the local cache
        try:
            path = snapshot_download(preset.path, revision=preset.revision, local_files_only=True)
            return Path(path).name
        except Exception:
            raise _hub_hint(preset, online_error) from None
