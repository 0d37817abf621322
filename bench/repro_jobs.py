"""`halludetect repro --jobs N` against DVC's one stage at a time (runner/parallel_repro.py), on the same
work: the stages named by `--stages` (fnmatch patterns over the built world's stage names) and
whatever their outputs change downstream.

Each run starts from the same state: a copy of this repository (its data and DVC cache hard-linked,
so a copy costs seconds and no disk; stages write new files, never into the linked ones) whose
`dvc.lock` has lost the chosen stages' entries, so that DVC runs them again, and then whatever reads
a file they rewrite with other bytes (their timings) runs too. Runs alternate (serial, parallel,
serial, ...), and the copies are removed afterwards: the repository itself is not touched. Prints the
stages each run ran, the wall times, their ratio, and whether every run recorded the same hashes for
every output under data/ (the metrics files mix figures with wall times).

    python -m bench.repro_jobs [--stages 'train*@world-world_lookalike-*'] [--jobs 2] [--repeats 1]

Needs the built demo world (`make repro`). The default is the look-alike dataset's training stages
(12, about 2.5 minutes of a serial run on 2 cores) and what follows them.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import emit, need

# the science: every output under data/ (questions, generations, states, labels, detectors, scores,
# bundles, evidence) but the clustering's timings; the metrics files mix figures with wall times
SCIENCE = re.compile(r"^data/(?!labels/.*/cluster_timings)")


def copy_repo(dst: Path) -> None:
    """This repository at dst: data, the DVC cache and git's objects hard-linked, the rest copied
    (.venv left out: the commands use this interpreter's environment through PATH)."""
    dst.mkdir()
    for entry in Path(".").iterdir():
        if entry.name == ".venv" or entry.name.startswith("bench-repro-jobs-"):
            continue
        if entry.name in ("data", "metrics", ".dvc", ".git"):
            subprocess.run(["cp", "-al", str(entry), str(dst / entry.name)], check=True)
        elif entry.is_dir():
            shutil.copytree(entry, dst / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, dst / entry.name)
    shutil.rmtree(dst / ".dvc/tmp", ignore_errors=True)  # run history, locks, the rwlock of this repository
    shutil.rmtree(dst / ".dvc/cache/runs", ignore_errors=True)  # the run cache would restore the stages, not run them


def forget(repo: Path, patterns: list[str]) -> list[str]:
    """Remove the lock entries of the stages matching `patterns`: DVC will run them again."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    chosen = [s for s in lock["stages"] if any(fnmatch.fnmatch(s, p) for p in patterns)]
    for s in chosen:
        del lock["stages"][s]
    from halludetect.runner.dvc_internals import get

    _dump = get("yaml._dump")  # DVC's own dumper: the file is a lock DVC wrote

    with open(repo / "dvc.lock", "w") as f:
        _dump(lock, f)
    return chosen


def outs(repo: Path) -> dict[str, str]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o.get("md5") for st in lock["stages"].values() for o in st.get("outs", [])}


def one_run(root: Path, name: str, patterns: list[str], jobs: int) -> dict:
    repo = root / name
    copy_repo(repo)
    chosen = forget(repo, patterns)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("HALLUDETECT_REPRO_JOBS", None)
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "halludetect.cli", "repro", "--jobs", str(jobs)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"error: the {name} run failed:\n{res.stdout[-3000:]}{res.stderr[-2000:]}")
    ran = [line.split("'")[1] for line in res.stdout.splitlines() if line.startswith("Running stage '")]
    result = {"jobs": jobs, "wall_s": wall, "stages_ran": len(ran), "forgotten": len(chosen), "outs": outs(repo)}
    shutil.rmtree(repo)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", nargs="+", default=["train*@world-world_lookalike-*"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    need(Path("dvc.lock"), Path("metrics/summary.json"))  # the whole DAG built: only the chosen stages re-run
    runs = {"serial": [], "parallel": []}
    with tempfile.TemporaryDirectory(prefix="bench-repro-jobs-", dir=".") as tmp:
        for i in range(args.repeats):
            runs["serial"].append(one_run(Path(tmp), f"serial{i}", args.stages, 1))
            runs["parallel"].append(one_run(Path(tmp), f"parallel{i}", args.stages, args.jobs))

    def science(r: dict) -> dict:
        return {p: m for p, m in r["outs"].items() if SCIENCE.match(p)}

    ref = science(runs["serial"][0])
    same = all(science(r) == ref for rs in runs.values() for r in rs)
    serial, parallel = (min(r["wall_s"] for r in runs[k]) for k in ("serial", "parallel"))
    emit(
        {
            "bench": "repro_jobs",
            "stages": args.stages,
            "jobs": args.jobs,
            "cpus": len(os.sched_getaffinity(0)),
            "forgotten_stages": runs["serial"][0]["forgotten"],
            "stages_ran": {k: [r["stages_ran"] for r in v] for k, v in runs.items()},
            "serial_s": [round(r["wall_s"], 1) for r in runs["serial"]],
            "parallel_s": [round(r["wall_s"], 1) for r in runs["parallel"]],
            "ratio_serial_over_parallel": round(serial / parallel, 3),
            "same_data_outputs": same,  # every run, every output under data/ but cluster timings
        }
    )


if __name__ == "__main__":
    main()
