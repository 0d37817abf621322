"""The pipeline's DAG with each stage family collapsed: one line per family (`train x 65`), in
topological order, with the families it reads from. `dvc dag` draws every stage of every matrix,
6,061 columns wide on the demo world (issue 22); this is what a person reads.

    world
    world_check             <- world
    manifest                <- world
    ...
    train x 50              <- dump, judge
    evaluate x 10           <- generate, dump, judge, train

The stages and their edges are DVC's own (`dvc.repo.Repo(...).index.graph`, the matrix expanded
with the params), so this view never disagrees with `dvc dag`; a family is a stage name before `@`.
What DVC cannot read (a broken dvc.yaml or params.yaml, a directory outside a DVC repository or
its git clone) is one line naming the file and the fix (`DagError`), not DVC's traceback."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from halludetect.core.errors import UserError


class DagError(UserError):
    """DVC cannot read the pipeline of the repository."""


@dataclass
class Family:
    name: str
    stages: int = 0
    upstream: list[str] = field(default_factory=list)  # families it reads from, in this view's order


def families(edges: list[tuple[str, str]], stages: list[str]) -> list[Family]:
    """Collapse `stages` (DVC addresses, `name` or `name@item`, in dvc.yaml's order) and `edges`
    ((stage, a stage it depends on)) into families in topological order (dvc.yaml's order among
    families with no order between them)."""
    name = lambda stage: stage.split("@", 1)[0]  # noqa: E731
    fams: dict[str, Family] = {}
    for s in stages:
        fams.setdefault(name(s), Family(name(s))).stages += 1
    up: dict[str, set[str]] = {f: set() for f in fams}
    for stage, dep in edges:
        if name(stage) != name(dep):
            up[name(stage)].add(name(dep))
    order, placed = [], set()
    while len(order) < len(fams):
        ready = [f for f in fams if f not in placed and up[f] <= placed]
        if not ready:  # DVC refuses cycles; families of one stage each cannot have one either
            raise ValueError(f"stage families with a cycle: {sorted(set(fams) - placed)}")
        order.append(ready[0])
        placed.add(ready[0])
    rank = {f: i for i, f in enumerate(order)}
    for f in order:
        fams[f].upstream = sorted(up[f], key=rank.__getitem__)
    return [fams[f] for f in order]


def collapsed(repo: str | Path = ".") -> list[Family]:
    """The families of the DVC pipeline of `repo` (its dvc.yaml files, with its params)."""
    from halludetect.runner.dvc_internals import DvcException, Repo

    try:
        with Repo(str(repo)) as r:
            graph = r.index.graph
            stages = [s.addressing for s in r.index.stages]
            edges = [(a.addressing, b.addressing) for a, b in graph.edges]
    except DvcException as e:
        raise DagError(dvc_problem(e, repo)) from None
    return families(edges, stages)


def dvc_problem(e: Exception, repo: str | Path) -> str:
    """One line for what DVC could not read: the file, line and column of a YAML error (DVC
    prints them over several lines, or only in its traceback), and what to do."""
    from halludetect.runner.dvc_internals import NotDvcRepoError, SCMError, YAMLValidationError

    repo = Path(repo).resolve()  # `.` says nothing in a message
    if isinstance(e, NotDvcRepoError):
        return (
            f"{repo} is not in a DVC repository (no .dvc directory there or above): run it in the root of "
            "the project's git clone, or pass --repo"
        )
    if isinstance(e, SCMError):
        return (
            f"{repo}: DVC needs the git repository around it ({e}): run it in the project's git clone, or pass --repo"
        )
    if isinstance(e, YAMLValidationError):  # e.g. an unknown key in a stage: voluptuous says which
        return f"{e} ({e.exc}): fix it (`dvc dag` lists every problem)"
    cause = e.__cause__
    while cause is not None and getattr(cause, "problem_mark", None) is None:
        cause = cause.__cause__
    if cause is not None:  # a YAML syntax error: ruamel's mark is 0-based
        mark, path = cause.problem_mark, getattr(e, "path", None) or "a YAML file"
        return (
            f"{path}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {cause.problem} (check the "
            "indentation and quoting at that line, or the line before it)"
        )
    detail = f" ({e.__cause__})" if e.__cause__ is not None and str(e.__cause__) not in str(e) else ""
    text = f"{e}{detail}".replace("\n", " ")  # one line, whatever DVC's message holds
    return f"{repo}: DVC cannot read the pipeline: {text}; fix the file it names (dvc.yaml or params.yaml)"


def render(fams: list[Family]) -> str:
    """One line per family: its name, `x N` for a matrix of N stages, and `<- ` its upstream. A
    family that every family after it reads (two or more: the code and params stages, whose files
    every stage lists) is said once on its own line and left out of the others' lists, where it
    would only repeat."""
    read_by_all = {
        f.name for k, f in enumerate(fams) if len(fams) - k > 2 and all(f.name in g.upstream for g in fams[k + 1 :])
    }
    labels = [f.name if f.stages == 1 else f"{f.name} x {f.stages}" for f in fams]
    width = max(map(len, labels), default=0)
    lines = []
    for label, f in zip(labels, fams):
        upstream = [u for u in f.upstream if u not in read_by_all]
        if f.name in read_by_all:
            lines.append(f"{label:<{width}}  -> every family after it reads it")
        else:
            lines.append(f"{label:<{width}}  <- {', '.join(upstream)}" if upstream else label)
    return "\n".join(lines) + "\n"
