"""A score with nothing to train (methods/scores.py: P_sem, semantic entropy, the mean token
log-prob, the length, ...) as a bundle: what `halludetect score` needs to flag a new answer with it
as the evaluate stage measured it. The trained detectors' bundles (bundle.py) carry weights; a
score's carries none, but the rest is the same: thresholds and a Platt calibration fitted on
validation (evaluation/thresholds.py, as a detector's), their test figures, the base model.

One safetensors file:

    tensors   val_score float64 [n_val], val_label uint8 [n_val]: the validation answers' scores and
              labels, by response id, that chose the thresholds and the calibration (what a new
              threshold could be chosen from without the DAG; loading checks them against the metadata)
    metadata  one sorted JSON entry, "bundle":
      format, format_version, kind   "halludetect-score-bundle", 1, "score" (a halludetect older than
                                     score bundles names the format it cannot read)
      digest                         as a detector bundle's: sha256 of every tensor and of the metadata
      score                          its declaration: name, display, needs, source, family
      params                         its section detectors.<name> (p_sem: `variant`, which P_sem)
      model, dataset                 the grid cell it was evaluated on
      base_model                     as a detector bundle's (scoring/export.py base_model_meta)
      inputs                         the prompt the answers were sampled (and, for logprob, are
                                     teacher forced) with: template, hash, chat_template flag
      generation                     (optional) how the answers were sampled and clustered
                                     (samples_per_question, equivalence, backend, ...), as given
      thresholds, default_threshold  as a detector bundle's, on the score's own scale (tokens, nats, 1 - P_sem)
      calibration                    Platt p = sigmoid(a score + b), fitted on validation: an
                                     affine map, so a score that is not a logit needs nothing more
      evaluation                     validation and test AUROC, answers and hallucinated answers per
                                     split, and how many were left out unscored
      score_range                    the validation scores' minimum, maximum and quantiles: `score`
                                     marks a row whose score lies outside them (the calibration
                                     and thresholds were never fitted there)

This module writes it (`export_score_bundle`, the evaluate stage's last step for a score);
bundle.py reads it: `load_bundle` recognises the kind and returns a `ScoreBundle` (checked by
`load_score_bundle`, beside the detector bundle's checks whose pieces it shares). What
`halludetect score` computes per score (scorer.py, `ScoreBundleScorer`): `ONE_ANSWER` says which
can be computed for one answer alone and from what; the others read the question's other answers
and are refused, naming what they need.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import torch

from halludetect.core.errors import DataError
from halludetect.core.lookup import lookup
from halludetect.evaluation.thresholds import fit_platt
from halludetect.methods import SCORES
from halludetect.metrics import auroc
from halludetect.prompts import GENERATION, template_hash
from halludetect.scoring.answer_range import QUANTILES
from halludetect.scoring.bundle import (  # noqa: F401 - the score bundle's format, re-exported with its export
    KIND,
    ONE_ANSWER,
    RANGE_RULE,
    SCORE_CAN_SCORE,
    SCORE_FORMAT,
    SCORE_FORMAT_VERSION,
    SPLITS,
    ScoreBundle,
    load_score_bundle,
    write_bundle_file,
)
from halludetect.scoring.export import base_model_meta, bundle_thresholds


# ---------------------------------------------------------------------------- export
def _scored(answers: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, int]]:
    """The answers checked (columns, splits, labels, one row per response and split), and the
    scored ones; rows without a finite score are left out and counted per split."""
    need = {"response_id", "question_id", "sample_index", "split", "label", "score"}
    if missing := sorted(need - set(answers.columns)):
        raise DataError(f"the score's answers lack column(s) {', '.join(missing)}")
    if bad := sorted(set(answers["split"].unique().to_list()) - set(SPLITS)):
        raise DataError(f"the score's answers hold split(s) {bad}: only val and test answers are exported")
    if bad := sorted(set(answers["label"].unique().to_list()) - {0, 1}):
        raise DataError(f"the score's answers hold label(s) {bad}: labels are 1 (hallucinated) or 0 (correct)")
    if (dup := answers.filter(pl.struct("split", "response_id").is_duplicated())).height:
        raise DataError(f"the score's answers repeat response {dup['response_id'][0]!r}: one row per response")
    z = pl.col("score").cast(pl.Float64)
    ok = answers.filter(z.is_not_null() & z.is_finite())
    unscored = {s: answers.filter(pl.col("split") == s).height - ok.filter(pl.col("split") == s).height for s in SPLITS}
    return ok.with_columns(z.alias("score")).sort("response_id"), unscored


def _split(ok: pl.DataFrame, split: str, score: str) -> tuple[np.ndarray, np.ndarray]:
    part = ok.filter(pl.col("split") == split)
    if part.height == 0:
        raise DataError(f"'{score}' scored no {split} answer: its bundle needs both splits; re-run evaluate")
    return part["label"].to_numpy().astype(np.int64), part["score"].to_numpy()


def export_score_bundle(
    out: str | Path,
    *,
    score: str,
    params: dict,
    answers: pl.DataFrame,
    manifest: dict,
    export,
    model: str,
    dataset: str,
    generation: dict | None = None,
) -> dict:
    """Write the bundle of a score evaluated on (model, dataset) and return a summary for the log.

    `answers`: one row per val/test response it was evaluated on: response_id, question_id,
    sample_index, split, label (1 = hallucinated), score (higher = more likely hallucinated; a
    null or non-finite score is left out, counted). `params`: its section detectors.<score>;
    `manifest`: the model manifest (data/models/<m>.json); `export`: the ExportParams section
    (threshold, fpr_targets); `generation`: how the answers were sampled and clustered (e.g.
    samples_per_question, equivalence, backend), recorded as given."""
    decl = lookup("score", score, SCORES)
    ok, unscored = _scored(answers)
    y_val, z_val = _split(ok, "val", score)
    y_test, z_test = _split(ok, "test", score)
    thresholds = bundle_thresholds(
        (y_val, z_val), (y_test, z_test), export.fpr_targets, export.threshold, f"'{score}'", "re-run judge"
    )
    meta = {
        "format": SCORE_FORMAT,
        "format_version": SCORE_FORMAT_VERSION,
        "kind": KIND,
        "score": {
            "name": decl.name,
            "display": decl.display,
            "needs": list(decl.needs),
            "source": decl.source,
            "family": decl.family,
        },
        "params": dict(params),
        "model": model,
        "dataset": dataset,
        "base_model": base_model_meta(manifest),
        "inputs": {
            "prompt_template": GENERATION,  # the prompt stages/export.py records for every detector
            "prompt_hash": template_hash(GENERATION),
            "chat_template": bool(manifest["preset"]["chat_template"]),
        },
        **({"generation": generation} if generation is not None else {}),
        "thresholds": thresholds,
        "default_threshold": export.threshold,
        # Platt's a z + b is affine: a score on its own scale (tokens, nats) is calibrated as a logit is
        "calibration": fit_platt(y_val, z_val),
        "evaluation": {
            "val_auroc": float(auroc(y_val, z_val)),
            "test_auroc": float(auroc(y_test, z_test)),
            "n_val": int(len(y_val)),
            "n_test": int(len(y_test)),
            "n_val_hallucinated": int(y_val.sum()),
            "n_test_hallucinated": int(y_test.sum()),
            "unscored": unscored,
        },
        "score_range": {
            "split": "val",
            "n": int(len(z_val)),
            "min": float(z_val.min()),
            "max": float(z_val.max()),
            **{f"q{p:g}": float(v) for p, v in zip(QUANTILES, np.quantile(z_val, QUANTILES))},
        },
    }
    tensors = {"val_score": torch.from_numpy(z_val.copy()), "val_label": torch.from_numpy(y_val.astype(np.uint8))}
    write_bundle_file(out, tensors, meta)
    default = thresholds[export.threshold]
    return {
        "score": score,
        "default_threshold": export.threshold,
        "threshold": default,
        "calibration": meta["calibration"],
        "evaluation": meta["evaluation"],
    }
