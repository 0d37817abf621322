"""The evaluate stage (stages/evaluate.py), the hostile case: a layer of grid.layers without figures, or
a missing layer file of the chosen layer, is an error naming the file and the stage to run, never a
layer silently left out."""

import json
import subprocess
from pathlib import Path

import pytest
from support import stage

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
        "--timing",
        str(root / "timing.json"),
    )


@pytest.mark.hostile
def test_evaluate_fails_naming_a_missing_layer_file_of_a_trained_layer(trained):
    """Every file of every layer of grid.layers (figures, scores, weights, the layer file) must be
    there: before, a missing layer file of a layer other than the best exited 0 (the stage reads
    only the best layer's, while DVC records the whole dump directory as its input). Each missing
    file is named with its layer and the stage that writes it, all at once, before any work."""
    # the train stage's record of the layers it trained (here layers 0 and 1, one second each)
    one = {"seconds_per_seed": {"0": 1.0}, "mean_seconds_per_seed": 1.0, "wall_seconds": 1.0}
    (trained / "timing.json").write_text(json.dumps({"layer_0": one, "layer_1": one}))
    figures = trained / "layers" / "layer_1.json"
    kept = figures.read_bytes()
    figures.unlink()
    res = evaluate_stage(trained)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        f"error: max: 1 file(s) of the trained layers missing: layer 1: {figures} is missing (re-run "
        f"train@m-d-max, or `dvc pull {figures}`)\n"
    ) in res.stderr
    figures.write_bytes(kept)
    assert evaluate_stage(trained).returncode == 0  # whole again
    assert json.loads((trained / "e.json").read_text())["best_layer"] == 0  # equal layers: the lowest
    (trained / "e.json").unlink()
    layer_file = trained / "acts" / layer_filename(1)  # not the best layer's
    layer_file.unlink()
    (trained / "scores" / "layer_1.parquet").unlink()
    res = evaluate_stage(trained)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        f"error: max: 2 file(s) of the trained layers missing: layer 1: {trained / 'scores' / 'layer_1.parquet'} is "
        f"missing (re-run train@m-d-max, or `dvc pull {trained / 'scores' / 'layer_1.parquet'}`); layer 1: "
        f"{layer_file} is missing (re-run dump@m-d, or `dvc pull {layer_file}`)\n"
    ) in res.stderr
    assert not (trained / "e.json").exists()
