"""The train stage (stages/train.py) checks everything before it trains: an unknown method, a method that
reads P_sem without --clusters, non-finite states and a layer file of another layer stop it with
nothing trained and nothing written."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import D, stage, synthetic, write_layers

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_writer import LayerWriter


def test_bad_layer_files_stop_the_train_stage_before_any_training(tmp_path):
    import h5py

    acts = tmp_path / "acts"
    acts.mkdir()
    labels = write_layers(acts)
    labels.write_parquet(tmp_path / "labels.parquet")
    with h5py.File(acts / layer_filename(1), "r") as f:
        offsets = f["offsets"][:]
    layer, _ = synthetic()
    states = layer.states.copy()
    states[offsets[7] + 1, 3] = np.inf  # response 7: train7/0
    w = LayerWriter(acts / layer_filename(1), D, "float32", {"layer": 1})
    w.append(states, np.diff(offsets), layer.response_ids)
    w.close(fsync=False)
    out = tmp_path / "dets"

    def train(layer: int) -> subprocess.CompletedProcess:
        return stage(
            "stages.train",
            "--method",
            "max",
            "--layers",
            str(layer),
            "--activations",
            str(acts),
            "--judgments",
            str(tmp_path / "labels.parquet"),
            "--out",
            str(out),
            "--scores",
            str(tmp_path / "s"),
            "--metrics",
            str(tmp_path / "m"),
        )

    res = train(1)
    assert res.returncode == 2, res.stderr
    assert f"{acts / layer_filename(1)}: non-finite hidden states (NaN or inf) in response train7/0" in res.stderr
    assert "seed 0" not in res.stderr and not out.exists()  # nothing trained, nothing written
    (acts / layer_filename(0)).write_bytes((acts / layer_filename(1)).read_bytes())  # layer 1's file named layer 0
    res = train(0)
    assert res.returncode == 2 and "holds layer 1, not layer 0: re-run dump" in res.stderr
    (acts / layer_filename(0)).unlink()
    res = train(0)
    assert (
        res.returncode == 2 and f"{acts} has no {layer_filename(0)}: dump.layers must cover grid.layers" in res.stderr
    )
    res = train(9)
    assert res.returncode == 2 and "--layers [9]: not in grid.layers [0, 1, 2, 3, 4]" in res.stderr


def test_stages_refuse_an_unknown_method_and_missing_p_sem_before_reading_data(tmp_path):
    outs = ["--out", str(tmp_path / "out"), "--scores", str(tmp_path / "s"), "--metrics", str(tmp_path / "m")]
    res = stage(
        "stages.train",
        "--method",
        "hami-sp",
        "--layers",
        "0",
        "--activations",
        str(tmp_path),
        "--judgments",
        "none",
        *outs,
    )
    assert res.returncode == 2 and "unknown detector 'hami-sp'; did you mean 'hami_sp'?" in res.stderr
    res = stage(
        "stages.train",
        "--method",
        "hami_sp",
        "--layers",
        "0",
        "--activations",
        str(tmp_path),
        "--judgments",
        "none",
        *outs,
    )
    assert res.returncode == 2 and "hami_sp reads the clustering: pass --clusters" in res.stderr
    assert not (tmp_path / "out").exists()


def test_a_layer_gives_the_same_bytes_alone_and_beside_the_others(tmp_path):
    """The stage trains its layers side by side (HALLUDETECT_TRAIN_PROCESSES=2: this process and a
    worker) or one after another (these layers are too small to be worth a worker: the default); a
    layer's weights, scores and figures are the same bytes either way, and `--layers` trains only its
    layers into the directories (what train-layer runs)."""
    from support import cell, train_stage

    acts, labels, params = cell(tmp_path)
    labels.write_parquet(tmp_path / "judgments.parquet")
    data = yaml.safe_load(params.read_text())
    data["grid"]["layers"] = [0, 1]
    params.write_text(yaml.safe_dump(data))

    def train(out: Path, layer: int | None, processes=None) -> subprocess.CompletedProcess:
        return train_stage(out, acts, tmp_path / "judgments.parquet", params, layer, timing=True, processes=processes)

    both, alone = tmp_path / "both", tmp_path / "alone"
    assert train(both, None, processes=2).returncode == 0
    res = train(alone, 1)
    assert res.returncode == 0, res.stderr
    workers = {k: t["parallel_workers"] for k, t in json.loads((both / "timing.json").read_text()).items()}
    assert workers == {"layer_0": 2, "layer_1": 2}
    assert json.loads((alone / "timing.json").read_text())["layer_1"]["parallel_workers"] == 1
    assert not (alone / "scores" / "layer_0.parquet").exists()
    files = [p.relative_to(alone) for p in sorted(alone.rglob("*")) if p.is_file() and p.name != "timing.json"]
    assert {str(f) for f in files} >= {
        "dets/layer_1/seed_0.safetensors",
        "scores/layer_1.parquet",
        "layers/layer_1.json",
    }
    for f in files:
        assert (alone / f).read_bytes() == (both / f).read_bytes(), f
    assert set(json.loads((both / "timing.json").read_text())) == {"layer_0", "layer_1"}


@pytest.mark.hostile
def test_a_layer_too_small_for_a_worker_trains_in_the_stage_process(monkeypatch):
    """A spawned worker's start (2 to 3 s of CPU) is paid only for layers estimated to train longer;
    HALLUDETECT_TRAIN_PROCESSES fixes the count (checked), HALLUDETECT_CORES (a stage's share beside
    others) caps it, and a GPU trains in the stage's process."""
    from halludetect.core.errors import DataError
    from stages import train

    monkeypatch.delenv(train.PROCESSES_ENV, raising=False)
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    world_layer = 44_748 * 128 * 100 * 3  # the world's `max` layer: about 29 s on one core
    assert train.workers_for("cpu", 5, world_layer) == 4
    assert train.workers_for("cpu", 2, world_layer) == 2
    assert train.workers_for("cpu", 2, 4_000 * 64 * 8) == 1  # the tests' world: a fraction of a second
    assert train.workers_for("cuda", 5, world_layer) == 1
    monkeypatch.setenv(train.PROCESSES_ENV, "3")
    assert train.workers_for("cpu", 5, 1) == 3 and train.workers_for("cpu", 2, 1) == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(train.PROCESSES_ENV, bad)
        with pytest.raises(DataError, match=f"HALLUDETECT_TRAIN_PROCESSES='{bad}': a count of processes"):
            train.workers_for("cpu", 5, 1)
    # beside other stages (halludetect repro --jobs): no more workers than the stage's share of the cores
    monkeypatch.delenv(train.PROCESSES_ENV)
    from halludetect.runner import parallel_repro

    assert parallel_repro.CORES_ENV == train.CORES_ENV  # the runner's name for it is the stage's
    monkeypatch.setenv(train.CORES_ENV, "2")
    assert train.workers_for("cpu", 5, world_layer) == 2
    monkeypatch.setenv(train.CORES_ENV, "1")
    assert train.workers_for("cpu", 5, world_layer) == 1
    monkeypatch.setenv(train.CORES_ENV, "8")
    assert train.workers_for("cpu", 5, world_layer) == 4  # never more than it has
    for bad in ("0", "x"):
        monkeypatch.setenv(train.CORES_ENV, bad)
        with pytest.raises(DataError, match=f"HALLUDETECT_CORES='{bad}': a count of cores"):
            train.workers_for("cpu", 5, 1)  # checked for small layers too
