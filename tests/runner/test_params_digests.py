"""The params stage (runner/params_digests.py, stages/params.py): one file per stage of the values
of its `meta.params`, from one parse of params.yaml, and DVC re-running exactly the stages whose file
changed. On a DVC repository of shell one-liners beside the params stage (a few DVC processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

from halludetect.runner import params_digests
from halludetect.runner.params_digests import ParamsDigestError

PARAMS = """\
grid:
  models: [a, b]
x:
  a: {lr: 1, dim: 8}
  b: {lr: 2, dim: 8}
shared: 3
unread: 4
"""

DVC_YAML = """\
stages:
  params:
    cmd: python -m stages.params --out data/params
    params:
      - params.yaml:
    outs:
      - data/params
  use:
    matrix:
      m: ${grid.models}
    cmd: cat data/params/use@${item.m}.json > out_${item.m}.txt
    deps:
      - data/params/use@${item.m}.json
    meta:
      params:
        - x.${item.m}
        - shared
    outs:
      - out_${item.m}.txt
"""


ENV = {  # the stage's `python` is this environment's, as under make (DVC runs commands through the shell)
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}",
}


def dvc(repo, *args):
    res = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True, env=ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def ran(log: str) -> set[str]:
    return {line.split("'")[1] for line in log.splitlines() if line.startswith("Running stage '")}


@pytest.fixture
def repo(tmp_path):
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "params.yaml").write_text(PARAMS)
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    return tmp_path


def test_each_stage_gets_the_values_of_its_keys_and_no_other(repo):
    written = params_digests.write(root=repo)
    assert set(written) == {"use@a.json", "use@b.json"}
    assert json.loads((repo / "data/params/use@a.json").read_text()) == {"shared": 3, "x.a": {"dim": 8, "lr": 1}}
    assert json.loads((repo / "data/params/use@b.json").read_text()) == {"shared": 3, "x.b": {"dim": 8, "lr": 2}}
    # the order keys are listed in (and a comment) changes no byte: a stage re-runs for values only
    (repo / "dvc.yaml").write_text(
        DVC_YAML.replace("        - x.${item.m}\n        - shared\n", "        - shared  # s\n        - x.${item.m}\n")
    )
    assert params_digests.write(root=repo) == written
    # run from a folder of the repository, the output spelt another way: the same files at the root
    (repo / "sub").mkdir()
    assert params_digests.write("./data/params/", root=repo / "sub") == written
    assert not (repo / "sub" / "data").exists() and (repo / "data/params/use@a.json").is_file()


def test_dvc_re_runs_exactly_the_stages_whose_values_changed(repo):
    assert ran(dvc(repo, "repro")) == {"params", "use@a", "use@b"}
    assert json.loads(dvc(repo, "status", "--json")) == {}
    (repo / "params.yaml").write_text(PARAMS.replace("lr: 1", "lr: 5"))
    # DVC names the params stage alone (it tracks the whole file); the plan works its files out
    assert set(json.loads(dvc(repo, "status", "--json"))) == {"params"}
    plan = "import json; from halludetect.runner.repro import plan; print(json.dumps(plan([])))"
    fates = json.loads(
        subprocess.run(
            [sys.executable, "-c", plan],
            cwd=repo,
            capture_output=True,
            text=True,
            env=ENV,
        ).stdout
    )
    assert dict(fates) == {"params": "run", "use@a": "run", "use@b": "skip"}
    assert ran(dvc(repo, "repro")) == {"params", "use@a"}
    assert json.loads((repo / "out_a.txt").read_text())["x.a"]["lr"] == 5
    # a key no stage reads: the params stage runs (a second), no other
    (repo / "params.yaml").write_text(PARAMS.replace("lr: 1", "lr: 5").replace("unread: 4", "unread: 6"))
    assert ran(dvc(repo, "repro")) == {"params"}
    # a key every stage reads
    (repo / "params.yaml").write_text(PARAMS.replace("lr: 1", "lr: 5").replace("shared: 3", "shared: 7"))
    assert ran(dvc(repo, "repro")) == {"params", "use@a", "use@b"}


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("        - shared\n", "        - shared\n        - nowhere.key\n"),
            "params.yaml has no 'nowhere.key' (stage 'use@a')",
        ),
        (
            ("      - data/params/use@${item.m}.json\n", "      - params.yaml\n"),
            "list exactly `data/params/use@a.json`",
        ),
        (
            ("data/params/use@${item.m}.json\n", "data/params/use@${item.m}-x.json\n"),
            "list exactly `data/params/use@a.json`",
        ),
        (
            ("    meta:\n      params:\n        - x.${item.m}\n        - shared\n", ""),
            "depends on ['data/params/use@a.json'] but has no meta.params",
        ),
        (
            ("        - x.${item.m}\n        - shared\n", "          x: 1\n"),
            "meta.params must be a list of params.yaml keys",
        ),
    ],
)
def test_a_stage_whose_params_cannot_be_written_is_named_with_the_fix(repo, edit, message):
    (repo / "dvc.yaml").write_text(DVC_YAML.replace(*edit))
    with pytest.raises(ParamsDigestError) as e:
        params_digests.write(root=repo)
    assert message in str(e.value)
    assert not (repo / "data/params").exists()  # nothing half-written


@pytest.mark.hostile
def test_the_stage_says_what_is_wrong_without_a_traceback(tmp_path_factory, repo):
    def params_stage(cwd):
        cmd = [sys.executable, "-m", "stages.params", "--out", "data/params"]
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=ENV)

    (repo / "params.yaml").write_text("grid: [unclosed\n")
    res = params_stage(repo)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr
    res = params_stage(tmp_path_factory.mktemp("not-a-repo"))
    assert res.returncode == 2 and "DVC cannot read the pipeline" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.hostile
def test_a_stage_new_to_dvc_yaml_gets_its_file_under_halludetect_repro(repo):
    """DVC cannot track dvc.yaml, so nothing re-runs the params stage for a stage added to it: plain
    `dvc repro` stops naming the missing file; `halludetect repro` runs the params stage first."""
    dvc(repo, "repro")
    extra = "  extra:\n    cmd: cat data/params/extra.json > extra.txt\n    deps:\n      - data/params/extra.json\n"
    extra += "    meta:\n      params:\n        - shared\n    outs:\n      - extra.txt\n"
    (repo / "dvc.yaml").write_text(DVC_YAML + extra)
    plain = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True, env=ENV)
    assert plain.returncode != 0 and "data/params/extra.json" in plain.stdout + plain.stderr
    res = subprocess.run(
        [sys.executable, "-m", "halludetect.cli", "repro"], cwd=repo, capture_output=True, text=True, env=ENV
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "params: a stage new to dvc.yaml has no params file yet" in res.stdout
    assert json.loads((repo / "extra.txt").read_text()) == {"shared": 3}
    assert ran(res.stdout) == {"params", "extra"} and json.loads(dvc(repo, "status", "--json")) == {}
