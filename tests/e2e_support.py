"""What the end-to-end modules share: a temporary copy of the repository with its own git and
DVC repo, a very small world's params, and helpers to run commands in it and read DVC's plan.

Two modules build such a repository, each its own (test_e2e.py: the whole DAG and the
recompute contract; test_e2e_sharing.py: the remote and the sweeps, on a smaller grid), so
that the two test workers of `make test` run them side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
        "methods": ["hami", "max"],
        "sp_methods": ["hami_sp"],
        "layers": [1, 2],
        "baselines": ["p_sem", "semantic_entropy", "logprob", "length"],
        "model_baselines": [],  # test_e2e.py adds the field's baselines; the sharing module needs none
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
    # as `halludetect repro` runs DVC (dvc.lock written entry by entry, core/dvc_lock.py), every write
    # checked against DVC's own dump of the whole lock: the DAG's real entries, byte for byte
    run([sys.executable, "-m", "halludetect.core.dvc_lock", "repro"], repo, HALLUDETECT_CHECK_LOCK="1")
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "results"], repo)
    return repo
