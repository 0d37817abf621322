"""Detectors registered from the user's own package (halludetect/methods/plugins.py): the example
of docs/detectors.md "Your own detector" runs as written from a small package that this test
builds in a temporary folder (a module plus a dist-info with its entry_points.txt on the Python
path, no pip), and every bad plugin is one line naming the entry point or the params key and the
fix. Each case runs in a subprocess: entry points are read once per process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from support import doc_blocks

from halludetect.core import code_deps

ROOT = code_deps.ROOT
DOC = doc_blocks("docs/detectors.md", "Your own detector")


def package(site: Path, module: str, entry_points: dict[str, str] | None) -> Path:
    """my_detectors/wide.py holding `module`, and (with `entry_points`) the dist-info of an
    installed distribution my-detectors 0.1 declaring them in the group halludetect.detectors."""
    (site / "my_detectors").mkdir(parents=True, exist_ok=True)
    (site / "my_detectors" / "__init__.py").write_text("")
    (site / "my_detectors" / "wide.py").write_text(module)
    if entry_points is not None:
        dist = site / "my_detectors-0.1.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-detectors\nVersion: 0.1\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (dist / "entry_points.txt").write_text(f"[halludetect.detectors]\n{lines}")
    return site


def run(code: str, site: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def doc_entry_points() -> dict[str, str]:
    return tomllib.loads(DOC["toml"][0])["project"]["entry-points"]["halludetect.detectors"]


CHECK = """
import json, yaml, torch
from halludetect.config import parse_params
from halludetect.activations.bags import Bags
from halludetect.detectors.build import build_detector
from halludetect.methods import METHODS
from halludetect.report.paper_tables import NAMES, family

data = yaml.safe_load(open("params.yaml"))
doc = yaml.safe_load(DOC_YAML)
data["grid"]["methods"] = doc["grid"]["methods"]
data["detectors"].update(doc["detectors"])
params = parse_params(data)
m = METHODS["wide_max"]
z = build_detector("wide_max", 3, params.detectors.wide_max)(Bags(torch.randn(5, 3), torch.tensor([2, 3])))
print(json.dumps({"dim": params.detectors.wide_max.dim, "family": family("wide_max"), "name": NAMES["wide_max"],
                  "origin": [m.origin.via, m.origin.factory, m.origin.distribution], "shape": list(z.shape),
                  "grid": params.grid.methods}))
"""


def test_the_docs_plugin_registers_from_its_entry_point_as_written(tmp_path):
    site = package(tmp_path, DOC["python"][0], doc_entry_points())
    out = run(CHECK.replace("DOC_YAML", repr(DOC["yaml"][0])), site)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got == {
        "dim": 512,
        "family": "yours",
        "name": "Wide max pooling",
        "origin": ["entry point", "my_detectors.wide:make", "my-detectors 0.1"],
        "shape": [2],
        "grid": ["hami", "max", "wide_max"],
    }


def test_the_params_key_registers_the_same_factory_without_packaging(tmp_path):
    site = package(tmp_path, DOC["python"][0], None)
    code = CHECK.replace("DOC_YAML", repr(DOC["yaml"][0])).replace(
        'data["detectors"].update(doc["detectors"])',
        'data["detectors"].update(doc["detectors"])\n'
        'data["detectors"]["wide_max"]["factory"] = "my_detectors.wide:make"',
    )
    out = run(code, site)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["origin"] == ["params", "my_detectors.wide:make", None] and got["dim"] == 512


PARSE = """
import yaml
from halludetect.config import parse_params
data = yaml.safe_load(open("params.yaml"))
data["detectors"].update(SECTIONS)
data["grid"]["methods"] += GRID
try:
    parse_params(data, "params.yaml")
    print("accepted")
except Exception as e:
    print(type(e).__name__, str(e))
