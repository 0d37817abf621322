"""The collapsed DAG (halludetect/core/dag.py, `halludetect dag`): stage families in topological
order with their counts and upstream families, from DVC's own graph of the repository."""

import pytest
import yaml
from support import ROOT

from halludetect.core.dag import Family, collapsed, families, render


def test_families_collapse_a_matrix_and_keep_topological_order():
    stages = ["a", "m@1", "m@2", "b", "z@x"]
    edges = [("m@1", "a"), ("m@2", "a"), ("z@x", "m@1"), ("z@x", "m@2"), ("z@x", "b"), ("b", "a")]
    got = families(edges, stages)
    assert [(f.name, f.stages, f.upstream) for f in got] == [
        ("a", 1, []),
        ("m", 2, ["a"]),
        ("b", 1, ["a"]),
        ("z", 1, ["m", "b"]),
    ]
    assert render(got) == "a\nm x 2  <- a\nb      <- a\nz      <- m, b\n"


def test_a_family_listed_before_its_upstream_moves_after_it():
    got = families([("first", "second")], ["first", "second"])
    assert [f.name for f in got] == ["second", "first"]


def test_a_cycle_between_families_is_named():
    with pytest.raises(ValueError, match=r"cycle: \['a', 'b'\]"):
        families([("a@1", "b"), ("b", "a@2")], ["a@1", "a@2", "b"])


def test_the_repositorys_dag_has_one_line_per_family_with_the_grids_counts():
    g = yaml.safe_load((ROOT / "params.yaml").read_text())["grid"]
    cells = len(g["models"]) * len(g["datasets"])
    got = {f.name: f for f in collapsed(ROOT)}
    empty = set() if g["model_baselines"] else {"model_baselines"}  # a matrix over an empty list: no stage
    assert set(got) == set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]) - empty
    assert got["train"].stages == cells * len(g["methods"])  # a stage per method, every layer in it
    assert got["train_sp"].stages == cells * len(g["sp_methods"])
    assert got["evaluate"].stages == cells * len(g["methods"])
    assert got["code"].upstream == [] and got["world"].upstream == ["code"]
    assert got["train"].upstream == ["code", "dump", "judge"]
    names = list(got)
    for f in got.values():  # every family after what it reads
        assert all(names.index(u) < names.index(f.name) for u in f.upstream), f
    text = render(list(got.values()))
    assert len(text.splitlines()) == len(got) and max(map(len, text.splitlines())) <= 200


@pytest.mark.hostile
def test_dag_without_a_dvc_yaml_is_one_line_and_exit_2(tmp_path, capsys):
    from halludetect import cli as console

    with pytest.raises(SystemExit) as e:
        console.main(["dag", "--repo", str(tmp_path)])
    assert e.value.code == 2
    expected = f"error: {tmp_path} has no dvc.yaml: run it in the repository's root, or pass --repo\n"
    assert capsys.readouterr().err == expected


def test_the_command_prints_the_rendered_view_of_the_repo(capsys, monkeypatch, tmp_path):
    from halludetect import cli as console
    from halludetect.core import dag

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    fams = [Family("world", 1), Family("train", 3, ["world"])]
    monkeypatch.setattr(dag, "collapsed", lambda repo: fams if repo == str(tmp_path) else [])
    console.main(["dag", "--repo", str(tmp_path)])
    assert capsys.readouterr().out == "world\ntrain x 3  <- world\n"
