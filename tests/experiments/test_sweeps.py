"""Sweeps into tables (halludetect/experiments/sweeps.py), on experiments as `dvc exp show` gives them
(the real queue runs in tests/test_e2e_sharing.py): a failed, queued or running experiment is a row
marked so, a failed one's first error line is in the notes, and an unknown parameter, --where key,
method or metric is an error naming the valid ones."""

import pytest
import yaml
from support import ROOT, experiments_repo, git

from halludetect.experiments import sharing, sweeps
from halludetect.experiments.sweeps import Experiment, SweepError, first_error
from halludetect.report.cells import Grid
from halludetect.report.tables import to_markdown

GRID = Grid(["world"], ["world"], {"world": None}, {"world": None})
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def metrics(auroc: float) -> dict:
    stat = lambda v: {"mean": v, "stderr": 0.01}  # noqa: E731
    return {"best_layer": 2, "test": {"auroc": stat(auroc), "auprc": stat(auroc - 0.1), "n": 40}}


def exp(name, dim, auroc=None, state=None, error=None) -> Experiment:
    cells = {} if auroc is None else {("world", "world", "max"): metrics(auroc)}
    return Experiment(name, {"detectors.max.dim": dim, "train.epochs": 8}, cells, state, error)


EXPS = [
    exp("queued-one", 64, state="queued"),
    exp("bad-dim", 0, state="failed", error="params.yaml: detectors.max.dim: Input should be greater than 0"),
    exp("dim-32", 32, 0.71),
    exp("dim-8", 8, 0.65),
    exp("main", 16, 0.70),  # the baseline
]


@pytest.fixture
def repo_with(monkeypatch):
    def use(exps):
        monkeypatch.setattr(sweeps, "experiments", lambda repo, *which: exps)

    return use


@pytest.mark.hostile
def test_a_failed_experiment_is_a_row_marked_failed_with_its_first_error_line(repo_with):
    """Before: a failed experiment was left out of the table without a word."""
    repo_with(EXPS)
    table = sweeps.sweep(".", "detectors.max.dim", GRID, params=PARAMS)
    md = to_markdown(table)
    assert [r.label for r in table.rows] == ["0", "8", "16", "32", "64"]
    assert "| 0 | failed |" in md and "| 64 | queued |" in md and "| 32 | **0.710** ± 0.010 L2 |" in md
    assert (
        "- detectors.max.dim=0: experiment bad-dim failed: params.yaml: detectors.max.dim: Input should be "
        "greater than 0 (`dvc queue logs bad-dim`)"
    ) in md
    assert "- detectors.max.dim=64: experiment queued-one is queued: run this again once it has finished" in md


def test_a_value_that_also_succeeded_keeps_its_figures_and_notes_the_failure(repo_with):
    repo_with([exp("retry", 8, state="failed", error="Killed"), *EXPS[2:]])
    md = to_markdown(sweeps.sweep(".", "detectors.max.dim", GRID, params=PARAMS))
    assert "| 8 | 0.650 ± 0.010 L2 |" in md and "experiment retry failed: Killed" in md


@pytest.mark.parametrize(
    ("log", "line"),
    [
        (
            "Reproducing experiment 'x'\nRunning stage 'train@w-w-max-2':\n> python -m stages.train ...\n"
            "error: params.yaml: detectors.max.dim: Input should be greater than 0\n"
            "ERROR: failed to reproduce 'train@w-w-max-2': failed to run: python -m stages.train, exited with 2\n",
            "params.yaml: detectors.max.dim: Input should be greater than 0",
        ),
        (
            "Running stage 'train':\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "RuntimeError: CUDA out of memory\nERROR: failed to reproduce 'train': failed to run: ...\n",
            "RuntimeError: CUDA out of memory",
        ),
        (
            "error: params.yaml: 1 problem(s)\n"
            "  detectors.max.dim: Input should be greater than 0 (got 0)\nERROR: failed to reproduce ...\n",
            "params.yaml: 1 problem(s) detectors.max.dim: Input should be greater than 0 (got 0)",
        ),
        ("ERROR: failed to reproduce 'x': dependency 'data/a' does not exist\n", "failed to reproduce 'x': dependency"),
        ("", None),
    ],
)
def test_first_error_is_the_line_that_says_why(log, line):
    got = first_error(log)
    assert got == line if line is None else got.startswith(line)


