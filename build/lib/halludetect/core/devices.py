"""What a params `device` key (auto, cpu, cuda, cuda:N, mps) means on this machine.

config.py checks the spelling when params load; this checks, before any model or data is
loaded, that the machine has the device, naming the key when it has not.
"""

from __future__ import annotations

import re

import torch

from halludetect.core.errors import UserError


class DeviceError(UserError, ValueError):
    """A device this machine does not have."""


# The spelling config.py accepts for a params `device` key (its DEVICE); the library's callers
# (`halludetect score --device`) pass strings that params never validated.
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def resolve_device(device: str, key: str = "device") -> str:
    """'auto' -> cuda if available, else cpu; any other device is checked to exist here."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise DeviceError(f"{key}: {device!r} is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
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
    return device
