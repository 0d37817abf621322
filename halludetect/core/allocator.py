"""Keep freed memory in the process instead of handing it back to the kernel after every free.

glibc's malloc serves a request of 128 KiB and more with its own mmap (and raises that threshold
as it goes, up to 32 MiB), and returns the top of the heap to the kernel whenever more than twice
the threshold is free there. A detector's training allocates and frees tensors of a few MiB
thousands of times per epoch (a batch's activations, the gradient-ratio trace's float64 blocks), so
each allocation is fresh pages the kernel must zero and map: on the world's `max` layer 4 (3 seeds,
100 epochs) 12 of the 42 s were system time. With the mmap threshold fixed at its ceiling and no
trimming below 2 GiB, freed blocks are reused: 28 s, 0.7 s of it system time, the same bytes (an allocator
changes where numbers live, never their values). Measured 2026-11-27 on the 2-core AMD EPYC:
`python -m stages.train --method max ... --layers 4` in the built world, with and without
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 (what `keep_freed_memory` sets).

The cost: a process keeps the heap of its peak (which it reached anyway); blocks above 32 MiB
still come from mmap and go back when freed. Other allocators (musl, macOS) are left as they are,
and HALLUDETECT_KEEP_FREED_MEMORY=0 leaves glibc's too (`python -m bench.allocator` compares both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # malloc.h: free memory at the heap's top kept before it is returned
M_MMAP_THRESHOLD = -3  # malloc.h: requests of at least this size get their own mmap
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB of free memory at the top before any is returned

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (module docstring) once per process; False where malloc is not glibc's
    or HALLUDETECT_KEEP_FREED_MEMORY is 0."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("HALLUDETECT_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
