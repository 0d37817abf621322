"""Issue 13: the cases a hostile new user tried, one test each, named after the case.

Bad input never becomes a result, damaged state never blocks a re-run, and nothing is paid
twice across processes. Each test asserts the message a user sees (the file, line, row or
params key, and the fix). Stage-level tests run `python -m stages.<name>` as DVC does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import polars as pl
import pytest
import yaml
from test_training import D, synthetic

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_writer import LayerWriter
from halludetect.config import ChatParams, DatasetPreset, ParamsError, PrepareParams, load_params, parse_params
from halludetect.detectors.data import DataError
from halludetect.labels.call_cache import CallCache
from halludetect.labels.chat_client import ApiError, ChatRunner
from halludetect.labels.text import YES_NO, parse_choice
from halludetect.qa.datasets import DatasetError, md5_id, prepare, read_questions
from halludetect.testing.fake_openai import FakeOpenAI, Fault, rule_responder

ROOT = Path(__file__).resolve().parents[1]
KEY = "HD_HOSTILE_API_KEY"
SECRET = "sk-hostile-0123456789abcdef"
SPLIT = PrepareParams(seed=0, train=0.5, val=0.2, test=0.3)
yes_no = lambda t: parse_choice(t, YES_NO)


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("HALLUDETECT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(KEY, SECRET)


def stage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env or dict(os.environ))


def base_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def write_params(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------------- QA records (prepare)
GOOD = [json.dumps({"id": f"g{i}", "question": f"Good question {i}?", "answers": [f"a{i}"]}) for i in range(10)]


def qa_file(tmp_path: Path, lines: list, name: str = "qa.jsonl") -> Path:
    """A QA file: the 10 good records first (lines 1-10), then `lines` (line 11 on)."""
    path = tmp_path / name
    with path.open("wb") as f:
        for line in [*GOOD, *lines]:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


def prepare_error(path: Path) -> str:
    with pytest.raises(DatasetError) as e:
        prepare(DatasetPreset(loader="file", path=str(path)), SPLIT)
    return str(e.value)


def test_prepare_rejects_a_null_question_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": null, "answers": ["Paris"]}'])
    assert f"{path}:11: question: null (every record needs the question text)" in prepare_error(path)


def test_prepare_rejects_a_numeric_question_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": 42, "answers": ["Paris"]}'])
    assert f"{path}:11: question: a number (42), not a string" in prepare_error(path)


def test_prepare_rejects_a_list_question_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": ["Where", "born?"], "answers": ["Paris"]}'])
    assert f"{path}:11: question: a list, not a string (join the words into one string)" in prepare_error(path)


def test_prepare_reads_the_text_of_a_squad_style_answers_dict(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": "Where?", "answers": {"text": ["Paris", "Paris"], '
                              '"answer_start": [3, 3]}}'])
    df, _ = prepare(DatasetPreset(loader="file", path=str(path)), SPLIT)
    assert df.filter(pl.col("id") == "x")["answers"].to_list() == [["Paris"]]


def test_prepare_rejects_a_nested_answers_list_naming_file_and_line(tmp_path):
    path = qa_file(tmp_path, ['{"id": "x", "question": "Where?", "answers": [["Paris"], "Lyon"]}'])
    msg = prepare_error(path)
    assert f"{path}:11: answers: item 0 is a list, not a string (answers must be a flat list of strings)" in msg


def test_prepare_keeps_id_0_as_a_real_id(tmp_path):
    path = qa_file(tmp_path, ['{"id": 0, "question": "Zero?", "answers": ["none"]}'])
    df, _ = prepare(DatasetPreset(loader="file", path=str(path)), SPLIT)
    assert df.filter(pl.col("question") == "Zero?")["id"].to_list() == ["0"]
    assert md5_id("Zero?") not in df["id"].to_list()


def test_prepare_rejects_ids_7_and_string_7_naming_both_lines(tmp_path):
    path = qa_file(tmp_path, ['{"id": 7, "question": "Seven?", "answers": ["a"]}',
                              '{"id": "7", "question": "Seven?", "answers": ["a"]}'])
    assert f"{path}:12: id: '7' and 7 at {path}:11 both become the id '7' (give one of them another id)" \
        in prepare_error(path)


def test_prepare_rejects_a_repeated_id_with_another_question_naming_both_lines(tmp_path):
    path = qa_file(tmp_path, ['{"id": "d", "question": "First?", "answers": ["a"]}',
                              '{"id": "d", "question": "Second?", "answers": ["a"]}'])
    assert (f"{path}:12: id: 'd' is also the id of {path}:11, with another question, answers or context (ids must "
            "be unique: rename one, or remove the repeat)") in prepare_error(path)


def test_prepare_drops_exact_repeats_and_counts_them_with_their_ids(tmp_path):
    path = qa_file(tmp_path, ['{"id": "r", "question": "Again?", "answers": ["a"]}'] * 3)
    data = base_params()
    data["datasets"]["mine"] = {"loader": "file", "path": str(path)}
    res = stage("stages.prepare", "--params", str(write_params(tmp_path / "params.yaml", data)), "--dataset", "mine",
                "--out", str(tmp_path / "q.parquet"), "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["repeated_records"] == {"count": 2, "ids": ["r", "r"]} and m["dropped"] == {} and m["questions"] == 11


def test_prepare_rejects_a_nul_in_a_question_id_before_any_forward_pass(tmp_path):
    path = qa_file(tmp_path, ['{"id": "q\\u0000x", "question": "Nul?", "answers": ["a"]}'])
    assert (f"{path}:11: id: 'q\\x00x' contains the control character NUL (HDF5 files and file names cannot hold "
            "it: remove it)") in prepare_error(path)


def test_generate_and_dump_refuse_a_hand_made_questions_file_with_a_nul_id(tmp_path):
    path = tmp_path / "questions.parquet"
    pl.DataFrame({"id": ["ok", "bad\x00id"], "question": ["A?", "B?"], "answers": [["a"], ["b"]],
                  "context": [None, None], "split": ["train", "test"]},
                 schema={"id": pl.String, "question": pl.String, "answers": pl.List(pl.String),
                         "context": pl.String, "split": pl.String}).write_parquet(path)
    with pytest.raises(DatasetError, match=r"questions.parquet: ids with control characters \(HDF5 cannot hold "
                                           r"them\): \['bad\\x00id'\]; re-run prepare"):
        read_questions(path)


def test_prepare_names_file_and_line_of_a_json_array_line(tmp_path):
    path = qa_file(tmp_path, ['["Where?", "Paris"]'])
    assert f"{path}:11: record: a list, not an object (each record is one JSON object" in prepare_error(path)


def test_prepare_names_file_and_line_of_a_json_string_line(tmp_path):
    path = qa_file(tmp_path, ['"Where was he born?"'])
    assert f"{path}:11: record: a string, not an object" in prepare_error(path)


def test_prepare_names_file_and_line_of_latin1_bytes(tmp_path):
    line = '{"id": "c", "question": "Caf\u00e9?", "answers": ["x"]}'.encode("latin-1")
    path = qa_file(tmp_path, [line])
    assert (f"{path}:11: not UTF-8 (byte 0xe9 at column {line.index(0xE9) + 1}; re-save the file as UTF-8, e.g. "
            "`iconv -f latin1 -t utf-8`)") in prepare_error(path)


def test_prepare_refuses_a_json_file_holding_an_array_with_the_fix(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"question": "Where?", "answers": ["Paris"]}]))
    assert prepare_error(path).startswith(f"{path}:1: the file holds one JSON array; records are read as JSON "
                                          "Lines, one object per line: convert it (e.g. `jq -c '.[]' qa.json > "
                                          "qa.jsonl`)")


def test_prepare_names_file_and_1_based_line_of_a_missing_field(tmp_path):
    path = qa_file(tmp_path, ['{"id": "m", "question": "Where?"}'])
    assert (f"{path}:11: answers: missing (the common schema needs question and answers; id and context are "
            "optional)") in prepare_error(path)


def test_prepare_reports_every_bad_record_at_once_and_the_stage_writes_nothing(tmp_path):
    path = qa_file(tmp_path, ['{"id": "a", "question": null, "answers": ["x"]}', '[1]',
                              '{"id": "b", "question": "Q?", "answers": 3}'])
    data = base_params()
    data["datasets"]["mine"] = {"loader": "file", "path": str(path)}
    res = stage("stages.prepare", "--params", str(write_params(tmp_path / "params.yaml", data)), "--dataset", "mine",
                "--out", str(tmp_path / "q.parquet"), "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {path}: 3 problem(s); nothing was written" in res.stderr
    for line in (11, 12, 13):
        assert f"{path}:{line}: " in res.stderr
    assert "answers: a number (3), not a string or a list of strings" in res.stderr
    assert not (tmp_path / "q.parquet").exists()


# ------------------------------------------------------------------------------- params
def params_error(update) -> str:
    data = base_params()
    update(data)
    with pytest.raises(ParamsError) as e:
        parse_params(data)
    return str(e.value)


def test_params_reject_an_empty_stop_string_naming_the_key():
    msg = params_error(lambda d: d["generate"].update(stop=["\n", ""]))
    assert "generate.stop: '' is empty or only spaces/tabs: it would stop every answer before its first word" in msg
    assert "generate.stop: ' ' is empty" in params_error(lambda d: d["generate"].update(stop=[" "]))
    data = base_params()
    data["generate"]["stop"] = ["\n", "\n\n", "Question:"]  # newline stops are real stops
    assert parse_params(data).generate.stop == ["\n", "\n\n", "Question:"]


def test_params_reject_a_zero_split_fraction_naming_the_key():
    msg = params_error(lambda d: d["prepare"].update(val=0, test=0.5))  # still sums to 1
    assert ("prepare.val: 0 is not a share strictly between 0 and 1: every split is needed (train fits the "
            "detectors, val picks their epoch and layer, test reports)") in msg


def test_params_reject_empty_train_seeds_naming_the_key():
    msg = params_error(lambda d: d["train"].update(seeds=[]))
    assert "train.seeds: no seeds: list at least one (the paper: [0, 1, 2, 3, 4]); an empty list trains nothing" in msg


def test_params_reject_empty_dump_layers_naming_the_key():
    msg = params_error(lambda d: d["dump"].update(layers=[]))
    assert "dump.layers: no layers: list at least one index (0 = embeddings), or write all" in msg


def test_params_yaml_syntax_error_names_file_line_and_column(tmp_path):
    text = (ROOT / "params.yaml").read_text().replace("prepare:\n  seed: 0\n  train: 0.5",
                                                      "prepare:\n  seed: 0\n train: 0.5")
    path = tmp_path / "params.yaml"
    path.write_text(text)
    line = text.splitlines().index(" train: 0.5") + 1
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert str(e.value).startswith(f"{path}:{line}:2: YAML syntax error: ")
    res = stage("stages.prepare", "--params", str(path), "--dataset", "world", "--out", str(tmp_path / "q.parquet"),
                "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 2 and f"error: {path}:{line}:2: YAML syntax error" in res.stderr
    assert "Traceback" not in res.stderr


def test_params_reject_an_unknown_device_naming_the_key():
    msg = params_error(lambda d: [d["generate"].update(device="banana"), d["train"].update(device="gpu")])
    assert "generate.device: 'banana' is not a device; use auto, cpu, cuda, cuda:N (a GPU index) or mps" in msg
    assert "train.device: 'gpu' is not a device" in msg
    data = base_params()
    data["dump"]["device"], data["cluster"]["hf"]["device"], data["train"]["device"] = "cuda:1", "mps", "cuda"
    parse_params(data)  # real devices pass


def test_a_device_this_machine_lacks_is_named_with_its_key_before_anything_loads(monkeypatch):
    import torch

    from halludetect.core.devices import DeviceError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"^train.device: 'cuda:1' was asked for but CUDA is not available; use "
                                          r"'cpu' or 'auto'$"):
        resolve_device("cuda:1", "train.device")
    assert resolve_device("auto", "train.device") == "cpu"  # auto is a device for training too


# ----------------------------------------------------------------- label tables (train)
def cell(tmp_path: Path, layers=(0, 1)) -> tuple[Path, pl.DataFrame, Path]:
    """Two synthetic layer files, their labels, and a params file that trains for 2 epochs, one seed."""
    acts = tmp_path / "acts"
    acts.mkdir()
    layer, labels = synthetic()
    for index in layers:
        w = LayerWriter(acts / layer_filename(index), D, "float32", {"layer": index})
        w.append(layer.states, np.diff(layer.offsets), layer.response_ids)
        w.close(fsync=False)
    data = base_params()
    data["train"].update(epochs=2, seeds=[0])
    return acts, labels, write_params(tmp_path / "params.yaml", data)


def train_stage(tmp_path, acts, judgments: Path, params: Path, layer: int = 1) -> subprocess.CompletedProcess:
    """The train stage of one layer, its outputs under tmp_path."""
    outs = {"--out": tmp_path / "dets" / f"layer_{layer}", "--scores": tmp_path / "scores" / f"layer_{layer}.parquet",
            "--metrics": tmp_path / "layers" / f"layer_{layer}.json"}
    return stage("stages.train", "--params", str(params), "--method", "max", "--layer", str(layer), "--activations",
                 str(acts / layer_filename(layer)), "--judgments", str(judgments),
                 *(x for flag, path in outs.items() for x in (flag, str(path))))


def test_train_rejects_a_kept_label_of_2_naming_file_and_row(tmp_path):
    acts, labels, params = cell(tmp_path)
    path = tmp_path / "judgments.parquet"
    labels.with_columns(pl.when(pl.col("question_id") == "val3").then(2).otherwise(pl.col("label"))
                        .alias("label")).write_parquet(path)
    res = train_stage(tmp_path, acts, path, params)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {path}: 1 problem(s):" in res.stderr
    assert "label: not 0 (correct) or 1 (hallucinated) on kept row(s) row 64 (val3/0: 2)" in res.stderr
    assert "Re-run judge to rewrite it" in res.stderr and not (tmp_path / "dets").exists()


def judgments_error(path: Path) -> str:
    """What train, evaluate and baselines say about a judgments file (they all read it so)."""
    from halludetect.labels.readers import read_judgments

    with pytest.raises(DataError) as e:
        read_judgments(path)
    return str(e.value)


def test_train_rejects_a_kept_row_with_a_null_label_naming_file_and_row(tmp_path):
    _, labels = synthetic()
    path = tmp_path / "judgments.parquet"
    labels.with_columns(pl.when(pl.col("question_id") == "train5").then(None).otherwise(pl.col("label"))
                        .alias("label")).write_parquet(path)
    assert (f"{path}: 1 problem(s):\n  label: null on kept row(s) row 6 (train5/0) (a kept answer needs 0 or 1; "
            "an answer without a label has kept = false)") in judgments_error(path)


def test_train_rejects_duplicate_rows_with_opposite_labels_naming_both_rows(tmp_path):
    _, labels = synthetic()
    path = tmp_path / "judgments.parquet"
    twin = labels.filter(pl.col("question_id") == "train2").with_columns((1 - pl.col("label")).alias("label"))
    pl.concat([labels, twin]).write_parquet(path)
    assert ("the same response on more than one row (one row per question_id and sample_index): row 3 "
            "(train2/0: 0), row 181 (train2/0: 1)") in judgments_error(path)


def test_train_names_a_judgments_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "judgments.parquet"
    path.write_text("question_id,sample_index,label\nq1,0,1\n")
    msg = judgments_error(path)
    assert msg.startswith(f"{path}: not a readable judgments table (ComputeError: parquet: File out of specification")
    assert "re-run judge to rewrite it" in msg


def test_baselines_reject_a_clusters_table_with_p_sem_outside_0_1_naming_the_row(tmp_path):
    from test_evaluation import world_like_tables

    labels, gens, clusters = world_like_tables()
    for name, df in (("j", labels), ("g", gens)):
        df.with_columns(pl.lit("test").alias("split")).write_parquet(tmp_path / f"{name}.parquet") if name == "g" \
            else df.write_parquet(tmp_path / f"{name}.parquet")
    bad = clusters.join(labels.select("question_id", "sample_index", "split"), on=["question_id", "sample_index"])
    bad = bad.with_columns(pl.when(pl.col("question_id") == "val1").then(1.7).otherwise(pl.col("p_sem_mean"))
                           .alias("p_sem_mean"))
    bad.write_parquet(tmp_path / "c.parquet")
    res = stage("stages.baselines", "--model", "m", "--dataset", "d", "--generations", str(tmp_path / "g.parquet"),
                "--judgments", str(tmp_path / "j.parquet"), "--clusters", str(tmp_path / "c.parquet"),
                "--out", str(tmp_path / "b.json"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "p_sem_mean: null or outside [0, 1] on valid row(s) row 23 (val1/0: 1.7), row 24 (val1/1: 1.7)" \
        in res.stderr and "Re-run cluster to rewrite it" in res.stderr


# ------------------------------------------------------------- damaged artifacts (train)
def layer_error(tmp_path, damage) -> str:
    """What train (and evaluate) say, before any training, about layer 1 damaged by `damage`."""
    from halludetect.activations.layer_reader import read_layer

    acts, _, _ = cell(tmp_path)
    damage(acts / layer_filename(1))
    with pytest.raises(DataError) as e:
        read_layer(acts / layer_filename(1), expect_layer=1)
    return str(e.value)


def test_train_names_a_truncated_layer_file_and_the_fix(tmp_path):
    def truncate(path):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    msg = layer_error(tmp_path, truncate)
    assert msg.startswith(f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (OSError: Unable to "
                          "synchronously open file (truncated file")
    assert msg.endswith("re-run dump to rewrite it (dvc repro --force the dump stage)")


def test_train_names_an_empty_layer_file(tmp_path):
    msg = layer_error(tmp_path, lambda path: path.write_bytes(b""))
    assert msg.startswith(f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (OSError: ")


def test_train_names_a_garbage_layer_file(tmp_path):
    msg = layer_error(tmp_path, lambda path: path.write_bytes(b"not hdf5 at all\n" * 100))
    assert msg.startswith(f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (OSError: Unable to "
                          "synchronously open file (file signature not found)); it is damaged or not what the dump "
                          "stage writes: re-run dump")


def test_train_rejects_offsets_past_the_end_of_states_before_any_training(tmp_path):
    def overrun(path):
        with h5py.File(path, "r") as f:
            states, offsets, ids, attrs = f["states"][:], f["offsets"][:], f["response_id"][:], dict(f.attrs)
        offsets[-1] += 7
        with h5py.File(path, "w") as f:
            f["states"], f["offsets"], f["response_id"] = states, offsets, ids
            f.attrs.update(attrs)

    acts, labels, params = cell(tmp_path)
    labels.write_parquet(tmp_path / "judgments.parquet")
    overrun(acts / layer_filename(1))
    res = train_stage(tmp_path, acts, tmp_path / "judgments.parquet", params)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (f"{tmp_path / 'acts' / 'layer_1.h5'}: not a readable HDF5 layer file (the last offset is 745 but "
            "states has 738 rows (offsets past the end of states))") in res.stderr
    assert "best epoch" not in res.stderr and not (tmp_path / "dets").exists()  # nothing trained, nothing written


# ---------------------------------------------------------- damaged artifacts (evaluate)
@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """Layers 0 and 1 trained with one seed (max, a few epochs) by their train stages' code."""
    from halludetect.activations.layer_reader import read_layer
    from halludetect.detectors.data import SPLITS, split_data
    from halludetect.detectors.training import train_layer
    from halludetect.methods.pooling import PoolingParams

    root = tmp_path_factory.mktemp("trained")
    acts, labels, _ = cell(root)
    labels.write_parquet(root / "judgments.parquet")
    params = PoolingParams(dim=8, dropout=0.0)
    for index in (0, 1):
        layer = read_layer(acts / layer_filename(index), dtype=None)
        train_layer("max", params, {s: split_data(layer, labels, s) for s in SPLITS}, [0], layer=index, epochs=2,
                    batch_size=64, device="cpu", out_dir=root / "dets" / f"layer_{index}",
                    scores_path=root / "scores" / f"layer_{index}.parquet",
                    metrics_path=root / "layers" / f"layer_{index}.json", log=lambda *_: None)
    return root, labels


