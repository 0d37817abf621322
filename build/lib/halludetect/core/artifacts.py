"""Opening the files one stage hands to another, so that a damaged one is named with its fix.

Stages read Parquet tables, HDF5 layer files and safetensors detectors that an earlier stage
wrote. A file cut short (a full disk, a killed copy), emptied, or replaced by something else
makes the libraries raise their own errors (polars `ComputeError`, h5py `OSError`,
`SafetensorError`), which name neither the file's role nor what to do. Everything here turns
them into an `ArtifactError` naming the file and the stage that rewrites it.

The library imports happen inside the functions: `prepare` never loads h5py, `report` never
loads safetensors.
"""

from __future__ import annotations

from pathlib import Path

from halludetect.core.errors import DataError


class ArtifactError(DataError):
    """A file written by an earlier stage that is missing, unreadable or inconsistent."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def damaged(path: str | Path, what: str, writer: str, err: BaseException | str) -> ArtifactError:
    """The error for a file that exists but cannot be used: what it should be, why, the fix."""
    why = err if isinstance(err, str) else _first_line(err)
    return ArtifactError(
        f"{path}: not a readable {what} ({why}); it is damaged or not what the {writer} stage "
        f"writes: re-run {writer} to rewrite it (dvc repro --force the {writer} stage)"
    )


def missing(path: str | Path, writer: str) -> ArtifactError:
    return ArtifactError(f"{path} does not exist: run the {writer} stage first (or dvc pull it)")


def read_parquet(path: str | Path, writer: str, what: str = "Parquet table"):
    """A Parquet file written by the stage `writer`, as a polars DataFrame."""
    import polars as pl

    path = Path(path)
    if not path.exists():
        raise missing(path, writer)
    try:
        return pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError) as e:
        raise damaged(path, what, writer, e) from None


def open_hdf5(path: str | Path, writer: str, what: str = "HDF5 file"):
    """An HDF5 file opened read-only (never `a`/`r+`: DVC may hardlink it from its cache)."""
    import h5py

    path = Path(path)
    if not path.exists():
        raise missing(path, writer)
    try:
        return h5py.File(path, "r")
    except OSError as e:  # truncated, empty, not HDF5 at all
        raise damaged(path, what, writer, e) from None


def safetensors_metadata(path: str | Path, writer: str, what: str = "safetensors file") -> dict[str, str]:
    """The metadata map of a safetensors file (its header only: no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise missing(path, writer)
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise damaged(path, what, writer, e) from None


def load_safetensors(path: str | Path, writer: str, what: str = "safetensors file") -> dict:
    """Every tensor of a safetensors file (no pickles are involved)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise missing(path, writer)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise damaged(path, what, writer, e) from None
