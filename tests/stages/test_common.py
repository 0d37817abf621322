"""The stages' plumbing (stages/common.py): bad input (params, a missing dataset file) is one clear line
on stderr and exit status 2, without a traceback, and nothing is written."""

import subprocess
import sys

import yaml
from support import base_params as base


def run_prepare(tmp_path, data: dict, dataset: str):
    """Run the prepare stage as DVC would, with `data` as its params file."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(data))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.prepare",
            "--params",
            str(params),
            "--dataset",
            dataset,
            "--out",
            str(tmp_path / "q.parquet"),
            "--metrics",
            str(tmp_path / "m.json"),
        ],
        capture_output=True,
        text=True,
    )


def test_stage_reports_bad_params_without_traceback(tmp_path):
    data = base()
    data["prepare"]["tran"] = 0.5
    res = run_prepare(tmp_path, data, "world")
    assert res.returncode == 2
    assert "prepare.tran: unknown key; did you mean 'train'?" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "q.parquet").exists()  # nothing written


def test_stage_missing_dataset_file_is_one_clear_line(tmp_path):
    data = base()
    data["datasets"]["bioasq"]["path"] = str(tmp_path / "training11b.json")
    res = run_prepare(tmp_path, data, "bioasq")
    assert res.returncode == 2 and "register at bioasq.org" in res.stderr and "Traceback" not in res.stderr
