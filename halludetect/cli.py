"""The `halludetect` command (a console script of the package).

    halludetect score --bundle B.safetensors --input answers.jsonl --out scores.parquet
    halludetect score --bundle B.safetensors --input questions.jsonl --generate --out answers.jsonl
    halludetect score --bundle B.safetensors --input answers.jsonl --explain --out explained.parquet
    halludetect explain explained.parquet [--html explained.html]          # token evidence, for a person
    halludetect show B.safetensors [--json]
    halludetect train-layer --model M --dataset D --method max --layer 16    # from the DVC remote
    halludetect sweep detectors.max.dim                                       # experiments -> a table
    halludetect exp-push origin                     # experiments to git, their outputs to the DVC remote
    halludetect dag                                       # the DAG, each stage family on one line

`score` is `halludetect.scoring.scorer.score_file`; `explain` renders an explained scores file
(`halludetect.scoring.evidence_views`); `show` summarises a bundle (`--json`: its metadata). Bad input
(a malformed row, a bundle for another model) prints one error line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _score(args) -> None:
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


def _explain(args) -> None:
    from halludetect.core.atomic_io import write_text
    from halludetect.scoring.answer_files import check_output
    from halludetect.scoring.evidence_views import html_page, read_explained, terminal

    if args.html:  # a directory, a missing folder or the scores file itself: one line, before reading
        check_output(args.html, "the page (--html)", {"scores file": args.scores})
    limit = args.limit if args.limit is not None else (500 if args.html else 20)  # 0 is refused, not the default
    explained = read_explained(args.scores, limit)
    if args.html:
        write_text(args.html, html_page(explained, args.title))
        print(
            f"written: {args.html} ({len(explained.rows):,} of {explained.n_scored:,} scored answers)", file=sys.stderr
        )
        return
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    print(terminal(explained, color))


def _show(args) -> None:
    from halludetect.scoring.bundle import load_bundle, p_sem_requirement
    from halludetect.scoring.bundle_summary import summary_text

    # a damaged bundle is an error here, as when scoring; a plugin's is summarised without its plugin
    b = load_bundle(args.bundle, metadata_only_without_plugin=True)
    for warning in b.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not args.json:
        print(summary_text(b))
        return
    needs = p_sem_requirement(b.meta)  # hami_sp: the P_sem variant and K its input rows must follow
    print(json.dumps({"sha256": b.sha256, **b.meta, **({"needs": needs} if needs else {})}, indent=2, sort_keys=True))


def _train_layer(args) -> None:
    from pathlib import Path

    from halludetect.config import load_params
    from halludetect.experiments.sharing import train_layer_from_remote

    fetched = train_layer_from_remote(
        Path("."),
        load_params(args.params),
        args.model,
        args.dataset,
        args.method,
        args.layer,
        remote=args.remote,
        jobs=args.jobs,
    )
    print(
        json.dumps(
            {
                "stage": fetched.stage,
                "layer": args.layer,
                "fetched_bytes": fetched.bytes,
                "fetched": fetched.files,
                "recorded": fetched.recorded,
            },
            indent=2,
            sort_keys=True,
        )
    )


def _check_out_dir(path: str) -> None:
    """--out-dir: a directory, or one that can be made (its nearest existing ancestor is a directory)."""
    from pathlib import Path

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out-dir {out} is a file, not a directory: give a directory (default: metrics/sweeps)")
    up = out
    while not up.exists() and up != up.parent:
        up = up.parent
    if up.exists() and not up.is_dir():
        raise UserError(f"--out-dir {out}: {up} is a file, so the directory cannot be made there")


def _where(items: list[str] | None) -> dict:
    where = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--where {item!r}: write KEY=VALUE, e.g. --where train.epochs=100")
        where[key] = _literal(value)
    return where


def _sweep(args) -> None:
    from pathlib import Path

    from halludetect.config import load_params
    from halludetect.core import yaml12
    from halludetect.core.atomic_io import write_text
    from halludetect.experiments.sweeps import sweep
    from halludetect.report.cells import Grid
    from halludetect.report.tables import to_latex, to_markdown

    _check_out_dir(args.out_dir)
    where = _where(args.where)
    params = load_params(args.params)  # validated first: a broken file is named here
    raw = yaml12.load(Path(args.params).read_text())  # the keys as written, to check the swept one
    table = sweep(
        ".",
        args.param,
        Grid.of(params),
        method=args.method,
        metric=args.metric,
        where=where,
        params=raw,
        revs=args.rev,
        all_commits=args.all_commits,
        names=args.experiments,
    )
    out = Path(args.out_dir)
    write_text(out / f"{table.name}.md", to_markdown(table))
    write_text(out / f"{table.name}.tex", to_latex(table))
    print(to_markdown(table))
    print(f"written: {out / table.name}.md and .tex", file=sys.stderr)


def _exp_push(args) -> None:
    from pathlib import Path

    from halludetect.experiments.sharing import push_experiments

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"-j/--jobs {args.jobs}: give 1 or more parallel uploads")
    result = push_experiments(
        Path("."),
        args.git_remote,
        args.experiments,
        all_commits=args.all_commits,
        rev=args.rev,
        dvc_remote=args.remote,
        force=args.force,
        jobs=args.jobs,
    )
    if diverged := result.get("diverged"):
        raise UserError(
            f"{', '.join(diverged)}: the git remote {args.git_remote} has other experiments of these names; "
            "their git refs were not pushed, their outputs were (--force replaces the git remote's)"
        )
    pushed = sorted(result.get("success", []) + result.get("up_to_date", []))
    if not pushed:
        raise UserError(
            "no experiment to push: none derives from HEAD or a commit before it (-A pushes every "
            "experiment of this clone; `dvc exp list` lists them)"
        )
    for why in result.get("unreadable", {}).values():  # in scope, but no ref to push: say so
        print(f"warning: not pushed: {why}", file=sys.stderr)
    print(
        json.dumps(
            {
                "experiments": pushed,
                "files_uploaded": result.get("uploaded", 0),
                "git_remote": args.git_remote,
                **({"not_pushed": sorted(result["unreadable"])} if result.get("unreadable") else {}),
            },
            indent=2,
        )
    )


def _dag(args) -> None:
    from pathlib import Path

    from halludetect.core.dag import collapsed, render

    if not (Path(args.repo) / "dvc.yaml").is_file():
        raise UserError(f"{args.repo} has no dvc.yaml: run it in the repository's root, or pass --repo")
    sys.stdout.write(render(collapsed(args.repo)))


def _literal(text: str):
    """A --where value as DVC reads it from params.yaml (1 -> 1, 0.5 -> 0.5, true -> True, off -> 'off',
    else the text): YAML 1.2, core/yaml12.py."""
    from halludetect.core import yaml12

    return yaml12.load(text)


def _device_map(text: str) -> str:
    """--device-map checked as params' device_map is: one line from argparse, not transformers' traceback."""
    from halludetect.config import device_map_problem

    if problem := device_map_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors (a missing or unknown flag, a count that is not a number) as one line and
    exit 2, like every other bad input; `-h` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} -h)\n")


def parser() -> argparse.ArgumentParser:
    from halludetect.scoring.answer_range import CAN_SCORE

    p = OneLineParser(prog="halludetect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "score",
        help="score answers (or sampled answers to questions) with a detector bundle",
        description="Score answers with a detector bundle (the export stage writes them to "
        f"data/bundles/<model>/<dataset>/<method>.safetensors). A detector can score {CAN_SCORE}. The base "
        "model runs whole, for the answers' token log-probs; with --no-distribution-check, or a bundle that "
        "predates the check, only up to the detector's layer.",
    )
    s.add_argument("--bundle", required=True, help="detector bundle (.safetensors)")
    s.add_argument(
        "--input",
        required=True,
        help="JSONL or Parquet: question, answer[, id, answer_token_ids, p_sem]; with --generate: question[, id]",
    )
    s.add_argument(
        "--out",
        required=True,
        help="output file, .parquet or .jsonl (parts of an unfinished run are "
        "kept next to it in .<name>.parts/ and reused by a re-run)",
    )
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
    s.set_defaults(run=_score)

    ex = sub.add_parser(
        "explain",
        help="show where in each answer its score comes from (an output of `score --explain`)",
        description="Render an explained scores file by score, highest first: each answer's tokens "
        "coloured by their contribution (red toward hallucination, blue toward correct), in the "
        "terminal or as one self-contained HTML page (no script, nothing loaded).",
    )
    ex.add_argument("scores", help="output of `halludetect score --explain` (.parquet or .jsonl)")
    ex.add_argument("--html", help="write one HTML page here instead of printing")
    ex.add_argument(
        "--limit",
        type=int,
        help="the highest-scored answers shown (default: 20 in the terminal, 500 in a page; a note says "
        "how many the file holds)",
    )
    ex.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="terminal colours (default: auto, when printing to a terminal and NO_COLOR is unset)",
    )
    ex.add_argument("--title", help="the page's title (default: from the file's name)")
    ex.set_defaults(run=_explain)

    show = sub.add_parser(
        "show",
        help="summarise a bundle: model, layer, training and test figures, thresholds, calibration, input",
        description="Print a readable summary of a detector bundle (--json: its raw metadata).",
    )
    show.add_argument("bundle", help="detector bundle (.safetensors)")
    show.add_argument("--json", action="store_true", help="print the raw metadata as JSON instead (and its sha256)")
    show.set_defaults(run=_show)

    tl = sub.add_parser(
        "train-layer",
        help="fetch one layer's states and the labels from the DVC remote and train "
        "a method on that layer (nothing upstream runs)",
        description="Pull the one layer file and the labels that train@<model>-<dataset>-<method> needs "
        "for that layer from the DVC remote, train the layer alone with the stage's own command, and "
        "compare each file it wrote with the version dvc.lock records. Run it in the repository's root.",
    )
    tl.add_argument("--model", required=True, help="model preset (grid.models)")
    tl.add_argument("--dataset", required=True, help="dataset preset (grid.datasets)")
    tl.add_argument("--method", required=True, help="detector method (grid.methods or grid.sp_methods)")
    tl.add_argument("--layer", required=True, type=int, help="layer index (grid.layers; 0 = embeddings)")
    tl.add_argument("--remote", help="DVC remote name (default: the repository's default remote)")
    tl.add_argument("-j", "--jobs", type=int, help="parallel downloads (dvc pull -j)")
    tl.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    tl.set_defaults(run=_train_layer)

    sw = sub.add_parser(
        "sweep",
        help="one table of every DVC experiment along a swept parameter",
        description="Read the repository's experiments (dvc.api.exp_show) and write a table of a "
        "method's test metric by the values of one parameter, per grid cell, as "
        "Markdown and LaTeX. Run it in the repository's root.",
    )
    sw.add_argument("param", help="the swept parameter, e.g. detectors.max.dim")
    sw.add_argument(
        "experiments",
        nargs="*",
        help="only these experiments (and their baseline commits); default: those of HEAD and of the commits before it",
    )
    sw.add_argument(
        "--rev",
        action="append",
        help="the experiments of this baseline commit (repeatable) instead of HEAD's and its ancestors'",
    )
    sw.add_argument(
        "-A", "--all-commits", action="store_true", help="every experiment of this clone, whatever its baseline"
    )
    sw.add_argument("--method", help="whose metrics (default: the method the parameter belongs to)")
    sw.add_argument(
        "--metric",
        default="auroc",
        help="a test metric of metrics/eval/...: auroc (default), auprc, margin, prr, fpr_at_95_tpr, ...",
    )
    sw.add_argument(
        "--where",
        action="append",
        metavar="KEY=VALUE",
        help="only experiments with this param value (repeatable), when others vary too",
    )
    sw.add_argument("--out-dir", default="metrics/sweeps", help="where the tables go (default: metrics/sweeps)")
    sw.add_argument("--params", default="params.yaml", help="params file, for the grid's paper identities")
    sw.set_defaults(run=_sweep)

    ep = sub.add_parser(
        "exp-push",
        help="push experiments to a git remote and their outputs to the DVC remote configured now",
        description="`dvc exp push GIT_REMOTE`, with every experiment's outputs sent to the DVC "
        "remote the workspace configures now, also for experiments run before that remote was "
        "configured (plain DVC looks for a remote in each experiment's own commit and then pushes "
        "no data). Default: the experiments of HEAD and of the commits before it. Run it in the "
        "repository's root.",
    )
    ep.add_argument("git_remote", help="git remote name or URL, e.g. origin")
    ep.add_argument("experiments", nargs="*", help="only these experiments (dvc exp list names them)")
    ep.add_argument("-A", "--all-commits", action="store_true", help="every experiment of this clone")
    ep.add_argument("--rev", help="the experiments of this commit and the commits before it (default: HEAD)")
    ep.add_argument("-r", "--remote", help="DVC remote name (default: the workspace's default remote)")
    ep.add_argument("-f", "--force", action="store_true", help="replace experiments of the same name on the remote")
    ep.add_argument("-j", "--jobs", type=int, help="parallel uploads (dvc push -j)")
    ep.set_defaults(run=_exp_push)

    dag = sub.add_parser(
        "dag",
        help="the pipeline's DAG with each stage family on one line (`train x 50 <- dump, judge`)",
        description="Print the stage families of dvc.yaml (the matrix expanded with params.yaml, as DVC "
        "does) in topological order, each with its count of stages and the families it reads from.",
    )
    dag.add_argument("--repo", default=".", help="the repository's root (default: .)")
    dag.set_defaults(run=_dag)

    # Listed for --help only: main() hands `repro` and every argument after it to core/repro.py,
    # which passes them to `dvc repro` as they are (argparse would take DVC's options for its own).
    sub.add_parser(
        "repro",
        help="`dvc repro` (any of its arguments) with a progress line: stage k of N, elapsed, about how long left",
    )
    return p


def _inherit_numerics() -> None:
    """Started from a pinned process (its environment carries the pins: a stage's shell, the
    tests), load the MKL shim as well, which a child does not inherit, so that the command
    computes its parent's bytes (halludetect/core/numerics.py). Otherwise the command keeps the
    machine's own numerics, all cores. Before any command imports torch."""
    import ctypes

    from halludetect.core import numerics

    if "MKL_CBWR" not in os.environ or numerics.mode() == "native" or "torch" in sys.modules:
        return
    shim = numerics.mkl_intel_shim()
    if shim is not None:
        ctypes.CDLL(str(shim), mode=os.RTLD_GLOBAL)


def main(argv: list[str] | None = None) -> None:
    _inherit_numerics()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["repro"]:
        from halludetect.core import repro

        sys.exit(repro.main(argv[1:]))
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: finished parts are kept; run the same command again to continue", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # `halludetect show B | head`: the reader left early, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()
