"""`halludetect sweep`: one table of every DVC experiment along a swept parameter
(`halludetect.experiments.sweeps`)."""

from __future__ import annotations

import sys

from halludetect.core.errors import UserError


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


def _literal(text: str):
    """A --where value as DVC reads it from params.yaml (1 -> 1, 0.5 -> 0.5, true -> True, off -> 'off',
    else the text): YAML 1.2, core/yaml12.py."""
    from halludetect.core import yaml12

    return yaml12.load(text)


def run(args) -> None:
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


def add(sub) -> None:
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
    sw.set_defaults(run=run)
