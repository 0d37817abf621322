"""Data parallelism over processes: `accelerate launch` (or torchrun) starts them, we shard.

A stage asks `workers()` who it is. Run plainly it is process 0 of 1 and nothing here costs
anything. Started by `accelerate launch --multi_gpu --num_processes N -m stages.generate ...`
(or with `HALLUDETECT_PROCESSES=N` in the environment, see `relaunch`), each process takes
its share of the work units, writes them to disk, waits at a barrier, and process 0 merges
them in unit order, so the output does not depend on N.

On machines without CUDA the processes talk over gloo (accelerate's MULTI_CPU); the tests
use that with two CPU processes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass
class Workers:
    rank: int = 0
    size: int = 1
    device: str | None = None  # this process's device when there are several; None: use params
    _state: object | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self._state is not None:
            self._state.wait_for_everyone()

    def share(self, n_units: int) -> list[int]:
        """This process's work units out of 0..n_units-1, dealt round-robin.

        Units are sorted by prompt length before they are numbered, so dealing them out
        round-robin gives every process a similar mix of short and long ones.
        """
        return list(range(self.rank, n_units, self.size))

    def check_placement(self, name: str, preset) -> None:
        """Refuse a model split over the GPUs by `device_map` when several processes would each split it."""
        if self.size > 1 and preset.device_map:
            from halludetect.lm.hf_models import ModelError

            raise ModelError(
                f"models.{name}.device_map splits one model over all GPUs, and {self.size} processes "
                "would each do that: run one process (unset HALLUDETECT_PROCESSES) or remove device_map"
            )

    def span(self, n_units: int) -> range:
        """A contiguous block of units (for outputs merged by concatenation, like the dump)."""
        per, extra = divmod(n_units, self.size)
        start = self.rank * per + min(self.rank, extra)
        return range(start, start + per + (self.rank < extra))


def workers() -> Workers:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Workers()
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    device = str(state.device)
    if device.startswith("cpu"):
        # Each process keeps the pinned thread count (core/numerics.py): a unit computed by any of
        # them gives the bytes it gives in a one-process run.
        device = "cpu"
    return Workers(state.process_index, state.num_processes, device, state)


def relaunch(module: str) -> None:
    """Re-run this stage under `accelerate launch` when HALLUDETECT_PROCESSES asks for several processes.

    This keeps `dvc.yaml`'s commands (and so DVC's stage hashes) the same whatever the
    machine: `HALLUDETECT_PROCESSES=8 dvc repro` uses eight GPUs, `dvc repro` one.
    """
    n = int(os.environ.get("HALLUDETECT_PROCESSES", "1"))
    if n <= 1 or "WORLD_SIZE" in os.environ:  # one process, or already launched
        return
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(n),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        module,
        *sys.argv[1:],
    ]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
