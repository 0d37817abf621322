"""Reproducible CPU numerics: the same inputs give the same bytes on any x86-64 machine, Intel or
AMD, with any core count.

A float result depends on the order of its operations, and on a CPU three things choose that
order behind our back:

- torch's kernel dispatch: vectorised loops for the widest instruction set the CPU has (AVX-512
  on one machine, AVX2 on another) split reductions differently;
- MKL, which does torch's matrix products and, through its vector maths library (VML), torch's
  elementwise sqrt, exp, log, tanh, sin, cos and a few more: it picks a code branch by
  instruction set, and by *vendor* as well. On a CPU whose CPUID does not say GenuineIntel it
  ignores `MKL_CBWR` and takes a branch of its own, whose sgemm sums in another order and whose
  sqrt is not even correctly rounded (about 1 element in 6 off by one ulp on an AMD EPYC);
- the number of threads that split a reduction (torch's default: one per core).

Left alone, the demo world trains to other weights on 1 core than on 2, and on an AMD or an
older Intel processor than on this one, and every output after it differs: a fresh clone's
`dvc repro` never matches the committed dvc.lock, and colleagues sharing a remote miss its
cache from the first stage on. `pin()` fixes all three before torch loads:

- `ATEN_CPU_CAPABILITY=avx2`: torch's AVX2 kernels, which every x86-64 CPU of the last ten
  years runs (Intel since Haswell, AMD since Zen);
- MKL's conditional-numerical-reproducibility mode (`MKL_CBWR`) on a fixed branch, and MKL's
  vendor check answered "Intel" on every CPU, so that the branch asked for is the branch taken
  (`mkl_intel_shim`: a one-line C function, built once with the system's C compiler and loaded
  before torch; MKL's own `MKL_DEBUG_CPU_TYPE` override is gone from the MKL torch ships, and
  `MKL_ENABLE_INSTRUCTIONS` only narrows the vendor's own branch);
- a fixed number of threads, whatever the machine: one per process, so that more cores are used
  by running processes side by side (parallel.py's data parallelism), never by changing how
  one computation is split. The world model's training, whose matrices are the largest, runs
  on exactly `WORLD_THREADS` (`fixed_threads`).

Modes (`HALLUDETECT_NUMERICS`):

- `reproducible` (the default): MKL on its AVX2 branch. The same bytes on every x86-64 CPU with
  AVX2, Intel or AMD, AVX-512 or not, and any core count (docs/reproducible-numbers.md: a small
  world trained on an AMD EPYC gives an emulated Intel Haswell's weights, which an Intel
  machine gave too).
- `portable`: MKL on its COMPATIBLE (SSE2) branch. It makes the bytes independent of the
  instruction sets MKL would pick (tested), but not of the processor: that branch's sqrt starts
  from the approximate reciprocal square root instruction (rsqrtps), whose bits the x86
  manuals bound but do not fix, and which differ between an AMD EPYC and qemu's emulation (so
  presumably between vendors). Its matrix products are slower: the world model trains about
  3.5 times as long.
- `native`: no pins; all cores and the CPU's own kernels. Fastest, byte-stable on one machine
  with one core count only.

CUDA kernels are not affected; GPU results have their own (non-)determinism.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

THREADS = 1  # intra-op threads of a stage process, on every machine
WORLD_THREADS = 2  # the world model's training: its matrix products are worth two threads
MKL_BRANCH = {"reproducible": "AVX2", "portable": "COMPATIBLE"}
# How long an OpenMP thread spins before it sleeps (GNU OpenMP, which torch's wheels use). libgomp's
# default, 300,000 spins where a process has no more threads than the machine has cores, assumes the
# cores are its own; the world model's two threads beside other busy processes (the tests' workers, a
# second queued stage) then spin through most of their time slices: 3 epochs of the tests' world took
# 26 s instead of 3 beside two busy processes, and 8 to 10 s with this count, which costs nothing alone
# (python -m bench.world_threads). Only when to sleep changes, never the arithmetic: the same bytes.
SPIN_COUNT = "3000"
PINNED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# mkl_serv_cbwr_get(MKL_CBWR_BRANCH)'s answer when MKL runs the branch asked for (mkl_cbwr.h).
MKL_BRANCH_CODE = {"COMPATIBLE": 3, "AVX2": 10}

# MKL asks this function (exported by libtorch_cpu.so, reached through its PLT) whether the CPU is
# an Intel one, and on "no" ignores MKL_CBWR. A definition loaded into the global symbol scope
# before torch takes precedence over MKL's own (the dynamic linker searches that scope first).
# Answering "yes" on an AMD CPU is safe for the branches pinned here: MKL still checks that the
# CPU has the instructions of the branch (AVX2, or SSE2 for COMPATIBLE) before taking it.
MKL_INTEL_SHIM = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
_shim_loaded = False


def mode() -> str:
    """`reproducible` (the default), `portable` or `native`: HALLUDETECT_NUMERICS."""
    value = os.environ.get("HALLUDETECT_NUMERICS", "reproducible")
    if value not in (*MKL_BRANCH, "native"):
        raise ValueError(f"HALLUDETECT_NUMERICS={value!r}: use 'reproducible' (the default), 'portable' or 'native'")
    return value


def pin(threads: int = THREADS) -> None:
    """Fix torch's kernels, MKL's branch and the thread count for this process and its children.

    Must run before torch is imported (the libraries read these variables once, when they
    load): `stages/__init__.py` and the tests' conftest call it first thing. A child process
    inherits the variables but not the MKL shim: a Python child that computes calls pin() too
    (stage processes do, through `import stages`; forked workers inherit the loaded shim).
    """
    global _shim_loaded
    current = mode()
    if current == "native":
        return
    pins = {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": MKL_BRANCH[current],
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    if all(os.environ.get(k) == v for k, v in pins.items()) and (_shim_loaded or "torch" in sys.modules):
        return  # pinned already (a stage module imported by a test that pinned first)
    if "torch" in sys.modules:
        raise RuntimeError("numerics.pin() must run before torch is imported (the kernel choices are made then)")
    os.environ.update(pins)
    if "OMP_WAIT_POLICY" not in os.environ:  # a user's own wait policy or spin count stands
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    shim = mkl_intel_shim()
    if shim is not None:
        ctypes.CDLL(str(shim), mode=os.RTLD_GLOBAL)
        _shim_loaded = True


def cpu_vendor() -> str:
    """The vendor string of /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...); '' where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")


