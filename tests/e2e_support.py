"""What the end-to-end modules share: the small world's whole DAG, built once per test session in a
temporary copy of the repository with its own git and DVC repo, and helpers to run commands in it
and read DVC's plan.

One DAG serves both end-to-end modules (test_e2e.py: the whole DAG and the recompute contract;
test_e2e_sharing.py: the remote, the sweeps and sampling through a serving engine). Its build is
most of their time, so it starts in the background as soon as a test session has collected an
end-to-end test (`start_shared_build`, called by tests/conftest.py), while the unit modules run
beside it; each module then works on its own copy (`shared_dag`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COPY = [
    "halludetect",
    "stages",
    "dvc.yaml",
    "params.yaml",
    "pyproject.toml",
    "inputs/README.md",
    ".dvc/config",
    ".dvc/plots",
    ".dvcignore",
    ".gitignore",
]

SMALL = {
    "world": {
        "n_people": 60,
        "exposures": [0, 30],
        "epochs": 10,
        "hidden_size": 64,
        "intermediate_size": 128,
        "n_heads": 4,
        "n_layers": 2,
        "vocab_size": 512,
    },
    "generate": {"n_samples": 3, "max_new_tokens": 16},
    "train": {"epochs": 8, "seeds": [0]},
    "evaluate": {"bootstrap": 20, "throughput_repeats": 1},
    "analyze": {"steps": 50},
    # one of each kind of stage; every method is covered by the unit tests; one dataset, so the
    # transfer stage is its diagonal alone (transfer@world-world-world)
    "grid": {
        "datasets": ["world"],
        "detectors": ["hami", "max", "hami_sp"],  # FIELD adds the field's methods and a score of each kind
        "layers": [1, 2],
        "transfer": ["world"],  # the diagonal alone: transfer@world-world-world
    },
    "detectors": {m: {"dim": 16} for m in ("hami", "hami_sp", "max")},
}


def run(cmd: list[str], cwd: Path, check: bool = True, **extra_env: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(cwd), **extra_env}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bindir}:{env['PATH']}"  # `python` (dvc.yaml) and `halludetect` (README) are this venv's
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and res.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def stage_cmd(
    stage: str,
    out: Path,
    questions: str | Path = "data/questions/world.parquet",
    generations: Path | None = None,
    params: Path | None = None,
) -> list[str]:
    """The world's generate or dump command as dvc.yaml writes it, its outputs under `out` (the dump
    reads `generations`, by default what generate wrote there), with other questions or params."""
    args = ["--model", "world", "--questions", str(questions), "--manifest", "data/models/world.json"]
    if stage == "generate":
        args += [
            "--progress",
            str(out / "progress"),
            "--out",
            str(out / "gen.parquet"),
            "--metrics",
            str(out / "gen.json"),
        ]
    else:
        args += ["--generations", str(generations or out / "gen.parquet"), "--out", str(out / "acts")]
    return [sys.executable, "-m", f"stages.{stage}", *args, *(["--params", str(params)] if params else [])]


def set_params(repo: Path, updates: dict) -> None:
    path = repo / "params.yaml"
    data = yaml.safe_load(path.read_text())

    def merge(dst, src):
        for k, v in src.items():
            if isinstance(v, dict):
                merge(dst.setdefault(k, {}), v)
            else:
                dst[k] = v

    merge(data, updates)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def changed(repo: Path) -> set[str]:
    """Stages `dvc status` marks as changed (their own deps or params changed)."""
    return set(json.loads(run([sys.executable, "-m", "dvc", "status", "--json"], repo) or "{}"))


def stale_after_params(repo: Path) -> set[str]:
    """The stages a params.yaml edit makes stale: `dvc status` names only the params stage (and the
    code stage, for `detectors`), which write one file per stage; once they have run (a second or
    two), what DVC names is the stages whose params file or code digest changed. (Before, DVC names
    those two alone: test_training_param_reruns_only_training_and_after checks it.)"""
    run([sys.executable, "-m", "dvc", "repro", "params"], repo)
    return changed(repo)


def ran(log: str) -> set[str]:
    return {line.split("'")[1] for line in log.splitlines() if line.startswith("Running stage '")}


def build_repo(repo: Path, *updates: dict, prepare=None) -> Path:
    """Copy the pipeline into `repo`, apply SMALL and then `updates` to its params, `prepare(repo)`
    (adding files, say), commit, run the whole DAG and commit its results."""
    for rel in COPY:
        src = ROOT / rel
        if src.exists():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, repo / rel) if src.is_dir() else shutil.copy(src, repo / rel)
    for pycache in repo.rglob("__pycache__"):
        shutil.rmtree(pycache)
    for params in (SMALL, *updates):
        set_params(repo, params)
    if prepare is not None:
        prepare(repo)
    run(["git", "init", "-q"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"], repo)
    # as `make repro` runs DVC (dvc.lock written entry by entry, runner/dvc_lock.py; two stages at a
    # time, runner/parallel_repro.py), every write checked against DVC's own dump of the whole lock:
    # the DAG's real entries, byte for byte
    run(
        [sys.executable, "-m", "halludetect.runner.dvc_lock", "repro"],
        repo,
        HALLUDETECT_CHECK_LOCK="1",
        HALLUDETECT_REPRO_JOBS="2",
    )
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "results"], repo)
    return repo


# ------------------------------------------------------------------ the DAG both modules share
# The paper's two kinds of detector, two of the field's baselines that take paths of their own
# (EigenScore: a question's answers together, nothing fitted; the SE probe: fitted in closed form
# to the semantic entropy, which the route stage hands it), and the plugin of docs/detectors.md "Your own detector",
# registered by an entry point of a package in the repository's root.
# Then one score with nothing to train of each kind (stages/train_score.py): of the clustering, of the answer
# alone, of the model asked again; each is two stages, so the other four are left to the unit tests and
# the world's `make repro`.
LAYERS = (1, 2)
METHODS = ("hami", "max", "eigenscore", "wide_max")
SP_METHODS = ("hami_sp", "sep_slt")
SCORES = ("p_sem", "logprob", "p_true")
FIELD = {
    "grid": {"detectors": [*METHODS, *SP_METHODS, *SCORES]},
    "detectors": {"wide_max": {"dim": 16}},
}


def add_plugin(repo: Path) -> None:
    """The docs' plugin as an installed distribution in the repository's root (on the stages' path),
    then `make deps`: its file is code of the stages that run methods/."""
    from support import doc_blocks

    (repo / "my_detectors").mkdir()
    (repo / "my_detectors" / "__init__.py").write_text("")
    (repo / "my_detectors" / "wide.py").write_text(doc_blocks("docs/detectors.md", "Your own detector")["python"][0])
    dist = repo / "my_detectors-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-detectors\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[halludetect.detectors]\nwide_max = my_detectors.wide:make\n")
    run([sys.executable, "-m", "halludetect.core.code_deps", "--write"], repo)


SHARED = "e2e-dag"  # under the session's temporary root, which every xdist worker of the session shares
BUILD_S = 1800  # how long a module waits for the build (about 2 minutes alone, 3 beside two workers)


def session_root(basetemp: Path) -> Path:
    """The session's temporary root: xdist gives each worker a folder of it as its basetemp."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


def start_shared_build(basetemp: Path) -> subprocess.Popen | None:
    """Start building the shared DAG in a process of its own, unless a worker of this session already
    did: the first to create the claim file builds. Its environment is this process's before any test
    ran (tests change os.environ). Returns the build process of this worker, to wait for at its end."""
    root = session_root(basetemp) / SHARED
    root.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(root / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    with open(root / "build.log", "w") as log:  # the child writes to its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, __file__, str(root)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def shared_dag(basetemp: Path, into: Path) -> Path:
    """A copy of the shared DAG (built and committed, results included) in `into`/repo, once the build
    has finished; the build's error if it failed."""
    root = session_root(basetemp) / SHARED
    done, deadline = root / "done", time.monotonic() + BUILD_S
    if not (root / "claim").exists():  # conftest's hook did not start it (a session run without it)
        start_shared_build(basetemp)
    while not done.exists():
        assert time.monotonic() < deadline, f"the shared DAG was not built in {BUILD_S} s: {root / 'build.log'}"
        time.sleep(0.5)
    if done.read_text() != "ok":
        raise AssertionError(f"the shared DAG's build failed ({root / 'build.log'}):\n{done.read_text()[-6000:]}")
    repo = into / "repo"
    shutil.copytree(root / "repo", repo, symlinks=True)
    return repo


def _build(root: Path) -> None:
    """The build process: the DAG into root/repo, then root/done ("ok" or the error), atomically."""
    status = "ok"
    try:
        (root / "repo").mkdir()
        build_repo(root / "repo", FIELD, prepare=add_plugin)
    except BaseException as e:  # the modules waiting for it raise it
        status = f"{type(e).__name__}: {e}"
    (root / "done.tmp").write_text(status)
    (root / "done.tmp").rename(root / "done")


if __name__ == "__main__":
    _build(Path(sys.argv[1]))