@pytest.fixture
def trained(trained_once, tmp_path):
    """A private copy of the trained cell (tests damage it)."""
    root, _ = trained_once
    for name in ("acts", "dets", "scores", "layers", "params.yaml", "judgments.parquet"):
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, tmp_path / name)
    return tmp_path


def detector_error(root: Path) -> str:
    from halludetect.evaluation.evaluate import load_models

    with pytest.raises(DataError) as e:
        load_models(root / "dets" / "layer_1", "max", 1, [0], D)
    return str(e.value)


def test_evaluate_names_a_garbage_detector_file(trained):
    path = trained / "dets" / "layer_1" / "seed_0.safetensors"
    path.write_bytes(b"garbage" * 100)
    assert detector_error(trained).startswith(f"{path}: not a readable detector file (safetensors) (SafetensorError: "
                                              "Error while deserializing header: header too large); it is damaged "
                                              "or not what the train stage writes: re-run train")


def test_evaluate_names_a_truncated_detector_file(trained):
    path = trained / "dets" / "layer_1" / "seed_0.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    assert detector_error(trained).startswith(f"{path}: not a readable detector file (safetensors) (SafetensorError: "
                                              "Error while deserializing header: incomplete metadata")


def test_evaluate_names_an_empty_detector_file(trained):
    path = trained / "dets" / "layer_1" / "seed_0.safetensors"
    path.write_bytes(b"")
    assert detector_error(trained).startswith(f"{path}: not a readable detector file (safetensors) (SafetensorError: "
                                              "Error while deserializing header: header too small)")


