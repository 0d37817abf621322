"""docs/sweeps-and-sharing.md's `halludetect dag` example runs as written on this repository and
prints the lines the page shows (they went stale once: 215 stages, `train x 100`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import ROOT, doc_blocks


def test_the_documented_dag_lines_are_the_repositorys():
    blocks = doc_blocks("docs/sweeps-and-sharing.md", "Readable views")
    [command] = [b.strip() for b in blocks["bash"] if b.startswith("halludetect dag")]
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout == blocks["text"][0]