"""


def parse(site: Path, sections: dict, grid: list[str]) -> str:
    out = run(PARSE.replace("SECTIONS", repr(sections)).replace("GRID", repr(grid)), site)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


GOOD = DOC["python"][0]


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("module", "value", "message"),
    [
        (GOOD, "no_such_pkg.wide:make", "no module 'no_such_pkg.wide' on the Python path"),
        (
            "raise RuntimeError('boom')\n",
            "my_detectors.wide:make",
            "importing 'my_detectors.wide' failed: RuntimeError: boom",
        ),
        (GOOD, "my_detectors.wide:nothing", "'my_detectors.wide' has no 'nothing'"),
        (
            GOOD + "\nNOT_CALLABLE = 3\n",
            "my_detectors.wide:NOT_CALLABLE",
            "is a int, not a callable that returns a Method",
        ),
        (
            GOOD + "\ndef bad():\n    return {'name': 'wide_max'}\n",
            "my_detectors.wide:bad",
            "returned a dict, not a halludetect.methods.spec.Method",
        ),
        (
            GOOD + "\ndef boom():\n    raise ValueError('no')\n",
            "my_detectors.wide:boom",
            "'my_detectors.wide:boom()' raised ValueError: no",
        ),
        (GOOD, "my_detectors.wide", "is not 'module:factory'"),
    ],
)
def test_a_bad_entry_point_is_one_line_naming_it_and_the_fix(tmp_path, module, value, message):
    site = package(tmp_path, module, {"wide_max": value})
    got = parse(site, {}, [])
    assert (
        got.startswith("PluginError entry point 'wide_max = ")
        and "(group halludetect.detectors, my-detectors 0.1)" in got
    )
    assert message in got and "pip uninstall my-detectors" in got and "\n" not in got


@pytest.mark.hostile
def test_a_bad_params_key_plugin_names_the_key():
    got = parse(ROOT, {"wide_max": {"factory": "no_such_pkg.wide:make", "dim": 4}}, ["wide_max"])
    assert got.startswith("ParamsError params.yaml: 1 problem(s)")
    assert "detectors.wide_max.factory: no module 'no_such_pkg.wide' on the Python path" in got


@pytest.mark.hostile
def test_a_plugin_named_like_a_built_in_or_under_another_name_is_refused(tmp_path):
    site = package(tmp_path, GOOD, None)
    got = parse(site, {"max": {"factory": "my_detectors.wide:make"}}, [])
    assert "detectors.max.factory: the factory returned the method 'wide_max', registered as 'max'" in got
    renamed = GOOD.replace('"wide_max",\n        "Wide', '"max",\n        "Wide')
    site = package(tmp_path / "b", renamed, None)
    got = parse(site, {"max": {"factory": "my_detectors.wide:make"}}, [])
    assert "detectors.max.factory: 'max' is already a built-in method; give the plugin's method another name" in got


@pytest.mark.hostile
def test_invalid_plugin_params_name_the_key_and_suggest(tmp_path):
    site = package(tmp_path, GOOD, doc_entry_points())
    got = parse(site, {"wide_max": {"dim": 4, "dimm": 5}}, ["wide_max"])
    assert "detectors.wide_max.dimm: unknown key; did you mean 'dim'?" in got


@pytest.mark.hostile
def test_a_build_that_returns_no_module_is_refused_naming_the_plugin(tmp_path):
    module = GOOD.replace(
        'build=lambda net, d, p: net.PoolingNet(d, p.dim, p.dropout, "max")', "build=lambda net, d, p: 42"
    )
    site = package(tmp_path, module, doc_entry_points())
    code = """
from halludetect.detectors.build import build_detector, params_for
try:
    build_detector("wide_max", 4, params_for("wide_max"))
except Exception as e:
    print(type(e).__name__, e)
"""
    out = run(code, site)
    assert out.stdout.strip() == (
        "PluginError detector 'wide_max' (from the entry point 'my_detectors.wide:make' (group "
        "halludetect.detectors, my-detectors 0.1)): build returned a int, not a torch.nn.Module mapping "
        "Bags to one score per answer; fix its build"
    ), out.stderr[-2000:]


def test_a_plugin_in_the_repository_is_code_of_the_stages_that_run_methods_only(tmp_path):
    """make deps lists an in-repository plugin's folder (params key) among the code stage's deps; its
    file is in the plugin's own digests and in those of the stages that read every method, never in
    generate's or another method's; --write then --check agree; an edit to the plugin changes the
    score fingerprint."""
    for part in ("halludetect", "stages"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / f, tmp_path / f)
    package(tmp_path, GOOD, None)
    params = (
        (tmp_path / "params.yaml")
        .read_text()
        .replace(
            "  probe:                   # logistic",
            "  wide_max:\n    factory: my_detectors.wide:make\n  probe:                   # logistic",
        )
    )
    (tmp_path / "params.yaml").write_text(params)
    code = """
import json
from halludetect.core import code_deps
stages = ("stages.train", "stages.generate", "stages.report")
out = {m: [code_deps.relative(p) for p in code_deps.closure(m)] for m in stages}
digests = code_deps.digests()
out["train/wide_max"] = digests["train/wide_max.txt"]
out["train/max"] = digests["train/max.txt"]
out["digest"] = "my_detectors/wide.py" in code_deps.code_digest("halludetect.scoring.scorer")
print(json.dumps(out))
"""
    out = run(code, tmp_path, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert "my_detectors/wide.py" in got["stages.train"] and "my_detectors/wide.py" in got["stages.report"]
    assert "my_detectors/wide.py" not in got["stages.generate"] and got["digest"]
    assert "my_detectors/wide.py" in got["train/wide_max"] and "my_detectors/wide.py" not in got["train/max"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    tool = [sys.executable, "-m", "halludetect.core.code_deps"]
    stale = subprocess.run([*tool, "--check"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert stale.returncode == 1 and "stage 'code'" in stale.stderr and "my_detectors" in stale.stderr
    subprocess.run([*tool, "--write"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert subprocess.run([*tool, "--check"], cwd=tmp_path, env=env, capture_output=True).returncode == 0
    subprocess.run([*tool, "--write"], cwd=tmp_path, env=env, check=True, capture_output=True)  # idempotent
    dvc_yaml = (tmp_path / "dvc.yaml").read_text()
    assert dvc_yaml.count("      - my_detectors\n") == 1  # the code stage's deps only
    assert "my_detectors/" not in dvc_yaml
