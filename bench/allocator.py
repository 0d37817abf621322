"""What keeping freed memory buys (halludetect/core/allocator.py): one layer of one method trained by
the train stage's own command, as a stage process with glibc's allocator settings of `import stages`
and with HALLUDETECT_KEEP_FREED_MEMORY=0 (glibc's defaults), alternating, best of each. Prints wall,
user and system seconds of each, their ratios, and whether the two wrote the same bytes.

    python -m bench.allocator [--method max] [--layer 4] [--repeats 2]

Needs the demo world's activations and labels (`make bench` builds them).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit, need

CELL = Path("data/activations/world/world")
JUDGMENTS = Path("data/labels/world/world/judgments.parquet")


def train(method: str, layer: int, out: Path, keep: bool) -> dict:
    """One run of the stage's command into `out`: its wall, user and system seconds."""
    cmd = [sys.executable, "-m", "stages.train", "--method", method, "--activations", str(CELL),
           "--judgments", str(JUDGMENTS), "--out", str(out / "d"), "--scores", str(out / "s"),
           "--metrics", str(out / "m"), "--layers", str(layer)]  # fmt: skip
    env = {**os.environ, "HALLUDETECT_KEEP_FREED_MEMORY": "1" if keep else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime}


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        filecmp.cmp(a / f, b / f, shallow=False) for f in files
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="max")
    p.add_argument("--layer", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    need(CELL, JUDGMENTS)
    runs: dict[str, list[dict]] = {"kept": [], "glibc_default": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name in ("glibc_default", "kept") if r % 2 else ("kept", "glibc_default"):
                out = Path(tmp) / f"{name}_{r}"
                runs[name].append(train(args.method, args.layer, out, keep=name == "kept"))
        same = all(same_tree(Path(tmp) / f"kept_{r}", Path(tmp) / f"glibc_default_{r}") for r in range(args.repeats))
    best = {name: min(rs, key=lambda x: x["wall_s"]) for name, rs in runs.items()}
    emit(
        {
            "bench": "allocator",
            "method": args.method,
            "layer": args.layer,
            "repeats": args.repeats,
            "kept": best["kept"],
            "glibc_default": best["glibc_default"],
            "wall_ratio_default_over_kept": best["glibc_default"]["wall_s"] / best["kept"]["wall_s"],
            "same_bytes": same,
        }
    )


if __name__ == "__main__":
    main()
