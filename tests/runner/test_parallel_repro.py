"""`halludetect repro --jobs N` (runner/parallel_repro.py): independent stages side by side, on small
DVC repositories whose commands are shell one-liners.

Whether two stages ran at once is never read from a clock: stages `b` and `c` each mark that they
started and then wait for the other's mark (up to a deadline, after which they fail), so the run
passes only if both were running at the same time, and a serial run of the same repository fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from halludetect.runner.dvc_lock import LockWriter
from halludetect.runner.repro import split_jobs

WAIT = 60  # seconds a stage waits for the other's mark before it fails (never reached when they overlap)


def meets(me: str, other: str, then: str) -> str:
    """A command that marks `me` started, waits for `other`'s mark, then runs `then`."""
    return (
        f"touch started.{me} && i=0 && while [ ! -e started.{other} ]; do "
        f"i=$((i+1)); [ $i -gt {WAIT * 10} ] && exit 7; sleep 0.1; done && {then}"
    )


DVC_YAML = f"""\
stages:
  a:
    cmd: echo a > a.txt
    outs: [a.txt]
  b:
    cmd: {meets("b", "c", "cat a.txt > b.txt && echo b >> b.txt && echo b said this")}
    deps: [a.txt]
    outs: [b.txt]
  c:
    cmd: {meets("c", "b", "{c}")}
    deps: [a.txt]
    outs: [c.txt]
  d:
    cmd: cat b.txt c.txt > d.txt
    deps: [b.txt, c.txt]
    outs: [d.txt]
  e:
    cmd: echo e > e.txt
    outs: [e.txt]
"""


def make_repo(path: Path, c: str = "cat a.txt > c.txt") -> Path:
    path.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=path, check=True)
    (path / "dvc.yaml").write_text(DVC_YAML.replace("{c}", c))
    return path


def repro(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HALLUDETECT_REPRO_JOBS"}
    cmd = [sys.executable, "-m", "halludetect.cli", "repro", *args]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env)


def test_independent_stages_run_at_once_and_write_the_serial_runs_outputs_and_lock(tmp_path):
    par = make_repo(tmp_path / "par")
    res = repro(par, "-j", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "b | b said this" in out  # a command's lines carry its stage's name
    assert out.rstrip().splitlines()[-1].startswith("done: 5 stage(s) ran in ")
    assert out.index("Finished stage 'a'") < out.index("Running stage 'b'")  # b and c wait for a ...
    assert out.index("Finished stage 'c'") < out.index("Running stage 'd'")  # ... d for both
    # the same outputs and the same dvc.lock, byte for byte, as DVC's one-at-a-time run: there, b
    # waits for a c that never starts, so the serial run is given c's mark beforehand
    ser = make_repo(tmp_path / "ser")
    (ser / "started.c").touch()
    (ser / "started.b").touch()
    assert repro(ser).returncode == 0
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "dvc.lock"):
        assert (par / name).read_bytes() == (ser / name).read_bytes(), name


def test_a_failing_stage_lets_the_running_one_finish_and_starts_nothing_after_it(tmp_path):
    repo = make_repo(tmp_path / "r", c="exit 3")
    res = repro(repo, "-j", "2")
    assert res.returncode != 0
    assert "failed to reproduce 'c'" in res.stdout
    lock = (repo / "dvc.lock").read_text()
    assert "\n  b:\n" in lock and "\n  a:\n" in lock  # b ran beside c and is recorded: its work is kept
    assert "\n  d:\n" not in lock and not (repo / "d.txt").exists()  # d reads c: never started
    assert res.stdout.rstrip().splitlines()[-1].startswith("stopped: ")
    # --keep-going: what does not read c still runs (e, planned after d), d is skipped
    shutil.rmtree(repo / ".dvc/tmp", ignore_errors=True)
    (repo / "dvc.lock").unlink()
    res = repro(repo, "-j", "2", "--keep-going")
    assert res.returncode != 0 and "Stage 'd' will be skipped" in res.stdout
    assert (repo / "e.txt").exists() and not (repo / "d.txt").exists()


