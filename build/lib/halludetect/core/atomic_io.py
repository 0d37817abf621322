"""Atomic outputs: everything is written to a temporary sibling, then renamed into place.

A stage killed mid-way therefore leaves either the previous output or nothing, never a
half-written file that DVC or the next stage would take for a result. A rename alone does
not survive a power loss, though: the new name can reach the disk before the data does. Files
that a later run trusts without re-checking their bytes (resume units) are written
`durable=True`: the data is fsynced before the rename and the directory after it.

The temporary sibling is created at the mode a plain `open()` or `mkdir()` gives (0666 or 0777,
less the umask), not `tempfile`'s private 0600 or 0700: the rename keeps the mode, so every output
is as readable to a colleague as any other file the umask lets them read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import polars as pl


def temp_sibling(path: Path, *, is_dir: bool = False) -> Path:
    """A new, empty file (or directory) `.<name>.<random>.tmp` next to `path`, created exclusively
    at the umask's mode (module docstring)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            if is_dir:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        except FileExistsError:
            continue  # a name another writer drew: draw again
        return tmp
    raise FileExistsError(f"no free temporary name next to {path} after 100 tries")


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, is_dir: bool = False, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success move it over `path`.

    `durable` (files only): fsync the data before the rename and the directory after it, so
    that after a power loss `path` holds either the old bytes or all of the new ones."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path, is_dir=is_dir)
    try:
        yield tmp
        if is_dir:
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        else:
            if durable:
                fsync_path(tmp)
            os.replace(tmp, path)
            if durable:
                fsync_path(path.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_parquet(path: str | Path, df: pl.DataFrame, *, durable: bool = False) -> None:
    # No statistics timestamps are written by polars, so equal frames give equal bytes.
    with atomic_path(path, durable=durable) as tmp:
        df.write_parquet(tmp)


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
