"""Training on shared activations: fetch one layer file and the labels it needs from the DVC
remote, then train the method on that layer alone, and nothing upstream of it.

    halludetect train-layer --model llama3-8b --dataset trivia_qa --method max --layer 16

A colleague who dumped the activations (GPU hours) ran `dvc push`; this clone has an empty
cache. The command pulls exactly what the layer needs of the method's train stage's inputs (one
`layer_<L>.h5` of the dump's directory, `judgments.parquet`, and `clusters.parquet` for the methods
that read the clustering), then runs that stage's own command from dvc.yaml with `--layers L`: the
layer's weights, val/test scores and figures land where the stage writes them. The stage trains
every layer of grid.layers (one stage per method, docs/development.md#stage-granularity), so DVC
cannot record one layer's run: instead each file the layer wrote is compared with the version the
clone's dvc.lock records for it (read from DVC's listing of the stage's output directories,
locally or on the remote), and the result says which are identical. DVC's own messages (no remote,
a remote it cannot reach, credentials) are shown unchanged, before anything trains.

What it reports as fetched is what came from the remote: the bytes of the cache objects that
were not in the local cache before the pull (0 when everything was cached, even if the files
had to be checked out again).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from halludetect.activations.layer_format import layer_filename
from halludetect.config import Params
from halludetect.core.errors import UserError
from halludetect.core.lookup import suggest
from halludetect.methods import CLUSTER_METHODS


class SharingError(UserError):
    """A layer or stage that the shared pipeline does not have."""


def train_stage_name(model: str, dataset: str, method: str) -> str:
    """The DVC stage that trains `method` on every layer (train_sp for the methods that read the clustering)."""
    kind = "train_sp" if method in CLUSTER_METHODS else "train"
    return f"{kind}@{model}-{dataset}-{method}"


def check_in_grid(params: Params, model: str, dataset: str, method: str) -> None:
    """The stages exist only for the grid's cells: say which key to change, before DVC says less."""
    methods = [*params.grid.methods, *params.grid.sp_methods]
    for key, value, choices in (
        ("grid.models", model, params.grid.models),
        ("grid.datasets", dataset, params.grid.datasets),
        ("grid.methods / grid.sp_methods", method, methods),
    ):
        if value not in choices:
            raise SharingError(
                f"{key} has no {value!r}{suggest(value, choices)}: add it to params.yaml (the "
                "stages exist only for the grid's cells)"
            )


def dvc(*args: str, cwd: Path) -> int:
    """Run a DVC command with its output shown as it is; returns its exit code."""
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd).returncode


def dvc_or_fail(*args: str, cwd: Path) -> None:
    """Run a DVC command with its output shown as it is; a failure stops here with DVC's message."""
    if code := dvc(*args, cwd=cwd):
        raise SharingError(f"`dvc {' '.join(args)}` failed (exit {code}); its message is above")


def workspace_remotes(repo: str | Path) -> dict | None:
    """The DVC remotes the workspace configures now (.dvc/config, config.local with its
    credentials, the user's and the system's), as a config override for DVC's Python API: DVC
    reads the remote of an older commit's config when it reads that commit's outputs, and a
    commit made before the remote was configured has none. None when no remote is configured.
    The override lives in this process only; nothing of it is printed or written."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        remotes = {name: dict(section) for name, section in r.config.get("remote", {}).items()}
        default = r.config.get("core", {}).get("remote")
    if not remotes:
        return None
    return {"remote": remotes, **({"core": {"remote": default}} if default else {})}


def writer(repo: Path, path: str) -> str | None:
    """The stage whose output `path` is (or lies in)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        for st in r.index.stages:
            for o in st.outs:
                out = str(o.def_path)
                if path == out or path.startswith(out + "/"):
                    return st.addressing
    return None


def stage_data_deps(repo: Path, stage: str) -> list[str]:
    """The stage's dependencies that other stages write (what must come from the remote)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        (found,) = r.stage.collect(stage)
        written = [str(o.def_path) for s in r.index.stages for o in s.outs]
        return [
            str(d.def_path)
            for d in found.deps
            if any(str(d.def_path) == w or str(d.def_path).startswith(w + "/") for w in written)
        ]


def cache_objects(repo: Path, stage: str, paths: list[str]) -> dict[str, dict[str, Path]]:
    """{path: {object id: its file in the local cache}} of the deps `paths` of `stage`, as dvc.lock
    records them: one object for a file; for a directory its listing and, when the listing is in
    the cache already, its entries."""
    from dvc.repo import Repo

    out: dict[str, dict[str, Path]] = {}
    with Repo(str(repo)) as r:
        odb = r.cache.local
        (found,) = r.stage.collect(stage)
        for dep in found.deps:
            path = str(dep.def_path)
            if path not in paths or not dep.hash_info or not dep.hash_info.value:
                continue
            oid = dep.hash_info.value
            objects = {oid: Path(odb.oid_to_path(oid))}
            if dep.hash_info.isdir and odb.exists(oid):
                from dvc_data.hashfile.tree import Tree

                for _, _, entry in Tree.load(odb, dep.hash_info):
                    objects[entry.value] = Path(odb.oid_to_path(entry.value))
            out[path] = objects
    return out


def dumped_layers(repo: Path, activations: str) -> list[int]:
    """The layers a dump directory holds, read from DVC's record of it (locally or on the remote)."""
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(repo))
    names = [Path(p).name for p in fs.ls(activations, detail=False)]
    return sorted(int(n[len("layer_") : -len(".h5")]) for n in names if n.startswith("layer_") and n.endswith(".h5"))


