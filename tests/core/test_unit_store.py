"""Resumable work units (halludetect/core/unit_store.py), the hostile cases: a unit with another schema
or a store with a garbage fingerprint is discarded with a warning, never read, and a unit is
fsynced before its rename, so a power loss cannot leave a renamed unit without its data; one run
owns a store: a second process on it stops at once naming the first, and a killed owner's claim
is taken over. (A truncated unit that generate recomputes: tests/lm/test_generation.py; two
`halludetect score` runs on one --out: tests/scoring/test_scorer.py.)"""

import json
import logging
import os
import subprocess
import sys

import polars as pl
import pytest
from support import ROOT


@pytest.mark.hostile
def test_generate_discards_a_unit_with_another_schema_with_a_warning(tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore
    from halludetect.lm.generation import GENERATIONS_SCHEMA

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
    store.release()
    pl.DataFrame({"question_id": ["q"], "text": ["hi"]}).write_parquet(tmp_path / "progress" / "unit_000000.parquet")
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA).prepare() == 0
    assert "discarding damaged work unit" in caplog.text and "(another schema (" in caplog.text


@pytest.mark.hostile
def test_generate_discards_a_store_with_a_garbage_fingerprint_with_a_warning(tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore

    store = UnitStore(tmp_path / "progress", {"run": 1})
    store.prepare()
    store.put(0, pl.DataFrame({"x": [1]}))
    store.release()
    (tmp_path / "progress" / "fingerprint.json").write_bytes(b'{"run": 1, \x00garbage')
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(tmp_path / "progress", {"run": 1}).prepare() == 0
    assert f"progress {tmp_path / 'progress'}: fingerprint.json is unreadable (JSONDecodeError: " in caplog.text
    assert "discarding its units" in caplog.text
    assert json.loads((tmp_path / "progress" / "fingerprint.json").read_text()) == {"run": 1}


@pytest.mark.hostile
def test_a_unit_file_copied_by_hand_over_another_is_discarded_with_a_warning(tmp_path, caplog):
    """Each unit records which unit of which run it holds: a copy over another unit's name, a unit
    of another run (another fingerprint, the same schema) or a file not written by the store would
    otherwise be merged as that unit (repeated and missing rows, no error)."""
    import shutil

    from halludetect.core.unit_store import UnitStore

    progress = tmp_path / "progress"
    store = UnitStore(progress, {"run": 1})
    store.prepare()
    for u in range(4):
        store.put(u, pl.DataFrame({"x": [u]}))
    store.release()
    other = UnitStore(tmp_path / "other", {"run": 2})
    other.prepare()
    other.put(2, pl.DataFrame({"x": [20]}))
    other.release()
    shutil.copy(progress / "unit_000000.parquet", progress / "unit_000001.parquet")  # unit 0's rows as unit 1
    shutil.copy(tmp_path / "other" / "unit_000002.parquet", progress / "unit_000002.parquet")
    pl.DataFrame({"x": [30]}).write_parquet(progress / "unit_000003.parquet")  # no record of what it holds
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(progress, {"run": 1}).prepare() == 1
    assert sorted(p.name for p in progress.glob("unit_*")) == ["unit_000000.parquet"]
    assert (
        f"discarding damaged work unit {progress / 'unit_000001.parquet'} (another unit's: it records unit 0, not 1;"
        in (caplog.text)
    )
    assert "unit_000002.parquet (another run's: it records unit 2 of a run with other params" in caplog.text
    assert "unit_000003.parquet (not written by this store: it records no unit;" in caplog.text
    assert caplog.text.count("it will be recomputed") == 3


@pytest.mark.hostile
def test_a_unit_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    from halludetect.core import atomic_io
    from halludetect.core.unit_store import UnitStore

    store = UnitStore(tmp_path / "progress", {"run": 1})
    store.prepare()
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        atomic_io.os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd)
    )
    monkeypatch.setattr(atomic_io.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    store.put(3, pl.DataFrame({"x": [1]}))
    unit = str(tmp_path / "progress" / "unit_000003.parquet")
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "replace", "fsync"], events  # the data, the rename, the directory entry
    assert events[0][1].startswith(str(tmp_path / "progress" / ".unit_000003.parquet."))
    assert events[1][1] == unit and events[2][1] == str(tmp_path / "progress")


