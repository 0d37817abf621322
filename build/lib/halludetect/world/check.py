"""Check the demo world: does the model know what it saw often, and hallucinate the rest?"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from halludetect.config import GenerateParams, ModelPreset
from halludetect.core.atomic_io import read_jsonl
from halludetect.labels.text import contains
from halludetect.lm.generation import generate
from halludetect.lm.hf_models import load_model, load_tokenizer
from halludetect.metrics import auroc


def greedy_answers(world_dir: Path, rows: list[dict], params: GenerateParams) -> pl.DataFrame:
    """The world model's greedy answer to each question of `rows`, in order."""
    preset = ModelPreset(path=str(world_dir / "model"), dtype="float32")
    model, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    questions = pl.DataFrame(
        {"id": [r["id"] for r in rows], "question": [r["question"] for r in rows], "split": ["all"] * len(rows)}
    )
    return generate(model, tokenizer, questions, params.model_copy(update={"n_samples": 1}), greedy=True)


def check_lookalikes(world_dir: Path, qa_path: Path, params: GenerateParams) -> dict:
    """Greedy answers to the look-alike dataset (world/lookalike.py): accuracy by kind, and how
    often a look-alike gets the fact of the known person whose name it nearly shares."""
    rows = read_jsonl(qa_path)
    greedy = greedy_answers(world_dir, rows, params)
    known = {(r["entity"], r["relation"]): r["answers"][0] for r in rows if r["kind"] == "known"}
    mean_lp = [float(np.mean(lp)) if len(lp) else float("nan") for lp in greedy["token_logprobs"].to_list()]
    out = {}
    for kind in ("known", "lookalike"):
        pick = [(t, r) for t, r in zip(greedy["text"], rows) if r["kind"] == kind]
        lp = [v for v, r in zip(mean_lp, rows) if r["kind"] == kind]
        out[kind] = {
            "questions": len(pick),
            "greedy_accuracy": float(np.mean([contains(t, r["answers"][0]) for t, r in pick])),
            "mean_token_logprob": float(np.nanmean(lp)),
        }
        if kind == "lookalike":
            out[kind]["answers_with_the_known_persons_fact"] = float(
                np.mean([contains(t, known[(r["lookalike_of"], r["relation"])]) for t, r in pick])
            )
    return out


def evaluate_world(world_dir: Path, params: GenerateParams) -> dict:
    """Greedy answers to every question: does the model know what it saw often?

    A separate step (and DVC stage) from training, so that a change to the generation code
    re-runs this check and not the training. `params` are generate's (stop strings, length,
    repetition penalty); the check decodes one greedy answer per question.
    """
    rows = read_jsonl(world_dir / "qa.jsonl")
    greedy = greedy_answers(world_dir, rows, params)
    correct = np.array([contains(t, r["answers"][0]) for t, r in zip(greedy["text"], rows)])
    exposure = np.array([r["exposure"] for r in rows])
    mean_lp = np.array([np.mean(lp) if len(lp) else -np.inf for lp in greedy["token_logprobs"].to_list()])
    halluc = ~correct
    return {
        "questions": len(rows),
        "greedy_accuracy_by_exposure": {str(e): float(correct[exposure == e].mean()) for e in sorted(set(exposure))},
        "greedy_hallucination_rate": float(halluc.mean()),
        # AUROC of -mean token log-prob of the greedy answer as a hallucination score.
        "logprob_auroc": float(auroc(halluc, -mean_lp)) if 0 < halluc.sum() < len(halluc) else None,
    }
