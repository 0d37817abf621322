"""The trivial compute of `bench.dag`: stands in for `python` on the PATH of `dvc repro`.

`bench.dag` copies this file to `<tmp>/shim/python` (executable, this interpreter in its shebang),
so every stage's command runs verbatim (`python -m stages.<name> ...`: the lock records the real
command text) and lands here. DVC names the stage in $DVC_STAGE; the map that `bench.dag`
precomputed from DVC's own view of the stage ($BENCH_DAG_MAP) lists its outputs: each file is
written with a few deterministic bytes, each directory with the files that other stages list
as dependencies inside it (a layer file in dump's directory, a digest in a code stage's).
Appends `<stage>\t<seconds>` to $BENCH_DAG_TIMES: this process's wall time from its start
(/proc, 10 ms ticks) to its end, interpreter start-up included. Standard library only: no torch,
no project import (run with -I -S).
"""

import json
import os
import sys
import time


def _started() -> float:
    """This process's start, seconds on CLOCK_BOOTTIME (what /proc's starttime counts)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def main() -> int:
    stage = os.environ["DVC_STAGE"].rsplit(":", 1)[-1]  # [dvc.yaml:]name
    with open(os.environ["BENCH_DAG_MAP"]) as f:
        outs = json.load(f)[stage]
    for out in outs:
        path = out["path"]
        if out["dir"]:
            for name in out["files"]:
                _write(os.path.join(path, name), f"{stage}\n{name}\n")
        else:
            _write(path, f"{stage}\n{path}\n")
    wall = time.clock_gettime(time.CLOCK_BOOTTIME) - _started()
    with open(os.environ["BENCH_DAG_TIMES"], "a") as f:
        f.write(f"{stage}\t{wall:.4f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
