"""`halludetect score`: answers (or sampled answers to questions) scored with a detector bundle, or
answers with a score bundle (p_sem, length, logprob) (`halludetect.scoring.scorer.score_file`)."""

from __future__ import annotations

import argparse
import json
import sys

from halludetect.core.errors import UserError


def _sampling(args):
    """`score --generate`'s sampling params: --params' generate section (or the defaults), with
    --seed and --max-new-tokens over it, validated again (scorer.checked_generate)."""
    from halludetect.config import GenerateParams, load_params
    from halludetect.scoring.scorer import checked_generate

    if not args.generate:
        if args.params or args.seed is not None or args.max_new_tokens is not None or args.greedy:
            raise UserError(
                "--params, --seed, --max-new-tokens and --greedy set the sampling of --generate: "
                "pass --generate, or drop them"
            )
        return None
    generate = load_params(args.params).generate if args.params else GenerateParams()
    update = {k: v for k, v in (("seed", args.seed), ("max_new_tokens", args.max_new_tokens)) if v is not None}
    return checked_generate(generate.model_copy(update=update))


def _check_summary_path(args) -> None:
    """--summary is written after the scores: refuse a path that would destroy an input or the scores."""
    from halludetect.scoring.answer_files import check_output

    if args.summary:
        reads = {"input (--input)": args.input, "bundle (--bundle)": args.bundle, "output (--out)": args.out}
        check_output(args.summary, "the summary (--summary)", reads)


def _device_map(text: str) -> str:
    """--device-map checked as params' device_map is: one line from argparse, not transformers' traceback."""
    from halludetect.config import device_map_problem

    if problem := device_map_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


def run(args) -> None:
    from halludetect.core.atomic_io import write_json
    from halludetect.scoring.scorer import score_file

    generate = _sampling(args)
    _check_summary_path(args)
    summary = score_file(
        args.bundle,
        args.input,
        args.out,
        args.model,
        revision=args.revision,
        dtype=args.dtype,
        device=args.device,
        device_map=args.device_map,
        positions=args.positions,
        generate=generate,
        greedy=args.greedy,
        threshold=args.threshold,
        batch_size=args.batch_size,
        per_seed=args.per_seed,
        explain=args.explain,
        check_distribution=not args.no_distribution_check,
        rows_per_part=args.rows_per_part,
        progress=not args.no_progress,
        log=lambda msg: print(msg, file=sys.stderr),
    )
    if args.summary:
        write_json(args.summary, summary)
    print(json.dumps(summary, sort_keys=True))


def add_model_options(s) -> None:
    """The base model's options, shared by `score` and `serve`."""
    s.add_argument(
        "--model",
        help="base model: a local directory or hub id (default: the one the bundle names); "
        "it must be the model the detector was trained on",
    )
    s.add_argument("--revision", help="hub revision of --model (default: the bundle's)")
    s.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16", "auto"], help="model dtype (default: the bundle's preset)"
    )
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: auto)")
    s.add_argument("--device-map", type=_device_map, help="accelerate placement over several GPUs, e.g. auto")


def add(sub) -> None:
    from halludetect.scoring.answer_range import CAN_SCORE

    s = sub.add_parser(
        "score",
        help="score answers (or sampled answers to questions) with a detector bundle",
        description="Score answers with a detector bundle (the export stage writes them to "
        f"data/bundles/<model>/<dataset>/<method>.safetensors). A detector can score {CAN_SCORE}. The base "
        "model runs whole, for the answers' token log-probs; with --no-distribution-check, or a bundle that "
        "predates the check, only up to the detector's layer. A score bundle (a score with nothing to train) "
        "scores answers given: p_sem is 1 - each row's p_sem (no model; `halludetect show` says which P_sem), "
        "length the answer's tokens under the base model's tokenizer, logprob minus its mean token log-prob "
        "under the base model; the scores that read a question's other answers (semantic_entropy, "
        "lexical_similarity, semantic_sets, p_true) are refused.",
    )
    s.add_argument("--bundle", required=True, help="detector or score bundle (.safetensors)")
    s.add_argument(
        "--input",
        required=True,
        help="JSONL or Parquet: question, answer[, id, answer_token_ids, p_sem] (p_sem: for hami_sp and a p_sem "
        "score bundle); with --generate: question[, id]",
    )
    s.add_argument(
        "--out",
        required=True,
        help="output file, .parquet or .jsonl (parts of an unfinished run are "
        "kept next to it in .<name>.parts/ and reused by a re-run)",
    )
    add_model_options(s)
    s.add_argument(
        "--positions",
        choices=["predicting", "generated"],
        help="the token-position convention you expect; a bundle with another one is refused",
    )
    s.add_argument(
        "--threshold",
        help="flag threshold: best_f1, fpr_0.05, ... (stored in the bundle; `halludetect "
        "show` lists them) or a logit value (default: the bundle's default)",
    )
    s.add_argument("--batch-size", type=int, default=32, help="answers per forward pass (default: 32)")
    s.add_argument(
        "--rows-per-part",
        type=int,
        default=1024,
        help="rows per resumable part: a killed run loses at most one part (default: 1024)",
    )
    s.add_argument("--per-seed", action="store_true", help="also write each seed's logit (seed_scores)")
    s.add_argument(
        "--explain",
        action="store_true",
        help="also write each answer's token evidence: its tokens, their character offsets in the answer and "
        "their contributions, which sum with `bias` to the score (read it with `halludetect explain`)",
    )
    s.add_argument(
        "--generate",
        action="store_true",
        help="the input has questions only: sample one answer each and score it from the states "
        "of the sampling pass itself",
    )
    s.add_argument(
        "--params",
        help="with --generate: a params file whose `generate` section sets the sampling "
        "(default: the built-in defaults, as in params.yaml)",
    )
    s.add_argument("--seed", type=int, help="with --generate: sampling seed (each row draws from its own stream)")
    s.add_argument("--max-new-tokens", type=int, help="with --generate: longest answer in tokens")
    s.add_argument("--greedy", action="store_true", help="with --generate: the most likely answer instead of a sample")
    s.add_argument(
        "--no-distribution-check",
        action="store_true",
        help="skip the answers' token log-probs and in_distribution (null in every row): the base model then "
        "runs only up to the detector's layer, which is faster when that layer is far below the top",
    )
    s.add_argument("--summary", help="also write the run's summary JSON here")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(run=run)