@pytest.mark.hostile
def test_a_parameter_that_is_not_in_params_yaml_is_named_with_the_valid_ones(repo_with):
    repo_with(EXPS)
    with pytest.raises(SweepError) as e:
        sweeps.sweep(".", "detectors.max.dims", GRID, params=PARAMS)
    assert str(e.value) == (
        "the swept parameter detectors.max.dims is not a parameter of params.yaml; did you mean detectors.max.dim"
        " or detectors.mean.dim or detectors.raw_max.dim? The keys of detectors.max: detectors.max.dim, "
        "detectors.max.dropout, detectors.max.lr, detectors.max.weight_decay"
    )
    with pytest.raises(SweepError, match=r"^--where train.epoch is not a parameter of params.yaml; did you mean "):
        sweeps.sweep(".", "detectors.max.dim", GRID, where={"train.epoch": 8}, params=PARAMS)


@pytest.mark.hostile
def test_an_unknown_metric_or_method_is_named_with_the_valid_ones(repo_with):
    repo_with(EXPS)
    with pytest.raises(SweepError, match=r"^--metric 'aucroc' is not a test metric of 'max'; did you mean 'auroc'\? "
                                         r"valid: auprc, auroc$"):  # fmt: skip
        sweeps.sweep(".", "detectors.max.dim", GRID, metric="aucroc", params=PARAMS)
    with pytest.raises(SweepError, match=r"^unknown method 'maxx'; did you mean 'max'\? valid: "):
        sweeps.sweep(".", "detectors.max.dim", GRID, method="maxx", params=PARAMS)


def test_a_metric_with_a_bare_key_is_not_taken_for_a_param(tmp_path, monkeypatch):
    """`dvc exp show` gives a metric its bare key where no other file has it (the evidence JSON's
    `methods.max...`): only keys under a section of params.yaml are params."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"detectors": {"max": {"dim": 8}}, "train": {"epochs": 8}}))
    rows = [
        {
            "Experiment": name,
            "rev": name,
            "State": "Success",
            "detectors.max.dim": dim,
            "train.epochs": 8,
            "methods.max.classes.correct.s50.median": 2.0 + dim,  # the evidence JSON's, unprefixed
            "metrics/eval/world/world/max.json:best_layer": 2,
            "metrics/eval/world/world/max.json:test.auroc.mean": 0.7,
        }
        for name, dim in (("a", 8), ("b", 16))
    ]
    monkeypatch.setattr(sweeps, "_exp_show", lambda repo, revs, config, hidden: rows)
    monkeypatch.setattr(sweeps, "exp_refs", lambda repo: [])
    evaluation = {("world", "world", "max"): {"best_layer": 2, "test": {"auroc": {"mean": 0.7}}}}
    monkeypatch.setattr(sweeps, "evaluations", lambda repo, rev, remotes, cache=None: (evaluation, {}))
    monkeypatch.setattr(sweeps, "baselines", lambda *a: ["HEAD"])
    monkeypatch.setattr(sharing, "workspace_remotes", lambda repo: None)
    exps = sweeps.experiments(tmp_path)
    assert [e.params for e in exps] == [
        {"detectors.max.dim": 8, "train.epochs": 8},
        {"detectors.max.dim": 16, "train.epochs": 8},
    ]
    results, _ = sweeps.sweep_results(exps, "detectors.max.dim", "max")
    assert set(results[("world", "world")]) == {8, 16}


def table_rows(md: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith("| ") and line[2:3].isdigit()]


ROWS = ["| 8 | 0.080 ± 0.010 L1 |", "| 16 | <u>0.160</u> ± 0.010 L1 |", "| 32 | **0.320** ± 0.010 L1 |"]


@pytest.mark.hostile
def test_an_experiment_ref_at_its_own_baseline_reads_no_history_and_is_a_note(tmp_path, monkeypatch):
    """Before: DVC walked first parents from the ref's commit until it met the baseline, which a ref
    pointing at HEAD itself never meets: every commit of the history was read (past 10 GB in 6
    minutes on this repository's). Now DVC reads the baseline and the two experiments, nothing else."""
    import dvc.repo.experiments.collect as collect

    repo = tmp_path / "repo"
    shas = experiments_repo(repo, history=6)
    base = shas["baseline"]
    ref = f"refs/exps/{base[:2]}/{base[2:]}/at-head"
    git(repo, "update-ref", ref, "HEAD")
    read = []
    collect_rev = collect.collect_rev
    monkeypatch.setattr(
        collect, "collect_rev", lambda r, rev, *a, **kw: read.append(rev) or collect_rev(r, rev, *a, **kw)
    )
    md = to_markdown(sweeps.sweep(repo, "detectors.max.dim", GRID))
    assert set(read) <= {"workspace", base, shas["dim-8"], shas["dim-32"]}, f"DVC read {len(set(read))} commits"
    assert table_rows(md) == ROWS, md
    assert (
        f"- experiment at-head is not in the table: {ref} points at its baseline {base[:7]} itself, not at an "
        f"experiment's commit on top of it: remove it (`git update-ref -d {ref}`)"
    ) in md


def point_at_tree(repo, ref, base):
    git(repo, "update-ref", ref, f"{base}^{{tree}}")


def damage(repo, ref, base):
    (repo / ".git" / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / ".git" / ref).write_text("not a commit id\n")


def point_at_a_lost_commit(repo, ref, base):
    (repo / ".git" / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / ".git" / ref).write_text("1234567" + "0" * 33 + "\n")  # a commit the clone never had


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("make", "why"),
    [
        (point_at_tree, "points at a tree ({tree}), not at a commit: remove it (`git update-ref -d {ref}`)"),
        (damage, 'is damaged (its file holds no commit id): delete it (`rm "$(git rev-parse --git-dir)/{ref}"`)'),
        (point_at_a_lost_commit, "points at 1234567, which this clone does not have: remove it"),
    ],
)
def test_an_experiment_whose_ref_cannot_be_read_is_a_note_naming_the_ref_and_why(tmp_path, make, why):
    """Before: a ref pointing at a tree was a traceback, a damaged one or one whose commit the clone
    lacks vanished from the table without a word."""
    repo = tmp_path / "repo"
    shas = experiments_repo(repo, history=1)
    base = shas["baseline"]
    ref = f"refs/exps/{base[:2]}/{base[2:]}/dim-64"
    make(repo, ref, base)
    md = to_markdown(sweeps.sweep(repo, "detectors.max.dim", GRID))
    assert table_rows(md) == ROWS, md
    tree = git(repo, "rev-parse", "--short", f"{base}^{{tree}}")
    assert f"- experiment dim-64 is not in the table: {ref} {why.format(ref=ref, tree=tree)}" in md, md
    assert "dvc exp pull origin dim-64" in md  # how to get it back
    # with no other experiment left, the error says so too
    for name in ("dim-8", "dim-32"):
        git(repo, "update-ref", "-d", f"refs/exps/{base[:2]}/{base[2:]}/{name}")
    with pytest.raises(SweepError, match=r"^no experiment varies .* And 1 could not be read: experiment dim-64 is not"):
        sweeps.sweep(repo, "detectors.max.dim", GRID)