def absent_on_remote(repo: Path, objects: dict[str, dict[str, Path]], remote: str | None) -> list[str] | None:
    """The paths of `objects` ({path: {object id: local file}}) with an object that is neither in
    the local cache nor on the DVC remote; None when the remote cannot be asked (none configured,
    unreachable, no credentials: DVC's own message says which)."""
    from dvc.repo import Repo

    local_missing = {p: [oid for oid, f in objs.items() if not f.exists()] for p, objs in objects.items()}
    local_missing = {p: oids for p, oids in local_missing.items() if oids}
    if not local_missing:
        return []
    try:
        with Repo(str(repo)) as r:
            odb = r.cloud.get_remote_odb(remote, "pull")
            try:
                # a probe that raises where the remote cannot be asked (`exists` answers False there)
                odb.fs.ls(odb.path, detail=False)
            except FileNotFoundError:
                return list(local_missing)  # nothing was ever pushed to it
            return [p for p, oids in local_missing.items() if not all(odb.exists(oid) for oid in oids)]
    except Exception:  # noqa: BLE001 - any failure to ask the remote leaves DVC's message to explain
        return None


def missing_from_remote(repo: Path, stage: str, deps: list[str], remote: str | None) -> str:
    """What to tell a colleague whose pull found some of a stage's inputs on no remote: the
    stage that writes each, and the likely cause (a dvc.lock that does not record the run that
    was pushed), instead of DVC's bare list of missing cache files. Empty when the remote could
    not be asked, or has everything (the pull failed for another reason DVC has given)."""
    absent = absent_on_remote(repo, cache_objects(repo, stage, deps), remote)
    if not absent:
        return ""
    name = remote or (workspace_remotes(repo) or {}).get("core", {}).get("remote", "the default")
    what = "; ".join(f"{p} (written by {writer(repo, p) or 'no stage'})" for p in absent)
    return (
        f"{stage} needs {what}, and neither the local cache nor the DVC remote '{name}' has the version "
        "this clone's dvc.lock records. Likely cause: the dvc.lock you cloned does not record the run "
        "that was pushed: it was committed from another run (another machine's: files that hold wall-clock "
        "times differ on every run), or whoever pushed did not commit the dvc.lock of their run, or never "
        "ran `dvc push`. "
        "Fix: whoever pushed commits the dvc.lock of the run they pushed (`git add dvc.lock && git "
        f"commit && git push`) and runs `dvc push`; or run the writing stages here (`dvc repro {stage}`)"
    )


