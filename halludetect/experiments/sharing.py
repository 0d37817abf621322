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
from halludetect.config import Params, is_score
from halludetect.core.errors import UserError
from halludetect.core.lookup import suggest
from halludetect.experiments.refs import ExpRef, exp_refs


class SharingError(UserError):
    """A layer or stage that the shared pipeline does not have."""


def train_stage_name(model: str, dataset: str, method: str) -> str:
    """The DVC stage that trains `method` on every layer."""
    return f"train@{model}-{dataset}-{method}"


def check_in_grid(params: Params, model: str, dataset: str, method: str) -> None:
    """The stages exist only for the grid's cells: say which key to change, before DVC says less."""
    for key, value, choices in (
        ("grid.models", model, params.grid.models),
        ("grid.datasets", dataset, params.grid.datasets),
        ("grid.detectors", method, params.grid.detectors),
    ):
        if value not in choices:
            raise SharingError(
                f"{key} has no {value!r}{suggest(value, choices)}: add it to params.yaml (the "
                "stages exist only for the grid's cells)"
            )
    if is_score(method):
        raise SharingError(
            f"{method} is a score with nothing to train: it has no layers to train one by one; its train "
            f"stage computes it whole: dvc repro {train_stage_name(model, dataset, method)}"
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
    from halludetect.runner.dvc_internals import Repo

    with Repo(str(repo)) as r:
        remotes = {name: dict(section) for name, section in r.config.get("remote", {}).items()}
        default = r.config.get("core", {}).get("remote")
    if not remotes:
        return None
    return {"remote": remotes, **({"core": {"remote": default}} if default else {})}


def writer(repo: Path, path: str) -> str | None:
    """The stage whose output `path` is (or lies in)."""
    from halludetect.runner.dvc_internals import Repo

    with Repo(str(repo)) as r:
        for st in r.index.stages:
            for o in st.outs:
                out = str(o.def_path)
                if path == out or path.startswith(out + "/"):
                    return st.addressing
    return None


def stage_data_deps(repo: Path, stage: str) -> list[str]:
    """The stage's dependencies that other stages write (what must come from the remote)."""
    from halludetect.runner.dvc_internals import Repo

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
    from halludetect.runner.dvc_internals import Repo

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
                from halludetect.runner.dvc_internals import Tree

                for _, _, entry in Tree.load(odb, dep.hash_info):
                    objects[entry.value] = Path(odb.oid_to_path(entry.value))
            out[path] = objects
    return out


def dumped_layers(repo: Path, activations: str) -> list[int]:
    """The layers a dump directory holds, read from DVC's record of it (locally or on the remote)."""
    from halludetect.runner.dvc_internals import DVCFileSystem

    fs = DVCFileSystem(str(repo))
    names = [Path(p).name for p in fs.ls(activations, detail=False)]
    return sorted(int(n[len("layer_") : -len(".h5")]) for n in names if n.startswith("layer_") and n.endswith(".h5"))


def absent_on_remote(repo: Path, objects: dict[str, dict[str, Path]], remote: str | None) -> list[str] | None:
    """The paths of `objects` ({path: {object id: local file}}) with an object that is neither in
    the local cache nor on the DVC remote; None when the remote cannot be asked (none configured,
    unreachable, no credentials: DVC's own message says which)."""
    from halludetect.runner.dvc_internals import Repo

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
    from halludetect.runner.dvc_internals import Repo

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

    from halludetect.runner.dvc_internals import DVCFileSystem

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
    # the layer's file of the dump directory, the labels; not the code digest nor the params file (the
    # command runs the code and reads params.yaml)
    deps = [
        f"{activations}/{layer_filename(layer)}" if d == activations else d
        for d in data
        if written_by[d] not in ("code", "params")
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


def check_git_remote(repo: Path, git_remote: str) -> None:
    """`git_remote` is a remote of the clone, or a URL or path (as `git push` takes)."""
    remotes = subprocess.run(["git", "remote"], cwd=repo, capture_output=True, text=True).stdout.split()
    looks_like_url = "://" in git_remote or ":" in git_remote or (repo / git_remote).exists()
    if git_remote in remotes or looks_like_url:
        return
    known = _listed(git_remote, remotes, "this clone has no git remote")
    if "/" in git_remote:  # meant as a path
        raise SharingError(f"no git repository at {git_remote} and no git remote of that name{known}")
    raise SharingError(
        f"no git remote '{git_remote}'{known}. Add it (`git remote add {git_remote} URL`) or give its URL"
    )


def _listed(name: str, choices: list[str], none: str) -> str:
    """'; did you mean ...? valid: ...' (or '; valid: ...'), or '; ' and what to say when there are none."""
    return suggest(name, choices) if choices else f"; {none}"


def experiments_to_push(
    repo: Path, names: list[str] | None = None, *, all_commits: bool = False, rev: str | None = None
) -> tuple[list[ExpRef], list[ExpRef]]:
    """The experiments in scope, as `push_experiments` takes them: (those that can be pushed,
    those whose ref cannot be read). A named experiment that does not exist or cannot be read,
    and a `rev` that is no commit, are errors."""
    refs = exp_refs(repo)
    if names:
        known = sorted({ref.name for ref in refs})
        if missing := [n for n in names if n not in known]:
            hint = _listed(missing[0], known, "this clone has no experiments")
            raise SharingError(f"no experiment named {', '.join(missing)}{hint} (`dvc exp list -A` lists them)")
        chosen = [ref for ref in refs if ref.name in names]
        if bad := next((ref for ref in chosen if ref.problem), None):
            raise SharingError(f"experiment {bad.name} cannot be pushed: {bad.problem}")
    elif all_commits:
        chosen = refs
    else:
        target = rev or "HEAD"
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{target}^{{commit}}"],
            cwd=repo,
            capture_output=True,
            text=True,
        )
        if found.returncode:
            raise SharingError(
                f"--rev {target}: no such commit in this clone (a branch, tag or sha; `git log --oneline` lists them)"
            )
        history = subprocess.run(
            ["git", "rev-list", "--first-parent", found.stdout.strip()], cwd=repo, capture_output=True, text=True
        ).stdout.split()
        chosen = [ref for ref in refs if ref.baseline in set(history)]
    return [ref for ref in chosen if not ref.problem], [ref for ref in chosen if ref.problem]


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
    workspace configures now, and sent first. Plain DVC takes the remote from each experiment's
    own commit, so after a sweep that ran before the remote was configured it pushes the git
    refs and no data, and says nothing (or, with `-r`, fails on a remote the commit does not
    know); and it pushes the refs before the data, so a remote that is down or refuses the
    credentials leaves a colleague refs without data.

    Which experiments: `names`; else every one (`all_commits`); else those derived from `rev`
    and its first-parent ancestors (default HEAD's), so a sweep stays in scope after commits on
    top of it. Everything is checked before anything is pushed: the git remote, the names, the
    revision. The outputs go first; when they cannot, no ref is pushed (a `SharingError` that
    says so); when the refs fail after them, the error says what was done and what to run.
    Returns DVC's result: the experiments pushed (`success`), already there (`up_to_date`),
    refused (`diverged`: another experiment of that name is on the git remote; `force` replaces
    it), the number of files uploaded, and `unreadable`: {ref: why} of the experiments in scope
    whose ref cannot be read (not pushed)."""
    from halludetect.runner.dvc_internals import Repo

    override = workspace_remotes(repo)
    if override is None:
        raise SharingError(
            "no DVC remote is configured: add the team's first (`dvc remote add -d NAME URL`, "
            "docs/sweeps-and-sharing.md), then push"
        )
    if dvc_remote is not None and dvc_remote not in override["remote"]:
        raise SharingError(f"no DVC remote '{dvc_remote}'{suggest(dvc_remote, override['remote'])}")
    check_git_remote(repo, git_remote)
    refs, unreadable = experiments_to_push(repo, names, all_commits=all_commits, rev=rev)
    skipped = {ref.ref: ref.problem for ref in unreadable}
    if not refs:
        why = f"; and {len(skipped)} whose ref cannot be read: {'; '.join(skipped.values())}" if skipped else ""
        raise SharingError(
            "no experiment to push: none derives from HEAD or a commit before it (-A pushes every "
            f"experiment of this clone; `dvc exp list` lists them){why}"
        )
    remote = dvc_remote or override.get("core", {}).get("remote") or next(iter(override["remote"]))
    which = " ".join(sorted({ref.name for ref in refs}))
    with Repo(str(repo), config=override) as r:
        # the data first: refs without it would send a colleague experiments whose outputs no one can fetch.
        # The commits are the checked refs' own, so a ref at its baseline never sends the whole history's
        try:
            uploaded = r.push(
                revs=[c for ref in refs for c in ref.commits], remote=dvc_remote, jobs=jobs, workspace=False
            )
        except Exception as e:  # noqa: BLE001 - whatever stopped the upload, no ref may follow it
            raise SharingError(
                f"the outputs of {which} could not be pushed to the DVC remote '{remote}' ({type(e).__name__}: "
                f"{e}), so no git ref was pushed: check its URL (`dvc remote list`) and credentials, then run "
                "this again"
            ) from None
        try:
            result = r.experiments.push(git_remote, [ref.ref for ref in refs], force=force, push_cache=False)
        except Exception as e:  # noqa: BLE001 - the data went; say what is left to do
            raise SharingError(
                f"the outputs of {which} are on the DVC remote '{remote}' ({uploaded} file(s) uploaded), but "
                f"pushing their git refs to '{git_remote}' failed ({type(e).__name__}: {e}): check the git remote "
                f"(`git remote -v`: its URL, your access), then finish with `halludetect exp-push {git_remote} "
                f"{which}` (the outputs are not uploaded again)"
            ) from None
    return {**result, "uploaded": uploaded, "unreadable": skipped}
