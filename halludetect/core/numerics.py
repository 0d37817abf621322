"""Reproducible CPU numerics: the same inputs give the same bytes on any machine of a kind, with
any core count.

A float result depends on the order of its operations, and on a CPU three things choose that
order behind our back:

- torch's kernel dispatch: vectorised loops for the widest instruction set the CPU has (AVX-512
  on one machine, AVX2 on another) split reductions differently;
- MKL, which does torch's matrix products: it picks a code branch by instruction set, and by
  *vendor* as well (on an AMD processor it refuses its Intel branches);
- the number of threads that split a reduction (torch's default: one per core).

Left alone, the demo world trains to other weights on 1 core than on 2, and on an AMD or an
older Intel processor than on this one, and every output after it differs: a fresh clone's
`dvc repro` never matches the committed dvc.lock, and colleagues sharing a remote miss its
cache from the first stage on. `pin()` fixes all three before torch loads:

- `ATEN_CPU_CAPABILITY=avx2`: torch's AVX2 kernels, which every x86-64 CPU of the last ten
  years runs (Intel since Haswell, AMD since Zen);
- MKL's conditional-numerical-reproducibility mode (`MKL_CBWR`) on a fixed branch;
- a fixed number of threads, whatever the machine: one per process, so that more cores are used
  by running processes side by side (parallel.py's data parallelism, training's worker pool),
  never by changing how one computation is split. The world model's training, whose matrices
  are the largest, runs on exactly `WORLD_THREADS` (`fixed_threads`).

Modes (`HALLUDETECT_NUMERICS`):

- `reproducible` (the default): MKL on its AVX2 branch. The same bytes on every Intel x86-64
  CPU since Haswell (AVX-512 or not) and any core count. On an AMD processor MKL ignores the
  request and uses its own branch: AMD machines get other bytes than Intel ones.
- `portable`: MKL on its COMPATIBLE (SSE2) branch, which MKL documents as identical on Intel and
  AMD processors. It makes the bytes independent of the instruction sets MKL would pick
  (tested), but not of the vendor: under CPU emulation an AMD EPYC-Rome still trained the world
  to other weights than an Intel machine (docs/reproducible-numbers.md), so something besides
  MKL chooses by vendor. Its matrix products are slower: the world model trains about 3.5 times
  as long.
- `native`: no pins; all cores and the CPU's own kernels. Fastest, byte-stable on one machine
  with one core count only.

CUDA kernels are not affected; GPU results have their own (non-)determinism.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

THREADS = 1  # intra-op threads of a stage process, on every machine
WORLD_THREADS = 2  # the world model's training: its matrix products are worth two threads
MKL_BRANCH = {"reproducible": "AVX2", "portable": "COMPATIBLE"}
PINNED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def mode() -> str:
    """`reproducible` (the default), `portable` or `native`: HALLUDETECT_NUMERICS."""
    value = os.environ.get("HALLUDETECT_NUMERICS", "reproducible")
    if value not in (*MKL_BRANCH, "native"):
        raise ValueError(f"HALLUDETECT_NUMERICS={value!r}: use 'reproducible' (the default), 'portable' or 'native'")
    return value


def pin(threads: int = THREADS) -> None:
    """Fix torch's kernels, MKL's branch and the thread count for this process and its children.

    Must run before torch is imported (the libraries read these variables once, when they
    load): `stages/__init__.py` and the tests' conftest call it first thing.
    """
    current = mode()
    if current == "native":
        return
    pins = {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": MKL_BRANCH[current],
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    if all(os.environ.get(k) == v for k, v in pins.items()):
        return  # pinned already (a stage module imported by a test that pinned first)
    if "torch" in sys.modules:
        raise RuntimeError("numerics.pin() must run before torch is imported (the kernel choices are made then)")
    os.environ.update(pins)


@contextlib.contextmanager
def fixed_threads(n: int) -> Iterator[None]:
    """Run the block on exactly `n` threads (in reproducible mode), then restore the count."""
    import torch

    if mode() == "native":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
