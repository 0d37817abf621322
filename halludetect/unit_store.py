"""Finished work units of a long stage, kept on disk so that a killed run resumes.

    <dir>/fingerprint.json     what the units were computed from
    <dir>/unit_000012.parquet  one file per finished unit, each written atomically

The directory lives next to the stage's output but is not a DVC output, so `dvc repro`
does not delete it before re-running the stage. If the fingerprint (params, model, inputs,
code) differs from the one on disk, the old units are discarded: a resumed run never mixes
results computed two different ways. The stage removes the directory once its real output
is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl

from halludetect.atomic_io import write_json, write_parquet


class UnitStore:
    def __init__(self, directory: str | Path, fingerprint: dict):
        self.dir = Path(directory)
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))  # JSON-normalised

    def _path(self, unit: int) -> Path:
        return self.dir / f"unit_{unit:06d}.parquet"

    def prepare(self) -> int:
        """Keep matching units from an earlier run, discard others; return how many were kept."""
        stamp = self.dir / "fingerprint.json"
        if self.dir.exists():
            old = json.loads(stamp.read_text()) if stamp.exists() else None
            if old == self.fingerprint:
                return len(self.finished())
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        write_json(stamp, self.fingerprint)
        return 0

    def finished(self) -> set[int]:
        return {int(p.stem.split("_")[1]) for p in self.dir.glob("unit_*.parquet")}

    def put(self, unit: int, df: pl.DataFrame) -> None:
        write_parquet(self._path(unit), df)

    def paths(self, n_units: int) -> list[Path]:
        """Every unit's file in unit order (for merges that stream rather than load them all)."""
        missing = sorted(set(range(n_units)) - self.finished())
        if missing:
            raise RuntimeError(f"{len(missing)} work units missing in {self.dir} (e.g. {missing[:5]})")
        return [self._path(u) for u in range(n_units)]

    def merge(self, n_units: int) -> pl.DataFrame:
        return pl.concat([pl.read_parquet(p) for p in self.paths(n_units)], how="vertical")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