def test_an_experiments_evaluations_come_from_the_local_cache_and_dvc_opens_a_commit_only_for_the_rest(
    tmp_path, monkeypatch
):
    """Each file by the md5 the commit's dvc.lock records, from the local cache; DVC's filesystem at
    that commit (about 0.5 s to open: it builds the commit's index) only for a file the cache lacks,
    read from the remote, and its error is the row's note."""
    import json

    import dvc.api

    cached, remote, gone = (f"metrics/eval/world/world/{m}.json" for m in ("max", "hami", "mean"))
    monkeypatch.setattr(sweeps, "recorded_evaluations", lambda repo, rev: {cached: "aa11", remote: "bb22", gone: None})
    (tmp_path / "aa11").write_text(json.dumps({"best_layer": 1}))

    class Cache:
        def oid_to_path(self, md5):
            return str(tmp_path / md5)

    opened, read = [], []

    class FS:
        def __init__(self, repo, rev, config):
            opened.append(rev)

        def read_text(self, path):
            read.append(path)
            if path == gone:
                raise FileNotFoundError(path)
            return json.dumps({"best_layer": 2})

    monkeypatch.setattr(dvc.api, "DVCFileSystem", FS)
    found, unread = sweeps.evaluations(tmp_path, "abc123", None, Cache())
    assert found == {("world", "world", "max"): {"best_layer": 1}, ("world", "world", "hami"): {"best_layer": 2}}
    assert opened == ["abc123"] and read == [remote, gone]  # opened once, for the two the cache lacks
    assert list(unread) == [gone] and "FileNotFoundError" in unread[gone]
