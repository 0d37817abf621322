"""Atomic outputs (halludetect/core/atomic_io.py): a file or directory written through a temporary
sibling ends with the mode the umask gives any other file (a colleague can read a sweep table or
an explain page where the umask allows it), never tempfile's private 0600 or 0700."""

import os
import stat

import polars as pl
import pytest

from halludetect.core.atomic_io import atomic_path, write_json, write_parquet, write_text


@pytest.fixture
def umask():
    """Set the process's umask for a test, and restore it after."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.hostile
@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomically_written_files_and_directories_respect_the_umask(tmp_path, umask, mask):
    umask(mask)
    write_text(tmp_path / "page.html", "<p>hi</p>")
    write_json(tmp_path / "table.json", {"a": 1})
    write_parquet(tmp_path / "scores.parquet", pl.DataFrame({"x": [1]}), durable=True)
    with atomic_path(tmp_path / "layer", is_dir=True) as tmp:
        (tmp / "seed_0.txt").write_text("w")
    plain = tmp_path / "plain.txt"
    plain.write_text("as open() makes it")
    for name in ("page.html", "table.json", "scores.parquet"):
        assert mode(tmp_path / name) == 0o666 & ~mask == mode(plain), name
    assert mode(tmp_path / "layer") == 0o777 & ~mask
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary sibling left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    write_text(tmp_path / "out.txt", "old")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "out.txt") as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert (tmp_path / "out.txt").read_text() == "old" and not list(tmp_path.glob(".*.tmp"))
