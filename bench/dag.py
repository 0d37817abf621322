"""The DAG's own overhead: what DVC costs per stage for a given design of dvc.yaml, at the paper's grid.

    python -m bench.dag [--rev REV|DIR] [--baseline-rev 58462e0 | --no-baseline]
                        [--models 3] [--datasets 4] [--methods all] [--layers 52]
                        [--max-repro-stages 400] [--reduced-models 1] [--reduced-datasets 2] [--reduced-layers 2]
                        [--synth-max-mb 2] [--status-runs 3] [--keep]

    python -m bench.dag --rev 58462e0 --no-baseline --models 1 --datasets 1 --layers 2   # a quick one

The default run (the paper's grid, both designs) takes about 20 minutes on a loaded 2-core EPYC:
today's design is measured on its reduced grid (137 stages, most of the time) and extrapolated.

For each design (the dvc.yaml, params.yaml and code of `--rev`: a git revision, or a checkout's
directory read as it is, default this working tree; and of `--baseline-rev`, today's design at
58462e0, side by side in the same run):

1. A temporary repository (git init, dvc init) gets the revision's halludetect/, stages/,
   dvc.yaml, params.yaml, .dvc/config, .dvcignore, pyproject.toml and inputs/README.md, and a
   params.yaml whose grid is the requested one (grid.transfer: every dataset of it; a revision
   before that was a list gets grid.transfer_stages derived by its own config; the whole file is
   validated by its `load_params` and a failure printed). Every
   dependency no stage produces and the revision lacks (a user-supplied dataset file) gets a
   placeholder.
2. DVC itself expands the stages (`Repo.index.stages`: each one's resolved cmd, deps, outs).
   Each command keeps its text (the lock records it verbatim); `python` on the PATH of `dvc
   repro` is bench/dag_stub.py, which writes the stage's outputs with a few deterministic bytes
   (a directory with the files other stages list inside it) and records its own wall time.
3. Measured: `dvc repro` wall (a subprocess, CLI start-up included), the stage commands' wall
   (summed from the stub), DVC's time per stage = (repro wall - commands) / stages, dvc.lock's
   bytes and entries (deps + outs + params keys), `dvc status --json` on the finished repository
   (3 runs, min and median; it must be clean), one lock rewrite at that size (what DVC does
   after every stage: `dvc.utils.serialize.modify_yaml`, a ruamel round-trip load + dump, min of 3)
   and one plain load (DVC's safe parse, what status reads).

The grid: the paper's models (llama3-8b, mistral-nemo-12b, llama3_3-70b) and datasets (trivia_qa,
squad, nq, bioasq), every method the revision's registry has (halludetect.methods: the trained
detectors under grid.detectors, or for a revision before the route stage hidden-state methods under
grid.methods and those reading the clustering under grid.sp_methods; the analysable ones under
grid.analyze; every score with nothing to train, p_true among them: in grid.detectors, or for a
revision before that under grid.baselines and grid.model_baselines) and its layers. The
paper trains a detector on every layer (Setup: "For each layer, a lightweight MLP detector was
trained"): Llama-3.1-8B 32 blocks + embeddings (33), Mistral-NeMo-12B 41, Llama-3.3-70B 81, i.e.
155 (model, layer) pairs per dataset and method. grid.layers is one list for every model
(halludetect/config.py GridParams), so the default `--layers 52` (0..51) gives each model 52:
3 x 52 = 156 pairs, the paper's count of per-layer stages to one. `--layers 81` lists the 70B's
(over-counting the smaller models'); `--layers 33` only layers every model has. `--models`,
`--datasets` take a count (the first N of the paper's) or a comma list; `--methods` `all` or a
comma list (of trained methods and, for a revision where they are detectors, scores; a revision
before that always has its baselines' stages).

At the paper's scale today's design has thousands of stages and a lock of tens of MB: its
`dvc repro` would run for hours to days, since DVC rewrites the whole lock after every stage.
A design whose grid has more than `--max-repro-stages` stages is therefore run (measured) on a
reduced grid (`--reduced-*`: the first model, first two datasets, two layers, every method), and
its paper-scale figures are EXTRAPOLATED, labelled so in the output:

- stages: exact (DVC's expansion of the paper-scale repository, which is built but not run);
- lock bytes and entries: a lock SYNTHESISED from that expansion (each stage's entry as DVC
  writes it, with made-up hashes and the stub's sizes), scaled by real / synthesised lock bytes
  on the reduced grid (printed: the synthesis' error). Dumping tens of MB with ruamel takes
  long, so the file written holds the first `--synth-max-mb` of it; the rest of the entries'
  bytes are estimated (JSON length x the family's YAML / JSON ratio, from a few entries dumped
  per stage family; its error on the reduced grid is printed as synth_estimate_error);
- one lock rewrite and one load at that size: proportional to bytes through the synthesised
  lock's measured rewrite and load (exact when the whole lock was written); the reduced grid's
  real lock gives a second point (both are in the JSON: the seconds per MB should agree);
- DVC time: the CLI's start-up once (`dvc config -l`), a fixed part per stage (the reduced
  grid's DVC time minus start-up and its modelled lock rewrites, per stage) and the lock
  bookkeeping: the sum over stages (in repro order) of one rewrite at the lock's size after
  that stage;
- `dvc status`: start-up + (reduced status - start-up - reduced lock load) x stages ratio +
  one load of the grid's lock;
- `split_bookkeeping`: the same bookkeeping with the stages spread over several dvc.yaml files,
  each with its own lock (DVC rewrites only the lock of the stage's file): one file per stage
  family, and one per family and model.

Beside DVC's own writer, each design is also run through halludetect/runner/dvc_lock.py (what
`halludetect repro` runs: dvc.lock written entry by entry, the same bytes): a second build of the
same repository reproduced that way (its lock compared byte for byte with the first), one warm
entry-wise rewrite timed on the measured and on the grid's synthesised lock, and the grid's DVC time
with that rewrite after every stage (the same fixed part per stage; the rewrite at the full lock's
size, an upper bound). `--measure-entrywise-grid` runs the whole grid that way too (a few minutes
at the paper's grid, where DVC's own writer would take most of an hour), and times its `dvc status`,
then again on a copy with every stage's `params:` removed (`without_params`: what the per-stage
parse of params.yaml costs status) and on one where each stage depends on a file of its params'
values instead (`digests`).

When the grid is small enough, everything is measured on it (the bookkeeping share alone is
modelled). The last line is one JSON object: both designs' figures, and new / baseline ratios.
The machine's load matters (DVC is single-threaded Python): run the two designs in one run
(the JSON's `machine` gives the load average before and after, and whether ruamel's C loader is
installed). ratio_grid compares the two designs at the grid; ratio_measured compares the runs
that were measured, each design's own reduced grid when the grid was too large.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAPER_MODELS = ["llama3-8b", "mistral-nemo-12b", "llama3_3-70b"]
PAPER_DATASETS = ["trivia_qa", "squad", "nq", "bioasq"]
PAPER_LAYERS = 52
BASELINE_REV = "58462e0"
COPY = [
    "halludetect",
    "stages",
    "dvc.yaml",
    "params.yaml",
    ".dvc/config",
    ".dvcignore",
    "pyproject.toml",
    "inputs/README.md",
]
STATUS_RUNS = 3
REWRITE_RUNS = 3

REGISTRY = """
import json
from halludetect import config
from halludetect.methods import ANALYZABLE, CLUSTER_METHODS, METHODS
cluster = set(CLUSTER_METHODS)
print(json.dumps({
    "methods": [m for m in METHODS if m not in cluster],
    "sp_methods": [m for m in METHODS if m in cluster],
    "analyze": list(ANALYZABLE),
    "baselines": list(getattr(config, "BASELINES", ())),
    "model_baselines": list(getattr(config, "MODEL_BASELINES", ())),
    "scores": list(getattr(__import__("halludetect.methods").methods, "SCORES", ())),
}))
"""

TRANSFER = """
import json, sys
from halludetect import config
grid = json.load(sys.stdin)
grid.pop("transfer_stages", None)
g = config.GridParams.model_validate(grid)
f = getattr(g, "expected_transfer_stages", None)
print(json.dumps(f() if f else None))
"""

VALIDATE = "from halludetect.config import load_params; load_params('params.yaml')"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path, env: dict | None = None, stdin: str | None = None) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"error: {' '.join(cmd)} (in {cwd}) failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def base_env() -> dict:
    return dict(os.environ, DVC_NO_ANALYTICS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def pick(spec: str, full: list[str]) -> list[str]:
    if spec == "all":
        return list(full)
    if spec.isdigit():
        return full[: int(spec)]
    return [s for s in spec.split(",") if s]


# --- the temporary repository -------------------------------------------------------------------


def export(rev: str | None, dest: Path) -> None:
    """The revision's files of COPY into dest (rev None: this working tree; a directory: that one's)."""
    dest.mkdir(parents=True)
    if rev is None or Path(rev).is_dir():
        tree = ROOT if rev is None else Path(rev)
        for p in COPY:
            src = tree / p
            if src.is_dir():
                shutil.copytree(src, dest / p, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif src.exists():
                (dest / p).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / p)
        return
    have = [p for p in COPY if subprocess.run(["git", "cat-file", "-e", f"{rev}:{p}"], cwd=ROOT).returncode == 0]
    archive = subprocess.run(["git", "archive", rev, "--", *have], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def py(repo: Path, code: str, stdin: str | None = None) -> str:
    env = dict(base_env(), PYTHONPATH=str(repo))
    return run([sys.executable, "-c", code], cwd=repo, env=env, stdin=stdin)


def write_params(repo: Path, grid: dict) -> None:
    from ruamel.yaml import YAML

    yaml = YAML()  # round-trip: the file keeps its comments and order
    path = repo / "params.yaml"
    data = yaml.load(path)
    for k, v in grid.items():
        data["grid"][k] = v
    with path.open("w") as f:
        yaml.dump(data, f)


def grid_for(repo: Path, models: list[str], datasets: list[str], methods: str, layers: int) -> dict:
    reg = json.loads(py(repo, REGISTRY))
    chosen = None if methods == "all" else set(methods.split(","))

    def keep(xs: list[str]) -> list[str]:
        return [x for x in xs if chosen is None or x in chosen]

    grid = {"models": models, "datasets": datasets, "layers": list(range(layers))}
    from ruamel.yaml import YAML

    written = YAML(typ="safe").load(repo / "params.yaml")["grid"]
    if "detectors" in written:  # one list since the route stage
        grid["detectors"] = keep(reg["methods"] + reg["sp_methods"])
    else:
        grid["methods"], grid["sp_methods"] = keep(reg["methods"]), keep(reg["sp_methods"])
    if "baselines" in written:  # the scores' own lists, before they were detectors
        grid |= {"baselines": reg["baselines"], "model_baselines": reg["model_baselines"]}
    elif "detectors" in grid:  # the scores with the detectors (all of them by default, as the baselines were)
        grid["detectors"] += keep(reg["scores"])
    trained = detectors(grid)
    grid["analyze"] = [m for m in reg["analyze"] if m in trained]
    return grid


def detectors(grid: dict) -> list[str]:
    """The grid's trained detectors, in either form of params.yaml's grid."""
    return grid.get("detectors") or [*grid.get("methods", []), *grid.get("sp_methods", [])]


def resolve(repo: Path) -> list[dict]:
    """Every expanded stage as DVC sees it, in `dvc repro`'s order (dependencies first)."""
    import networkx as nx

    from halludetect.runner.dvc_internals import ParamsDependency, Repo

    with Repo(str(repo)) as r:
        index = r.index
        order = {s: i for i, s in enumerate(nx.dfs_postorder_nodes(index.graph))}
        stages = sorted(index.stages, key=lambda s: order.get(s, len(order)))
        out = []
        for s in stages:
            params = {}
            for d in s.deps:
                if isinstance(d, ParamsDependency):
                    keys = d.params if isinstance(d.params, list) else list(d.params)
                    params.setdefault(d.def_path, []).extend(keys)
            out.append(
                {
                    "name": s.name,
                    "cmd": s.cmd,
                    "deps": [d.def_path for d in s.deps if not isinstance(d, ParamsDependency)],
                    "params": params,
                    "outs": [o.def_path for o in s.outs],
                }
            )
    return out


