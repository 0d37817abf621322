"""Shared fixtures: a tiny randomly initialised Llama with a real BPE tokenizer, saved locally."""

from __future__ import annotations

import os

from halludetect.core import numerics

# The stages' numerics (halludetect/core/numerics.py), pinned before torch loads, so that what a test
# computes in this process matches what a stage subprocess computes.
numerics.pin()

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")  # nor does DVC, which would report each command


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from halludetect.world.kb import build_people, corpus
    from halludetect.world.tiny_llama import train_tokenizer

    docs = corpus(build_people(30, [1, 3], ["birth_city", "job"], seed=1), qa_fraction=0.5, seed=1)
    tok = train_tokenizer(docs, vocab_size=400)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    from halludetect.config import ModelPreset
    from halludetect.lm.hf_models import load_model, load_tokenizer

    preset = ModelPreset(path=str(tiny_model_dir), dtype="float32")
    return load_model(preset, "cpu"), load_tokenizer(preset)


@pytest.fixture(scope="session")
def contract(tiny, tiny_model_dir, tmp_path_factory):
    """A miniature DAG in the per-layer layout of train/evaluate (tests/contract_layout.py)."""
    from contract_layout import build

    model, tok = tiny
    return build(tmp_path_factory.mktemp("dag"), model, tok, tiny_model_dir)


@pytest.fixture(scope="session")
def bundle_path(contract, tmp_path_factory):
    """The export of the miniature DAG's `max` detector."""
    import json

    from halludetect.prompts import GENERATION
    from halludetect.scoring.bundle import export_bundle

    out = tmp_path_factory.mktemp("bundle") / "max.safetensors"
    export_bundle(out, metrics=json.loads((contract / "metrics" / "max.json").read_text()),
                  detectors_dir=contract / "detectors" / "max", scores_dir=contract / "scores" / "max",
                  manifest=json.loads((contract / "manifest.json").read_text()), positions="predicting",
                  states_dtype="float16", prompt_template=GENERATION, fpr_targets=[0.01, 0.05, 0.1],
                  default_threshold="best_f1")
    return out


def pytest_collection_modifyitems(config, items):
    """The end-to-end modules first. Each takes minutes; under `make test` (xdist, a module per
    worker at a time, in collection order) each of the two workers starts with one of them and
    the unit modules fill in around them, instead of one worker ending with both."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # stable: file order otherwise
