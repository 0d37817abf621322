import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from halludetect.config import ParamsError, load_params, parse_params


def base() -> dict:
    return yaml.safe_load(Path("params.yaml").read_text())


def test_shipped_params_are_valid():
    p = load_params("params.yaml")
    assert p.grid.models == ["world"] and p.model("world").path == "data/world/model"


def test_unknown_key_names_key_and_suggests():
    data = base()
    data["generate"]["temprature"] = 0.7
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "generate.temprature: unknown key" in msg and "did you mean 'temperature'" in msg
    assert "max_new_tokens" in msg  # lists the valid keys


def test_unknown_key_in_preset_and_nested_section():
    data = base()
    data["models"]["world"]["dtyp"] = "float32"
    data["detectors"]["max"]["dimm"] = 3
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "models.world.dtyp: unknown key; did you mean 'dtype'" in msg
    assert "detectors.max.dimm: unknown key; did you mean 'dim'" in msg
    assert "2 problem(s)" in msg  # every problem at once


def test_wrong_type_and_bad_choice():
    data = base()
    data["generate"]["n_samples"] = "five"
    data["dump"]["positions"] = "middle"
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "generate.n_samples" in msg and "'five'" in msg
    assert "dump.positions" in msg and "predicting" in msg


def test_grid_names_must_exist():
    data = base()
    data["grid"]["methods"] = ["maxx"]
    data["grid"]["datasets"] = ["triviaqa"]
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "'maxx' is not defined; did you mean 'max'?" in msg
    assert "'triviaqa' is not defined; did you mean 'trivia_qa'?" in msg


def test_a_preset_name_with_a_dot_is_refused_before_dvc_misreads_it():
    """dvc.yaml declares `models.${item.model}`; DVC reads `models.llama3.3-70b` as nested keys."""
    data = base()
    data["models"]["llama3.3-70b"] = data["models"].pop("llama3_3-70b")
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    assert "models: preset name 'llama3.3-70b' contains '.'" in str(e.value)
    assert "e.g. 'llama3_3-70b'" in str(e.value)


def test_cross_field_checks():
    data = base()
    data["prepare"]["test"] = 0.5
    data["world"]["n_heads"] = 5
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    msg = str(e.value)
    assert "train + val + test must be 1" in msg and "not divisible by n_heads 5" in msg


def test_missing_params_file(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")


def test_unknown_preset_lookup():
    p = load_params("params.yaml")
    with pytest.raises(ParamsError, match="did you mean 'llama3-8b'"):
        p.model("llama3-7b")


def run_prepare(tmp_path, data: dict, dataset: str):
    """Run the prepare stage as DVC would, with `data` as its params file."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(data))
    return subprocess.run(
        [sys.executable, "-m", "stages.prepare", "--params", str(params), "--dataset", dataset,
         "--out", str(tmp_path / "q.parquet"), "--metrics", str(tmp_path / "m.json")],
        capture_output=True, text=True,
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