def prefixes(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def stub_map(stages: list[dict]) -> tuple[dict, list[str]]:
    """{stage: [{path, dir, files}]} for the stub, and the deps no stage produces."""
    outs = {o for s in stages for o in s["outs"]}
    deps = {d for s in stages for d in s["deps"]}
    inside: dict[str, set[str]] = defaultdict(set)
    out_parents = {p for o in outs for p in prefixes(o)}
    external = []
    for d in deps:
        produced = d in outs or d in out_parents
        for p in prefixes(d):
            if p in outs:
                inside[p].add(d[len(p) + 1 :])
                produced = True
        if not produced:
            external.append(d)
    mapping = {}
    for s in stages:
        entries = []
        for o in s["outs"]:
            names = sorted(inside.get(o, ()))
            leaves = [n for n in names if not any(m.startswith(n + "/") for m in names)]
            is_dir = bool(leaves) or "." not in o.rsplit("/", 1)[-1]
            entries.append({"path": o, "dir": is_dir, "files": leaves or ["stub.txt"]})
        mapping[s["name"]] = entries
    return mapping, sorted(external)


def build(rev: str | None, grid_args: dict, dest: Path) -> dict:
    """The temporary repository of `rev` with the requested grid; its stages resolved by DVC."""
    repo = dest / "repo"
    export(rev, repo)
    config = (repo / ".dvc" / "config").read_text() if (repo / ".dvc" / "config").exists() else None
    dvcignore = (repo / ".dvcignore").read_text() if (repo / ".dvcignore").exists() else None
    shutil.rmtree(repo / ".dvc", ignore_errors=True)
    env = base_env()
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo, env)
    if config is not None:
        (repo / ".dvc" / "config").write_text(config)
    if dvcignore is not None:
        (repo / ".dvcignore").write_text(dvcignore)

    grid = grid_for(repo, **grid_args)
    write_params(repo, grid)
    from ruamel.yaml import YAML

    params = YAML(typ="safe").load(repo / "params.yaml")
    if "transfer_stages" in params["grid"]:  # a revision before grid.transfer became a list of datasets
        want = json.loads(py(repo, TRANSFER, stdin=json.dumps(params["grid"])))
        if want is not None:
            write_params(repo, {"transfer_stages": want})
            params = YAML(typ="safe").load(repo / "params.yaml")
    elif isinstance(params["grid"].get("transfer"), list):  # every ordered pair of the grid's datasets, as `all` was
        write_params(repo, {"transfer": list(grid["datasets"])})
        params = YAML(typ="safe").load(repo / "params.yaml")
    invalid = subprocess.run(
        [sys.executable, "-c", VALIDATE], cwd=repo, env=dict(env, PYTHONPATH=str(repo)), capture_output=True, text=True
    )
    if invalid.returncode:
        log(f"  note: the revision's config rejects this params.yaml: {invalid.stderr.strip().splitlines()[-1]}")

    t0 = time.perf_counter()
    stages = resolve(repo)
    resolve_s = time.perf_counter() - t0
    mapping, external = stub_map(stages)
    placeholders = []
    for d in external:
        if not (repo / d).exists():
            (repo / d).parent.mkdir(parents=True, exist_ok=True)
            (repo / d).write_text("bench.dag placeholder\n")
            placeholders.append(d)
    for ds in grid["datasets"]:  # a user-supplied dataset file (BioASQ) under a dependency directory
        path = (params.get("datasets", {}).get(ds) or {}).get("path") or ""
        if path.startswith("inputs/") and not (repo / path).exists():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text("[]\n")
            placeholders.append(path)
    odd = [s["name"] for s in stages if not s["cmd"].startswith("python ")]
    if odd:
        sys.exit(f"error: commands that do not start with `python ` cannot be stubbed: {odd[:5]}")

    (dest / "stub_map.json").write_text(json.dumps(mapping))
    shim = dest / "shim"
    shim.mkdir()
    stub = shim / "python"
    stub.write_text(f"#!{sys.executable} -IS\n" + (ROOT / "bench" / "dag_stub.py").read_text())
    stub.chmod(0o755)
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "bench"], repo)
    return {
        "repo": repo,
        "dest": dest,
        "stages": stages,
        "params": params,
        "grid": grid,
        "placeholders": placeholders,
        "resolve_s": resolve_s,
    }


