"""The params stage: one small file per stage holding the values of the params it reads.

Why not DVC's own `params:` per stage: DVC parses params.yaml once for every stage that lists params
(dvc/dependency/param.py, `read_param_file`, DVC 3.67.1), and looks each key up by walking the whole
tree. At the paper's grid (661 stages) that was 54% of `dvc status`, 13.7 s against 6.3 s with a file
per stage (bench/dag.py, docs/benchmarks.md), and 50 KB of the world's 268 KB dvc.lock, every stage's
values written out again. So each stage names the keys it reads in `meta: {params: [...]}` (DVC resolves
`${item.*}` there as anywhere in the stage, and keeps meta out of dvc.lock) and depends on
`data/params/<stage>.json`, written here from one parse of params.yaml; the params stage tracks the
whole of params.yaml, so `dvc params diff`, `dvc exp show` and `dvc exp run -S` see every key.

The recompute contract is DVC's, one step later: a params.yaml edit re-runs this stage (a second),
and DVC then re-runs the stages whose file changed, as the code stage does for code edits. What
`dvc status` names after an edit is therefore this stage alone; `halludetect repro`'s plan works the
files out (runner/repro.py) and names the stages that will run.

dvc.yaml cannot be a dependency (DVC refuses it), so an edit to a stage's `meta.params` alone is seen
at the next params.yaml change: a key added to a list then re-runs that stage once (its outputs were
made with that key's value already, since the value did not change), a key removed likewise. A
new stage's file does not exist until this stage runs again: `halludetect repro` sees that in its plan
and runs this stage first, forced; plain `dvc repro` stops naming the file (`dvc repro -f params`).

    from halludetect.runner import params_digests
    params_digests.write("data/params")           # what stages/params.py runs
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

OUT = "data/params"  # dvc.yaml's output of the params stage; every stage's file lies inside it
PARAMS_FILE = "params.yaml"


class ParamsDigestError(ValueError):
    """dvc.yaml or params.yaml cannot give a stage its params file (the message names the stage and key)."""


@dataclass(frozen=True)
class StageParams:
    stage: str  # DVC's name of the stage: `train@world-world-hami`
    keys: tuple[str, ...]  # meta.params, resolved by DVC
    file: str  # its dependency under the params stage's output


def file_for(stage: str, out: str = OUT) -> str:
    """The params file of a stage: named as DVC names the stage, so `dvc status` and the file agree."""
    return f"{out}/{stage}.json"


def stage_name(stage, root: str | Path) -> str:
    """DVC's name of a stage as `dvc status` run in the repository's root gives it: `train@a-b-c`, or
    `sub/dvc.yaml:a` for a stage of another dvc.yaml (DVC's `addressing` depends on the working folder)."""
    rel = Path(os.path.relpath(stage.path, root)).as_posix()
    return stage.name if rel == "dvc.yaml" else f"{rel}:{stage.name}"


def stage_params(stages, root: str | Path, out: str = OUT) -> list[StageParams]:
    """What each of DVC's resolved `stages` (`Repo.index.stages` of the repository at `root`) reads of
    params.yaml, checked: a stage with `meta.params` depends on exactly its own file under `out`, and a
    stage depending on a file under `out` names its keys."""
    found, problems = [], []
    for s in stages:
        name = stage_name(s, root)
        if any(_from_root(o, root) == out for o in s.outs):
            continue  # the params stage itself
        meta = s.meta if isinstance(s.meta, dict) else {}
        keys = meta.get("params")
        mine = [_from_root(d, root) for d in s.deps if _from_root(d, root).startswith(out + "/")]
        want = file_for(name, out)
        if keys is None:
            if mine:
                problems.append(f"stage '{name}' depends on {mine} but has no meta.params: name the keys it reads")
            continue
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            problems.append(f"stage '{name}': meta.params must be a list of params.yaml keys, not {keys!r}")
            continue
        if mine != [want]:
            problems.append(
                f"stage '{name}' has meta.params but its deps list {mine or 'no file'} under {out}/: "
                f"list exactly `{want}`"
            )
            continue
        found.append(StageParams(name, tuple(keys), want))
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ParamsDigestError("dvc.yaml: " + "; ".join(problems[:5]) + more)
    return found


def _from_root(dep, root: str | Path) -> str:
    """A dependency's path relative to the repository's root (a stage's `wdir` may be another folder)."""
    return Path(os.path.relpath(dep.fs_path, root)).as_posix()


def lookup(params: dict, key: str):
    """params.yaml's value at a dotted key, as DVC reads `params: [a.b]` (a list index is a number)."""
    node = params
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(key)
    return node


def texts(stages, root: str | Path = ".", out: str = OUT) -> dict[str, str]:
    """{path relative to `out`: its text} for every stage that names params: the values of its keys,
    as sorted JSON (the order keys are listed in, or a comment beside them, changes nothing; a YAML
    date is its text)."""
    from halludetect.core import yaml12

    path = Path(root) / PARAMS_FILE
    try:
        params = yaml12.load(path.read_text(encoding="utf-8")) or {}
    except yaml12.YAMLError as e:
        raise ParamsDigestError(f"{path}: not YAML ({e})") from None
    if not isinstance(params, dict):
        raise ParamsDigestError(f"{path}: a mapping of sections expected, found {type(params).__name__}")
    out_texts, missing = {}, []
    for sp in stage_params(stages, root, out):
        values = {}
        for key in sorted(set(sp.keys)):
            try:
                values[key] = lookup(params, key)
            except KeyError:
                missing.append(f"'{key}' (stage '{sp.stage}')")
        out_texts[sp.file[len(out) + 1 :]] = (
            json.dumps(values, indent=1, sort_keys=True, ensure_ascii=False, default=str) + "\n"
        )
    if missing:
        raise ParamsDigestError(
            f"{path} has no {', '.join(missing)}: add the key to {path.name}, or remove it from the "
            "stage's meta.params in dvc.yaml"
        )
    return out_texts


def write(out: str = OUT, root: str | Path = ".") -> dict[str, str]:
    """Every stage's params file under `out` (relative to the repository at `root`), atomically as one
    directory; DVC's own resolution of dvc.yaml gives the stages and their keys."""
    from halludetect.core.atomic_io import atomic_path
    from halludetect.runner.dvc_internals import DvcException, Repo

    out = Path(out).as_posix()  # `data/params/` or `./data/params` as dvc.yaml's `data/params`
    try:
        with Repo(str(root)) as repo:
            stages, root = list(repo.index.stages), Path(repo.root_dir)  # the root, run from a subfolder too
    except DvcException as e:  # not a DVC repository, a dvc.yaml DVC cannot read
        raise ParamsDigestError(f"{Path(root).resolve()}: DVC cannot read the pipeline: {e}") from None
    found = texts(stages, root, out)
    with atomic_path(root / out, is_dir=True) as tmp:
        for rel, text in found.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)  # a stage of a dvc.yaml in a subfolder
            (tmp / rel).write_text(text, encoding="utf-8")  # the bytes runner/repro.py predicts
    return found
