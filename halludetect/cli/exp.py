"""`halludetect exp run`: `dvc exp run` (every argument passed on) with params.yaml and each `-S`
value checked first, and the progress line of `halludetect repro`.

    halludetect exp run -S detectors.max.dim=128            # one experiment in the workspace
    halludetect exp run -j 2 -S detectors.max.dim=128       # its independent stages side by side
    halludetect exp run --queue -S 'detectors.max.dim=8,32' # checked, then queued as DVC queues them
    halludetect exp run --run-all                           # the queue, a progress line per stage

Why a wrapper rather than a check DVC runs: DVC expands dvc.yaml from params.yaml before any stage
of an experiment runs, so no stage, hook or derived file of ours can speak first when a value is one
dvc.yaml cannot iterate; DVC then says "'Value' object is not iterable" and nothing else. This
command makes each run's params.yaml as `exp run` will make it (halludetect/experiments/overrides.py)
and prints the check's one line per problem, naming the key and the `-S` it came from, before DVC
starts (exit status 2, nothing queued or run). A workspace run then gets `halludetect repro`'s plan
and progress (`-j N`: N stages at once, as there; DVC's own `exp run -j` counts queue workers, which
only `--run-all` uses, and is passed on there). Plain `dvc exp run` works as ever.
"""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    """`halludetect exp ARGS`; returns the exit status."""
    if argv[:1] != ["run"]:
        sub = argv[0] if argv else ""
        if sub in ("-h", "--help", ""):
            print(__doc__.split("\n\n")[0], file=sys.stderr if not sub else sys.stdout)
            return 0 if sub else 2
        print(f"error: halludetect exp runs `dvc exp run` only: use `dvc exp {sub}` as it is", file=sys.stderr)
        return 2
    args = argv[1:]
    from halludetect.runner import repro

    if {"-h", "--help"} & set(args):
        return repro.main(args, command=("exp", "run"))
    from halludetect.runner.dvc_internals import parse_args

    try:
        dvc_args, _ = repro.split_jobs(args)  # DVC's parser reads -j as an int; ours may be 'auto'
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        ns = parse_args(["exp", "run", *dvc_args])
    except (Exception, SystemExit):  # noqa: BLE001 - DVC's own run says what is wrong with its arguments
        return subprocess.run(repro.dvc("exp", "run", *args)).returncode
    from halludetect.experiments.overrides import problems

    if found := problems(ns.set_param):
        for line in found:
            print(f"error: {line}", file=sys.stderr)
        print("nothing was run or queued: fix the value (or params.yaml) and run the command again", file=sys.stderr)
        return 2
    if ns.queue:
        return subprocess.run(repro.dvc("exp", "run", *args)).returncode
    workspace = not (ns.run_all or ns.tmp_dir)
    return repro.main(args, command=("exp", "run"), set_params=ns.set_param, jobs_are_ours=workspace)
