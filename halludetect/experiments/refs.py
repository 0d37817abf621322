"""The experiment refs of a clone, read and checked before DVC reads them.

An experiment is a git ref `refs/exps/<baseline sha, split 2/38>/<name>` pointing at a commit
made on top of that baseline (one commit in DVC 3). DVC collects an experiment by walking first
parents from the ref's commit until it meets the baseline: a ref that points at the baseline
itself (or at a commit not derived from it) never meets it and walks the whole history, reading
every commit's params and metrics (`halludetect sweep` grew past 10 GB that way), and `dvc exp
push` sends every one of those commits' outputs. A ref whose file is damaged, whose commit this
clone lacks, or that points at a tree makes DVC drop the experiment silently or fail with a
traceback, depending on the git backend it tries first.

`exp_refs` reads every ref with plain git (a handful of processes, whatever the number of
refs) and says for each whether it can be read and why not; callers hand DVC the readable ones
only and report the others.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

# DVC 3 writes one commit per experiment; refs from DVC 2's checkpoints held a few. Further than
# this from its baseline, a ref is not an experiment of that baseline (and DVC would walk on).
MAX_COMMITS = 10


@dataclass(frozen=True)
class ExpRef:
    ref: str  # refs/exps/ab/cdef.../name
    name: str
    baseline: str  # the baseline commit's full sha, as the ref's path spells it
    commits: tuple[str, ...] = ()  # the experiment's commits, newest first, without the baseline
    problem: str | None = None  # why it cannot be read, and the fix; None: readable

    @property
    def commit(self) -> str | None:
        return self.commits[0] if self.commits else None


def _git(repo: str | Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, input=stdin)


def _ref_names(repo: str | Path) -> list[str]:
    """Every experiment ref name, as DVC lists them (its git library lists a ref whose file is
    damaged, which `git for-each-ref` skips with a warning)."""
    from scmrepo.git import Git

    from halludetect.runner.dvc_internals import EXPS_NAMESPACE, ITER_SKIP_NAMESPACES, STASHES

    scm = Git(str(repo))
    try:
        names = list(scm.iter_refs(base=f"{EXPS_NAMESPACE}/"))
    finally:
        scm.close()
    return sorted(r for r in names if r not in STASHES and not any(r.startswith(n) for n in ITER_SKIP_NAMESPACES))


def _fix(ref: str, name: str) -> str:
    return (
        f"remove it (`git update-ref -d {ref}`) and pull the experiment again if a colleague pushed it "
        f"(`dvc exp pull origin {name}`)"
    )


def exp_refs(repo: str | Path) -> list[ExpRef]:
    """Every experiment ref of the clone, checked: readable ones with their commits, the others
    with the problem and the fix. A ref whose path is no experiment's (not
    `refs/exps/<2>/<38>/<name>`) is reported too."""
    out: list[ExpRef] = []
    parsed: dict[str, tuple[str, str]] = {}  # ref -> (name, baseline)
    for ref in _ref_names(repo):
        parts = ref.split("/")
        if len(parts) == 5 and len(parts[2]) == 2 and len(parts[3]) == 38:
            parsed[ref] = (parts[4], parts[2] + parts[3])
        else:
            why = f"{ref} is not an experiment ref (refs/exps/<2>/<38>/<name>): remove it (`git update-ref -d {ref}`)"
            out.append(ExpRef(ref, parts[-1], "", problem=why))
    # one process for every ref: "<sha> <type>", or "<ref> missing" (a damaged file, or a commit this clone lacks)
    query = "".join(f"{ref}\n" for ref in parsed)
    listed = _git(repo, "cat-file", "--batch-check=%(objectname) %(objecttype)", stdin=query).stdout if parsed else ""
    commits: dict[str, str] = {}
    for ref, line in zip(parsed, listed.splitlines() + [""] * len(parsed), strict=False):
        sha, _, kind = line.partition(" ")
        if kind == "commit":
            commits[ref] = sha
        else:
            out.append(ExpRef(ref, *parsed[ref], problem=_unreadable(repo, ref, parsed[ref][0], sha, kind)))
    # one process for every commit's parents: a DVC 3 experiment is one commit on its baseline
    shas = list(dict.fromkeys(commits.values()))
    listed = _git(repo, "rev-list", "--no-walk=unsorted", "--parents", *shas).stdout if shas else ""
    first_parent = {line.split()[0]: line.split()[1:2] for line in listed.splitlines() if line.strip()}
    for ref, sha in commits.items():
        name, base = parsed[ref]
        if first_parent.get(sha) == [base]:
            out.append(ExpRef(ref, name, base, (sha,)))
        elif sha == base:
            why = f"{ref} points at its baseline {base[:7]} itself, not at an experiment's commit on top of it"
            out.append(ExpRef(ref, name, base, problem=f"{why}: remove it (`git update-ref -d {ref}`)"))
        else:  # a few commits on the baseline (DVC 2's checkpoints): one walk, bounded
            walk = _git(repo, "rev-list", "--first-parent", f"--max-count={MAX_COMMITS + 1}", sha).stdout.split()
            if base in walk:
                out.append(ExpRef(ref, name, base, tuple(walk[: walk.index(base)])))
            else:
                why = (
                    f"{ref} points at {sha[:7]}, which is not an experiment of its baseline {base[:7]} "
                    f"(not {MAX_COMMITS} commits or fewer on top of it)"
                )
                out.append(ExpRef(ref, name, base, problem=f"{why}: {_fix(ref, name)}"))
    return sorted(out, key=lambda r: r.ref)


def _unreadable(repo: str | Path, ref: str, name: str, sha: str, kind: str) -> str:
    """Why a ref that does not point at a commit cannot be read, and the fix."""
    if kind and kind != "missing":
        return f"{ref} points at a {kind} ({sha[:7]}), not at a commit: {_fix(ref, name)}"
    raw = _git(repo, "rev-parse", "--verify", "--quiet", ref)
    if raw.returncode == 0:
        return f"{ref} points at {raw.stdout.strip()[:7]}, which this clone does not have: {_fix(ref, name)}"
    # not even a sha in its file; `git update-ref -d` refuses such a ref
    return (
        f'{ref} is damaged (its file holds no commit id): delete it (`rm "$(git rev-parse --git-dir)/{ref}"`) '
        f"and pull the experiment again if a colleague pushed it (`dvc exp pull origin {name}`)"
    )
