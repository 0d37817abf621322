"""The samplers `generate.backend` names (kind "sampler" of core/registry.py, did-you-mean errors).

    hf           transformers in the stage's process (generation.py); the model loads here
    completions  a running vLLM or SGLang server (completions.py); only the tokenizer and the
                 model's config load here

Each entry opens a sampler of lm/sampling.py's interface for a model preset; `sampling.sample`
runs it. A plugin's opener takes the same arguments (entry-point group `halludetect.samplers`).
"""

from __future__ import annotations

from halludetect.config import GenerateParams, ModelPreset
from halludetect.core import registry
from halludetect.lm.completions import EngineSampler
from halludetect.lm.generation import HFSampler
from halludetect.lm.hf_models import load_config, load_generation_eos, load_model
from halludetect.lm.sampling import Sampler


def open_hf(preset: ModelPreset, params: GenerateParams, tokenizer, *, device: str, states_dir=None) -> HFSampler:
    model = load_model(preset, device)
    where = str(model.device) if not preset.device_map else f"device_map={preset.device_map}"
    return HFSampler(model, tokenizer, device=where)


def open_completions(
    preset: ModelPreset, params: GenerateParams, tokenizer, *, device: str, states_dir=None
) -> EngineSampler:
    config = load_config(preset)
    served = params.endpoint.model or preset.path  # what `vllm serve <path>` calls it
    eos = load_generation_eos(preset, config)
    return EngineSampler(
        tokenizer,
        config,
        model=served,
        eos=eos,
        replicas=len(params.endpoint.urls),
        states_dir=states_dir,
        states_layers=params.endpoint.hidden_states,
    )


def open_sampler(preset: ModelPreset, params: GenerateParams, tokenizer, *, device: str, states_dir=None) -> Sampler:
    """The sampler of `params.backend` for `preset`; `device` is where `hf` loads the model; `states_dir`
    where an engine's hidden states are kept (generate.endpoint.hidden_states)."""
    opener = registry.resolve("sampler", params.backend)
    return opener(preset, params, tokenizer, device=device, states_dir=states_dir)
