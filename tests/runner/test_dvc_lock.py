"""runner/dvc_lock.py: dvc.lock written entry by entry gives the bytes DVC's own writer gives."""

from __future__ import annotations

import copy
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dvc.utils.serialize import _yaml
from ruamel.yaml import YAML

from halludetect.core.code_deps import ROOT
from halludetect.runner import dvc_lock


def dvc_dump(data) -> str:
    buf = io.StringIO()
    _yaml._dump(data, buf)
    return buf.getvalue()


def writer() -> dvc_lock.LockWriter:
    return dvc_lock.LockWriter(_yaml.modify_yaml, _yaml._dump)


def test_the_entry_wise_text_of_the_repositorys_lock_is_dvcs():
    """The committed dvc.lock (85 stages, every family) as DVC dumps it, and after edits: an entry
    changed, one added at the end, one removed."""
    text = (ROOT / "dvc.lock").read_text()
    data = YAML(typ="safe").load(text)
    w = writer()
    assert w.text(data) == dvc_dump(data) == text
    stages = data["stages"]
    first = next(iter(stages))
    stages[first] = {**stages[first], "cmd": stages[first]["cmd"] + " --more " + "x" * 100}
    stages["new@a-b"] = copy.deepcopy(stages[first])
    del stages[list(stages)[3]]
    assert w.text(data) == dvc_dump(data)
    assert len(w.texts) == len(stages)  # the replaced and removed entries' texts are gone


def test_a_shape_it_does_not_reproduce_is_left_to_dvc():
    w = writer()
    assert w.text({"schema": "2.0", "stages": {}}) is None
    assert w.text({"schema": "2.0", "stages": {"a": {"cmd": "x"}}, "datasets": []}) is None


def run_writes(modify, path: Path, edits) -> list[str]:
    out = []
    for edit in edits:
        with modify(path) as data:
            edit(data)
        out.append(path.read_text())
    return out


def edits():
    def first(d):
        d.update({"schema": "2.0"})
        d["stages"] = {"a": {"cmd": "echo a", "outs": [{"path": "a.txt", "md5": "1", "size": 2}]}}

    def second(d):
        d["stages"].update({"b": {"cmd": "echo b: 'q'", "deps": [{"path": "a.txt", "md5": "1"}]}})

    def third(d):
        d["stages"].update({"a": {"cmd": "echo a2", "outs": [{"path": "a.txt", "md5": "3", "size": 2}]}})

    return [first, second, third]


def test_a_run_of_writes_gives_dvcs_bytes_and_heals_after_others_write(tmp_path):
    ours, theirs = tmp_path / "ours" / "dvc.lock", tmp_path / "theirs" / "dvc.lock"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    w = writer()
    got = run_writes(w.modify, ours, edits())
    assert got == run_writes(_yaml.modify_yaml, theirs, edits())
    # another writer (DVC itself, a checkout) changes the file: the next write starts from the file
    ours.write_text(theirs.read_text().replace("echo a2", "echo a3"))
    with w.modify(ours) as data:
        assert data["stages"]["a"]["cmd"] == "echo a3"
        data["stages"]["c"] = {"cmd": "echo c"}
    assert "echo a3" in ours.read_text() and ours.read_text() == dvc_dump(YAML(typ="safe").load(ours.read_text()))
    # a failure inside the block writes nothing and forgets the data it changed
    before = ours.read_text()
    with pytest.raises(RuntimeError), w.modify(ours) as data:
        data["stages"]["d"] = {"cmd": "echo d"}
        raise RuntimeError("a stage's lock entry could not be made")
    assert ours.read_text() == before and w.data is None
    with w.modify(ours) as data:
        assert "d" not in data["stages"]


def test_a_failed_write_forgets_what_it_did_not_write(tmp_path, monkeypatch):
    """A write that fails after the block (a full disk) leaves the file as it was, and the next write
    starts from the file, not from the entry that never reached it."""
    path = tmp_path / "dvc.lock"
    w = writer()
    run_writes(w.modify, path, edits()[:1])
    real = dvc_lock._write_atomically

    def full_disk(p, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dvc_lock, "_write_atomically", full_disk)
    with pytest.raises(OSError), w.modify(path) as data:
        data["stages"]["b"] = {"cmd": "echo b"}
    monkeypatch.setattr(dvc_lock, "_write_atomically", real)
    with w.modify(path) as data:
        data["stages"]["c"] = {"cmd": "echo c"}
    assert list(YAML(typ="safe").load(path.read_text())["stages"]) == ["a", "c"]


def test_what_only_dvcs_round_trip_keeps_goes_to_dvc(tmp_path):
    """A hand-edited lock (a comment, a flow list, a hex number) is written by DVC's round trip, which
    keeps them; the kept texts never mix an int key with its string (1 and '1')."""
    text = "schema: '2.0'\nstages:\n  a:  # checked by hand\n    cmd: echo a\n    outs: [x.txt]\n    n: 0x1F\n"
    ours, theirs = tmp_path / "ours" / "dvc.lock", tmp_path / "theirs" / "dvc.lock"
    for p in (ours, theirs):
        p.parent.mkdir()
        p.write_text(text)

    def edit(d):
        d["stages"]["b"] = {"cmd": "echo b"}

    assert run_writes(writer().modify, ours, [edit]) == run_writes(_yaml.modify_yaml, theirs, [edit])
    assert "# checked by hand" in ours.read_text()
    w = writer()
    for key in (1, "1", True, "true"):
        data = {"schema": "2.0", "stages": {"a": {"params": {"p.yaml": {key: 1}}}}}
        assert w.text(data) == dvc_dump(data)