def mkl_intel_shim(cache: Path | None = None, vendor: str | None = None) -> Path | None:
    """The shared object that answers MKL's vendor check with "Intel", built on first use into
    `cache` (default: $XDG_CACHE_HOME/halludetect, else ~/.cache/halludetect) with the C compiler
    `$CC` (default `cc`); None off x86-64 Linux (no MKL in torch's wheels there).

    It is built and loaded on Intel CPUs too, where it answers what MKL would (so that an
    emulated CPU, whose vendor /proc/cpuinfo does not show, is covered as well); only there is
    failing to build it harmless. On another vendor that is an error: without the shim MKL
    ignores MKL_CBWR and the bytes differ from an Intel machine's.
    """
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "halludetect"
    target = cache / f"mkl_intel_shim-{hashlib.sha256(MKL_INTEL_SHIM.encode()).hexdigest()[:12]}.so"
    if target.exists():
        return target
    try:
        _build_shim(shlex.split(os.environ.get("CC") or "cc"), target)
    except RuntimeError as e:
        vendor = cpu_vendor() if vendor is None else vendor
        if vendor in ("GenuineIntel", ""):
            return None  # MKL's own check says Intel here; the shim would change nothing
        raise RuntimeError(
            f"HALLUDETECT_NUMERICS={mode()} on this {vendor} CPU needs a one-line C shim that makes MKL take the "
            f"branch MKL_CBWR asks for (halludetect/core/numerics.py), and {e}: install a C compiler "
            f"(apt-get install gcc, or set CC), or run with HALLUDETECT_NUMERICS=native (this machine's own "
            f"numbers, which match no other machine's)"
        ) from None
    return target


def _build_shim(cc: list[str], target: Path) -> None:
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler was found to build it (CC={' '.join(cc) or '(empty)'})")
    source = target.with_suffix(f".{os.getpid()}.c")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            source.write_text(MKL_INTEL_SHIM)
        except OSError as e:
            raise RuntimeError(
                f"it cannot be written into {target.parent} ({e.strerror}; or set XDG_CACHE_HOME)"
            ) from e
        build = subprocess.run(
            [*cc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source)], capture_output=True, text=True
        )
        if build.returncode != 0:
            raise RuntimeError(f"building it with {' '.join(cc)} failed ({build.stderr.strip()})")
        os.replace(partial, target)  # processes starting together each build, one file results
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)


def mkl_branch() -> int:
    """The branch MKL runs (mkl_serv_cbwr_get(MKL_CBWR_BRANCH)), to compare with MKL_BRANCH_CODE:
    2 (AUTO) where MKL ignored MKL_CBWR. Loads torch."""
    import torch

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    return lib.mkl_serv_cbwr_get(1)


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
