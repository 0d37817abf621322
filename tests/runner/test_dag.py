"""The collapsed DAG (halludetect/runner/dag.py, `halludetect dag`): stage families in topological
order with their counts and upstream families, from DVC's own graph of the repository; what DVC
cannot read (a broken dvc.yaml or params.yaml, no DVC repository, no git) is one line."""

import subprocess

import pytest
import yaml
from support import ROOT

from halludetect.runner.dag import Family, collapsed, families, render


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
    assert set(got) == set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert got["train"].stages == cells * len(g["detectors"])  # a stage per detector, every layer in it
    assert got["evaluate"].stages == cells * len(g["detectors"])
    assert got["route"].stages == cells
    assert got["code"].upstream == [] and got["params"].upstream == ["code"]
    assert got["world"].upstream == ["code", "params"]
    assert got["train"].upstream == ["code", "params", "dump", "judge", "route"]
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
    from halludetect.runner import dag

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    fams = [Family("world", 1), Family("train", 3, ["world"])]
    monkeypatch.setattr(dag, "collapsed", lambda repo: fams if repo == str(tmp_path) else [])
    console.main(["dag", "--repo", str(tmp_path)])
    assert capsys.readouterr().out == "world\ntrain x 3  <- world\n"


def _repo(path, dvc_yaml: str, params_yaml: str = "x: 1\n", git: bool = True, dvc: bool = True):
    """A directory holding a pipeline; `.dvc/` with an empty config is all DVC needs to find its root."""
    path.mkdir()
    (path / "dvc.yaml").write_text(dvc_yaml)
    (path / "params.yaml").write_text(params_yaml)
    if dvc:
        (path / ".dvc").mkdir()
        (path / ".dvc" / "config").write_text("")
    if git:
        subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


STAGE = "stages:\n  a:\n    cmd: echo ${x}\n    params: [x]\n"


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("repo", "message"),
    [
        (dict(dvc_yaml=STAGE), None),
        (
            dict(dvc_yaml="stages:\n  a:\n    cmd: [echo\n"),
            "dvc.yaml:4:1: YAML syntax error: did not find expected ',' or ']' (check the indentation",
        ),
        (
            dict(dvc_yaml=STAGE, params_yaml="x: [1\n"),
            "params.yaml:2:1: YAML syntax error: did not find expected ',' or ']'",
        ),
        (
            dict(dvc_yaml="stages:\n  a:\n    cmdx: echo\n"),
            "validation failed: 2 errors (extra keys not allowed @ data['stages']['a']['cmdx']): fix it",
        ),
        (
            dict(dvc_yaml=STAGE, params_yaml="y: 1\n"),
            "{repo}: DVC cannot read the pipeline: failed to parse 'stages.a.cmd' in 'dvc.yaml': Could not find 'x'",
        ),
        (
            dict(dvc_yaml=STAGE, dvc=False),
            "{repo} is not in a DVC repository (no .dvc directory there or above): run it in the root of the",
        ),
        (dict(dvc_yaml=STAGE, git=False), "{repo}: DVC needs the git repository around it ("),
    ],
    ids=["readable", "dvc_yaml_syntax", "params_yaml_syntax", "dvc_yaml_schema", "missing_param", "no_dvc", "no_git"],
)
def test_dag_of_a_pipeline_dvc_cannot_read_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, repo, message):
    """What `dvc dag` prints as a message (never a traceback), each as one line naming the file."""
    from halludetect import cli as console

    monkeypatch.chdir(_repo(tmp_path / "r", **repo))  # DVC names files relative to the working directory
    if message is None:  # the same pipeline, unbroken, reads
        console.main(["dag"])
        assert capsys.readouterr().out == "a\n"
        return
    with pytest.raises(SystemExit) as e:
        console.main(["dag"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert message.format(repo=tmp_path.resolve() / "r") in err


def test_a_family_every_other_reads_is_said_once_not_on_every_line():
    fams = [Family("code", 1), Family("world", 1, ["code"]), Family("train", 3, ["code", "world"])]
    assert render(fams) == "code       -> every family after it reads it\nworld\ntrain x 3  <- world\n"
    # the code and the params stage: every family after each reads it (params reads code's digest)
    fams = [Family("code", 1), Family("params", 1, ["code"]), *(Family(f, 1, ["code", "params"]) for f in "ab")]
    fams.append(Family("c", 2, ["code", "params", "a"]))
    assert render(fams) == (
        "code    -> every family after it reads it\nparams  -> every family after it reads it\na\nb\nc x 2   <- a\n"
    )
    chain = [Family("a", 1), Family("b", 1, ["a"]), Family("c", 1, ["b"])]  # each read by the next alone
    assert render(chain) == "a\nb  <- a\nc  <- b\n"
    two = [Family("world", 1), Family("train", 3, ["world"])]  # with two, the upstream one is just that
    assert render(two) == "world\ntrain x 3  <- world\n"
