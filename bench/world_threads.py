"""How the world model's two training threads wait (halludetect/core/numerics.py, `SPIN_COUNT`):
the world stage's training, as a stage process trains it (`import stages` pins the numerics), with
GNU OpenMP's default wait (a thread spins 300,000 times before it sleeps) and with the spin count
`import stages` sets, alone and beside `--busy` processes that keep cores busy (as the tests' other
workers, or a second stage of `dvc queue start -j 2`, do). Runs alternate, and each setting keeps its
median over `--repeats`, not its best: beside busy processes how much the spinning costs varies from
run to run. Prints each setting's training and CPU seconds, the ratios, every run's seconds, and
whether every run gave the same weights.

    python -m bench.world_threads [--epochs 2] [--busy 2] [--repeats 4] [--world default|small]

`small` is the tests' world (tests/e2e_support.py SMALL); `default` the world of params.yaml. No
data is needed: the corpus is built from params, as the world stage builds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import emit

# One training in a fresh process: the spin count is read once, when OpenMP loads with torch.
TRAIN = """
import hashlib, json, resource, sys, time
import stages
from halludetect.config import WorldParams
from halludetect.world.kb import build_people, corpus
from halludetect.world.tiny_llama import train_model, train_tokenizer
p = WorldParams(**json.loads(sys.argv[1]))
docs = corpus(build_people(p.n_people, p.exposures, p.relations, p.seed), p.qa_fraction, p.seed)
tok = train_tokenizer(docs, p.vocab_size)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
model, _ = train_model(docs, tok, hidden_size=p.hidden_size, n_layers=p.n_layers, n_heads=p.n_heads,
                       intermediate_size=p.intermediate_size, epochs=p.epochs, batch_size=p.batch_size,
                       lr=p.lr, seed=p.seed, log=lambda *a: None)
wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(v.contiguous().numpy().tobytes())
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"train_s": wall, "cpu_s": cpu, "digest": h.hexdigest()}))
"""

BUSY = "while True: pass"


def world_params(which: str, epochs: int) -> dict:
    import yaml

    world = yaml.safe_load(Path("params.yaml").read_text())["world"]
    if which == "small":
        sys.path.insert(0, "tests")
        from e2e_support import SMALL

        world |= SMALL["world"]
    return world | {"epochs": epochs}


def train(world: dict, spin: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if spin is not None:  # else pin() sets its own
        env["GOMP_SPINCOUNT"] = spin
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, json.dumps(world)], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded runs")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--world", choices=["default", "small"], default="small")
    p.add_argument("--spins", default="", help="other GOMP_SPINCOUNT values to try, comma-separated")
    args = p.parse_args()
    world = world_params(args.world, args.epochs)
    # libgomp spins 300,000 times where it has no more threads than cores; None: what pin() sets
    settings = {"gomp_default": "300000", "pinned": None} | {f"spin_{s}": s for s in args.spins.split(",") if s}
    runs: dict[str, list[dict]] = {f"{s}_{load}": [] for s in settings for load in ("alone", "loaded")}
    for r in range(args.repeats):
        for load in ("alone", "loaded"):
            busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy if load == "loaded" else 0)]
            time.sleep(0.2 if busy else 0)
            try:
                for name in list(settings)[:: 1 if r % 2 == 0 else -1]:
                    runs[f"{name}_{load}"].append(train(world, settings[name]))
            finally:
                for b in busy:
                    b.kill()
                    b.wait()
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("train_s", "cpu_s")} for k, v in runs.items()}
    digests = {x["digest"] for v in runs.values() for x in v}
    emit(
        {
            "bench": "world_threads",
            "world": args.world,
            "epochs": args.epochs,
            "busy": args.busy,
            "repeats": args.repeats,
            **{k: {"train_s": round(v["train_s"], 2), "cpu_s": round(v["cpu_s"], 2)} for k, v in med.items()},
            "every_train_s": {k: [round(x["train_s"], 2) for x in v] for k, v in runs.items()},
            "alone_ratio_default_over_pinned": med["gomp_default_alone"]["train_s"] / med["pinned_alone"]["train_s"],
            "loaded_ratio_default_over_pinned": med["gomp_default_loaded"]["train_s"] / med["pinned_loaded"]["train_s"],
            "same_bytes": len(digests) == 1,
        }
    )


if __name__ == "__main__":
    main()
