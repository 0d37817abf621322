"""Build the demo world: people, corpus, tokenizer and tiny Llama, saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

from halludetect.config import WorldParams
from halludetect.core.atomic_io import atomic_path, write_jsonl
from halludetect.world.kb import build_people, corpus, qa_rows
from halludetect.world.tiny_llama import train_model, train_tokenizer


def build_world(params: WorldParams, out_dir: Path, log=print) -> dict:
    """Train the world model and write `out_dir/model/` and `out_dir/qa.jsonl`; return the training report."""
    people = build_people(params.n_people, params.exposures, params.relations, params.seed)
    docs = corpus(people, params.qa_fraction, params.seed)
    if not docs:
        raise ValueError("world.exposures are all 0: the corpus would be empty")
    tokenizer = train_tokenizer(docs, params.vocab_size)
    model, report = train_model(
        docs,
        tokenizer,
        hidden_size=params.hidden_size,
        n_layers=params.n_layers,
        n_heads=params.n_heads,
        intermediate_size=params.intermediate_size,
        epochs=params.epochs,
        batch_size=params.batch_size,
        lr=params.lr,
        seed=params.seed,
        log=log,
    )
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        write_jsonl(tmp / "qa.jsonl", qa_rows(people))
    return {
        "parameters": report.n_params,
        "train_seconds": round(report.seconds, 1),
        "final_loss": report.final_loss,
        "corpus_documents": report.n_docs,
        "corpus_tokens": report.n_tokens,
        "epochs": report.epochs,
    }
