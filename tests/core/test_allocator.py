"""The allocator settings (halludetect/core/allocator.py): every stage process has them, before torch
loads. What they buy is measured, not tested (docs/benchmarks.md): page faults depend on the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from support import ROOT

from halludetect.core import allocator

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)


@glibc
def test_a_stage_process_keeps_freed_memory_from_its_first_import():
    code = (
        "import json, sys\n"
        "import stages\n"
        "from halludetect.core import allocator\n"
        "print(json.dumps([allocator._done, 'torch' in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == [True, False]  # set by `import stages`, before any torch import


@glibc
def test_setting_it_again_is_a_no_op():
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()


@glibc
def test_the_variable_leaves_glibcs_defaults():
    code = "import stages\nfrom halludetect.core import allocator\nprint(allocator._done)\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HALLUDETECT_KEEP_FREED_MEMORY": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"
