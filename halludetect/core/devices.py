"""What a params `device` key (auto, cpu, cuda, cuda:N, mps) means on this machine.

config.py checks the spelling when params load; this checks, before any model or data is
loaded, that the machine has the device, naming the key when it has not.
"""

from __future__ import annotations

import os
import re
import sys

import torch

from halludetect.core.errors import UserError


class DeviceError(UserError, ValueError):
    """A device this machine does not have."""


# The spelling config.py accepts for a params `device` key (its DEVICE); the library's callers
# (`halludetect score --device`) pass strings that params never validated.
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


# Stages run side by side (`halludetect repro --jobs N`, runner/parallel_repro.py) take turns on the GPUs:
# the runner names a lock file here for its commands, and a stage process takes it before its first
# use of CUDA (`hold_gpu`), so two stages never load a model onto the GPUs at once while stages on
# the CPU run beside them. Set it yourself to share one lock between workspaces; empty turns it off.
GPU_LOCK_ENV = "HALLUDETECT_GPU_LOCK"
_gpu_lock: int | None = None  # this process's descriptor of the lock, held until it exits


def hold_gpu() -> None:
    """Take the GPU lock HALLUDETECT_GPU_LOCK names (nothing when it names none), waiting, with a line
    saying for whom, while another stage holds it. Once per process; the kernel releases it when the
    process ends, however it ends (fcntl.flock)."""
    global _gpu_lock
    path = os.environ.get(GPU_LOCK_ENV)
    if _gpu_lock is not None or not path:
        return
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        print(
            f"waiting for the GPU: {holder} is using it (stages side by side take turns)",
            file=sys.stderr,
            flush=True,
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"stage {os.environ.get('DVC_STAGE', '?')} (pid {os.getpid()})".encode(), 0)
    _gpu_lock = fd
    os.environ[GPU_LOCK_ENV] = ""  # this process's own workers (the dump's, generation's) share its turn


def resolve_device(device: str, key: str = "device") -> str:
    """'auto' -> cuda if available, else cpu; any other device is checked to exist here."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise DeviceError(f"{key}: {device!r} is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"{key}: '{device}' was asked for but CUDA is not available; use 'cpu' or 'auto'")
        index, n = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= n:
            raise DeviceError(
                f"{key}: '{device}' was asked for but this machine has {n} GPU(s) (cuda:0 to cuda:{n - 1})"
            )
    if device == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{key}: 'mps' was asked for but this machine has no Apple GPU; use 'cpu' or 'auto'")
    if device.startswith("cuda"):
        hold_gpu()  # the caller is about to place something there
    return device
