"""Do the pinned numerics give the same bytes on other CPUs? A small world model trained under
CPU emulation (qemu-user as an Intel Haswell, an AMD EPYC Rome and an EPYC Milan) against this
machine, in each numerics mode, compared by a digest of its weights, with its training time.

    apt-get install qemu-user        # Debian's package; the emulation is slow (minutes)
    python -m bench.cross_cpu [--epochs 1] [--cpus Haswell,EPYC-Rome] [--modes reproducible,native]
    python -m bench.cross_cpu --cpus '' --modes reproducible,unshimmed,native --epochs 2 --repeat 3

What it shows (halludetect/core/numerics.py; docs/benchmarks.md has the digests by date): in
`reproducible` mode an AMD EPYC, natively or emulated, gives an emulated Intel Haswell's
weights, which an Intel machine gave too. `unshimmed` is reproducible mode as it was before
2026-11-25: the same environment pins, without the shim that answers MKL's vendor check, so
MKL ignores MKL_CBWR on an AMD CPU and the weights differ by vendor. `portable` (MKL's
COMPATIBLE branch) cannot be judged under emulation: its sqrt starts from the approximate
rsqrtps instruction, which qemu computes more exactly than any silicon. `native` shows what no
pinning gives. `--cpus ''` runs on this machine only (for timings: the training's wall-clock and
CPU seconds, without starting Python and building the tokenizer). The last line is one JSON object: digests and
seconds by CPU and mode, and which modes agree everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from halludetect.core import numerics

# A world small enough to train under emulation in minutes, as the world stage trains it
# (`import stages` pins the numerics first).
TRAIN = """
import hashlib, stages, time
from halludetect.world.kb import build_people, corpus
from halludetect.world.tiny_llama import train_model, train_tokenizer
docs = corpus(build_people(24, [1, 5], ["birth_city", "job"], seed=5), qa_fraction=0.5, seed=5)
tokenizer = train_tokenizer(docs, 320)
cpu = time.process_time()
model, report = train_model(docs, tokenizer, hidden_size=64, n_layers=2, n_heads=4,
                       intermediate_size=128, epochs=EPOCHS, batch_size=16, lr=3e-3, seed=0, log=lambda *a: None)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(v.contiguous().numpy().tobytes())
print(h.hexdigest()[:16], report.seconds, time.process_time() - cpu)
"""

# reproducible mode's environment pins without the MKL shim (numerics.py), on the world's threads
UNSHIMMED = {
    "HALLUDETECT_NUMERICS": "native",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "OMP_NUM_THREADS": str(numerics.WORLD_THREADS),
    "MKL_NUM_THREADS": str(numerics.WORLD_THREADS),
}


def digest(cpu: str | None, mode: str, epochs: int) -> tuple[str, float, float]:
    """The weights' digest, the training's wall-clock seconds and its CPU seconds (both threads;
    the steadier figure on a shared machine) of one run."""
    cmd = [sys.executable, "-c", TRAIN.replace("EPOCHS", str(epochs))]
    if cpu:
        cmd = ["qemu-x86_64", "-cpu", cpu, *cmd]
    env = {k: v for k, v in os.environ.items() if k not in numerics.PINNED}
    env |= UNSHIMMED if mode == "unshimmed" else {"HALLUDETECT_NUMERICS": mode}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    d, seconds, cpu_seconds = out.stdout.strip().splitlines()[-1].split()
    return d, float(seconds), float(cpu_seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cpus", default="Haswell,EPYC-Rome,EPYC-Milan", help="qemu CPU models to emulate ('' for this machine only)"
    )
    ap.add_argument("--modes", default="reproducible,portable,native", help="numerics modes, or 'unshimmed'")
    ap.add_argument("--epochs", type=int, default=1, help="epochs of the small world's training")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each (CPU, mode), alternating, for timings")
    args = ap.parse_args()
    cpus = [None, *filter(None, args.cpus.split(","))]
    if len(cpus) > 1 and shutil.which("qemu-x86_64") is None:
        sys.exit("error: qemu-x86_64 not found: apt-get install qemu-user (or --cpus '' for this machine only)")
    table: dict[str, dict[str, str]] = {}
    seconds: dict[str, dict[str, list[float]]] = {}
    cpu_seconds: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeat):
        for mode in args.modes.split(","):
            for cpu in cpus:
                d, s, c = digest(cpu, mode, args.epochs)
                name = cpu or "this machine"
                if table.setdefault(mode, {}).setdefault(name, d) != d:
                    sys.exit(f"error: {mode} on {name} gave {d}, then {table[mode][name]}: not reproducible")
                seconds.setdefault(mode, {}).setdefault(name, []).append(round(s, 2))
                cpu_seconds.setdefault(mode, {}).setdefault(name, []).append(round(c, 2))
                print(f"{mode:12s} {name:14s} {d} ({s:.1f} s training, {c:.1f} s CPU)", flush=True)
    print(
        json.dumps(
            {
                "bench": "cross_cpu",
                "epochs": args.epochs,
                "vendor": numerics.cpu_vendor(),
                "digests": table,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "same_everywhere": {m: len(set(v.values())) == 1 for m, v in table.items()},
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
