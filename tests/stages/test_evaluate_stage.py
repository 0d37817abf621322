"""The evaluate stage (stages/evaluate.py), the hostile case: a layer of grid.layers without figures, or
a missing layer file of the chosen layer, is an error naming the file and the stage to run, never a
layer silently left out."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support import base_params, stage, write_params

from halludetect.activations.layer_format import layer_filename


def evaluate_stage(root: Path) -> subprocess.CompletedProcess:
    return stage(
        "stages.evaluate",
        "--params",
        str(root / "params.yaml"),
        "--model",
        "m",
        "--dataset",
        "d",
        "--method",
        "max",
        "--layer-metrics",
        str(root / "layers"),
        "--scores",
        str(root / "scores"),
        "--detectors",
        str(root / "dets"),
        "--activations",
        str(root / "acts"),
        "--judgments",
        str(root / "judgments.parquet"),
        "--out",
        str(root / "e.json"),
        "--plot",
        str(root / "p.json"),
    )


@pytest.mark.hostile
def test_evaluate_fails_naming_a_missing_layer_file_of_a_trained_layer(trained):
    """A layer of grid.layers whose figures are missing (its train stage never ran, or its file
    was never pulled) is an error, not a layer silently left out of the choice of the best one;
    so is a missing layer file of the chosen layer."""
    write_params(
        trained / "params.yaml",
        {**yaml.safe_load((trained / "params.yaml").read_text()), "grid": {**base_params()["grid"], "layers": [0, 1]}},
    )
    (trained / "layers" / "layer_1.json").unlink()
    res = evaluate_stage(trained)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        f"error: {trained / 'layers' / 'layer_1.json'} is missing: run the train stage of layer 1 first "
        "(grid.layers lists the layers evaluated)"
    ) in res.stderr
    shutil.copy(trained / "layers" / "layer_0.json", trained / "layers" / "layer_1.json")  # layer 1 back, as 0's
    (trained / "acts" / layer_filename(0)).unlink()
    res = evaluate_stage(trained)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {trained / 'acts' / layer_filename(0)} does not exist: run the dump stage first" in res.stderr
    assert not (trained / "e.json").exists()
