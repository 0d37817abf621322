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


HOLDER = """
import os, sys, time
import torch
torch.cuda.is_available = lambda: True  # this machine's CUDA, faked: resolve_device takes the lock
torch.cuda.device_count = lambda: 1
from halludetect.core.devices import resolve_device
assert resolve_device(sys.argv[1], "dump.device") == "cuda"
if sys.argv[1] == "auto":  # a worker of this stage (the dump's processes) shares its turn, never waits for it
    import subprocess
    worker = "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; " \
        "from halludetect.core.devices import resolve_device; resolve_device('cuda')"
    subprocess.run([sys.executable, "-c", worker], check=True, timeout=60)
open(sys.argv[2], "w").close()  # holding the lock
while not os.path.exists(sys.argv[3]):
    time.sleep(0.02)
"""


def test_stages_side_by_side_take_turns_on_the_gpu(tmp_path):
    """runner/parallel_repro.py names a lock file (HALLUDETECT_GPU_LOCK) for every command it runs: a
    stage process takes it at its first CUDA device and keeps it until it exits; another waits,
    saying for whom; a CPU stage and a process without the variable never touch it."""
    import fcntl
    import os
    import subprocess
    import sys

    from halludetect.core.devices import GPU_LOCK_ENV
    from halludetect.runner import parallel_repro

    assert parallel_repro.GPU_LOCK_ENV == GPU_LOCK_ENV  # the runner's name for it is this module's
    lock = tmp_path / "gpu.lock"
    env = {**os.environ, GPU_LOCK_ENV: str(lock), "DVC_STAGE": "dump@m-d"}

    def start(name: str, device: str = "auto"):
        args = [sys.executable, "-c", HOLDER, device, str(tmp_path / f"{name}.holds"), str(tmp_path / f"{name}.go")]
        return subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)

    def held() -> bool:
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    procs = []
    try:
        first = start("first")
        procs.append(first)
        while not (tmp_path / "first.holds").exists():
            assert first.poll() is None, first.communicate()[1]
        assert held() and lock.read_text() == f"stage dump@m-d (pid {first.pid})"
        second = start("second", "cuda")
        procs.append(second)
        assert (
            second.stderr.readline() == f"waiting for the GPU: stage dump@m-d (pid {first.pid}) is using it "
            "(stages side by side take turns)\n"
        )
        assert not (tmp_path / "second.holds").exists()  # it waits while the first holds the GPU
        (tmp_path / "first.go").touch()
        assert first.wait(timeout=60) == 0
        while not (tmp_path / "second.holds").exists():
            assert second.poll() is None, second.communicate()[1]
        assert held()  # the second has it now
        (tmp_path / "second.go").touch()
        assert second.wait(timeout=60) == 0 and not held()  # released at exit
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    # the runner's commands get the lock in DVC's scratch directory, unless the caller chose one
    env = parallel_repro.command_env({"A": "1"}, "/r/.dvc/tmp", 1)
    assert env["A"] == "1" and env[GPU_LOCK_ENV] == "/r/.dvc/tmp/halludetect-gpu.lock"
    assert parallel_repro.command_env({GPU_LOCK_ENV: ""}, "/r/.dvc/tmp", 1)[GPU_LOCK_ENV] == ""
