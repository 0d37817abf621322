"""Shared fixtures: a tiny randomly initialised Llama with a real BPE tokenizer, saved locally, the
miniature DAG on it and its bundle, a trained synthetic cell to damage, and a guard against loading
weights. Helpers that are not fixtures live in support.py (tests/ is on pytest's pythonpath).

The tests mirror the library: tests/<folder>/test_<module>.py checks halludetect/<folder>/<module>.py
(every test file has a unique basename, no tests/ folder is a package); tests/stages/ checks the
stages' own plumbing. Two markers cut across them:

- `e2e`: the end-to-end modules (test_e2e.py, test_e2e_sharing.py), run last, on one DAG built in
  the background beside the unit modules (see below).
- `hostile`: issue 13, the cases a hostile new user tried, one test each, named after the case
  (`pytest -m hostile`). Bad input never becomes a result, damaged state never blocks a re-run, and
  nothing is paid twice across processes; each asserts the message a user sees (the file, line,
  row or params key, and the fix).
"""

from __future__ import annotations

import os

from halludetect.core import allocator, numerics

# The stages' numerics (halludetect/core/numerics.py), pinned before torch loads, so that what a test
# computes in this process matches what a stage subprocess computes; and their allocator settings.
numerics.pin()
allocator.keep_freed_memory()

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
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
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
    """The export of the miniature DAG's `max` detector, with the range of its answers' log-probs."""
    import json

    import polars as pl

    from halludetect.prompts import GENERATION
    from halludetect.scoring.answer_range import kept_answers
    from halludetect.scoring.export import export_bundle

    out = tmp_path_factory.mktemp("bundle") / "max.safetensors"
    export_bundle(
        out,
        metrics=json.loads((contract / "metrics" / "max.json").read_text()),
        detectors_dir=contract / "detectors" / "max",
        scores_dir=contract / "scores" / "max",
        manifest=json.loads((contract / "manifest.json").read_text()),
        positions="predicting",
        states_dtype="float16",
        prompt_template=GENERATION,
        fpr_targets=[0.01, 0.05, 0.1],
        default_threshold="fpr_0.05",
        answers=kept_answers(*(pl.read_parquet(contract / f) for f in ("generations.parquet", "judgments.parquet"))),
    )
    return out


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory):
    """Layers 0 and 1 trained with one seed (max, a few epochs) by their train stages' code."""
    from support import cell

    from halludetect.activations.layer_format import layer_filename
    from halludetect.activations.layer_reader import read_layer
    from halludetect.detectors.data import SPLITS, split_data
    from halludetect.detectors.training import train_layer
    from halludetect.methods.pooling import PoolingParams

    root = tmp_path_factory.mktemp("trained")
    acts, labels, _ = cell(root)
    labels.write_parquet(root / "judgments.parquet")
    params = PoolingParams(dim=8, dropout=0.0)
    for index in (0, 1):
        layer = read_layer(acts / layer_filename(index), dtype=None)
        train_layer(
            "max",
            params,
            {s: split_data(layer, labels, s) for s in SPLITS},
            [0],
            layer=index,
            epochs=2,
            batch_size=64,
            device="cpu",
            out_dir=root / "dets" / f"layer_{index}",
            scores_path=root / "scores" / f"layer_{index}.parquet",
            metrics_path=root / "layers" / f"layer_{index}.json",
            log=lambda *_: None,
        )
    return root, labels


@pytest.fixture
def trained(trained_once, tmp_path):
    """A private copy of the trained cell (tests damage it)."""
    import shutil

    root, _ = trained_once
    for name in ("acts", "dets", "scores", "layers", "params.yaml", "judgments.parquet"):
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, tmp_path / name)
    return tmp_path


@pytest.fixture
def no_loading(monkeypatch):
    """Mismatches must be refused before any weights are loaded."""
    from halludetect.scoring import scorer as scoring

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the mismatch was found")

    monkeypatch.setattr("halludetect.activations.early_exit.load_until", refuse)
    monkeypatch.setattr(scoring, "load_model", refuse)


def pytest_collection_modifyitems(config, items):
    """The end-to-end modules last. Their DAG builds in the background from the end of collection
    (below) while the unit modules run; under `make test` (xdist, a module per worker at a time, in
    collection order) each of the two workers then ends with one of them, on its own copy of the DAG.
    (Placed after 60% of the unit modules instead, so that unit modules would fill in after them,
    both waited 50 to 80 s for the build, which runs slower beside two workers: 531 s of pytest
    against 484 s, docs/benchmarks.md.)"""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)  # stable: file order otherwise


def pytest_collection_finish(session):
    """Start building the end-to-end modules' DAG (tests/e2e_support.py) once a session has collected
    one of their tests: one worker of the session builds it, in a process of its own."""
    if session.config.option.collectonly or not any(i.get_closest_marker("e2e") for i in session.items):
        return
    from e2e_support import start_shared_build

    session.config._e2e_build = start_shared_build(session.config._tmp_path_factory.getbasetemp())


def pytest_sessionfinish(session, exitstatus):
    """The worker that started the build waits for it (the other worker's module may still need it),
    unless the session was interrupted."""
    build = getattr(session.config, "_e2e_build", None)
    if build is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        build.terminate()
    build.wait()
