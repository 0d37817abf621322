"""`halludetect repro` (runner/repro.py): `dvc repro` with "stage k of N, elapsed, about how long left",
on a three-stage DVC repository whose commands are shell one-liners (a few DVC processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from halludetect.runner.repro import Progress

DVC_YAML = """\
stages:
  a:
    cmd: echo a > a.txt
    outs: [a.txt]
  b:
    cmd: cat a.txt > b.txt && echo b >> b.txt
    deps: [a.txt]
    outs: [b.txt]
  c:
    cmd: {c}
    deps: [b.txt]
    outs: [c.txt]
"""


def repro(repo, *args):
    return subprocess.run(
        [sys.executable, "-m", "halludetect.cli", "repro", *args], cwd=repo, capture_output=True, text=True
    )


@pytest.fixture
def repo(tmp_path):
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(DVC_YAML.format(c="cat b.txt > c.txt"))
    return tmp_path


def test_repro_prints_each_stage_of_the_run_and_keeps_their_times(repo):
    res = repro(repo)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert out.startswith("dvc repro: 3 stages, 3 to run, 0 unchanged\n")
    assert [line.split(" elapsed")[0][:-8] for line in out.splitlines() if line.startswith("[running")] == [
        f"[running {k} of 3 | stage {k} of 3 | " for k in (1, 2, 3)
    ]
    assert out.index("Running stage 'a'") < out.index("[running 1 of 3") < out.index("Running stage 'b'")
    assert "about" not in out.split("[running 1 of 3")[1].splitlines()[0]  # nothing known yet: no estimate
    assert "left]" in out.split("[running 2 of 3")[1].splitlines()[0]  # a's time estimates b's
    assert out.rstrip().splitlines()[-1].startswith("done: 3 stage(s) ran in ")
    kept = json.loads((repo / ".dvc/tmp/halludetect-stage-seconds.json").read_text())
    assert set(kept) == {"a", "b", "c"} and all(t > 0 for t in kept.values())
    # nothing changed: every stage is visited and skipped (DVC's lines say so); the first line says so
    again = repro(repo).stdout
    assert again.startswith("dvc repro: 3 stages, 0 to run, 3 unchanged\n") and "[running" not in again
    # a change in the middle: b and c run (c is downstream: counted as running, an upper bound)
    (repo / "dvc.yaml").write_text(DVC_YAML.format(c="cat b.txt > c.txt").replace("echo b ", "echo B "))
    mid = repro(repo).stdout
    assert mid.startswith("dvc repro: 3 stages, 2 to run, 1 unchanged\n") and "[running 2 of 2 | stage 3 of 3 |" in mid
    # one stage's arguments pass through to dvc repro; its estimate is its last run's time
    one = repro(repo, "-f", "-s", "b").stdout
    assert one.startswith("dvc repro -f -s b: 1 stages, 1 to run, 0 unchanged\n") and "[running 1 of 1 | " in one


def test_repro_returns_dvcs_status_when_a_stage_fails(repo):
    (repo / "dvc.yaml").write_text(DVC_YAML.format(c="exit 3"))
    res = repro(repo)
    assert res.returncode != 0 and "[running 3 of 3 | stage 3 of 3 |" in res.stdout
    assert res.stdout.rstrip().splitlines()[-1].startswith("stopped: 3 stage(s) ran")


def test_repro_of_a_broken_dvc_yaml_is_dvcs_message_without_running(repo):
    (repo / "dvc.yaml").write_text("stages:\n  a:\n    cmd: [\n")
    res = repro(repo)
    assert res.returncode != 0 and "dvc.yaml" in res.stdout + res.stderr and "Traceback" not in res.stderr


@pytest.mark.hostile
def test_repro_that_dvc_cannot_expand_names_the_params_key_instead(tmp_path):
    """params.yaml of the former form (`grid.transfer: all`, before it listed datasets): DVC cannot
    expand dvc.yaml's transfer matrix over a word and says only "'Value' object is not iterable";
    `halludetect repro` prints the params check's message, naming the key and what to write."""
    from support import ROOT

    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    params = (ROOT / "params.yaml").read_text()
    former = re.sub(r"(?m)^  transfer:.*\n(?:  #.*\n)*(?:  - .*\n)+", "  transfer: all\n", params, count=1)
    assert former != params and "  transfer: all\n" in former
    (tmp_path / "params.yaml").write_text(former)
    res = repro(tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "grid.transfer: 'all' is the former form; write the datasets" in res.stderr
    assert "not iterable" not in res.stdout + res.stderr and "Running stage" not in res.stdout


def test_the_estimate_uses_the_last_run_then_the_family_then_all():
    planned = [("world", True), ("train@a", True), ("train@b", True), ("report", True)]
    p = Progress(planned, {"report": 5.0}, start=0.0)
    line = p.visit("world", True)
    assert line.startswith("[running 1 of 4 | stage 1 of 4 | ") and "left" not in line  # not "0 left"
    assert p.left() is None  # world, train@a and train@b: nothing known of them or their family yet
    p.seconds["world"] = 100.0  # as if world took 100 s
    p.current = None
    assert p.expected("train@a") == 100.0 and p.expected("report") == 5.0
    p.seconds["train@a"] = 10.0
    assert p.expected("train@b") == 10.0  # its family's, not world's


def test_repro_piped_into_a_reader_that_leaves_finishes_the_run(repo):
    """`halludetect repro | head -1`: the reader goes after a line; DVC still runs every stage."""
    res = subprocess.run(
        f"{sys.executable} -m halludetect.cli repro | head -1", shell=True, cwd=repo, capture_output=True, text=True
    )
    assert res.stdout == "dvc repro: 3 stages, 3 to run, 0 unchanged\n" and "Traceback" not in res.stderr
    assert (repo / "c.txt").read_text() == "a\nb\n"


EXP_DVC_YAML = """\
stages:
  a:
    cmd: echo a > a.txt
    outs: [a.txt]
  dim:
    cmd: cat a.txt > dim.txt && echo ${detectors.max.dim} >> dim.txt
    deps: [a.txt]
    params: [detectors.max.dim]
    outs: [dim.txt]
  pair:
    foreach: ${grid.transfer}
    do:
      cmd: echo ${item} > pair-${item}.txt
      outs:
      - pair-${item}.txt
"""


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def halludetect(repo, *args):
    return subprocess.run(
        [sys.executable, "-m", "halludetect.cli", *args], cwd=repo, capture_output=True, text=True, timeout=300
    )


def test_exp_run_checks_every_value_first_then_runs_with_the_plan_and_the_run_cache_counted(tmp_path):
    """`halludetect exp run` (cli/exp.py): a bad value in params.yaml or in -S is one line naming the
    key before DVC runs (plain `dvc exp run` says "'Value' object is not iterable", or fails a stage
    later); a good one runs DVC's own workspace experiment with the plan and the progress line. Going
    back to the committed value, DVC restores the stage from its run cache: the plan says so ("from the
    run cache") instead of counting it as a stage to run and its time in the estimate (issue 52: "about
    00:09:11 left" for a run that took 1:34)."""
    from support import ROOT

    repo = tmp_path
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True)
    (repo / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (repo / "dvc.yaml").write_text(EXP_DVC_YAML)
    assert halludetect(repo, "repro").returncode == 0
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    params = (repo / "params.yaml").read_bytes()

    # a value dvc.yaml cannot iterate, given with -S: one line, nothing run, params.yaml as it was
    bad = halludetect(repo, "exp", "run", "-S", "grid.transfer=off")
    assert bad.returncode == 2 and "-S grid.transfer=off: grid: grid.transfer: 'off' is the former form" in bad.stderr
    assert "not iterable" not in bad.stdout + bad.stderr and "Running stage" not in bad.stdout
    assert (repo / "params.yaml").read_bytes() == params
    # a queued sweep with one bad point: nothing queued
    sweep = halludetect(repo, "exp", "run", "--queue", "-S", "detectors.max.dim=8,x")
    assert sweep.returncode == 2 and "-S detectors.max.dim=x: detectors.max.dim: " in sweep.stderr
    assert "refs/exps" not in _git(repo, "for-each-ref") and not _git(repo, "stash", "list")

    # a good value: DVC's workspace experiment, with the plan and the progress line
    good = halludetect(repo, "exp", "run", "-S", "detectors.max.dim=7")
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith("dvc exp run -S detectors.max.dim=7: 4 stages, 1 to run, 3 unchanged\n")
    assert "[running 1 of 1 | stage 2 of 4 | " in good.stdout and "Running stage 'dim'" in good.stdout
    assert (repo / "dim.txt").read_text() == "a\n7\n"
    assert "refs/exps" in _git(repo, "for-each-ref")

    # back to the committed value: DVC restores `dim` from its run cache, and the plan counts it so
    _git(repo, "checkout", "-q", "params.yaml")
    back = halludetect(repo, "repro")
    assert back.returncode == 0, back.stdout + back.stderr
    assert back.stdout.startswith("dvc repro: 4 stages, 0 to run, 1 from the run cache, 3 unchanged\n"), back.stdout
    assert "Stage 'dim' is cached" in back.stdout and "[running" not in back.stdout
    assert (repo / "dim.txt").read_text() == "a\n256\n"
