"""The headline figures (halludetect/report/headline.py): one shape for every method and baseline,
the only DVC metrics of dvc.yaml, and the documented views (`dvc metrics show`, the `dvc exp show`
recipe of docs/sweeps-and-sharing.md) no wider than 200 columns on the demo world's grid."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import ROOT, doc_blocks

from halludetect.methods import SCORES
from halludetect.report.headline import headline, headlines

WIDTH = 200  # the columns a documented view may take (issue 22)


def full_entry(rng, detector: bool) -> dict:
    """A metrics JSON of the shape evaluate (detector) or baselines writes, with unrounded figures."""

    def stat(seeds):
        v = rng.uniform(0.5, 0.95, size=seeds)
        se = float(v.std(ddof=1) / np.sqrt(seeds)) if seeds > 1 else None
        return {"mean": float(v.mean()), "stderr": se, "sd": None, "per_seed": v.tolist()}

    seeds = 3 if detector else 1
    test = {k: stat(seeds) for k in ("auroc", "auprc", "prr", "prr_0.5", "fpr_at_95_tpr")}
    test |= {"margin": stat(seeds) if detector else None, "n": 1800, "auroc_ci95": [0.7, 0.8]}
    out = {"family": "detector" if detector else "baseline", "test": test, "val": test}
    if detector:
        out |= {"best_layer": int(rng.integers(0, 5)), "seeds": list(range(seeds)), "throughput": {"n": 1800}}
    return out


def analysis_entry(rng, best: int) -> dict:
    split = {"mean": {"c_int": {"gamma": float(rng.uniform(1, 3)), "inv_gamma": 0.5}}}
    return {"best_layer": best, "layers": {str(best): {"val": split, "test": split}}}


def world_headlines(seed=0) -> dict[str, dict]:
    """The headline files of the shipped params.yaml grid (the demo world), paths as dvc.yaml writes them."""
    rng = np.random.default_rng(seed)
    g = yaml.safe_load((ROOT / "params.yaml").read_text())["grid"]
    metrics, analysis = {}, {}
    for m in g["models"]:
        for d in g["datasets"]:
            for name in g["detectors"]:  # the trained ones, and the scores with nothing to train
                metrics[(m, d, name)] = full_entry(rng, detector=name not in SCORES)
            for name in g["analyze"]:
                analysis[(m, d, name)] = analysis_entry(rng, metrics[(m, d, name)]["best_layer"])
    return {f"metrics/headline/{rel}": h for rel, h in headlines(metrics, analysis).items()}


def test_a_headline_keeps_the_figures_a_sweep_reads_and_drops_the_rest():
    rng = np.random.default_rng(1)
    e = full_entry(rng, detector=True)
    h = headline(e, analysis_entry(rng, e["best_layer"]))
    assert h["best_layer"] == e["best_layer"]
    assert h["test"]["auroc"] == {"mean": e["test"]["auroc"]["mean"], "stderr": e["test"]["auroc"]["stderr"]}
    assert set(h["test"]) == {"auroc", "prr", "fpr_at_95_tpr"} and set(h["test"]["prr"]) == {"mean"}
    assert isinstance(h["gamma"], float)
    b = headline(full_entry(rng, detector=False))
    assert "best_layer" not in b and "gamma" not in b and set(b["test"]["auroc"]) == {"mean"}  # no stderr of one run


def test_only_the_headline_directory_is_a_dvc_metric():
    """Every other figure file is a plain output: declaring one as a metric again would put its
    keys in every row of `dvc metrics show`."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    bodies = [st.get("do", st) for st in dvc["stages"].values()]  # a foreach stage declares in its `do:`
    declared = [m for st in bodies for m in st.get("metrics", [])] + dvc.get("metrics", [])
    assert declared == ["metrics/headline"]
    assert "--headline-dir metrics/headline" in dvc["stages"]["report"]["cmd"]


def test_the_documented_views_fit_in_200_columns_on_the_world(tmp_path):
    """The commands of docs/sweeps-and-sharing.md's 'Readable views' run as written, by DVC, in a
    repository holding the world grid's headline files and one experiment."""
    dvc = Path(sys.executable).parent / "dvc"
    if not dvc.exists():
        pytest.skip(f"no dvc beside {sys.executable}")
    files = world_headlines()
    (tmp_path / "figures.json").write_text(json.dumps(files))
    (tmp_path / "write.py").write_text(
        "import json, pathlib\n"
        "for p, h in json.loads(pathlib.Path('figures.json').read_text()).items():\n"
        "    pathlib.Path(p).parent.mkdir(parents=True, exist_ok=True)\n"
        "    pathlib.Path(p).write_text(json.dumps(h))\n"
    )
    (tmp_path / "params.yaml").write_text("detectors:\n  max:\n    dim: 256\n")
    stage = {"cmd": f"{sys.executable} write.py", "deps": ["write.py", "figures.json"], "params": ["detectors.max.dim"]}
    stage["metrics"] = ["metrics/headline"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"report": stage}}))
    env = os.environ | {"PATH": f"{dvc.parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}

    def sh(cmd: str) -> str:
        res = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
        return res.stdout

    git = shutil.which("git")
    assert git, "git is needed"
    sh("git init -q && git config user.email t@t && git config user.name t && dvc init -q && dvc repro -q")
    sh("git add -A && git commit -qm world && dvc exp run -q -n a-sweep-point -S detectors.max.dim=64")
    commands = [
        line.split("#")[0].strip()
        for block in doc_blocks("docs/sweeps-and-sharing.md", "Readable views")["bash"]
        for line in block.splitlines()
        if line.startswith("dvc ")
    ]
    assert [c.split()[:2] for c in commands] == [["dvc", "metrics"], ["dvc", "exp"]]
    for cmd in commands:
        out = sh(cmd)
        width = max(len(line) for line in out.splitlines())
        assert width <= WIDTH, f"{cmd}: {width} columns\n{out}"
        if cmd.startswith("dvc metrics"):
            assert len(out.strip().splitlines()) == 2 + len(files)  # a row per file
        else:
            assert re.search(r"a-sweep-point", out) and "detectors.max.dim" in out
            assert out.count(":test.auroc.mean") == 2, out