@dataclass
class Fetched:
    stage: str
    files: dict[str, int]  # path -> bytes fetched from the remote for it (0: it was in the local cache)
    # each file the layer wrote -> "identical" to what dvc.lock records, "differs", or "not recorded"
    recorded: dict[str, str] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def stage_command(repo: Path, stage: str) -> tuple[str, list[str]]:
    """The stage's command as dvc.yaml renders it, and its outputs."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        (found,) = r.stage.collect(stage)
        return found.cmd, [str(o.def_path) for o in found.outs]


def layer_files(repo: Path, outs: list[str], layer: int) -> list[str]:
    """What one layer's training wrote inside the train stage's output directories: `layer_<L>` (a
    directory of weights) or `layer_<L>.<ext>` (its scores, its figures)."""
    name = f"layer_{layer}"
    found = []
    for out in outs:
        if (repo / out).is_dir():
            found += [
                f"{out}/{p.name}"
                for p in sorted((repo / out).iterdir())
                if p.name == name or p.name.startswith(name + ".")
            ]
    return found


def compare_with_record(repo: Path, paths: list[str]) -> dict[str, str]:
    """Each file under `paths` (files or directories the layer wrote) against the md5 dvc.lock records
    for it, read through DVC's file system (the local cache, else the remote's listing)."""
    import hashlib

    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(repo))
    out = {}
    for top in paths:
        local = repo / top
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        for f in files:
            rel = f.relative_to(repo).as_posix()
            try:
                want = (fs.info(rel).get("dvc_info") or {}).get("md5")
            except (FileNotFoundError, OSError):
                want = None
            if want is None:
                out[rel] = "not recorded"
            else:
                out[rel] = "identical" if hashlib.md5(f.read_bytes()).hexdigest() == want else "differs"
    return out


def train_layer_from_remote(
    repo: Path,
    params: Params,
    model: str,
    dataset: str,
    method: str,
    layer: int,
    *,
    remote: str | None = None,
    jobs: int | None = None,
) -> Fetched:
    """Pull the one layer file and the labels the method's train stage needs for it, train that layer
    alone with the stage's own command, and compare what it wrote with what dvc.lock records.
    Returns what was fetched and the comparison."""
    check_in_grid(params, model, dataset, method)
    stage = train_stage_name(model, dataset, method)
    data = stage_data_deps(repo, stage)
    written_by = {d: writer(repo, d) or "" for d in data}
    activations = next(d for d in data if written_by[d].startswith("dump@"))
    if layer not in params.grid.layers:
        raise SharingError(
            _not_dumped(repo, activations, model, dataset, layer)
            or f"grid.layers {params.grid.layers} has no layer {layer}: add it to params.yaml"
        )
    # the layer's file of the dump directory, the labels; not the code digest (the command runs the code)
    deps = [
        f"{activations}/{layer_filename(layer)}" if d == activations else d
        for d in data
        if not written_by[d].startswith("code")
    ]
    cached_before = {
        oid for objects in cache_objects(repo, stage, data).values() for oid, f in objects.items() if f.exists()
    }
    if dvc("pull", *(["-r", remote] if remote else []), *(["-j", str(jobs)] if jobs else []), *deps, cwd=repo):
        raise SharingError(
            missing_from_remote(repo, stage, data, remote)
            or f"`dvc pull` of {stage}'s inputs failed; DVC's message is above"
        )
    if absent := [d for d in deps if not (repo / d).exists()]:
        # `dvc pull` of a file its directory does not hold says "Everything is up to date".
        layer_file = next((d for d in absent if d.endswith(layer_filename(layer))), None)
        raise SharingError(
            (layer_file and _not_dumped(repo, str(Path(layer_file).parent), model, dataset, layer))
            or f"the remote has no {absent}: whoever ran the pipeline must `dvc push` them"
        )
    fetched = {}
    for path, objects in cache_objects(repo, stage, data).items():
        got = {oid: f for oid, f in objects.items() if oid not in cached_before and f.exists()}
        if path == activations:  # a directory: its one layer's file (and its listing, a few hundred bytes)
            path = f"{activations}/{layer_filename(layer)}"
            got = {oid: f for oid, f in got.items() if not oid.endswith(".dir")}
        fetched[path] = sum(f.stat().st_size for f in got.values())
    cmd, outs = stage_command(repo, stage)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if code := subprocess.run(f"{cmd} --layers {layer}", shell=True, cwd=repo, env=env).returncode:
        raise SharingError(f"{stage} on layer {layer} failed (exit {code}); its message is above")
    recorded = compare_with_record(repo, layer_files(repo, outs, layer))
    return Fetched(stage, {d: fetched.get(d, 0) for d in deps}, recorded)


def _not_dumped(repo: Path, activations: str, model: str, dataset: str, layer: int) -> str | None:
    have = dumped_layers(repo, activations)
    if layer in have:
        return None
    return (
        f"layer {layer} was never dumped for {model}/{dataset}: {activations} holds layers {have}. Train one "
        f"of those (--layer), or dump layer {layer} (dump.layers) and push it"
    )


def push_experiments(
    repo: Path,
    git_remote: str,
    names: list[str] | None = None,
    *,
    all_commits: bool = False,
    rev: str | None = None,
    dvc_remote: str | None = None,
    force: bool = False,
    jobs: int | None = None,
) -> dict:
    """`dvc exp push GIT_REMOTE` with every experiment's outputs sent to the DVC remote the
    workspace configures now. Plain DVC takes the remote from each experiment's own commit, so
    after a sweep that ran before the remote was configured it pushes the git refs and no data,
    and says nothing (or, with `-r`, fails on a remote the commit does not know).

    Which experiments: `names`; else every one (`all_commits`); else those derived from `rev`
    and its first-parent ancestors (default HEAD's), so a sweep stays in scope after commits on
    top of it. Returns DVC's result: the experiments pushed (`success`), already there
    (`up_to_date`), refused (`diverged`: another experiment of that name is on the git remote;
    `force` replaces it), and the number of files uploaded."""
    from dvc.repo import Repo

    override = workspace_remotes(repo)
    if override is None:
        raise SharingError(
            "no DVC remote is configured: add the team's first (`dvc remote add -d NAME URL`, "
            "docs/sweeps-and-sharing.md), then push"
        )
    if dvc_remote is not None and dvc_remote not in override["remote"]:
        raise SharingError(f"no DVC remote '{dvc_remote}'{suggest(dvc_remote, override['remote'])}")
    with Repo(str(repo), config=override) as r:
        return r.experiments.push(
            git_remote,
            list(names or []),
            all_commits=all_commits,
            rev=rev,
            num=-1,
            force=force,
            push_cache=True,
            dvc_remote=dvc_remote,
            jobs=jobs,
        )