@pytest.mark.hostile
@pytest.mark.parametrize("to", ["group", "runner", "runner_sigterm"])
def test_ctrl_c_stops_every_running_stage_and_starts_no_other(tmp_path, to):
    """SIGINT to the run's process group, as a terminal's Ctrl-C, or to the runner's pid alone (`kill
    -INT`, which before was ignored while DVC started the next stages and the run exited 0), or a
    SIGTERM to it: once b and c are both running."""
    repo = make_repo(tmp_path / "r", c="sleep 30 && cat a.txt > c.txt")
    env = {k: v for k, v in os.environ.items() if k != "HALLUDETECT_REPRO_JOBS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "halludetect.cli", "repro", "-j", "2"],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + WAIT
    while not ((repo / "started.b").exists() and (repo / "started.c").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    # b finishes at once (c's mark is there); c sleeps: interrupt while c is running
    deadline = time.monotonic() + WAIT
    while "\n  b:\n" not in ((repo / "dvc.lock").read_text() if (repo / "dvc.lock").exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    if to == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT if to == "runner" else signal.SIGTERM)
    out = proc.communicate(timeout=WAIT)[0]
    assert proc.returncode != 0, out
    lock = (repo / "dvc.lock").read_text()
    assert "\n  b:\n" in lock and "\n  c:\n" not in lock and "\n  d:\n" not in lock
    assert "Running stage 'd'" not in out and out.rstrip().splitlines()[-1].startswith("stopped: "), out
    # the next run does what was left, and only that
    (repo / "dvc.yaml").write_text((repo / "dvc.yaml").read_text().replace("sleep 30 && ", ""))
    res = repro(repo, "-j", "2")
    assert res.returncode == 0 and "Running stage 'b'" not in res.stdout and "Running stage 'd'" in res.stdout


def test_jobs_is_halludetects_argument_and_a_bad_count_is_refused_before_anything_runs(tmp_path):
    assert split_jobs(["-f", "-j", "3", "train"]) == (["-f", "train"], 3)
    assert split_jobs(["--jobs=2", "-s", "x"]) == (["-s", "x"], 2)
    assert split_jobs(["-j4"]) == ([], 4)
    assert split_jobs(["--jobs", "auto"])[1] >= 1
    assert split_jobs([]) == ([], 1)
    for bad in (["-j", "0"], ["--jobs", "two"], ["-j"]):
        with pytest.raises(ValueError, match="jobs|-j"):
            split_jobs(bad)
    repo = make_repo(tmp_path / "r")
    res = repro(repo, "--jobs", "0")
    assert res.returncode == 2 and "--jobs takes a count" in res.stderr and not (repo / "a.txt").exists()


def test_entries_new_to_a_lock_are_written_in_plan_order_whatever_order_stages_end_in(tmp_path):
    """Stages that end as c, b, a are written a, b, c after the entries the lock held, per lock file
    (a plan may span two dvc.yaml files), by the entry-wise writer and by DVC's own (a hand-edited lock)."""
    from dvc.utils.serialize import _yaml

    root, sub = tmp_path / "dvc.lock", tmp_path / "sub" / "dvc.lock"
    sub.parent.mkdir()
    root.write_text("schema: '2.0'\nstages:\n  z:\n    cmd: echo z\n  y:\n    cmd: echo y\n")
    sub.write_text(
        "schema: '2.0'\nstages:\n  old:  # kept by hand: DVC's own writer keeps this file\n    cmd: echo o\n"
    )
    w = LockWriter(_yaml.modify_yaml, _yaml._dump)
    plan = [(sub, "a"), (root, "a"), (root, "b"), (sub, "b"), (root, "c"), (sub, "c")]
    w.order = {(str(path), name): i for i, (path, name) in enumerate(plan)}
    for path, name in [(sub, "c"), (root, "c"), (root, "b"), (sub, "b"), (sub, "a"), (root, "a")]:  # as they end
        with w.modify(path) as data:
            data["stages"][name] = {"cmd": f"echo {name}"}
    names = [
        line.strip(" :")
        for line in root.read_text().splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    ]
    assert names == ["z", "y", "a", "b", "c"]  # the entries it held stay as they were, first
    text = sub.read_text()
    assert "# kept by hand" in text and [text.index(f"  {n}:") for n in ("old", "a", "b", "c")] == sorted(
        text.index(f"  {n}:") for n in ("old", "a", "b", "c")
    )
    assert LockWriter(None, None).order is None  # one stage at a time: DVC's order, untouched


def test_a_stage_ends_when_its_command_exits_though_a_process_it_left_holds_its_output(tmp_path):
    """Stage a leaves a background process holding its stdout, which ends only once b has started:
    b reads a, so b starts only if a counted as ended when its command exited (not at the end of
    its output, which the background process holds)."""
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=repo, check=True)
    wait_for_go = f"i=0; while [ ! -e go ] && [ $i -lt {WAIT * 10} ]; do i=$((i+1)); sleep 0.1; done"
    background = f"{wait_for_go}; [ -e go ] && echo ok > bg.txt"
    (repo / "dvc.yaml").write_text(
        "stages:\n"
        f"  a:\n    cmd: ( {background} ) & echo a > a.txt\n    outs: [a.txt]\n"
        "  b:\n    cmd: touch go && cat a.txt > b.txt\n    deps: [a.txt]\n    outs: [b.txt]\n"
    )
    res = repro(repo, "-j", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (repo / "bg.txt").read_text() == "ok\n"  # b started while a's background process was alive


def test_a_single_stage_forced_with_jobs_is_counted(tmp_path):
    """`halludetect repro -j 2 -f -s a` runs DVC's own loop (a single item): its stage is counted as run
    (before: `done: 0 stage(s) ran` after running it)."""
    repo = make_repo(tmp_path / "r")
    assert repro(repo, "-j", "2").returncode == 0
    res = repro(repo, "-j", "2", "-f", "-s", "a")
    assert res.returncode == 0 and "Running stage 'a'" in res.stdout
    assert res.stdout.rstrip().splitlines()[-1].startswith("done: 1 stage(s) ran"), res.stdout
