"""Export an evaluated detector as a self-contained bundle for `halludetect score`.

The evaluate stage runs this after its evaluation (`--bundle`); `python -m stages.export` runs it
alone on an evaluation's files.

The best layer (chosen on validation by evaluate), every evaluated seed's weights at that
layer, thresholds and a Platt calibration fitted on that layer's validation scores, and what
reproduces its input: the base model and what pins it (manifest), the position convention,
the prompt template, the stored dtype; and, given the generations and judgments, the range of the
token log-probs of the answers the detector was fit on, which `score` marks each row against
(halludetect/scoring/answer_range.py). The export: halludetect/scoring/export.py; the format:
halludetect/scoring/bundle.py; the thresholds and calibration: halludetect/evaluation/thresholds.py.
"""

import json
from pathlib import Path

from halludetect.core.artifacts import read_parquet
from halludetect.core.errors import DataError
from halludetect.labels.readers import read_judgments
from halludetect.prompts import GENERATION
from halludetect.scoring.answer_range import kept_answers
from halludetect.scoring.export import export_bundle
from stages import common


def sampling_input(generation_metrics: dict, cluster_metrics: dict | None = None) -> dict:
    """How a question's answers were sampled, and clustered where `cluster_metrics` is given: K answers
    per question (generate's metrics), the equivalence rule and NLI backend (cluster's metrics)."""
    made = {"samples_per_question": generation_metrics["samples"] / generation_metrics["questions"]}
    if cluster_metrics is not None:
        made |= {"equivalence": cluster_metrics["equivalence"], "backend": cluster_metrics["backend"]}
    return made


def p_sem_input(args) -> dict | None:
    """How the P_sem of a method that reads it was made (`sampling_input`), or None without both
    metrics files."""
    if not (args.generation_metrics and args.cluster_metrics):
        return None
    read = [json.loads(Path(f).read_text()) for f in (args.generation_metrics, args.cluster_metrics)]
    return sampling_input(*read)


def fit_answers(args):
    """The kept answers' token log-probs by split (--generations and --judgments), or None, with a
    warning: the bundle then records no range and `score` cannot say which rows are out of distribution."""
    generations, judgments = getattr(args, "generations", None), getattr(args, "judgments", None)
    if not (generations and judgments):
        common.log.warning(
            "no --generations (and --judgments): the bundle records no range of its answers' token log-probs, "
            "so `halludetect score` leaves every row's in_distribution null"
        )
        return None
    table = read_parquet(generations, "generate", "generations table")
    return kept_answers(table, read_judgments(judgments), str(generations))


def run(args, params):
    """`args`: the evaluate stage's (--out the evaluation, --bundle the bundle) or this module's own."""
    evaluation, bundle = (args.out, args.bundle) if getattr(args, "bundle", None) else (args.metrics, args.out)
    if not args.manifest:
        raise DataError("pass --manifest (the model manifest) with --bundle: the bundle pins the base model")
    metrics = json.loads(Path(evaluation).read_text())
    manifest = json.loads(Path(args.manifest).read_text())
    meta = export_bundle(
        bundle,
        metrics=metrics,
        detectors_dir=args.detectors,
        scores_dir=args.scores,
        manifest=manifest,
        positions=params.dump.positions,
        states_dtype=params.dump.dtype,
        prompt_template=GENERATION,
        fpr_targets=params.export.fpr_targets,
        default_threshold=params.export.threshold,
        p_sem_input=p_sem_input(args),
        answers=fit_answers(args),
    )
    ev, name = meta["evaluation"], meta["default_threshold"]
    t = meta["thresholds"][name]
    common.log.info(
        "%s: layer %d, seeds %s; test AUROC %.3f per seed (mean), %.3f as an ensemble; default threshold "
        "%s = %.3f: validation FPR %.3f, TPR %.3f; test FPR %.3f, TPR %.3f",
        meta["method"],
        meta["layer"],
        meta["seeds"],
        ev["test_auroc_dag"]["mean"],
        ev["test_auroc_ensemble"],
        name,
        t["threshold"],
        t["val_fpr"],
        t["val_tpr"],
        t["test_fpr"],
        t["test_tpr"],
    )
    if (rng := meta.get("answer_range")) and "test" in rng:
        common.log.info(
            "%s: answers' range from %d train and validation answers; it marks %d of %d test answers "
            "out of distribution (%.1f%%)",
            meta["method"],
            rng["n"],
            rng["test"]["out"],
            rng["test"]["n"],
            100 * rng["test"]["share"],
        )
    if t["val_tpr"] == 0.0:  # e.g. the highest validation score is a correct answer's: no threshold within the rate
        common.log.warning(
            "%s: the default threshold %s catches no validation hallucination (validation FPR %.3f): "
            "its flags mean nothing; choose another export.threshold or pass --threshold when scoring",
            meta["method"],
            name,
            t["val_fpr"],
        )


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--metrics", required=True, help="evaluation metrics JSON (best_layer, seeds, test AUROC)")
    p.add_argument("--detectors", required=True, help="the method's detector directory (layer_LL/seed_S.safetensors)")
    p.add_argument("--scores", required=True, help="the method's scores directory (layer_LL.parquet)")
    p.add_argument("--manifest", required=True, help="model manifest JSON (what pins the base model)")
    p.add_argument("--out", required=True, help="bundle file (.safetensors)")
    p.add_argument("--generation-metrics", help="generate's metrics JSON (K answers per question), for hami_sp")
    p.add_argument("--cluster-metrics", help="cluster's metrics JSON (equivalence rule, backend), for hami_sp")
    p.add_argument(
        "--generations",
        help="generations Parquet (the answers' token log-probs), with --judgments: the range `score` checks "
        "rows against",
    )
    p.add_argument("--judgments", help="judgments Parquet (which answers were kept, by split), with --generations")
    common.main(run, p)
