"""Finished work units of a long stage, kept on disk so that a killed run resumes.

    <dir>/fingerprint.json     what the units were computed from
    <dir>/unit_000012.parquet  one file per finished unit, each written atomically and durably

The directory lives next to the stage's output but is not a DVC output, so `dvc repro`
does not delete it before re-running the stage. If the fingerprint (params, model, inputs,
code) differs from the one on disk, the old units are discarded: a resumed run never mixes
results computed two different ways. The stage removes the directory once its real output
is written.

Damaged state never blocks a re-run: a unit file is fsynced before its rename (so a power
loss leaves the whole unit or none), and `prepare` still reads every kept unit back. One
that is unreadable (truncated, empty) or has another schema is discarded with a warning
naming it, and recomputed; an unreadable `fingerprint.json` discards the whole store, with a
warning. Each unit file also carries what it holds, in its Parquet key-value metadata
(`halludetect.unit`: its unit number and the digest of the fingerprint it was computed under):
a file copied by hand over another unit's name (one unit's rows over another's, or a unit of
another run) would give repeated and missing rows with no error, so it is discarded the same way.

One run owns a store at a time. `prepare` claims it before it reads or discards anything:

    <dir>/owner.lock           an exclusive lock (flock), held for as long as the run has the store
    <dir>/owner.json           who holds it: pid, host, start time (for the message of a refused run)

A second run on the same directory (two `halludetect score` with one --out, say) stops at once
with a `StoreBusy` naming the running process, before it reads or writes any unit: two runs never
mix their units, and neither loses its work to the other. The lock belongs to the open file: the
kernel drops it when the owner exits or is killed (SIGKILL, OOM), so a dead owner's claim is
taken over by the next run at once, with no lease to expire and no reused pid to mistake for it;
the next run logs whose claim it took over. Several processes of one run (the data-parallel
workers of `generate`) share the store: the main one claims it, the others only put units.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import polars as pl

from halludetect.core.atomic_io import atomic_path, write_json
from halludetect.core.errors import DataError, UserError
from halludetect.core.processes import HOST, pid_alive

log = logging.getLogger("halludetect")
UNIT = re.compile(r"unit_(\d{6,})\.parquet")
LOCK, OWNER, FINGERPRINT = "owner.lock", "owner.json", "fingerprint.json"
HOLDS = b"halludetect.unit"  # a unit file's key-value metadata: {"unit": N, "fingerprint": sha256}


class StoreBusy(UserError):
    """Another run holds the store: its units are not ours to read, discard or add to."""


def describe_owner(record: dict | None) -> str:
    if not record:
        return "another process (it has just started: its record is not written yet)"
    where = "" if record.get("host") == HOST else f" on host {record.get('host')}"
    return f"process {record.get('pid')}{where}, started {record.get('started')}"


class UnitStore:
    def __init__(self, directory: str | Path, fingerprint: dict, schema: dict | None = None, *, busy_hint: str = ""):
        """`schema` (column -> polars dtype): what every unit must hold; None accepts any readable unit.
        `busy_hint`: what a refused second run can do instead (e.g. ", or write to another --out")."""
        self.dir = Path(directory)
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))  # JSON-normalised
        self._digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()
        self.schema = pl.Schema(schema) if schema is not None else None
        self.busy_hint = busy_hint
        self._lock = None  # the open lock file while this object owns the store

    # ------------------------------------------------------------------ ownership
    def _owner(self) -> dict | None:
        try:
            record = json.loads((self.dir / OWNER).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return record if isinstance(record, dict) else None

    def _refuse(self) -> StoreBusy:
        # The owner writes its record just after it takes the lock: give it a moment to appear.
        for _ in range(20):
            record = self._owner()
            if record and (record.get("host") != HOST or pid_alive(record.get("pid"))):
                break
            time.sleep(0.05)
        else:
            record = None
        mine = record is not None and record.get("host") == HOST and record.get("pid") == os.getpid()
        who = f"this process ({os.getpid()}), through another UnitStore" if mine else describe_owner(record)
        return StoreBusy(
            f"{self.dir} is in use by another run: {who}. Two runs on one directory would mix their "
            f"results: wait for it to finish (or stop it){self.busy_hint}"
        )

    def claim(self) -> None:
        """Own the store, or raise `StoreBusy` naming the run that does. A dead owner's claim (its
        process ended without finishing) is taken over, with a warning naming it."""
        if self._lock is not None:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"{self.dir} is a file, not a progress directory: move it away") from None
        path = self.dir / LOCK
        while True:
            f = path.open("a+b")  # not inherited by child processes (O_CLOEXEC)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                raise self._refuse() from None
            except OSError as e:
                f.close()
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise UserError(
                        f"{path}: this filesystem has no file locks ({e.strerror}), so two runs could not "
                        "be kept apart: put the output (or progress directory) on a local disk"
                    ) from None
                raise
            # A finishing owner removes the directory: the file we locked may no longer be the one
            # at `path` (a third run may have made a new one). Only the lock on the live file counts.
            try:
                st, here = path.stat(), os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                    break
            except FileNotFoundError:
                pass
            f.close()
            self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = f
        if (previous := self._owner()) is not None:
            log.warning(
                "progress %s: taking it over from %s, which ended without finishing (killed?); its "
                "finished units are kept if they match",
                self.dir,
                describe_owner(previous),
            )
        write_json(
            self.dir / OWNER, {"pid": os.getpid(), "host": HOST, "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        )

    def release(self) -> None:
        """Give the store up (its units stay, for a later run); a no-op when this object does not own it."""
        if self._lock is None:
            return
        (self.dir / OWNER).unlink(missing_ok=True)
        self._lock.close()  # the lock goes with the file
        self._lock = None

    def __enter__(self) -> UnitStore:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        # An owner dropped without release() gives the store up, like a process that exits.
        if getattr(self, "_lock", None) is not None:
            self.release()

    # ------------------------------------------------------------------ units
    def _path(self, unit: int) -> Path:
        return self.dir / f"unit_{unit:06d}.parquet"

    def _stamp(self) -> dict | None:
        """The fingerprint on disk; None (with a warning) when it is missing or unreadable."""
        stamp = self.dir / FINGERPRINT
        try:
            return json.loads(stamp.read_text())
        except FileNotFoundError:
            log.warning("progress %s has no fingerprint.json: discarding its units", self.dir)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            log.warning(
                "progress %s: fingerprint.json is unreadable (%s: %s): discarding its units",
                self.dir,
                type(e).__name__,
                e,
            )
        return None

    def prepare(self) -> int:
        """Claim the store (`claim`), then keep matching, readable units from an earlier run and
        discard the others; return how many were kept."""
        self.claim()
        earlier = [p for p in self.dir.iterdir() if p.name not in (LOCK, OWNER)]
        if earlier:
            old = self._stamp()
            if old == self.fingerprint:
                self._discard_damaged()
                return len(self.finished())
            if old is not None:
                log.info(
                    "progress %s was computed differently (params, model, inputs or code): discarding it", self.dir
                )
            for p in earlier:  # everything but the claim, which stays ours
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        write_json(self.dir / FINGERPRINT, self.fingerprint)
        return 0

    def _read(self, path: Path) -> tuple[pl.DataFrame | None, str | None]:
        """(the unit, None), or (None, why it cannot be kept)."""
        try:
            df = pl.read_parquet(path)
        except (pl.exceptions.PolarsError, OSError) as e:
            return None, f"unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.schema is not None and df.schema != self.schema:
            return None, f"another schema ({dict(df.schema)} instead of {dict(self.schema)})"
        return df, self._holds(path)

    def _holds(self, path: Path) -> str | None:
        """Why the file at `path` is not the unit its name says of this store's run; None when it is."""
        import pyarrow.parquet as pq

        try:
            holds = json.loads((pq.read_schema(path).metadata or {})[HOLDS])
            unit, digest = int(holds["unit"]), str(holds["fingerprint"])
        except Exception:  # no such entry, or not ours: any file not written by `put`
            return "not written by this store: it records no unit; copied in by hand?"
        named = int(UNIT.fullmatch(path.name)[1])
        if digest != self._digest:
            return f"another run's: it records unit {unit} of a run with other params, inputs or code; copied by hand?"
        if unit != named:
            return f"another unit's: it records unit {unit}, not {named}; copied over this name by hand?"
        return None

    def _discard_damaged(self) -> None:
        for tmp in self.dir.glob(".*.tmp"):  # a write that a kill interrupted before its rename
            tmp.unlink()
        for path in sorted(self.dir.glob("unit_*.parquet")):
            why = "not a unit name" if not UNIT.fullmatch(path.name) else self._read(path)[1]
            if why:
                log.warning("discarding damaged work unit %s (%s); it will be recomputed", path, why)
                path.unlink()

    def finished(self) -> set[int]:
        return {int(m[1]) for p in self.dir.glob("unit_*.parquet") if (m := UNIT.fullmatch(p.name))}

    def put(self, unit: int, df: pl.DataFrame) -> None:
        """Keep a finished unit. The file records which unit of which run it holds (module docstring),
        through pyarrow: polars writes no key-value metadata before 1.26. Durable: a later run trusts
        a unit that exists (after reading it back once)."""
        import pyarrow.parquet as pq

        table = df.to_arrow()
        holds = json.dumps({"unit": unit, "fingerprint": self._digest}, sort_keys=True).encode()
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), HOLDS: holds})
        with atomic_path(self._path(unit), durable=True) as tmp:
            pq.write_table(table, tmp)

    def paths(self, n_units: int) -> list[Path]:
        """Every unit's file in unit order (for merges that stream rather than load them all)."""
        missing = sorted(set(range(n_units)) - self.finished())
        if missing:
            raise RuntimeError(f"{len(missing)} work units missing in {self.dir} (e.g. {missing[:5]})")
        return [self._path(u) for u in range(n_units)]

    def read(self, unit: int) -> pl.DataFrame:
        """One finished unit; a damaged one is an error that says a re-run heals it."""
        df, why = self._read(self._path(unit))
        if why:
            raise DataError(
                f"work unit {self._path(unit)} is {why}; re-run the stage: it discards the damaged "
                "unit and computes it again"
            )
        return df

    def merge(self, n_units: int) -> pl.DataFrame:
        self.paths(n_units)  # every unit there
        return pl.concat([self.read(u) for u in range(n_units)], how="vertical")

    def remove(self) -> None:
        """Delete the store (its results are in the real output now) and give up the claim."""
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
