"""halludetect: hallucination detection from an LLM's own hidden states.

The front door for library users; the DVC stages import the modules themselves. Names load
lazily, so `import halludetect` costs nothing until a name is used:

    from halludetect import load_params, load_model, load_tokenizer, capture, load_detector

    params = load_params("params.yaml")
    with capture(model, [16]) as states:    # hidden states of layer 16 on every forward pass
        model(**inputs)

Nothing here runs at import time (a test checks it), so this file is no dependency of any stage.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it
_EXPORTS = {
    # params
    "Params": "halludetect.config",
    "load_params": "halludetect.config",
    "UserError": "halludetect.core.errors",
    "DataError": "halludetect.core.errors",
    # base models and their inputs
    "load_model": "halludetect.lm.hf_models",
    "load_tokenizer": "halludetect.lm.hf_models",
    "encode_prompt": "halludetect.lm.model_inputs",
    # sampling, activations, layer files
    "generate": "halludetect.lm.generation",
    "capture": "halludetect.activations.capture",
    "dump": "halludetect.activations.capture",
    "layer_files": "halludetect.activations.layer_format",
    "read_layer": "halludetect.activations.layer_reader",
    "LayerReader": "halludetect.activations.layer_reader",
    # labels
    "get_judge": "halludetect.labels.judges",
    "two_pass": "halludetect.labels.judges",
    "get_nli": "halludetect.labels.nli",
    "cluster_responses": "halludetect.labels.nli",
    "read_judgments": "halludetect.labels.readers",
    "read_clusters": "halludetect.labels.readers",
    # detectors: the methods' registry, bags of token states, building, training, evaluating
    "METHODS": "halludetect.methods",
    "DETECTORS": "halludetect.detectors.build",
    "Bags": "halludetect.activations.bags",
    "build_detector": "halludetect.detectors.build",
    "load_detector": "halludetect.detectors.build",
    "save_detector": "halludetect.detectors.build",
    "split_data": "halludetect.detectors.data",
    "train_detector": "halludetect.detectors.training",
    "evaluate_detector": "halludetect.evaluation.evaluate",
    # scoring new answers with an exported bundle
    "load_bundle": "halludetect.scoring.bundle",
    "Scorer": "halludetect.scoring.scorer",
    "score_answers": "halludetect.scoring.scorer",
    "score_file": "halludetect.scoring.scorer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'halludetect' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
