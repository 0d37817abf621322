"""bench/dag.py on a tiny grid of this tree's design: it runs, and its figures are sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_dag_bench_tiny_grid():
    cmd = [sys.executable, "-m", "bench.dag", "--no-baseline", "--models", "1", "--datasets", "1"]
    cmd += ["--methods", "probe", "--layers", "1", "--status-runs", "1", "--measure-entrywise-grid"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    m, g = out["design"]["measured"], out["design"]["grid"]
    assert m["stages"] == m["dvc_stage_list"] == m["lock_stages"] > 10  # what `dvc stage list` says
    assert m["status_clean"]
    assert m["lock_bytes"] > 0 and m["lock_entries"] > m["stages"]
    assert 0 < m["commands_s"] < m["repro_wall_s"] and m["dvc_s"] > 0
    assert m["rewrite_s"] > 0 and m["load_s"] > 0
    assert abs(m["synth_lock_error"]) < 0.1  # the synthesised lock is close to DVC's own
    assert g["stages"] == m["stages"] and g["extrapolated"] == ["bookkeeping_s"]  # small: measured
    assert 0 < g["bookkeeping_s"] < m["dvc_s"] * 2
    # spread over a dvc.yaml per family (and per family and model: the one model here), a lock each,
    # every rewrite is of a smaller lock
    family, by_model = g["split_bookkeeping"]["family"], g["split_bookkeeping"]["family_model"]
    assert 1 < family["files"] == by_model["files"] <= m["stages"]
    assert family["bookkeeping_s"] == pytest.approx(by_model["bookkeeping_s"])
    assert 0 < family["bookkeeping_s"] < g["bookkeeping_s"]
    assert "baseline" not in out
    whole = g["entrywise"]["measured_grid"]  # the grid again through runner/dvc_lock.py, then without params
    assert whole["stages"] == m["stages"] and whole["status_clean"] and whole["lock_bytes"] == m["lock_bytes"]
    bare = whole["without_params"]  # a clean status: the copy is consistent
    assert bare["status_clean"] and 0 < bare["lock_bytes"] < whole["lock_bytes"]  # the params stage's whole file
    assert whole["digests"] is None  # the design has its params stage: a digest copy would be itself
