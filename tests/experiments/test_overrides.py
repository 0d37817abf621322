"""`dvc exp run -S` values checked before DVC runs anything (halludetect/experiments/overrides.py):
each run's params.yaml made by DVC's own edit on a copy of the repository's params.yaml and read by
the stages' own check."""

from __future__ import annotations

import re

import pytest
from support import ROOT

from halludetect.experiments.overrides import problems, runs


@pytest.fixture
def here(tmp_path):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    return tmp_path


def test_values_the_stages_accept_are_no_problem_and_the_file_is_untouched(here):
    before = (here / "params.yaml").read_bytes()
    assert problems(["detectors.max.dim=128", "grid.layers=[0,2]", "grid.transfer=[]"], here) == []
    assert problems([], here) == []
    assert (here / "params.yaml").read_bytes() == before


def test_a_sweep_is_checked_point_by_point_and_each_bad_point_named(here):
    assert runs(["detectors.max.dim=8,32"]) == [
        {"params.yaml": ["detectors.max.dim=8"]},
        {"params.yaml": ["detectors.max.dim=32"]},
    ]
    found = problems(["detectors.max.dim=8,abc,1.5"], here)
    assert len(found) == 2, found
    assert found[0].startswith("-S detectors.max.dim=abc: detectors.max.dim: Input should be a valid integer")
    assert found[1].startswith("-S detectors.max.dim=1.5: detectors.max.dim: ")


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        # the case: a word where dvc.yaml iterates a list (DVC: "'Value' object is not iterable")
        (["grid.transfer=off"], r"^-S grid\.transfer=off: grid: grid\.transfer: 'off' is the former form; write"),
        # a key params.yaml lacks: DVC says "Invalid `--set-param` value" and names nothing
        (
            ["detectors.max.dims=3"],
            r"^-S detectors\.max\.dims=3: detectors\.max\.dims: unknown key; did you mean 'dim'\?",
        ),
        (["train.seeds=[true]"], r"^-S train\.seeds=\[true\]: train\.seeds: true or false where a number is meant"),
        (["detectors.max.dim=["], r"^-S detectors\.max\.dim=\[: DVC cannot read it: "),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key_and_the_value(here, given, expected):
    found = problems(given, here)
    assert len(found) == 1 and re.search(expected, found[0]), found


@pytest.mark.hostile
def test_a_bad_params_file_is_named_before_any_value(here):
    text = (here / "params.yaml").read_text()
    former = re.sub(r"(?m)^  transfer:.*\n(?:  #.*\n)*(?:  - .*\n)+", "  transfer: off\n", text, count=1)
    assert former != text
    (here / "params.yaml").write_text(former)
    found = problems(["detectors.max.dim=128"], here)
    assert found and all(line.startswith("params.yaml: ") for line in found) and "grid.transfer" in found[0]


def test_values_for_another_params_file_are_left_to_dvc(here):
    assert problems(["other.yaml:anything=1"], here) == []
