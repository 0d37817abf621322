"""Devices (halludetect/core/devices.py), the hostile case: a device this machine lacks is named with its
params key before anything loads, and `auto` falls back to the CPU."""

import pytest


@pytest.mark.hostile
def test_a_device_this_machine_lacks_is_named_with_its_key_before_anything_loads(monkeypatch):
    import torch

    from halludetect.core.devices import DeviceError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        DeviceError,
        match=r"^train.device: 'cuda:1' was asked for but CUDA is not available; use "
        r"'cpu' or 'auto'$",
    ):
        resolve_device("cuda:1", "train.device")
    assert resolve_device("auto", "train.device") == "cpu"  # auto is a device for training too


@pytest.mark.hostile
@pytest.mark.parametrize("device", ["banana", "cuda:x", "CPU", "cuda:", "", "gpu0"])
def test_a_device_that_is_no_device_is_named_with_its_key(device):
    """A library caller's device string (`halludetect score --device`), which no params check saw:
    before, 'banana' reached torch and 'cuda:x' crashed in int()."""
    from halludetect.core.devices import DeviceError, resolve_device

    with pytest.raises(DeviceError) as e:
        resolve_device(device, "--device")
    assert str(e.value) == f"--device: {device!r} is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps"


def test_the_device_spelling_is_the_params_one():
    from halludetect import config
    from halludetect.core import devices

    assert devices.DEVICE.pattern == config.DEVICE.pattern
