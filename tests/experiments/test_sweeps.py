"""Sweeps into tables (halludetect/experiments/sweeps.py), on experiments as `dvc exp show` gives them
(the real queue runs in tests/test_e2e_sharing.py): a failed, queued or running experiment is a row
marked so, a failed one's first error line is in the notes, and an unknown parameter, --where key,
method or metric is an error naming the valid ones."""

import pytest
import yaml
from support import ROOT

from halludetect.experiments import sharing, sweeps
from halludetect.experiments.sweeps import Experiment, SweepError, first_error
from halludetect.report.paper_tables import Grid
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
    import dvc.api

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
    monkeypatch.setattr(dvc.api, "exp_show", lambda repo, revs, config: rows)
    evaluation = {("world", "world", "max"): {"best_layer": 2, "test": {"auroc": {"mean": 0.7}}}}
    monkeypatch.setattr(sweeps, "evaluations", lambda repo, rev, remotes: (evaluation, {}))
    monkeypatch.setattr(sweeps, "baselines", lambda *a: ["HEAD"])
    monkeypatch.setattr(sharing, "workspace_remotes", lambda repo: None)
    exps = sweeps.experiments(tmp_path)
    assert [e.params for e in exps] == [
        {"detectors.max.dim": 8, "train.epochs": 8},
        {"detectors.max.dim": 16, "train.epochs": 8},
    ]
    results, _ = sweeps.sweep_results(exps, "detectors.max.dim", "max")
    assert set(results[("world", "world")]) == {8, 16}
