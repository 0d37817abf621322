"""The stage zygote (runner/zygote.py): under `halludetect repro --jobs N`, a plain
`python -m stages.<name>` command is forked from one process that imported the libraries already,
with its own arguments, directory, environment and output; anything else runs as DVC runs it. On a
small DVC repository with its own `stages` package; a stage tells who its parent process is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from halludetect.runner.zygote import Zygote

WAIT = 60

HELLO = """\
import json, os, sys
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
print("hello says this")
info = {"argv": sys.argv[1:], "name": __name__, "parent": parent, "cwd": os.getcwd(),
        "stage": os.environ.get("DVC_STAGE"), "cores": os.environ.get("HALLUDETECT_CORES"),
        "torch_before_me": "torch" in sys.modules}
json.dump(info, open(sys.argv[1], "w"))
"""
FAIL = """\
import sys
if sys.argv[1] == "exit":
    sys.exit("the stage refuses: bad input")
raise ValueError("a bug in the stage")
"""
SLEEPY = """\
import pathlib, sys, time
pathlib.Path(sys.argv[1]).touch()
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("sleepy was interrupted", flush=True)
    raise
"""

DVC_YAML = """\
stages:
  a:
    cmd: python -m stages.hello a.json
    outs: [a.json]
  b:
    cmd: python -m stages.hello b.json
    outs: [b.json]
  shell:
    cmd: python -m stages.hello s.json && true
    outs: [s.json]
"""


def make_repo(path: Path, dvc_yaml: str = DVC_YAML) -> Path:
    (path / "stages").mkdir(parents=True)
    (path / "stages" / "__init__.py").write_text("")
    for name, code in (("hello", HELLO), ("fail", FAIL), ("sleepy", SLEEPY)):
        (path / "stages" / f"{name}.py").write_text(code)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=path, check=True)
    (path / "dvc.yaml").write_text(dvc_yaml)
    return path


def env(**extra: str) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("HALLUDETECT_REPRO_JOBS", "HALLUDETECT_ZYGOTE")}
    out["PATH"] = os.path.dirname(sys.executable) + os.pathsep + out.get("PATH", "")  # `python` is this one
    return out | extra


def repro(repo: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "halludetect.cli", "repro", *args]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env(**extra))


def zygotes(repo: Path) -> list[int]:
    """Pids of the zygote processes (and their forked children) running in `repo` now: other tests'
    runs beside this one have zygotes of their own, elsewhere."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if b"halludetect.runner.zygote" in cmdline and cwd == str(repo):
            out.append(int(pid))
    return out


def test_plain_stage_commands_are_forked_with_their_own_arguments_environment_and_output(tmp_path):
    repo = make_repo(tmp_path / "r")
    res = repro(repo, "-j", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "a | hello says this" in res.stdout and "b | hello says this" in res.stdout
    for name in ("a", "b"):
        info = json.loads((repo / f"{name}.json").read_text())
        assert "halludetect.runner.zygote" in info["parent"], info  # forked ...
        assert info["torch_before_me"]  # ... from the process that imported torch
        assert info["argv"] == [f"{name}.json"] and info["name"] == "__main__" and info["cwd"] == str(repo)
        assert info["stage"] == name and info["cores"].isdigit()  # the command's own environment
    shell = json.loads((repo / "s.json").read_text())
    assert "halludetect.runner.zygote" not in shell["parent"] and not shell["torch_before_me"]  # shell syntax: as DVC
    assert zygotes(repo) == []  # ended with the run
    # turned off: every command as DVC runs it, the same outputs but who started them
    off = make_repo(tmp_path / "off")
    assert repro(off, "-j", "2", HALLUDETECT_ZYGOTE="0").returncode == 0
    info = json.loads((off / "a.json").read_text())
    assert "halludetect.runner.zygote" not in info["parent"] and not info["torch_before_me"]


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_forked_stage_fails_as_the_interpreter_would(tmp_path, how):
    repo = make_repo(
        tmp_path / "r",
        DVC_YAML + f"  bad:\n    cmd: python -m stages.fail {how}\n    deps: [a.json]\n    outs: [never.txt]\n",
    )
    res = repro(repo, "-j", "2")
    assert res.returncode != 0
    said = "bad | the stage refuses: bad input" if how == "exit" else "bad | ValueError: a bug in the stage"
    assert said in res.stdout, res.stdout
    assert "failed to reproduce 'bad'" in res.stdout + res.stderr


def test_ctrl_c_reaches_the_forked_stages_and_the_zygote_ends(tmp_path):
    yaml = "stages:\n" + "".join(
        f"  {n}:\n    cmd: python -m stages.sleepy started.{n}\n    outs: [{n}.txt]\n" for n in ("x", "y")
    )
    repo = make_repo(tmp_path / "r", yaml)
    proc = subprocess.Popen(
        [sys.executable, "-m", "halludetect.cli", "repro", "-j", "2"],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + WAIT
    while not ((repo / "started.x").exists() and (repo / "started.y").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=WAIT)[0]
    assert proc.returncode != 0, out
    assert "x | sleepy was interrupted" in out and "y | sleepy was interrupted" in out, out
    assert out.rstrip().splitlines()[-1].startswith("stopped: "), out
    assert zygotes(repo) == []


def test_only_a_plain_python_m_stages_command_in_the_zygotes_environment_is_forked(tmp_path):
    z = Zygote("/venv/bin/python", {"PATH": "/venv/bin", "A": "1"}, str(tmp_path))
    z.ready.set()  # as if started
    ok = {"PATH": "/venv/bin", "A": "1", "DVC_STAGE": "x", "HALLUDETECT_CORES": "1"}
    bin_python = tmp_path / "venv" / "bin" / "python"
    bin_python.parent.mkdir(parents=True)
    bin_python.write_text("")
    bin_python.chmod(0o755)
    z.python, ok["PATH"], z.env["PATH"] = str(bin_python), str(bin_python.parent), str(bin_python.parent)
    cwd = str(tmp_path)
    assert z.accepts("python -m stages.train --out x --layers 1", ok, cwd) == [
        "python", "-m", "stages.train", "--out", "x", "--layers", "1"
    ]  # fmt: skip
    for cmd in (
        "python -m stages.train > log",
        "python -m stages.train $OUT",
        "FOO=1 python -m stages.train",
        "python -m other.module",
        "python stages/train.py",
        "python -m stages.a && python -m stages.b",
        "python -m stages.train 'quoted arg'",
    ):
        assert z.accepts(cmd, ok, cwd) is None, cmd
    assert z.accepts("python -m stages.x", ok | {"A": "2"}, cwd) is None  # read at import, maybe
    assert z.accepts("python -m stages.x", {k: v for k, v in ok.items() if k != "A"}, cwd) is None
    assert z.accepts("python -m stages.x", ok, str(tmp_path / "elsewhere")) is None
    z.failed = True  # the zygote could not start: everything as DVC runs it
    assert z.accepts("python -m stages.x", ok, cwd) is None
