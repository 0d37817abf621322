"""`halludetect dag`: the pipeline's DAG, each stage family on one line (`halludetect.runner.dag`)."""

from __future__ import annotations

import sys

from halludetect.core.errors import UserError


def run(args) -> None:
    from pathlib import Path

    from halludetect.runner.dag import collapsed, render

    if not (Path(args.repo) / "dvc.yaml").is_file():
        raise UserError(f"{args.repo} has no dvc.yaml: run it in the repository's root, or pass --repo")
    sys.stdout.write(render(collapsed(args.repo)))


def add(sub) -> None:
    dag = sub.add_parser(
        "dag",
        help="the pipeline's DAG with each stage family on one line (`train x 50 <- dump, judge`)",
        description="Print the stage families of dvc.yaml (the matrix expanded with params.yaml, as DVC "
        "does) in topological order, each with its count of stages and the families it reads from.",
    )
    dag.add_argument("--repo", default=".", help="the repository's root (default: .)")
    dag.set_defaults(run=run)
