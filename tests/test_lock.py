"""requirements.lock (`make lock`, uv's resolution of pyproject.toml's ranges) is what `make venv`
installs: every machine gets the same versions, where pyproject's ranges alone let a fresh machine
take whatever is newest that day (issue 53). The lock must pin every dependency, within its range."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support import ROOT


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line):
            pins[canonicalize_name(m[1])] = m[2]
    return pins


def test_the_lock_pins_every_dependency_within_pyprojects_range():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    pins = _pins()
    assert len(pins) > 100, "requirements.lock holds the whole resolution, not the direct dependencies only"
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned in pyproject, installed first from the CPU build (Makefile)
            assert name not in pins
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        assert name in pins, f"{req.name} is not in requirements.lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}: run `make lock`"
        )


def test_the_lock_pulls_no_cuda_build():
    """Resolved with the CPU build of torch (pip's find-links): no CUDA libraries, which PyPI's torch
    would bring (several GB on a machine with no GPU)."""
    assert not [name for name in _pins() if name.startswith(("nvidia-", "triton"))]


def test_the_dvc_range_the_runner_names_as_tested_is_the_range_ci_tests():
    """runner/dvc_internals.py's TESTED: the lowest DVC is pyproject's floor (.ci/dvc-range installs
    it), the newest is the lock's pin (`make test` runs it); an upgrade of either moves it."""
    from halludetect.runner.dvc_internals import TESTED

    floor = re.search(r'"dvc>=([0-9.]+),', (ROOT / "pyproject.toml").read_text())[1]
    assert (f"{floor}.0" if floor.count(".") == 1 else floor, _pins()["dvc"]) == TESTED