# --- measurements -------------------------------------------------------------------------------


ENTRYWISE = Path(__file__).resolve().parents[1] / "halludetect" / "runner" / "dvc_lock.py"


def repro(b: dict, entrywise: bool = False) -> dict:
    """`dvc repro` of the built repository; `entrywise`: through halludetect/runner/dvc_lock.py (what
    `halludetect repro` runs: DVC with dvc.lock written entry by entry), run as a script so that any
    revision's design can be measured with it."""
    dest, repo = b["dest"], b["repo"]
    times = dest / "stub_times.tsv"
    env = dict(
        base_env(),
        PATH=f"{dest / 'shim'}{os.pathsep}{base_env()['PATH']}",
        BENCH_DAG_MAP=str(dest / "stub_map.json"),
        BENCH_DAG_TIMES=str(times),
    )
    t0 = time.perf_counter()
    run([sys.executable, str(ENTRYWISE), "repro"] if entrywise else [str(BIN / "dvc"), "repro"], repo, env)
    wall = time.perf_counter() - t0
    ran = [line.split("\t") for line in times.read_text().splitlines()]
    n = len(b["stages"])
    if len(ran) != n:
        sys.exit(f"error: {len(ran)} stage commands ran, DVC expanded {n}")
    cmd_s = sum(float(t) for _, t in ran)
    return {"repro_wall_s": wall, "commands_s": cmd_s, "dvc_s": wall - cmd_s, "dvc_per_stage_s": (wall - cmd_s) / n}


