"""The train stage of a score with nothing to train (halludetect/methods/scores.py).

grid.detectors is one list, so a score has a train and an evaluate stage like a trained detector;
stages/train.py hands it over here (`common.hand_over`), by name rather than by an import, so that
the code stage gives a trained method's stage none of the scores' code and a score's none of the
training's (core/code_deps.py, HAND_OVER). The evaluate stage's part: stages/evaluate_score.py.

It computes the score of every kept val/test response from what the route stage hands it (the
generations; the clustering, or the questions and the model preset, to those that read them):
--scores/answers.parquet (response_id, question_id, sample_index, split, label, score; the score
null where it cannot be computed: an empty answer, a question with one answer, a prompt longer than
the model's context), and the seconds it took (--timing). It has no weights and no layers: --out and
--metrics hold only a note saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from halludetect.config import ModelPreset
from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import atomic_path, write_json, write_parquet
from halludetect.core.errors import DataError
from halludetect.core.registry import load_target
from halludetect.evaluation.baselines import timed_scores
from halludetect.labels.readers import read_clusters, read_judgments
from halludetect.labels.routing import take_routed
from halludetect.methods import SCORES
from halludetect.qa.responses import response_ids
from stages import common

ANSWERS = "answers.parquet"  # under --scores: one row per kept val/test response
TIMING = "score"  # the timing file's one key (a trained detector's: layer_<L>)
NOTE = "nothing_trained.json"  # in its weights and per-layer directories


def _nothing_trained(path: str, name: str, what: str) -> None:
    """An output a score has none of (weights, per-layer figures): a directory holding only a note
    saying so (DVC warns of an empty one), replacing whatever a killed run left."""
    with atomic_path(path, is_dir=True) as tmp:
        note = {"detector": name, "why": f"a score with nothing to train has no {what} (stages/train_score.py)"}
        (tmp / NOTE).write_text(json.dumps(note, indent=2) + "\n")


def _model_score(args, spec, p, judgments, generations) -> tuple[pl.DataFrame, dict, float]:
    """A score that asks the model again (p(True)): the preset's model, one batched forward pass per
    val/test answer."""
    preset_file, questions = getattr(args, "model_preset", None), getattr(args, "questions", None)
    if not (preset_file and questions):
        raise DataError(f"{args.method} asks the model again: pass --routed (the questions and the model preset)")
    preset = ModelPreset.model_validate(json.loads(Path(preset_file).read_text()))
    compute = load_target(spec.compute, f"the score {args.method}")
    questions = read_parquet(questions, "prepare", "questions table")
    scores, excluded, seconds, device = compute(preset, questions, generations, judgments, p)
    return scores.select("rid", "score"), {"left_out": excluded, "device": device}, seconds


def _unscored_advice(spec) -> str:
    if spec.source == "model":
        return "every answer empty or every prompt longer than the model's context: lower generate.max_new_tokens"
    if "sampling" in spec.needs:
        return "no question has two non-empty answers: raise generate.n_samples"
    if spec.reads_clusters:
        return "no question was clustered: see metrics/clusters (the NLI backend's invalid replies)"
    return "every answer empty: see metrics/generate"


def run(args, params) -> None:
    spec, p = SCORES[args.method], getattr(params.detectors, args.method)
    take_routed(args, "train")  # the generations; the clustering, the questions and the preset to those that read them
    if not args.generations:
        raise DataError(f"{args.method} is computed from the sampled answers: pass --routed (or --generations)")
    judgments = read_judgments(args.judgments)
    generations = read_parquet(args.generations, "generate", "generations table")
    if spec.source == "model":
        scores, extra, seconds = _model_score(args, spec, p, judgments, generations)
    else:
        clusters = read_clusters(args.clusters) if spec.reads_clusters else None
        scores, seconds = timed_scores(args.method, generations, clusters, p)
        extra = {}
    kept = judgments.filter(pl.col("kept") & pl.col("split").is_in(["val", "test"]))
    answers = (
        kept.select(response_ids(kept).alias("rid"), "question_id", "sample_index", "split", "label")
        .join(scores, on="rid", how="left")
        .rename({"rid": "response_id"})
        .sort("split", "question_id", "sample_index")
    )
    for split in ("val", "test"):
        if not answers.filter((pl.col("split") == split) & pl.col("score").is_not_null()).height:
            left_out = f" ({extra['left_out']})" if "left_out" in extra else ""
            raise DataError(f"{args.method}: no {split} answer could be scored{left_out}: {_unscored_advice(spec)}")
    _nothing_trained(args.out, args.method, "weights")
    _nothing_trained(args.metrics, args.method, "layers")
    with atomic_path(args.scores, is_dir=True) as tmp:
        write_parquet(tmp / ANSWERS, answers)
    n = scores.height
    write_json(
        args.timing,
        {TIMING: {"seconds": seconds, "responses": n, "samples_per_s": max(n, 1) / max(seconds, 1e-9), **extra}},
    )
    common.log.info(
        "%s: %d of %d kept val/test answers scored", args.method, answers["score"].is_not_null().sum(), len(answers)
    )
