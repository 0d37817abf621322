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
    "Params": "halludetect.config", "load_params": "halludetect.config", "UserError": "halludetect.errors",
    "DataError": "halludetect.errors",
    # base models and their inputs
    "load_model": "halludetect.hf_models", "load_tokenizer": "halludetect.hf_models",
    "encode_prompt": "halludetect.model_inputs",
    # sampling, activations, layer files
    "generate": "halludetect.generation", "capture": "halludetect.activations", "dump": "halludetect.activations",
    "layer_files": "halludetect.layer_format", "read_layer": "halludetect.layer_reader",
    "LayerReader": "halludetect.layer_reader",
    # labels
    "get_judge": "halludetect.judges", "two_pass": "halludetect.judges", "get_nli": "halludetect.nli",
    "cluster_responses": "halludetect.nli", "read_judgments": "halludetect.label_tables",
    "read_clusters": "halludetect.label_tables",
    # detectors
    "DETECTORS": "halludetect.detectors", "Bags": "halludetect.detectors", "build_detector": "halludetect.detectors",
    "load_detector": "halludetect.detectors", "save_detector": "halludetect.detectors",
    "split_data": "halludetect.detector_data", "train_detector": "halludetect.training",
    "evaluate_detector": "halludetect.evaluation",
    # scoring new answers with an exported bundle
    "load_bundle": "halludetect.bundle", "Scorer": "halludetect.scoring", "score_answers": "halludetect.scoring",
    "score_file": "halludetect.scoring",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'halludetect' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
