"""The `halludetect` command (a console script of the package).

    halludetect score --bundle B.safetensors --input answers.jsonl --out scores.parquet
    halludetect score --bundle B.safetensors --input questions.jsonl --generate --out answers.jsonl
    halludetect score --bundle B.safetensors --input answers.jsonl --explain --out explained.parquet
    halludetect serve --bundle B.safetensors [--port 8000]      # OpenAI-compatible, a score with every answer
    halludetect explain explained.parquet [--html explained.html]          # token evidence, for a person
    halludetect show B.safetensors [--json]
    halludetect train-layer --model M --dataset D --method max --layer 16    # from the DVC remote
    halludetect sweep detectors.max.dim                                       # experiments -> a table
    halludetect exp-push origin                     # experiments to git, their outputs to the DVC remote
    halludetect dag                                       # the DAG, each stage family on one line
    halludetect exp run -S detectors.max.dim=128      # dvc exp run, each -S checked first, with progress

`score` is `halludetect.scoring.scorer.score_file`; `explain` renders an explained scores file
(`halludetect.scoring.evidence_views`); `show` summarises a bundle (`--json`: its metadata). Bad input
(a malformed row, a bundle for another model) prints one error line and exits 2.

Each command is a module of this package with its parser (`add`) and what it runs (`run`); a
command imports what it needs when it runs, so `halludetect show` never loads torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from halludetect.cli import dag, exp_push, explain, score, serve, show, sweep, train_layer
from halludetect.core.errors import UserError

COMMANDS = (score, serve, explain, show, train_layer, sweep, exp_push, dag)  # one module each: its parser and its run


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors (a missing or unknown flag, a count that is not a number) as one line and
    exit 2, like every other bad input; `-h` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} -h)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="halludetect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    # Listed for --help only: main() hands `repro` and every argument after it to runner/repro.py, and
    # `exp` to cli/exp.py, which take -j/--jobs and pass the rest to DVC as they are (argparse would
    # take DVC's options for its own).
    sub.add_parser(
        "repro",
        help="`dvc repro` (any of its arguments) with a progress line: stage k of N, elapsed, about how long "
        "left; -j N runs up to N independent stages at once",
    )
    sub.add_parser(
        "exp",
        help="`halludetect exp run ...`: `dvc exp run` (any of its arguments) with params.yaml and each -S value "
        "checked before DVC runs anything, and the progress line of `halludetect repro`",
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


def _params_problem() -> str | None:
    """What the stages' own check finds wrong with ./params.yaml (every problem, naming its key), or
    None when it is fine or absent: why DVC could not expand dvc.yaml, when that is the cause."""
    from pathlib import Path

    from halludetect.config import ParamsError, load_params

    if not Path("params.yaml").is_file():
        return None
    try:
        load_params("params.yaml")
    except ParamsError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> None:
    _inherit_numerics()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["repro"]:
        from halludetect.runner import repro

        sys.exit(repro.main(argv[1:], why_unplannable=_params_problem))
    if argv[:1] == ["exp"]:
        from halludetect.cli import exp

        sys.exit(exp.main(argv[1:]))
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
