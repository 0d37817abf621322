"""Do the pinned numerics give the same bytes on other CPUs? A small world model trained under
CPU emulation (qemu-user as an Intel Haswell, an AMD EPYC Rome and an EPYC Milan) against this
machine, in each numerics mode, compared by a digest of its weights.

    apt-get install qemu-user        # Debian's package; the emulation is slow (minutes)
    python -m bench.cross_cpu [--epochs 1] [--cpus Haswell,EPYC-Rome]

What it shows (halludetect/core/numerics.py; docs/benchmarks.md has the digests of
2026-11-22): in `reproducible` mode an emulated Intel Haswell gives this Intel machine's
weights and an emulated AMD EPYC-Rome other ones (MKL refuses its Intel branches on AMD). In
`portable` mode (MKL's COMPATIBLE branch, documented as identical across vendors) the EPYC-Rome
still differed: something besides MKL chooses by vendor. `native` shows what no pinning gives.
The last line is one JSON object: digests by CPU and mode, and which modes agree everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# A world small enough to train under emulation in minutes, as the world stage trains it
# (`import stages` pins the numerics first).
TRAIN = """
import hashlib, stages
from halludetect.world.kb import build_people, corpus
from halludetect.world.tiny_llama import train_model, train_tokenizer
docs = corpus(build_people(24, [1, 5], ["birth_city", "job"], seed=5), qa_fraction=0.5, seed=5)
model, _ = train_model(docs, train_tokenizer(docs, 320), hidden_size=64, n_layers=2, n_heads=4,
                       intermediate_size=128, epochs=EPOCHS, batch_size=16, lr=3e-3, seed=0, log=lambda *a: None)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(v.contiguous().numpy().tobytes())
print(h.hexdigest()[:16])
"""


def digest(cpu: str | None, mode: str, epochs: int) -> tuple[str, float]:
    cmd = [sys.executable, "-c", TRAIN.replace("EPOCHS", str(epochs))]
    if cpu:
        cmd = ["qemu-x86_64", "-cpu", cpu, *cmd]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env={**env, "HALLUDETECT_NUMERICS": mode}, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", default="Haswell,EPYC-Rome,EPYC-Milan", help="qemu CPU models to emulate")
    ap.add_argument("--modes", default="reproducible,portable,native")
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    if shutil.which("qemu-x86_64") is None:
        sys.exit("error: qemu-x86_64 not found: apt-get install qemu-user")
    cpus = [None, *args.cpus.split(",")]
    table: dict[str, dict[str, str]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for mode in args.modes.split(","):
        for cpu in cpus:
            d, s = digest(cpu, mode, args.epochs)
            name = cpu or "this machine"
            table.setdefault(mode, {})[name] = d
            seconds.setdefault(mode, {})[name] = round(s, 1)
            print(f"{mode:12s} {name:14s} {d} ({s:.0f} s)", flush=True)
    print(
        json.dumps(
            {
                "bench": "cross_cpu",
                "epochs": args.epochs,
                "digests": table,
                "seconds": seconds,
                "same_everywhere": {m: len(set(v.values())) == 1 for m, v in table.items()},
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