def cli_floor(repo: Path) -> float:
    """The DVC CLI's start-up: `dvc config -l` (min of a few), paid once per command."""
    walls = []
    for _ in range(STATUS_RUNS):
        t0 = time.perf_counter()
        run([str(BIN / "dvc"), "config", "-l"], repo, base_env())
        walls.append(time.perf_counter() - t0)
    return min(walls)


def status(repo: Path) -> dict:
    walls, clean = [], True
    for _ in range(STATUS_RUNS):
        t0 = time.perf_counter()
        out = run([str(BIN / "dvc"), "status", "--json"], repo, base_env())
        walls.append(time.perf_counter() - t0)
        clean = clean and json.loads(out or "{}") == {}
    return {"status_min_s": min(walls), "status_median_s": statistics.median(walls), "status_clean": clean}


def lock_costs(lock: Path, scratch: Path, runs: int = REWRITE_RUNS) -> dict:
    """One rewrite (DVC after each stage) and one safe load (status) of the lock, min of a few."""
    from halludetect.runner.dvc_internals import load_yaml, modify_yaml

    copy = scratch / "lock_copy.yaml"
    shutil.copy(lock, copy)
    rewrite, load = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        with modify_yaml(str(copy)):
            pass
        rewrite.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_yaml(str(copy))
        load.append(time.perf_counter() - t0)
    ew = entrywise_rewrite(lock, scratch, runs)
    return {"rewrite_s": min(rewrite), "load_s": min(load), "entrywise_rewrite_s": ew}


def entrywise_rewrite(lock: Path, scratch: Path, runs: int) -> float:
    """One rewrite by runner/dvc_lock.py's writer, warm (as after the first stage of a run), with one
    entry changed: what `halludetect repro` pays after each stage. Min of a few."""
    from halludetect.runner.dvc_internals import yaml as _yaml
    from halludetect.runner.dvc_lock import LockWriter

    where = scratch / "entrywise"
    where.mkdir(exist_ok=True)
    copy = where / "dvc.lock"
    shutil.copy(lock, copy)
    writer = LockWriter(_yaml.modify_yaml, _yaml._dump)
    with writer.modify(copy):  # the first write of a run reads the file and dumps every entry
        pass
    times = []
    for i in range(max(runs, 3)):
        t0 = time.perf_counter()
        with writer.modify(copy) as data:
            name = next(iter(data["stages"]))
            data["stages"][name] = {**data["stages"][name], "cmd": f"{data['stages'][name]['cmd']} #{i}"}
        times.append(time.perf_counter() - t0)
    return min(times)


def without_params(repo: Path, dest: Path) -> dict:
    """What DVC's per-stage params cost `dvc status`, and what a params digest per stage would cost
    instead. DVC parses params.yaml once per stage that lists params (dvc/dependency/param.py
    `read_param_file`, 3.67.1) and looks each key up by walking the whole tree (dpath). Two copies of
    the finished repository:

    - `without_params`: every stage's `params:` removed from dvc.yaml and from its dvc.lock entry;
    - `digests`: the same, and each stage depends instead on `data/params/<stage>.json`, a file of its
      params' values (what a stage that reads params.yaml once would write, as the code stage writes
      a code digest per stage), recorded in its lock entry.

    Returns each copy's `dvc status` and lock bytes; `digests` is None for a design that has the
    params stage already (stages/params.py since issue 53: the copy would be the design itself)."""
    from ruamel.yaml import YAML

    y = YAML()
    spec = y.load((repo / "dvc.yaml").read_text())
    has_params_stage = any(PARAMS_OUT in (s.get("outs") or []) for s in spec["stages"].values())
    out = {"digests": None}
    for label in ("without_params",) if has_params_stage else ("without_params", "digests"):
        copy = dest / label.replace("_", "-")
        shutil.copytree(repo, copy, symlinks=True)
        spec, lock = y.load((copy / "dvc.yaml").read_text()), y.load((copy / "dvc.lock").read_text())
        for family, stage in spec["stages"].items():
            had = stage.pop("params", None)
            if label == "digests" and had:  # the stage's name as DVC expands it: family@v1-v2-... in matrix order
                name = family + ("@" + "-".join(f"${{item.{k}}}" for k in stage["matrix"]) if "matrix" in stage else "")
                stage.setdefault("deps", []).append(f"data/params/{name}.json")
        for name, entry in lock["stages"].items():
            had = entry.pop("params", None)
            if label == "digests" and had:
                data = json.dumps(had, sort_keys=True).encode()
                rel = f"data/params/{name}.json"
                (copy / rel).parent.mkdir(parents=True, exist_ok=True)
                (copy / rel).write_bytes(data)
                dep = {"path": rel, "hash": "md5", "md5": hashlib.md5(data).hexdigest(), "size": len(data)}
                entry["deps"] = sorted([*entry.get("deps", []), dep], key=lambda d: d["path"])
        for file, doc in (("dvc.yaml", spec), ("dvc.lock", lock)):
            with open(copy / file, "w") as f:
                y.dump(doc, f)
        out[label] = {**status(copy), "lock_bytes": (copy / "dvc.lock").stat().st_size}
    return out


