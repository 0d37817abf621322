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
warning.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import polars as pl

from halludetect.core.atomic_io import write_json, write_parquet
from halludetect.core.errors import DataError

log = logging.getLogger("halludetect")
UNIT = re.compile(r"unit_(\d{6,})\.parquet")


class UnitStore:
    def __init__(self, directory: str | Path, fingerprint: dict, schema: dict | None = None):
        """`schema` (column -> polars dtype): what every unit must hold; None accepts any readable unit."""
        self.dir = Path(directory)
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))  # JSON-normalised
        self.schema = pl.Schema(schema) if schema is not None else None

    def _path(self, unit: int) -> Path:
        return self.dir / f"unit_{unit:06d}.parquet"

    def _stamp(self) -> dict | None:
        """The fingerprint on disk; None (with a warning) when it is missing or unreadable."""
        stamp = self.dir / "fingerprint.json"
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
        """Keep matching, readable units from an earlier run, discard others; return how many were kept."""
        if self.dir.exists():
            old = self._stamp()
            if old == self.fingerprint:
                self._discard_damaged()
                return len(self.finished())
            if old is not None:
                log.info(
                    "progress %s was computed differently (params, model, inputs or code): discarding it", self.dir
                )
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        write_json(self.dir / "fingerprint.json", self.fingerprint)
        return 0

    def _read(self, path: Path) -> tuple[pl.DataFrame | None, str | None]:
        """(the unit, None), or (None, why it cannot be kept)."""
        try:
            df = pl.read_parquet(path)
        except (pl.exceptions.PolarsError, OSError) as e:
            return None, f"unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.schema is not None and df.schema != self.schema:
            return None, f"another schema ({dict(df.schema)} instead of {dict(self.schema)})"
        return df, None

    def _discard_damaged(self) -> None:
        for path in sorted(self.dir.glob("unit_*.parquet")):
            why = "not a unit name" if not UNIT.fullmatch(path.name) else self._read(path)[1]
            if why:
                log.warning("discarding damaged work unit %s (%s); it will be recomputed", path, why)
                path.unlink()

    def finished(self) -> set[int]:
        return {int(m[1]) for p in self.dir.glob("unit_*.parquet") if (m := UNIT.fullmatch(p.name))}

    def put(self, unit: int, df: pl.DataFrame) -> None:
        # Durable: a later run trusts a unit that exists (after reading it back once).
        write_parquet(self._path(unit), df, durable=True)

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
        shutil.rmtree(self.dir, ignore_errors=True)
