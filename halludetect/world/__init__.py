"""The offline demo world: knowledge base, corpus, tokenizer, tiny Llama, and its questions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
from sklearn.metrics import roc_auc_score

from halludetect.config import GenerateParams, WorldParams
from halludetect.io import atomic_path, read_jsonl, write_jsonl
from halludetect.text import contains
from halludetect.world.kb import build_people, corpus, qa_rows
from halludetect.world.model import train_model, train_tokenizer


def build_world(params: WorldParams, out_dir: Path, log=print) -> dict:
    """Train the world model and write `out_dir/model/` and `out_dir/qa.jsonl`; return the training report."""
    people = build_people(params.n_people, params.exposures, params.relations, params.seed)
    docs = corpus(people, params.qa_fraction, params.seed)
    if not docs:
        raise ValueError("world.exposures are all 0: the corpus would be empty")
    tokenizer = train_tokenizer(docs, params.vocab_size)
    model, report = train_model(
        docs, tokenizer, hidden_size=params.hidden_size, n_layers=params.n_layers, n_heads=params.n_heads,
        intermediate_size=params.intermediate_size, epochs=params.epochs, batch_size=params.batch_size,
        lr=params.lr, seed=params.seed, log=log,
    )
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        write_jsonl(tmp / "qa.jsonl", qa_rows(people))
    return {"parameters": report.n_params, "train_seconds": round(report.seconds, 1),
            "final_loss": report.final_loss, "corpus_documents": report.n_docs,
            "corpus_tokens": report.n_tokens, "epochs": report.epochs}


def evaluate_world(world_dir: Path) -> dict:
    """Greedy answers to every question: does the model know what it saw often?

    A separate step (and DVC stage) from training, so that a change to the generation code
    re-runs this check and not the three minutes of training.
    """
    from halludetect.config import ModelPreset
    from halludetect.generation import generate
    from halludetect.modeling import load_model, load_tokenizer

    preset = ModelPreset(path=str(world_dir / "model"), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    rows = read_jsonl(world_dir / "qa.jsonl")
    questions = pl.DataFrame({"id": [r["id"] for r in rows], "question": [r["question"] for r in rows],
                              "split": ["all"] * len(rows)})
    greedy = generate(model, tokenizer, questions, GenerateParams(n_samples=1, max_new_tokens=24), greedy=True)
    correct = np.array([contains(t, r["answers"][0]) for t, r in zip(greedy["text"], rows)])
    exposure = np.array([r["exposure"] for r in rows])
    mean_lp = np.array([np.mean(lp) if len(lp) else -np.inf for lp in greedy["token_logprobs"].to_list()])
    halluc = ~correct
    return {
        "questions": len(rows),
        "greedy_accuracy_by_exposure": {str(e): float(correct[exposure == e].mean()) for e in sorted(set(exposure))},
        "greedy_hallucination_rate": float(halluc.mean()),
        # AUROC of -mean token log-prob of the greedy answer as a hallucination score.
        "logprob_auroc": float(roc_auc_score(halluc, -mean_lp)) if 0 < halluc.sum() < len(halluc) else None,
    }