def evaluate_stage(root: Path) -> subprocess.CompletedProcess:
    return stage("stages.evaluate", "--params", str(root / "params.yaml"), "--model", "m", "--dataset", "d",
                 "--method", "max", "--layer-metrics", str(root / "layers"), "--scores", str(root / "scores"),
                 "--detectors", str(root / "dets"), "--activations", str(root / "acts"),
                 "--judgments", str(root / "judgments.parquet"), "--out", str(root / "e.json"),
                 "--plot", str(root / "p.json"))


def test_evaluate_fails_naming_a_missing_layer_file_of_a_trained_layer(trained):
    """A layer of grid.layers whose figures are missing (its train stage never ran, or its file
    was never pulled) is an error, not a layer silently left out of the choice of the best one;
    so is a missing layer file of the chosen layer."""
    write_params(trained / "params.yaml", {**yaml.safe_load((trained / "params.yaml").read_text()),
                                           "grid": {**base_params()["grid"], "layers": [0, 1]}})
    (trained / "layers" / "layer_1.json").unlink()
    res = evaluate_stage(trained)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (f"error: {trained / 'layers' / 'layer_1.json'} is missing: run the train stage of layer 1 first "
            "(grid.layers lists the layers evaluated)") in res.stderr
    shutil.copy(trained / "layers" / "layer_0.json", trained / "layers" / "layer_1.json")  # layer 1 back, as 0's
    (trained / "acts" / layer_filename(0)).unlink()
    res = evaluate_stage(trained)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"error: {trained / 'acts' / layer_filename(0)} does not exist: run the dump stage first" in res.stderr
    assert not (trained / "e.json").exists()


