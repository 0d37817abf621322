"""Training on shared activations: fetch one layer file and the labels it needs from the DVC
remote, then run that layer's train stage, and nothing upstream of it.

    halludetect train-layer --model llama3-8b --dataset trivia_qa --method max --layer 16

A colleague who dumped the activations (GPU hours) ran `dvc push`; this clone has an empty
cache. The command pulls exactly the stage's data dependencies (one `layer_<L>.h5` of the dump's
directory, `judgments.parquet`, and `clusters.parquet` for the methods that read P_sem), then
runs `dvc repro --single-item train@<model>-<dataset>-<method>-<L>`: DVC records the run in
dvc.lock, so `dvc status` of that stage is clean afterwards, and the stage's outputs (weights,
the layer's val/test scores and figures) can be pushed back. DVC's own messages (no remote, a
remote it cannot reach, credentials) are shown unchanged, before anything trains.

What it reports as fetched is what came from the remote: the bytes of the cache objects that
were not in the local cache before the pull (0 when everything was cached, even if the files
had to be checked out again).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from halludetect.activations.layer_format import layer_filename
from halludetect.config import Params
from halludetect.core.errors import UserError
from halludetect.core.lookup import suggest
from halludetect.methods import CLUSTER_METHODS


class SharingError(UserError):
    """A layer or stage that the shared pipeline does not have."""


def train_stage_name(model: str, dataset: str, method: str, layer: int) -> str:
    """The DVC stage that trains `method` on one layer (train_sp for the methods that read P_sem)."""
    kind = "train_sp" if method in CLUSTER_METHODS else "train"
    return f"{kind}@{model}-{dataset}-{method}-{layer}"


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


def dvc(*args: str, cwd: Path) -> None:
    """Run a DVC command with its output shown as it is; a failure stops here with DVC's message."""
    res = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd)
    if res.returncode:
        raise SharingError(f"`dvc {' '.join(args)}` failed (exit {res.returncode}); its message is above")


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


@dataclass
class Fetched:
    stage: str
    files: dict[str, int]  # path -> bytes fetched from the remote for it (0: it was in the local cache)

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


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
    """Pull the one layer file and the labels a layer's train stage needs, then run that stage
    alone (`dvc repro --single-item`). Returns what was fetched."""
    check_in_grid(params, model, dataset, method)
    if layer not in params.grid.layers:
        # No stage for it: find the cell's dump directory through a layer that has one.
        some = stage_data_deps(repo, train_stage_name(model, dataset, method, params.grid.layers[0]))
        activations = str(Path(next(d for d in some if d.endswith(".h5"))).parent)
        raise SharingError(
            _not_dumped(repo, activations, model, dataset, layer)
            or f"grid.layers {params.grid.layers} has no layer {layer}: add it to params.yaml"
        )
    stage = train_stage_name(model, dataset, method, layer)
    deps = stage_data_deps(repo, stage)
    cached_before = {
        oid for objects in cache_objects(repo, stage, deps).values() for oid, f in objects.items() if f.exists()
    }
    dvc("pull", *(["-r", remote] if remote else []), *(["-j", str(jobs)] if jobs else []), *deps, cwd=repo)
    if absent := [d for d in deps if not (repo / d).exists()]:
        # `dvc pull` of a file its directory does not hold says "Everything is up to date".
        layer_file = next((d for d in absent if d.endswith(layer_filename(layer))), None)
        raise SharingError(
            (layer_file and _not_dumped(repo, str(Path(layer_file).parent), model, dataset, layer))
            or f"the remote has no {absent}: whoever ran the pipeline must `dvc push` them"
        )
    fetched = {
        path: sum(f.stat().st_size for oid, f in objects.items() if oid not in cached_before and f.exists())
        for path, objects in cache_objects(repo, stage, deps).items()
    }
    dvc("repro", "--single-item", stage, cwd=repo)
    return Fetched(stage, {d: fetched.get(d, 0) for d in deps})


def _not_dumped(repo: Path, activations: str, model: str, dataset: str, layer: int) -> str | None:
    have = dumped_layers(repo, activations)
    if layer in have:
        return None
    return (
        f"layer {layer} was never dumped for {model}/{dataset}: {activations} holds layers {have}. Train one "
        f"of those (--layer), or dump layer {layer} (dump.layers) and push it"
    )
