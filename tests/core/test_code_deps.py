"""The resume fingerprints of `generate` and `halludetect score` hash every file they run.

A kept unit (generate) or part (score) computed by old code must never join one computed by new
code: the fingerprint holds the sha256 of every file in the import closure of the stage or of the
scorer (halludetect/core/code_deps.py, the function that writes dvc.yaml's code deps), so an edit
to any of them discards what was kept. Each file of the closure is edited in a copy of the code
and the kept work checked to be discarded.
"""

from __future__ import annotations

import shutil
from argparse import Namespace

import polars as pl
import pytest

from halludetect.config import load_params
from halludetect.core import code_deps
from halludetect.core.unit_store import UnitStore

ROOT = code_deps.ROOT
GENERATE = "stages.generate"
SCORER = "halludetect.scoring.scorer"


@pytest.fixture
def code_copy(tmp_path, monkeypatch):
    """The code as a copy that a test may edit, with code_deps reading the copy."""
    copy = tmp_path / "code"
    for package in code_deps.PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(code_deps, "ROOT", copy)
    monkeypatch.setattr(code_deps, "FRONT_DOOR", copy / "halludetect" / "__init__.py")
    code_deps.explicit_imports.cache_clear()
    code_deps._runs_nothing.cache_clear()
    yield copy
    code_deps.explicit_imports.cache_clear()
    code_deps._runs_nothing.cache_clear()


def test_the_closures_hold_the_modules_the_hand_kept_lists_missed():
    """Sampling depends on how the model loads; scoring also on how a detector is built and on
    the prompt: the files the old hand-kept lists left out."""
    generate = set(code_deps.code_digest(GENERATE))
    assert {
        "halludetect/lm/hf_models.py",
        "halludetect/lm/generation.py",
        "halludetect/lm/model_inputs.py",
        "halludetect/prompts.py",
        "halludetect/config.py",
        "stages/generate.py",
    } <= generate
    scorer = set(code_deps.code_digest(SCORER))
    assert {
        "halludetect/lm/hf_models.py",
        "halludetect/detectors/build.py",
        "halludetect/detectors/networks.py",
        "halludetect/prompts.py",
        "halludetect/methods/pooling.py",
        "halludetect/scoring/bundle.py",
    } <= scorer


def test_generate_fingerprints_its_closure(tmp_path):
    from stages.generate import fingerprint

    params = load_params(ROOT / "params.yaml")
    (tmp_path / "q.parquet").write_bytes(b"questions")
    (tmp_path / "m.json").write_text("{}")
    args = Namespace(questions=tmp_path / "q.parquet", manifest=tmp_path / "m.json")
    assert fingerprint(args, params, params.model("world"))["code"] == code_deps.code_digest(GENERATE)


def test_the_scorer_fingerprints_its_closure(bundle_path, tiny_model_dir):
    from halludetect.scoring.scorer import Scorer

    scorer = Scorer(bundle_path, str(tiny_model_dir), device="cpu")
    assert scorer.fingerprint()["code"] == code_deps.code_digest(SCORER)


@pytest.mark.parametrize("module", [GENERATE, SCORER])
def test_editing_any_file_of_the_closure_discards_the_kept_work(module, code_copy, tmp_path):
    files = code_deps.closure(module)
    assert len(files) > 10
    unit = pl.DataFrame({"x": [1]})
    for path in files:
        store = UnitStore(tmp_path / "progress", {"code": code_deps.code_digest(module)})
        store.prepare()
        store.put(0, unit)
        store.release()
        original = path.read_bytes()
        path.write_bytes(original + b"\n# an edit\n")
        try:
            kept = UnitStore(tmp_path / "progress", {"code": code_deps.code_digest(module)}).prepare()
        finally:
            path.write_bytes(original)
        assert kept == 0, f"an edit to {path.relative_to(code_copy)} kept work computed before it"
    # unedited, the same code keeps the unit
    store = UnitStore(tmp_path / "progress", {"code": code_deps.code_digest(module)})
    store.prepare()
    store.put(0, unit)
    store.release()
    assert UnitStore(tmp_path / "progress", {"code": code_deps.code_digest(module)}).prepare() == 1


def test_the_command_writes_checks_and_refuses_in_one_line(tmp_path, capsys):
    """`make deps` on a dvc.yaml whose code stage misses a code folder rewrites it; --check names the
    stale stage, and a stage that lists a code file or another module's digest; a bad module name or
    a missing file is one line and exit 2."""
    text = (ROOT / "dvc.yaml").read_text()
    stale = text.replace("      - stages\n", "", 1)
    assert stale != text
    path = tmp_path / "dvc.yaml"
    path.write_text(stale)
    assert code_deps.main(["--check", "--dvc-yaml", str(path)]) == 1
    assert "stage 'code' lists ['halludetect'], expected the code folders" in capsys.readouterr().err
    assert code_deps.main(["--write", "--dvc-yaml", str(path)]) == 0
    assert path.read_text() == text
    assert code_deps.main(["--check", "--dvc-yaml", str(path)]) == 0
    capsys.readouterr()
    wrong = text.replace("      - data/code/prepare.txt\n", "      - halludetect/qa/datasets.py\n", 1)
    wrong = wrong.replace("      - data/code/judge.txt\n", "      - data/code/cluster.txt\n", 1)
    path.write_text(wrong)
    assert code_deps.main(["--check", "--dvc-yaml", str(path)]) == 1
    err = capsys.readouterr().err
    assert "stage 'prepare' lists code files ['halludetect/qa/datasets.py']" in err
    assert "stage 'judge' lists the code digests ['data/code/cluster.txt'], expected [data/code/judge.txt]" in err
    assert code_deps.main(["--module", "stages.nope"]) == 2
    assert code_deps.main(["--check", "--dvc-yaml", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "no module 'stages.nope'" in err and "none.yaml" in err