# ------------------------------------------------------- judge and cluster: all invalid
def label_inputs(tmp_path: Path, url: str, n: int = 8) -> list[str]:
    questions = pl.DataFrame({"id": [f"q{i}" for i in range(n)], "question": [f"Where was person {i} born?"
                                                                               for i in range(n)],
                              "answers": [[f"City{i}"] for i in range(n)], "context": [None] * n,
                              "split": ["train", "val", "test", "test"] * (n // 4)},
                             schema={"id": pl.String, "question": pl.String, "answers": pl.List(pl.String),
                                     "context": pl.String, "split": pl.String})
    rows = [{"question_id": f"q{i}", "sample_index": k, "split": questions["split"][i], "n_tokens": 3,
             "text": f"Born in City{i + k}.", "token_logprobs": [-0.5, -0.5, -0.5]} for i in range(n) for k in range(3)]
    questions.write_parquet(tmp_path / "questions.parquet")
    pl.DataFrame(rows).write_parquet(tmp_path / "generations.parquet")
    data = base_params()
    for section in ("judge", "cluster"):
        data[section]["backend"] = "openai"
        data[section]["openai"].update(base_url=url, api_key_env=KEY, concurrency=4, parse_retries=1, max_retries=1)
    return ["--params", str(write_params(tmp_path / "params.yaml", data)), "--questions",
            str(tmp_path / "questions.parquet"), "--generations", str(tmp_path / "generations.parquet")]


def test_judge_stage_fails_when_every_reply_is_invalid_with_counts_and_where_to_look(tmp_path):
    with FakeOpenAI(lambda body, n: "I cannot tell.") as srv:
        args = label_inputs(tmp_path, srv.url)
        out, metrics = tmp_path / "j.parquet", tmp_path / "m.json"
        res = stage("stages.judge", *args, "--out", str(out), "--metrics", str(metrics))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert ("error: judge: no usable label in 3 split(s):\n  train: 2 answers judged, none kept (pass 1 invalid: 2)\n"
            "  val: 6 answers judged, none kept (pass 1 invalid: 6)\n"
            "  test: 12 answers judged, none kept (pass 1 invalid: 12)\n"
            f"The judge's raw replies are in {out} (columns pass1_raw, pass2_raw)") in res.stderr
    assert set(pl.read_parquet(out)["pass1_raw"]) == {"I cannot tell."}  # kept for inspection


def test_judge_stage_succeeds_with_partial_invalidity_and_counts_it(tmp_path):
    rules = rule_responder()
    respond = lambda body, n: "I cannot tell." if "City3" in body["messages"][0]["content"] else rules(body, n)
    with FakeOpenAI(respond) as srv:
        args = label_inputs(tmp_path, srv.url)
        res = stage("stages.judge", *args, "--out", str(tmp_path / "j.parquet"), "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["invalid"]["pass1"] > 0 and all(s["kept"] > 0 for s in m["splits"].values())
    assert "invalid verdicts (dropped, never labels)" in res.stderr


def test_cluster_stage_fails_when_every_reply_is_invalid_with_counts_and_where_to_look(tmp_path):
    with FakeOpenAI(lambda body, n: "no idea") as srv:
        args = label_inputs(tmp_path, srv.url)
        out = tmp_path / "c.parquet"
        res = stage("stages.cluster", *args, "--out", str(out), "--timings", str(tmp_path / "t.parquet"),
                    "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert ("error: cluster: no usable clustering:\n  every one of the 8 questions that needed the NLI backend is "
            "invalid (no usable relation came back)\n  train: 6 answers, none with a valid clustering (no P_sem)"
            ) in res.stderr
    assert f"Invalid questions are the rows with valid = false in {out}" in res.stderr
    assert f"the raw replies are in the call cache {tmp_path / 'cache' / 'api_calls.sqlite'}" in res.stderr


# ------------------------------------------------------------------- damaged resume state
def _no_seconds(df):
    return df.drop("seconds")


def test_generate_discards_a_truncated_unit_with_a_warning_and_recomputes_it(tiny, tmp_path, caplog):
    from test_generation import PARAMS, questions

    from halludetect.core.unit_store import UnitStore
    from halludetect.lm.generation import GENERATIONS_SCHEMA, generate

    model, tok = tiny
    clean = generate(model, tok, questions(), PARAMS)
    first = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    first.prepare()
    generate(model, tok, questions(), PARAMS, store=first)
    n_units = len(first.finished())
    unit = tmp_path / "progress" / "unit_000001.parquet"
    unit.write_bytes(unit.read_bytes()[:40])  # what a power loss can leave of a unit renamed without fsync
    again = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert again.prepare() == n_units - 1
    assert f"discarding damaged work unit {unit} (unreadable: ComputeError: " in caplog.text
    assert "it will be recomputed" in caplog.text
    resumed = generate(model, tok, questions(), PARAMS, store=again)
    assert _no_seconds(resumed).equals(_no_seconds(clean))


def test_generate_discards_a_unit_with_another_schema_with_a_warning(tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore
    from halludetect.lm.generation import GENERATIONS_SCHEMA

    store = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    store.prepare()
    pl.DataFrame({"question_id": ["q"], "text": ["hi"]}).write_parquet(tmp_path / "progress" / "unit_000000.parquet")
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA).prepare() == 0
    assert "discarding damaged work unit" in caplog.text and "(another schema (" in caplog.text


def test_generate_discards_a_store_with_a_garbage_fingerprint_with_a_warning(tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore

    store = UnitStore(tmp_path / "progress", {"run": 1})
    store.prepare()
    store.put(0, pl.DataFrame({"x": [1]}))
    (tmp_path / "progress" / "fingerprint.json").write_bytes(b"{\"run\": 1, \x00garbage")
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert UnitStore(tmp_path / "progress", {"run": 1}).prepare() == 0
    assert f"progress {tmp_path / 'progress'}: fingerprint.json is unreadable (JSONDecodeError: " in caplog.text
    assert "discarding its units" in caplog.text
    assert json.loads((tmp_path / "progress" / "fingerprint.json").read_text()) == {"run": 1}


def test_a_unit_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    from halludetect.core import atomic_io
    from halludetect.core.unit_store import UnitStore

    store = UnitStore(tmp_path / "progress", {"run": 1})
    store.prepare()
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(atomic_io.os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(atomic_io.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    store.put(3, pl.DataFrame({"x": [1]}))
    unit = str(tmp_path / "progress" / "unit_000003.parquet")
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "replace", "fsync"], events  # the data, the rename, the directory entry
    assert events[0][1].startswith(str(tmp_path / "progress" / ".unit_000003.parquet."))
    assert events[1][1] == unit and events[2][1] == str(tmp_path / "progress")


# ----------------------------------------------------------------------- cost and secrets
def test_two_judge_runs_at_once_on_one_cache_pay_each_request_once(tmp_path):
    with FakeOpenAI(rule_responder(), latency=0.05) as srv:
        args = label_inputs(tmp_path, srv.url, n=40)
        runs = [subprocess.Popen([sys.executable, "-m", "stages.judge", *args, "--out", str(tmp_path / f"j{i}.parquet"),
                                  "--metrics", str(tmp_path / f"m{i}.json")], cwd=ROOT, stderr=subprocess.PIPE,
                                 text=True) for i in (0, 1)]
        errors = [p.communicate(timeout=120)[1] for p in runs]
        assert [p.returncode for p in runs] == [0, 0], errors
        bodies = [json.dumps(b, sort_keys=True) for b in srv.requests]
    assert len(bodies) == len(set(bodies))  # no request was sent twice
    m = [json.loads((tmp_path / f"m{i}.json").read_text())["api"] for i in (0, 1)]
    assert m[0]["calls"] + m[1]["calls"] == len(set(bodies))
    assert (tmp_path / "j0.parquet").read_bytes() == (tmp_path / "j1.parquet").read_bytes()


def runner(srv, cache: CallCache | None = None, **kw) -> ChatRunner:
    params = {"model": "judge-model", "base_url": srv.url, "api_key_env": KEY, "max_retries": 2, "timeout": 10} | kw
    return ChatRunner(ChatParams(**params), where="judge.openai",
                      cache=cache or CallCache(Path(os.environ["HALLUDETECT_CACHE"]) / "api_calls.sqlite"))


def plant_claim(r: ChatRunner, prompt: str, host: str, pid: int, lease_until: float) -> str:
    """A claim on `prompt`'s request by another owner, as another process would leave it."""
    key, _ = r.key(prompt, 0)
    r.cache.db.execute("INSERT INTO claims VALUES (?, ?, ?, ?, ?)", (key, f"{host}:{pid}:other", host, pid,
                                                                     lease_until))
    return key


def test_a_claim_whose_owner_died_is_taken_over_at_once(tmp_path):
    from halludetect.labels.call_cache import HOST

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a SIGKILLed run's pid: gone, its lease still an hour long
    with FakeOpenAI(lambda body, n: "yes") as srv:
        r = runner(srv)
        plant_claim(r, "Q?", HOST, dead.pid, time.time() + 3600)
        t0 = time.monotonic()
        assert r.run(["Q?"], yes_no)[0].value == "yes"
        assert time.monotonic() - t0 < 5 and srv.count == 1


def test_a_claim_whose_lease_expired_is_taken_over(tmp_path):
    with FakeOpenAI(lambda body, n: "yes") as srv:
        r = runner(srv)
        plant_claim(r, "Q?", "another-host", 1, time.time() - 1)  # a crashed run on another machine
        assert r.run(["Q?"], yes_no)[0].value == "yes" and srv.count == 1


def test_a_live_claim_by_another_process_is_waited_for_not_sent_again(tmp_path):
    with FakeOpenAI(lambda body, n: "yes") as srv:
        r = runner(srv)
        key = plant_claim(r, "Q?", "another-host", 1, time.time() + 3600)
        reply = {"reply": "no", "prompt_tokens": 3, "completion_tokens": 1, "reasoning_tokens": None, "latency_s": 0.1}
        # the other process, whose reply lands after a while (its own connection, in its own thread)
        timer = threading.Timer(0.5, lambda: CallCache(r.cache.path).put(key, {"request": 1}, reply))
        timer.start()
        out = r.run(["Q?"], yes_no)
        timer.join()
    assert out[0].value == "no" and srv.count == 0
    assert r.usage.cache_hits == 1 and r.usage.waited == 1 and r.usage.calls == 0


@pytest.mark.parametrize("status", [401, 400, 503])
def test_the_api_key_is_redacted_from_an_error_that_echoes_the_authorization_header(status):
    def echo(body, n):
        auth = srv.headers[n]["authorization"]
        return Fault(status, body=json.dumps({"error": {"message": f"bad request with header {auth}",
                                                        "type": "invalid_request_error"}}))

    with FakeOpenAI(echo) as srv:
        with pytest.raises(ApiError) as e:
            runner(srv, max_retries=0).run(["Q?"], yes_no)
        assert SECRET in srv.headers[0]["authorization"]  # the server did echo it
    msg = str(e.value)
    assert SECRET not in msg and f"bad request with header Bearer [{KEY} redacted]" in msg


def test_timeout_is_a_deadline_per_request_that_cuts_off_a_trickling_server():
    with FakeOpenAI(lambda body, n: Fault(200, trickle=0.05)) as srv:  # ~250 bytes at 20 bytes/s: 12 s
        t0 = time.monotonic()
        with pytest.raises(ApiError, match=r"timed out 1 times \(0.5 s each\); raise judge.openai.timeout"):
            runner(srv, timeout=0.5, max_retries=0).run(["Q?"], yes_no)
        assert time.monotonic() - t0 < 4


def test_retry_after_beyond_the_patience_fails_at_once_saying_what_the_server_asked():
    with FakeOpenAI(lambda body, n: Fault(429, {"Retry-After": "86400"})) as srv:
        t0 = time.monotonic()
        with pytest.raises(ApiError) as e:
            runner(srv, timeout=10, max_retries=2).run(["Q?"], yes_no)
        assert time.monotonic() - t0 < 5 and srv.count == 1
    assert (f"judge.openai: {srv.url} answered HTTP 429 and asked to retry after 86400 s (1 d), longer than this "
            "request's remaining patience of 30 s ((max_retries + 1) x timeout = 30 s in all)") in str(e.value)
    assert "re-run later (every reply so far is cached)" in str(e.value)


def test_stage_error_messages_never_print_the_key(tmp_path):
    def echo(body, n):
        return Fault(401, body=json.dumps({"error": {"message": f"Incorrect API key {srv.headers[n]['authorization']}",
                                                     "type": "invalid_request_error"}}))

    with FakeOpenAI(echo) as srv:
        args = label_inputs(tmp_path, srv.url)
        res = stage("stages.judge", *args, "--out", str(tmp_path / "j.parquet"), "--metrics", str(tmp_path / "m.json"))
    assert res.returncode == 2 and SECRET not in res.stderr + res.stdout
    assert f"Incorrect API key Bearer [{KEY} redacted]" in res.stderr
