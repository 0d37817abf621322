"""Baselines that run the model again, one stage each (grid.model_baselines), so that they never
re-run the sampler: p(True), one more forward pass per val/test answer (evaluation/p_true.py).
Writes the per-answer scores (Parquet) and the baseline's metrics in the shape of baselines@'s,
with its cost per response (the forward pass, timed, and the K - 1 samples it shows)."""

import json
from pathlib import Path

import polars as pl

from halludetect.config import MODEL_BASELINES
from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json, write_parquet
from halludetect.core.devices import resolve_device
from halludetect.core.errors import DataError
from halludetect.core.lookup import lookup
from halludetect.evaluation.baselines import evaluate_baseline
from halludetect.evaluation.costs import cost_per_response, sampling_seconds
from halludetect.evaluation.p_true import p_true_scores
from halludetect.labels.readers import read_judgments
from halludetect.lm.hf_models import load_model, load_tokenizer
from halludetect.methods import SCORES
from halludetect.qa.questions import read_questions
from stages import common


def run(args, params):
    spec = lookup("model baseline", args.baseline, {n: SCORES[n] for n in MODEL_BASELINES})
    pp, ep = params.p_true, params.evaluate
    device = resolve_device(pp.device, "p_true.device")  # before anything loads
    preset = params.model(args.model)
    judgments = read_judgments(args.judgments)
    generations = read_parquet(args.generations, "generate", "generations table")
    questions = read_questions(args.questions)
    k, sampling = sampling_seconds(json.loads(Path(args.generation_metrics).read_text()))
    model = load_model(preset, device).eval()
    scores, excluded, seconds = p_true_scores(  # its declaration's compute (methods/scores.py)
        model,
        load_tokenizer(preset),
        questions,
        generations,
        judgments,
        few_shot=pp.few_shot,
        batch_size=pp.batch_size,
    )
    write_parquet(args.scores, scores)
    scored = {r.rsplit("/", 1)[0] for r in scores["rid"].to_list()}
    for split in ("val", "test"):
        if not judgments.filter((pl.col("split") == split) & pl.col("question_id").is_in(list(scored))).height:
            raise DataError(
                f"{args.baseline}: no {split} answer could be scored ({excluded}): every prompt is longer than the "
                "model's context or every answer empty; lower generate.max_new_tokens or generate.n_samples"
            )
    out = {
        "model": args.model,
        "dataset": args.dataset,
        "method": args.baseline,
        "family": "baseline",
        "seeds": None,
        "params": pp.model_dump(),
    }
    out |= evaluate_baseline(scores.select("rid", "score"), judgments, bootstrap=ep.bootstrap, seed=ep.seed)
    out["left_out"] = excluded  # before scoring: empty answers, prompts longer than the context
    out["cost_per_response"] = cost_per_response(
        spec.needs,
        max(scores.height, 1) / max(seconds, 1e-9),
        extra_seconds=sampling,
        extra_what=f"{k:g} - 1 more samples shown as brainstorm (generate's seconds per sample)",
    )
    out["cost_per_response"]["device"] = str(device)
    write_json(args.out, out)
    common.log.info(
        "%s: test AUROC %.3f (%d answers left out)", args.baseline, out["test"]["auroc"]["mean"], sum(excluded.values())
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--baseline", f"which: {', '.join(MODEL_BASELINES)}"),
        ("--model", "model preset name"),
        ("--dataset", "dataset preset name"),
        ("--questions", "questions Parquet"),
        ("--generations", "generations Parquet"),
        ("--judgments", "judgments Parquet (which answers are evaluated; few-shot labels)"),
        ("--manifest", "model manifest; a dependency only"),
        ("--generation-metrics", "generate metrics JSON (seconds per sample)"),
        ("--scores", "Parquet of every scored answer (rid, score, log_p_true)"),
        ("--out", "metrics JSON"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