# ------------------------------------------------------------------ one run owns a store
HOLD = """
import sys
import polars as pl
from halludetect.core.unit_store import UnitStore
store = UnitStore(sys.argv[1], {"run": 1})
store.prepare()
store.put(0, pl.DataFrame({"x": [1]}))
print("claimed", flush=True)
sys.stdin.read()  # hold the store until the test closes stdin (or kills this process)
store.remove()
"""


def holder(directory):
    """Another process that owns `directory` (a UnitStore holding one unit) until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    line = proc.stdout.readline()
    assert line == "claimed\n", proc.communicate(timeout=60)
    return proc


@pytest.mark.hostile
def test_a_second_run_on_a_store_in_use_stops_naming_the_running_process(tmp_path):
    from halludetect.core.unit_store import StoreBusy, UnitStore

    progress = tmp_path / "progress"
    proc = holder(progress)
    try:
        # the same work, or other work (which would otherwise discard the owner's units)
        for fingerprint in ({"run": 1}, {"run": 2}):
            with pytest.raises(StoreBusy) as e:
                UnitStore(progress, fingerprint, busy_hint=", or use another --out").prepare()
            msg = str(e.value)
            assert msg.startswith(f"{progress} is in use by another run: process {proc.pid}, started ")
            assert msg.endswith(
                "Two runs on one directory would mix their results: wait for it to finish "
                "(or stop it), or use another --out"
            )
            assert "\n" not in msg
        assert (progress / "unit_000000.parquet").exists()  # the owner's work is untouched
        assert json.loads((progress / "fingerprint.json").read_text()) == {"run": 1}
    finally:
        _, err = proc.communicate(timeout=60)  # closes its stdin: it finishes
    assert proc.returncode == 0, err
    assert not progress.exists()  # the owner finished and removed its store
    again = UnitStore(progress, {"run": 1})
    assert again.prepare() == 0  # free again
    again.release()


@pytest.mark.hostile
def test_a_killed_owners_claim_is_taken_over_and_its_units_kept(tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore

    progress = tmp_path / "progress"
    proc = holder(progress)
    proc.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock
    proc.communicate(timeout=60)
    store = UnitStore(progress, {"run": 1})
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert store.prepare() == 1
    assert f"progress {progress}: taking it over from process {proc.pid}, started " in caplog.text
    assert "which ended without finishing (killed?)" in caplog.text
    assert json.loads((progress / "owner.json").read_text())["pid"] == os.getpid()
    store.release()
    assert not (progress / "owner.json").exists()  # a clean release leaves nothing to take over
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(progress, {"run": 1}).prepare() == 1
    assert "taking it over" not in caplog.text


@pytest.mark.hostile
def test_generate_on_a_progress_directory_in_use_stops_naming_the_running_process(tmp_path):
    """The generate stage's --progress is a UnitStore: a second run by hand on it stops at once,
    one line and exit 2, before the model loads (this one does not even exist)."""
    from support import stage

    pl.DataFrame(
        {
            "id": ["q0"],
            "question": ["Where was Tavo Mir born?"],
            "answers": [["Calomar"]],
            "context": [None],
            "split": ["test"],
        },
        schema={
            "id": pl.String,
            "question": pl.String,
            "answers": pl.List(pl.String),
            "context": pl.String,
            "split": pl.String,
        },
    ).write_parquet(tmp_path / "questions.parquet")
    (tmp_path / "manifest.json").write_text("{}")
    proc = holder(tmp_path / "progress")
    try:
        res = stage(
            "stages.generate",
            "--model",
            "world",
            "--questions",
            str(tmp_path / "questions.parquet"),
            "--manifest",
            str(tmp_path / "manifest.json"),
            "--progress",
            str(tmp_path / "progress"),
            "--out",
            str(tmp_path / "g.parquet"),
            "--metrics",
            str(tmp_path / "g.json"),
        )
    finally:
        proc.communicate(timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and f"is in use by another run: process {proc.pid}, started " in errors[0]
    assert not (tmp_path / "g.parquet").exists()
