"""Resumable work units (halludetect/core/unit_store.py), the hostile cases: a unit with another schema
or a store with a garbage fingerprint is discarded with a warning, never read, and a unit is
fsynced before its rename, so a power loss cannot leave a renamed unit without its data. (A
truncated unit that generate recomputes: tests/lm/test_generation.py.)"""

import json
import logging
import os

import polars as pl
import pytest


@pytest.mark.hostile
def test_generate_discards_a_unit_with_another_schema_with_a_warning(tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore
    from halludetect.lm.generation import GENERATIONS_SCHEMA

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
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
    (tmp_path / "progress" / "fingerprint.json").write_bytes(b'{"run": 1, \x00garbage')
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(tmp_path / "progress", {"run": 1}).prepare() == 0
    assert f"progress {tmp_path / 'progress'}: fingerprint.json is unreadable (JSONDecodeError: " in caplog.text
    assert "discarding its units" in caplog.text
    assert json.loads((tmp_path / "progress" / "fingerprint.json").read_text()) == {"run": 1}


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