def test_a_change_that_keeps_size_and_time_is_seen(tmp_path):
    """Another writer's change of the same length within the same clock tick is read, not overwritten."""
    path = tmp_path / "dvc.lock"
    w = writer()
    run_writes(w.modify, path, edits())
    st = path.stat()
    path.write_text(path.read_text().replace("md5: '3'", "md5: '4'"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    with w.modify(path) as data:
        data["stages"]["c"] = {"cmd": "echo c"}
    assert "md5: '4'" in path.read_text()


def test_other_files_go_to_dvcs_writer(tmp_path):
    calls = []

    @__import__("contextlib").contextmanager
    def original(path, fs=None):
        calls.append(os.fspath(path))
        yield {}

    w = dvc_lock.LockWriter(original, _yaml._dump)
    with w.modify(tmp_path / "dvc.yaml"):
        pass
    assert calls == [str(tmp_path / "dvc.yaml")]


DVC_YAML = """
stages:
  one:
    cmd: python -c "open('one.txt', 'w').write('1')"
    outs: [one.txt]
  two:
    foreach: [a, b, c]
    do:
      cmd: python -c "open('two_${item}.txt', 'w').write(open('one.txt').read() + '${item}')"
      deps: [one.txt]
      params: [k]
      outs:
        - two_${item}.txt
"""


def repo(path: Path) -> Path:
    path.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    subprocess.run(["git", "init", "-q"], cwd=path, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True)
    (path / "dvc.yaml").write_text(DVC_YAML)
    (path / "params.yaml").write_text("k: 1\n")
    return path


def test_dvc_repro_through_it_writes_the_lock_plain_dvc_writes(tmp_path):
    """The same pipeline reproduced by plain `dvc repro` and through this module (checking every write
    against DVC's dump): the same dvc.lock, and again after a parameter change re-runs a family."""
    plain, fast = repo(tmp_path / "plain"), repo(tmp_path / "fast")
    env = {**os.environ, dvc_lock.CHECK_ENV: "1", "PYTHONPATH": str(ROOT)}
    for step in range(2):
        if step:
            for r in (plain, fast):
                (r / "params.yaml").write_text("k: 2\n")
        out = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=plain, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        out = subprocess.run(
            [sys.executable, "-m", "halludetect.runner.dvc_lock", "repro", "-q"],
            cwd=fast,
            env=env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert (fast / "dvc.lock").read_text() == (plain / "dvc.lock").read_text()
        assert "two@c" in (fast / "dvc.lock").read_text()


def test_the_dvc_internals_the_runner_uses_are_those_of_the_installed_dvc():
    """The lock writer, the parallel runner, the plan's run-cache lookup and the experiments use DVC
    names beyond its documented API (runner/dvc_internals.py lists them all); on a DVC that lacks one
    they fall back (a warning, DVC's own writer, one stage at a time, "it runs"), which a user would
    hardly notice. Here that is a failure: CI runs this at the newest DVC (requirements.lock) and at
    the lowest pyproject.toml allows (.ci/dvc-range)."""
    code = (
        "from halludetect.runner import dvc_internals, dvc_lock, parallel_repro\n"
        "assert dvc_internals.tested(), dvc_internals.version()\n"
        "assert dvc_internals.missing() == [], dvc_internals.missing()\n"
        "writer = dvc_lock.install()\n"
        "assert writer is not None and parallel_repro.install(2, writer)\n"
    )
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_missing_dvc_internal_is_named_with_the_dvc_version_and_the_writer_falls_back_saying_so(monkeypatch):
    """A DVC release that renames one of the names: `get` names it and DVC's version; the lock writer
    leaves DVC's own in place and says why (the runner goes on, as plain DVC)."""
    from halludetect.runner import dvc_internals

    monkeypatch.setitem(dvc_internals.NAMES, "yaml", ("dvc.utils.serialize._no_such_module", None))
    with pytest.raises(dvc_internals.Missing, match=rf"DVC {re.escape(dvc_internals.version())} has no dvc\.utils"):
        dvc_internals.get("yaml._dump")
    assert any("_no_such_module" in m for m in dvc_internals.missing())
    with pytest.warns(UserWarning, match=r"DVC's own writer: DVC \S+ has no dvc\.utils\.serialize\._no_such"):
        assert dvc_lock.install() is None


def test_a_dvc_outside_the_tested_range_is_said_once(monkeypatch):
    from halludetect.runner import dvc_internals

    monkeypatch.setattr(dvc_internals, "version", lambda: "3.99.0")
    monkeypatch.setattr(dvc_internals, "_WARNED", False)
    low, high = dvc_internals.TESTED
    with pytest.warns(UserWarning, match=rf"DVC 3\.99\.0 is outside the versions .* tested with \({low} to {high}\)"):
        dvc_internals.get("Repo")
    dvc_internals.get("Repo")  # once: no second warning (pytest's filterwarnings turns one into an error)