PARAMS_OUT = "data/params"  # the params stage's output (halludetect/runner/params_digests.py)


def lock_stats(lock: Path) -> dict:
    from halludetect.runner.dvc_internals import load_yaml

    data = load_yaml(str(lock)).get("stages", {})
    entries = 0
    for e in data.values():
        entries += len(e.get("deps", ())) + len(e.get("outs", ()))
        entries += sum(len(v) for v in (e.get("params") or {}).values())
    return {"lock_bytes": lock.stat().st_size, "lock_entries": entries, "lock_stages": len(data)}


def lookup(params: dict, key: str):
    node = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def synthesise(b: dict, path: Path, max_bytes: float) -> dict:
    """The lock DVC would write for b's stages, with made-up hashes. Returns its bytes, the bytes
    of each stage's entry (repro order) and its entries. The file written holds the first stages
    up to about max_bytes (all when the lock is smaller: `exact`); beyond, an entry's bytes are
    its JSON length x its family's YAML / JSON ratio, from a few entries dumped per family."""
    from halludetect.runner.dvc_internals import dump_yaml, dumps_yaml

    repo, params = b["repo"], b["params"]
    mapping = json.loads((b["dest"] / "stub_map.json").read_text())
    nfiles = {o["path"]: len(o["files"]) for outs in mapping.values() for o in outs}
    dirs = {o["path"] for outs in mapping.values() for o in outs if o["dir"]}
    dirs |= {p for outs in mapping.values() for o in outs for p in prefixes(o["path"])}

    def item(p: str, salt: str) -> dict:
        md5 = hashlib.md5(f"{salt}:{p}".encode()).hexdigest()
        f = repo / p
        if p in dirs or f.is_dir():
            n = nfiles.get(p) or (sum(1 for _ in f.rglob("*")) if f.is_dir() else 0) or 8
            return {"path": p, "hash": "md5", "md5": md5 + ".dir", "size": 60 * n, "nfiles": n}
        return {"path": p, "hash": "md5", "md5": md5, "size": f.stat().st_size if f.is_file() else 60}

    stages, entries = [], 0
    for s in b["stages"]:
        e = {"cmd": s["cmd"]}
        if s["deps"]:
            e["deps"] = [item(p, "dep") for p in sorted(s["deps"])]
        if s["params"]:
            # a copy each: shared objects would be dumped as YAML anchors and aliases, which DVC's lock has
            # not; no keys is the whole file (the params stage's `- params.yaml:`), as DVC records it
            e["params"] = {
                f: {k: copy.deepcopy(lookup(params, k)) for k in sorted(keys)} if keys else copy.deepcopy(params)
                for f, keys in s["params"].items()
            }
        if s["outs"]:
            e["outs"] = [item(p, s["name"]) for p in sorted(s["outs"])]
        entries += len(s["deps"]) + len(s["outs"]) + sum(len(k) for k in s["params"].values())
        stages.append((s["name"], e))

    def exact(name: str, e: dict) -> int:  # as nested under `stages:` in the file
        return len(dumps_yaml({"stages": {name: e}}).encode()) - len("stages:\n")

    families: dict[str, list[int]] = defaultdict(list)
    for i, (name, _) in enumerate(stages):
        families[name.split("@")[0]].append(i)
    sizes: list[float] = [0.0] * len(stages)
    for idx in families.values():
        sample = sorted({idx[0], idx[len(idx) // 3], idx[2 * len(idx) // 3], idx[-1]})
        ratio = []
        for i in sample:
            sizes[i] = exact(*stages[i])
            ratio.append(sizes[i] / len(json.dumps(stages[i][1])))
        for i in idx:
            if not sizes[i]:
                sizes[i] = len(json.dumps(stages[i][1])) * statistics.mean(ratio)
    header = len("schema: '2.0'\nstages:\n")
    keep, acc = 0, header
    while keep < len(stages) and acc < max_bytes:
        acc += sizes[keep]
        keep += 1
    estimated = header + sum(sizes)
    dump_yaml(str(path), {"schema": "2.0", "stages": dict(stages[:keep])})
    written = path.stat().st_size
    if keep == len(stages):  # the whole lock: each entry's bytes from the file itself
        lines = path.read_text().splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.startswith("  ") and line[2] != " "]
        ends = [*starts[1:], len(lines)]
        sizes = [sum(len(x.encode()) for x in lines[a:z]) for a, z in zip(starts, ends, strict=True)]
    by_family: dict[str, float] = defaultdict(float)
    for (name, _), size in zip(stages, sizes, strict=True):
        by_family[name.split("@")[0]] += size
    return {
        "by_family": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
        "bytes": written if keep == len(stages) else estimated,
        "sizes": sizes,
        "entries": entries,
        "written_bytes": written,
        "exact": keep == len(stages),
        "estimate_error": estimated / written - 1 if keep == len(stages) else None,
    }


def bookkeeping(sizes: list[int], header: int, scale: float, rewrite, groups: list[str] | None = None) -> float:
    """Sum over stages of one lock rewrite at the lock's size after that stage. `groups`: the dvc.yaml
    each stage would live in, each file with its own lock (DVC rewrites only the lock of the stage's
    file), for a layout of several files; None: one file."""
    total, acc = 0.0, defaultdict(lambda: float(header))
    for s, g in zip(sizes, groups or [""] * len(sizes), strict=True):
        acc[g] += s * scale
        total += rewrite(acc[g])
    return total


def split_layouts(stages: list[dict], models: list[str]) -> dict[str, list[str]]:
    """Which file each stage would be in, for two layouts of several dvc.yaml files (each with its own
    dvc.lock): one per stage family (train, evaluate, ...: the same files whatever the grid), and one
    per family and model (a stage whose outputs name no model of the grid in the family's file)."""

    def model_of(s: dict) -> str:
        for o in s["outs"]:
            for m in models:
                if f"/{m}/" in f"/{o}/" or o.endswith(f"/{m}.json"):
                    return m
        return ""

    family = [s["name"].split("@")[0] for s in stages]
    return {"family": family, "family_model": [f"{f}/{model_of(s)}" for f, s in zip(family, stages, strict=True)]}


def split_bookkeeping(stages: list[dict], models: list[str], sizes: list, header: int, scale: float, rewrite) -> dict:
    """The lock bookkeeping if the stages were spread over several dvc.yaml files (split_layouts),
    each its own lock, modelled as `bookkeeping` models one file, at today's entries."""
    return {
        name: {"files": len(set(groups)), "bookkeeping_s": bookkeeping(sizes, header, scale, rewrite, groups)}
        for name, groups in split_layouts(stages, models).items()
    }


def design(
    label: str, rev: str | None, grid_args: dict, reduced_args: dict, max_repro: int, synth_max_bytes: float, work: Path
) -> dict:
    log(f"== {label}: {'working tree' if rev is None else rev}")
    full = build(rev, grid_args, work / f"{label}-grid")
    n_full = len(full["stages"])
    log(
        f"  grid {len(grid_args['models'])} models x {len(grid_args['datasets'])} datasets x "
        f"{len(detectors(full['grid']))} detectors x {grid_args['layers']} layers: "
        f"{n_full} stages (resolved in {full['resolve_s']:.1f} s); placeholders: {full['placeholders'] or 'none'}"
    )
    measured_full = n_full <= max_repro
    if measured_full:
        run_b = full
    else:
        run_b = build(rev, reduced_args, work / f"{label}-reduced")
        log(
            f"  {n_full} stages > --max-repro-stages {max_repro}: dvc repro on the reduced grid "
            f"({len(run_b['stages'])} stages), the grid's figures extrapolated"
        )
    n = len(run_b["stages"])
    log(f"  dvc repro of {n} stages ...")
    m = repro(run_b)
    log(f"  dvc repro of {n} stages through runner/dvc_lock.py (a second build of the same repository) ...")
    again = build(rev, reduced_args if not measured_full else grid_args, work / f"{label}-entrywise")
    m["entrywise"] = repro(again, entrywise=True)
    m["entrywise"]["lock_identical"] = (again["repo"] / "dvc.lock").read_bytes() == (
        run_b["repo"] / "dvc.lock"
    ).read_bytes()
    lock = run_b["repo"] / "dvc.lock"
    m.update(lock_stats(lock))
    m.update(status(run_b["repo"]))
    m.update(lock_costs(lock, run_b["dest"]))
    m["cli_floor_s"] = cli_floor(run_b["repo"])
    m["rewrite_s_per_mb"] = m["rewrite_s"] / (m["lock_bytes"] / 1e6)
    m["stages"] = n
    listed = run([str(BIN / "dvc"), "stage", "list", "--name-only"], run_b["repo"], base_env()).split()
    m["dvc_stage_list"] = len(listed)

    syn = synthesise(run_b, run_b["dest"] / "synth.lock", float("inf"))
    header = len("schema: '2.0'\nstages:\n")
    correction = m["lock_bytes"] / syn["bytes"]
    m["synth_lock_error"] = syn["bytes"] / m["lock_bytes"] - 1
    m["synth_estimate_error"] = syn["estimate_error"]
    result = {"label": label, "rev": rev or "working tree", "measured": m}

    def line(t: float, size: float):
        """Seconds at s bytes: proportional to bytes through a measured point (ruamel's round
        trip is linear in the text; the per-call constant is milliseconds)."""
        return lambda s: t * s / size

    if measured_full:
        rewrite = line(m["rewrite_s"], m["lock_bytes"])
        book = bookkeeping(syn["sizes"], header, correction, rewrite)
        split = split_bookkeeping(full["stages"], grid_args["models"], syn["sizes"], header, correction, rewrite)
        result["grid"] = {
            "how": "measured on the grid itself (bookkeeping_s modelled)",
            "extrapolated": ["bookkeeping_s"],
            "stages": n,
            "lock_bytes": m["lock_bytes"],
            "lock_entries": m["lock_entries"],
            "rewrite_s": m["rewrite_s"],
            "load_s": m["load_s"],
            "status_s": m["status_min_s"],
            "dvc_per_stage_s": m["dvc_per_stage_s"],
            "dvc_s": m["dvc_s"],
            "bookkeeping_s": book,
            "split_bookkeeping": split,
            "lock_bytes_by_family": {k: round(v * correction) for k, v in syn["by_family"].items()},
            "entrywise": {
                "rewrite_s": m["entrywise_rewrite_s"],
                "dvc_s": m["entrywise"]["dvc_s"],
                "dvc_per_stage_s": m["entrywise"]["dvc_per_stage_s"],
            },
        }
        return result

    g = synthesise(full, full["dest"] / "synth.lock", synth_max_bytes)
    part = "" if g["exact"] else f" (estimated; its first {g['written_bytes'] / 1e6:.2f} MB written)"
    log(f"  synthesised the grid's lock: {g['bytes'] / 1e6:.2f} MB{part}; timing one rewrite and load")
    gc = lock_costs(full["dest"] / "synth.lock", full["dest"], runs=2)
    w = g["written_bytes"] * correction
    rewrite = line(gc["rewrite_s"], w)  # the larger lock measured: the better estimate of the slope
    load = line(gc["load_s"], w)
    g_bytes = g["bytes"] * correction
    book_small = bookkeeping(syn["sizes"], header, correction, rewrite)
    floor = m["cli_floor_s"]
    fixed = max(m["dvc_s"] - floor - book_small, 0.0) / n
    book = bookkeeping(g["sizes"], header, correction, rewrite)
    dvc_s = floor + fixed * n_full + book
    split = split_bookkeeping(full["stages"], grid_args["models"], g["sizes"], header, correction, rewrite)
    status_s = floor + max(m["status_min_s"] - floor - m["load_s"], 0.0) * n_full / n + load(g_bytes)
    extrapolated = ["lock_bytes", "status_s", "dvc_per_stage_s", "dvc_s", "bookkeeping_s", "fixed_per_stage_s"]
    if not g["exact"]:
        extrapolated += ["rewrite_s", "load_s"]
    result["grid"] = {
        "how": "extrapolated from the reduced grid's dvc repro and a synthesised lock (stages exact)",
        "extrapolated": extrapolated,
        "stages": n_full,
        "lock_bytes": round(g_bytes),
        "lock_entries": g["entries"],
        "rewrite_s": rewrite(g_bytes),
        "load_s": load(g_bytes),
        "rewrite_measured_at": {
            "bytes": round(w),
            "rewrite_s": gc["rewrite_s"],
            "load_s": gc["load_s"],
            "rewrite_s_per_mb": gc["rewrite_s"] / (w / 1e6),
        },
        "status_s": status_s,
        "dvc_per_stage_s": dvc_s / n_full,
        "dvc_s": dvc_s,
        "bookkeeping_s": book,
        "fixed_per_stage_s": fixed,
        "split_bookkeeping": split,
        "lock_bytes_by_family": {k: round(v * correction) for k, v in g["by_family"].items()},
    }
    # Through runner/dvc_lock.py: the same fixed part per stage, and one warm entry-wise rewrite per stage
    # measured on the grid's synthesised lock (an upper bound: the lock is smaller before the last stage).
    ew_book = gc["entrywise_rewrite_s"] * n_full
    ew_dvc = floor + fixed * n_full + ew_book
    result["grid"]["entrywise"] = {
        "rewrite_s": gc["entrywise_rewrite_s"],
        "bookkeeping_s": ew_book,
        "dvc_s": ew_dvc,
        "dvc_per_stage_s": ew_dvc / n_full,
        "measured_reduced_dvc_per_stage_s": m["entrywise"]["dvc_per_stage_s"],
    }
    return result


def report(r: dict) -> None:
    m, g = r["measured"], r["grid"]
    print(f"{r['label']} ({r['rev']})")
    print(
        f"  measured, dvc repro of {m['stages']} stages (dvc stage list: {m['dvc_stage_list']}): "
        f"wall {m['repro_wall_s']:.1f} s, commands {m['commands_s']:.1f} s, DVC {m['dvc_s']:.1f} s = "
        f"{m['dvc_per_stage_s'] * 1000:.0f} ms/stage"
    )
    print(
        f"  measured, dvc.lock {m['lock_bytes'] / 1e6:.3f} MB, {m['lock_entries']} entries; one rewrite "
        f"{m['rewrite_s'] * 1000:.0f} ms, one load {m['load_s'] * 1000:.0f} ms; dvc status {m['status_min_s']:.2f} s "
        f"(median {m['status_median_s']:.2f} s, {'clean' if m['status_clean'] else 'NOT CLEAN'}); "
        f"synthesised lock {m['synth_lock_error']:+.1%} off the real one"
    )
    print(
        f"  grid [{g['how']}]: {g['stages']} stages, dvc.lock {g['lock_bytes'] / 1e6:.2f} MB, "
        f"{g['lock_entries']} entries, one rewrite {g['rewrite_s']:.2f} s, dvc status {g['status_s']:.1f} s, "
        f"DVC {g['dvc_per_stage_s']:.2f} s/stage = {g['dvc_s'] / 3600:.2f} h of repro, of which lock "
        f"bookkeeping {g['bookkeeping_s'] / 3600:.2f} h"
    )
    e, me = g["entrywise"], m["entrywise"]
    print(
        f"  through runner/dvc_lock.py (halludetect repro): measured DVC {me['dvc_per_stage_s'] * 1000:.0f} ms/stage "
        f"(lock {'identical' if me['lock_identical'] else 'DIFFERENT'}); one warm rewrite at the measured lock "
        f"{m['entrywise_rewrite_s'] * 1000:.0f} ms; at the grid one rewrite {e['rewrite_s'] * 1000:.0f} ms, "
        f"DVC {e['dvc_per_stage_s']:.2f} s/stage = {e['dvc_s'] / 60:.1f} min of repro"
    )
    for name, sp in g.get("split_bookkeeping", {}).items():
        print(
            f"  the same stages in {sp['files']} dvc.yaml files ({name.replace('_', ' x ')}), a lock each: lock "
            f"bookkeeping {sp['bookkeeping_s'] / 60:.1f} min (extrapolated)"
        )
    top = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in list(g["lock_bytes_by_family"].items())[:5])
    print(f"  grid's dvc.lock by stage family (MB): {top}")


def ratios(new: dict, old: dict) -> dict:
    """new / old for every figure both have (not the checks: synthesis errors, stage-list counts)."""
    skip = {"dvc_stage_list", "lock_stages", "synth_lock_error", "synth_estimate_error", "status_clean"}
    return {
        k: new[k] / old[k]
        for k in new
        if k not in skip and isinstance(new[k], int | float) and not isinstance(new[k], bool) and old.get(k)
    }


def main() -> None:
    global STATUS_RUNS
    from bench.common import emit

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rev", default=None, help="git revision of the design, or a checkout's directory (default: this tree)"
    )
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--models", default=str(len(PAPER_MODELS)), help="a count (the paper's first N) or names")
    ap.add_argument("--datasets", default=str(len(PAPER_DATASETS)), help="a count (the paper's first N) or names")
    ap.add_argument("--methods", default="all", help="all, or a comma list (each goes where the registry puts it)")
    ap.add_argument("--layers", type=int, default=PAPER_LAYERS, help="grid.layers = 0..N-1 (docstring)")
    ap.add_argument("--max-repro-stages", type=int, default=400)
    ap.add_argument(
        "--synth-max-mb", type=float, default=2.0, help="write (and time) at most this much synthesised lock"
    )
    ap.add_argument("--reduced-models", default="1")
    ap.add_argument("--reduced-datasets", default="2")
    ap.add_argument("--reduced-layers", type=int, default=2)
    ap.add_argument("--status-runs", type=int, default=STATUS_RUNS, help="runs of dvc status (and of the CLI floor)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary repositories (their path is printed)")
    ap.add_argument(
        "--measure-entrywise-grid",
        action="store_true",
        help="also run the whole grid through runner/dvc_lock.py (measured, not extrapolated) and time its status",
    )
    a = ap.parse_args()
    STATUS_RUNS = a.status_runs

    grid_args = {
        "models": pick(a.models, PAPER_MODELS),
        "datasets": pick(a.datasets, PAPER_DATASETS),
        "methods": a.methods,
        "layers": a.layers,
    }
    reduced_args = {
        "models": pick(a.reduced_models, grid_args["models"]),
        "datasets": pick(a.reduced_datasets, grid_args["datasets"]),
        "methods": a.methods,
        "layers": min(a.reduced_layers, a.layers),
    }
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-dag-"))
    try:
        results = {
            "design": design("design", a.rev, grid_args, reduced_args, a.max_repro_stages, a.synth_max_mb * 1e6, work)
        }
        if a.measure_entrywise_grid:
            log("== the whole grid through runner/dvc_lock.py")
            full = build(a.rev, grid_args, work / "entrywise-grid")
            measured = repro(full, entrywise=True)
            measured.update(status(full["repo"]))
            measured.update(lock_stats(full["repo"] / "dvc.lock"))
            measured["stages"] = len(full["stages"])
            measured.update(without_params(full["repo"], work))
            results["design"]["grid"]["entrywise"]["measured_grid"] = measured
            log(
                f"  measured: {measured['stages']} stages, wall {measured['repro_wall_s']:.1f} s, DVC "
                f"{measured['dvc_s']:.1f} s = {measured['dvc_per_stage_s'] * 1000:.0f} ms/stage, dvc.lock "
                f"{measured['lock_bytes'] / 1e6:.2f} MB, dvc status {measured['status_min_s']:.1f} s"
            )
            for label, what in (
                ("without_params", "without any stage's params (dvc.yaml and dvc.lock)"),
                ("digests", "with a params digest file per stage instead"),
            ):
                w = measured[label]
                if w is None:
                    log(f"  the same {what}: the design itself (its params stage)")
                    continue
                log(
                    f"  the same {what}: dvc status {w['status_min_s']:.1f} s "
                    f"({'clean' if w['status_clean'] else 'NOT CLEAN'}), dvc.lock {w['lock_bytes'] / 1e6:.2f} MB"
                )
        if not a.no_baseline:
            results["baseline"] = design(
                "baseline", a.baseline_rev, grid_args, reduced_args, a.max_repro_stages, a.synth_max_mb * 1e6, work
            )
    finally:
        if a.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for r in results.values():
        report(r)
    from ruamel.yaml import YAML

    clib = YAML(typ="safe").Parser.__name__ == "CParser"  # ruamel's C loader (DVC's safe loads use it)
    machine = {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "ruamel_clib": clib}
    out = {"grid": dict(grid_args), "machine": machine, **results}
    if "baseline" in results:
        new, old = results["design"], results["baseline"]
        out["ratio_grid"] = ratios(new["grid"], old["grid"])
        if new["measured"]["stages"] and old["measured"]["stages"]:
            out["ratio_measured"] = ratios(new["measured"], old["measured"])
        rg = out["ratio_grid"]
        print(
            f"design / baseline at the grid: stages x{rg.get('stages', float('nan')):.3f}, lock bytes "
            f"x{rg.get('lock_bytes', float('nan')):.4f}, DVC per stage x{rg.get('dvc_per_stage_s', float('nan')):.3f}, "
            f"DVC total x{rg.get('dvc_s', float('nan')):.4f}, dvc status x{rg.get('status_s', float('nan')):.3f}"
        )
    emit(out)


if __name__ == "__main__":
    main()
