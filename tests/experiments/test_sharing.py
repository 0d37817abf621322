"""Sharing experiments and stage inputs through a DVC remote (halludetect/experiments/sharing.py) and
reading a sweep from wherever its metrics are (halludetect/experiments/sweeps.py), on a toy DVC
repository with real git, real `dvc exp run` and a local-directory DVC remote: a sweep that ran
before the remote was configured, and a HEAD that moved since. (The README's blocks run on the
small world's DAG and an S3 server in tests/test_e2e_sharing.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import experiments_repo, git

from halludetect.experiments import sharing, sweeps
from halludetect.experiments.sharing import SharingError, push_experiments, workspace_remotes
from halludetect.experiments.sweeps import SweepError
from halludetect.report.cells import Grid
from halludetect.report.tables import to_markdown

GRID = Grid(["world"], ["world"], {"world": None}, {"world": None})
GIT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

# Two stages whose outputs a lock can point elsewhere, and an evaluation whose test AUROC is dim / 100.
EVALUATE = """
import json, os, sys, yaml
os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)
dim = yaml.safe_load(open("params.yaml"))["detectors"]["max"]["dim"]
auroc = {"mean": dim / 100, "stderr": 0.01}
for path in sys.argv[1:]:  # two methods, so that `dvc exp show` names each metric by its file
    json.dump({"best_layer": 1, "test": {"auroc": auroc, "n": 10}}, open(path, "w"))
"""
DVC_YAML = {
    "stages": {
        "dump": {"cmd": "python -c \"open('states.bin', 'wb').write(bytes(range(256)) * 64)\"", "outs": ["states.bin"]},
        "train": {
            "cmd": "python -c \"open('weights.bin', 'wb').write(open('states.bin', 'rb').read()[::-1])\"",
            "deps": ["states.bin"],
            "outs": ["weights.bin"],
        },  # fmt: skip
        "evaluate": {
            "cmd": "python evaluate.py metrics/eval/world/world/max.json metrics/eval/world/world/mean.json",
            "deps": ["evaluate.py"],
            "params": ["detectors.max.dim"],
            "metrics": ["metrics/eval/world/world/max.json", "metrics/eval/world/world/mean.json"],
        },
    }
}


def sh(*cmd: str, cwd: Path, check: bool = True) -> str:
    env = {**os.environ, **GIT, "DVC_NO_ANALYTICS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and res.returncode:
        raise AssertionError(f"{' '.join(cmd)}: {res.stdout}{res.stderr}")
    return res.stdout + res.stderr


def dvc(*args: str, cwd: Path, check: bool = True) -> str:
    return sh(sys.executable, "-m", "dvc", *args, cwd=cwd, check=check)


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """A's clone after a two-value sweep of detectors.max.dim (8, 32; the baseline is 16), then a
    DVC remote configured and committed (HEAD moved) and `dvc push` of HEAD's outputs; the team's
    bare git repository; the remote's directory."""
    root = tmp_path_factory.mktemp("team")
    origin, store, a = root / "origin.git", root / "store", root / "a"
    sh("git", "init", "-q", "--bare", str(origin), cwd=root)
    a.mkdir()
    sh("git", "init", "-q", cwd=a)
    dvc("init", "-q", cwd=a)
    (a / "evaluate.py").write_text(EVALUATE)
    (a / "params.yaml").write_text(yaml.safe_dump({"detectors": {"max": {"dim": 16}}}))
    (a / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    dvc("repro", "-q", cwd=a)
    sh("git", "add", "-A", cwd=a)
    sh("git", "commit", "-qm", "results", cwd=a)
    for dim in (8, 32):
        dvc("exp", "run", "-q", "--temp", "-n", f"dim-{dim}", "-S", f"detectors.max.dim={dim}", cwd=a)
    sh("git", "remote", "add", "origin", str(origin), cwd=a)
    dvc("remote", "add", "-d", "shared", str(store), cwd=a)
    sh("git", "add", ".dvc/config", cwd=a)
    sh("git", "commit", "-qm", "DVC remote", cwd=a)
    sh("git", "push", "-q", "origin", "HEAD:refs/heads/main", cwd=a)
    sh("git", "--git-dir", str(origin), "symbolic-ref", "HEAD", "refs/heads/main", cwd=root)
    dvc("push", "-q", cwd=a)
    return a, origin, store


def clone(team, where: Path) -> Path:
    _, origin, _ = team
    sh("git", "clone", "-q", str(origin), str(where), cwd=where.parent)
    dvc("exp", "pull", "-q", "origin", "-A", "--no-cache", cwd=where)
    return where


def objects(store: Path) -> int:
    return sum(1 for f in store.rglob("*") if f.is_file())


def test_a_sweep_run_before_the_remote_was_configured_is_pushed_with_its_outputs(team, tmp_path):
    """DVC's own `exp push` takes HEAD's experiments (none: HEAD moved) and each experiment's
    commit's remote (none); exp-push pushes both experiments and uploads their metrics."""
    a, _, store = team
    before = objects(store)
    assert "No experiments to push" in dvc("exp", "push", "origin", cwd=a)  # what plain DVC does here
    result = push_experiments(a, "origin")
    # each experiment's metrics: its two files hold the same bytes, one object in DVC's store
    assert sorted(result["success"]) == ["dim-32", "dim-8"] and result["uploaded"] == 2, result
    assert objects(store) == before + 2
    again = push_experiments(a, "origin")
    assert sorted(again["up_to_date"]) == ["dim-32", "dim-8"] and again["uploaded"] == 0

    # A colleague's clone has the experiments' refs and no data; the table streams the metrics
    # files from the remote and nothing lands in its cache.
    b = clone(team, tmp_path / "b")
    table = sweeps.sweep(b, "detectors.max.dim", GRID)
    md = to_markdown(table)
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert rows == ["| 8 | 0.080 ± 0.010 L1 |", "| 16 | <u>0.160</u> ± 0.010 L1 |", "| 32 | **0.320** ± 0.010 L1 |"], md
    assert not (b / ".dvc/cache").exists()


def test_which_experiments_a_sweep_reads(team):
    a, _, _ = team
    head, base = (sh("git", "rev-parse", rev, cwd=a).strip() for rev in ("HEAD", "HEAD~1"))
    assert sweeps.baselines(a) == [head, base]  # HEAD and the earlier commit the sweep derives from
    assert sweeps.baselines(a, revs=["HEAD~1"]) == [base]
    assert sweeps.baselines(a, names=["dim-8"]) == [base]
    only = sweeps.experiments(a, names=["dim-8"])
    assert [(e.name, e.params["detectors.max.dim"]) for e in only] == [(e.name, 16) for e in only[:1]] + [("dim-8", 8)]
    with pytest.raises(SweepError, match=r"^no experiment named dim-9; did you mean 'dim-8'\? valid: dim-32, dim-8"):
        sweeps.baselines(a, names=["dim-9"])
    with pytest.raises(SweepError, match=r"^--rev nope: no such commit in this clone"):
        sweeps.baselines(a, revs=["nope"])


def test_metrics_the_remote_does_not_have_are_a_row_marked_missing_with_what_to_run(team, tmp_path):
    """A clone whose remote is another (empty) store: every experiment's metrics are recorded in
    its commit and found nowhere. Rows marked `missing`, no traceback, the note says who pushes."""
    b = clone(team, tmp_path / "b")
    (tmp_path / "empty").mkdir()
    dvc("remote", "modify", "--local", "shared", "url", str(tmp_path / "empty"), cwd=b)
    exps = sweeps.experiments(b)
    assert all(not e.metrics for e in exps)
    with pytest.raises(SweepError, match="no experiment has metrics of 'max'"):
        sweeps.sweep(b, "detectors.max.dim", GRID)
    # with one value found (the baseline's, put in the local cache), the others are marked
    dvc("pull", "-q", "-r", "shared", cwd=b, check=False)  # the empty store: nothing
    dvc("remote", "modify", "--local", "shared", "url", str(team[2]), cwd=b)
    dvc("pull", "-q", "evaluate", cwd=b)  # HEAD's metrics only
    dvc("remote", "modify", "--local", "shared", "url", str(tmp_path / "empty"), cwd=b)
    md = to_markdown(sweeps.sweep(b, "detectors.max.dim", GRID))
    assert "| 8 | missing |" in md and "| 32 | missing |" in md, md
    assert (
        "experiment dim-8's metrics are missing: its dvc.lock records metrics/eval/world/world/max.json, which is "
        "neither in the local cache nor on the DVC remote 'shared': whoever ran the experiment pushes its outputs "
        "with `halludetect exp-push origin`"
    ) in md


def test_workspace_remotes_hold_the_credentials_in_the_process_only(team, tmp_path):
    a, _, store = team
    dvc("remote", "add", "--local", "team-s3", "s3://bucket/halludetect", cwd=a)
    try:
        dvc("remote", "modify", "--local", "team-s3", "secret_access_key", "s3cret-value", cwd=a)
        remotes = workspace_remotes(a)
    finally:
        dvc("remote", "remove", "--local", "team-s3", cwd=a)
    assert remotes["core"] == {"remote": "shared"} and remotes["remote"]["shared"]["url"] == str(store)
    assert remotes["remote"]["team-s3"]["secret_access_key"] == "s3cret-value"  # config.local, as DVC reads it
    assert "s3cret-value" not in (a / ".dvc/config").read_text()
    bare = tmp_path / "bare"
    bare.mkdir()
    sh("git", "init", "-q", cwd=bare)
    dvc("init", "-q", cwd=bare)
    assert workspace_remotes(bare) is None
    with pytest.raises(SharingError, match=r"^no DVC remote is configured: add the team's first"):
        push_experiments(bare, "origin")
    with pytest.raises(SharingError, match=r"^no DVC remote 'share'; did you mean 'shared'\?"):
        push_experiments(a, "origin", dvc_remote="share")


def test_an_input_the_remote_never_received_names_its_stage_and_the_likely_cause(team, tmp_path, monkeypatch):
    """`dvc push` sent everything of A's run; a clone whose dvc.lock records another run of `dump`
    (another machine's) misses states.bin: the message names it, its writer and the cause."""
    b = tmp_path / "b"
    sh("git", "clone", "-q", str(team[1]), str(b), cwd=tmp_path)
    lock = yaml.safe_load((b / "dvc.lock").read_text())
    for out in lock["stages"]["dump"]["outs"] + lock["stages"]["train"]["deps"]:
        out["md5"] = "0" * 32  # the bytes another CPU would have written
    (b / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert dvc("pull", "states.bin", cwd=b, check=False)  # DVC's own failure comes first
    monkeypatch.chdir(b)  # as `halludetect train-layer` runs: DVC reads a stage name relative to the cwd
    message = sharing.missing_from_remote(b, "train", ["states.bin"], None)
    assert message.startswith(
        "train needs states.bin (written by dump), and neither the local cache nor the DVC remote 'shared' has "
        "the version this clone's dvc.lock records. Likely cause: the dvc.lock you cloned does not record the run "
        "that was pushed"
    ), message
    assert "`git add dvc.lock && git commit && git push`" in message
    (b / ".dvc/config.local").write_text("[core]\n    remote = nowhere\n['remote \"nowhere\"']\n    url = s3://x/y\n")
    assert sharing.missing_from_remote(b, "train", ["states.bin"], "nowhere") == ""  # cannot ask it: DVC's message
    json.dumps(message)  # one line of text, printable as is


@pytest.mark.hostile
def test_exp_push_with_no_experiment_in_scope_or_a_bad_job_count_says_what_to_do(team, tmp_path, monkeypatch, capsys):
    from halludetect.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["exp-push", "origin", "-j", "0"])
    assert stop.value.code == 2 and "-j/--jobs 0: give 1 or more parallel uploads" in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    sh("git", "clone", "-q", str(team[1]), str(fresh), cwd=tmp_path)  # the experiments' refs not pulled
    monkeypatch.chdir(fresh)
    with pytest.raises(SystemExit) as stop:
        main(["exp-push", "origin"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no experiment to push: none derives from HEAD or a commit before it" in err


@pytest.fixture
def pusher(tmp_path, monkeypatch):
    """A clone after a sweep (experiments dim-8 and dim-32 of HEAD, their outputs in the local cache),
    a git remote `origin` (an empty bare repository) and a DVC remote `shared` (a local directory),
    the clone as the working directory, as `halludetect exp-push` runs."""
    repo, origin, store = tmp_path / "a", tmp_path / "origin.git", tmp_path / "store"
    shas = experiments_repo(repo, history=2)
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(repo, "remote", "add", "origin", str(origin))
    with open(repo / ".dvc/config", "a") as config:
        config.write(f"[core]\n    remote = shared\n['remote \"shared\"']\n    url = {store}\n")
    monkeypatch.chdir(repo)
    return repo, origin, store, shas


def exp_push(*args: str, capsys) -> tuple[int, str, str]:
    from halludetect.cli import main

    try:
        main(["exp-push", *args])
        code = 0
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def pushed_refs(origin: Path) -> list[str]:
    return sorted(git(origin, "for-each-ref", "--format=%(refname:lstrip=-1)").split())


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nowhere"], "no git remote 'nowhere'; valid: origin. Add it (`git remote add nowhere URL`) or give its URL"),
        (["orign"], "no git remote 'orign'; did you mean 'origin'? valid: origin. Add it"),
        (["../nope.git"], "no git repository at ../nope.git and no git remote of that name; valid: origin"),
        (
            ["origin", "dim-9"],
            "no experiment named dim-9; did you mean 'dim-8'? valid: dim-32, dim-8 (`dvc exp list -A`",
        ),
        (["origin", "--rev", "nope"], "--rev nope: no such commit in this clone (a branch, tag or sha; `git log"),
    ],
)
def test_exp_push_with_an_unknown_git_remote_experiment_or_rev_says_so_before_pushing_anything(
    pusher, capsys, args, message
):
    """Before: a traceback each (DVC's SCMError, UnresolvedExpNamesError, RevError)."""
    _, origin, store, _ = pusher
    code, _, err = exp_push(*args, capsys=capsys)
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert pushed_refs(origin) == [] and not store.exists()


@pytest.mark.hostile
def test_exp_push_to_a_dvc_remote_that_cannot_be_written_pushes_no_git_ref(pusher, tmp_path, capsys):
    """Before: the git refs went first, then the upload failed (a traceback): a colleague got
    experiments whose outputs no one can fetch. (A directory under a file: unwritable even as root.)"""
    repo, origin, _, _ = pusher
    (tmp_path / "a-file").write_text("")
    (repo / ".dvc/config.local").write_text(f"['remote \"shared\"']\n    url = {tmp_path / 'a-file' / 'store'}\n")
    code, _, err = exp_push("origin", capsys=capsys)
    assert code == 2 and err.splitlines()[-1].startswith(
        "error: the outputs of dim-32 dim-8 could not be pushed to the DVC remote 'shared' (NotADirectoryError: "
    ), err
    assert err.splitlines()[-1].endswith(
        "so no git ref was pushed: check its URL (`dvc remote list`) and credentials, then run this again"
    )
    assert pushed_refs(origin) == []


@pytest.mark.hostile
def test_exp_push_whose_git_refs_fail_after_the_data_says_what_was_done_and_how_to_finish(pusher, capsys):
    repo, origin, store, _ = pusher
    git(repo, "remote", "add", "team", str(origin.with_name("moved.git")))  # the server moved
    code, _, err = exp_push("team", capsys=capsys)
    last = err.splitlines()[-1]
    assert code == 2 and last.startswith(
        "error: the outputs of dim-32 dim-8 are on the DVC remote 'shared' (2 file(s) uploaded), but pushing their "
        "git refs to 'team' failed ("
    ), err
    assert last.endswith(
        "then finish with `halludetect exp-push team dim-32 dim-8` (the outputs are not uploaded again)"
    )
    assert sum(1 for f in store.rglob("*") if f.is_file()) == 2 and pushed_refs(origin) == []
    git(repo, "remote", "set-url", "team", str(origin))
    code, out, _ = exp_push("team", "dim-32", "dim-8", capsys=capsys)
    assert code == 0 and json.loads(out)["files_uploaded"] == 0 and pushed_refs(origin) == ["dim-32", "dim-8"]


@pytest.mark.hostile
def test_exp_push_leaves_out_an_experiment_ref_at_its_own_baseline_and_says_so(pusher, capsys):
    """Before: DVC pushed it, after walking the whole history for its commits' outputs."""
    repo, origin, _, shas = pusher
    base = shas["baseline"]
    git(repo, "update-ref", f"refs/exps/{base[:2]}/{base[2:]}/at-head", "HEAD")
    code, out, err = exp_push("origin", capsys=capsys)
    assert code == 0 and pushed_refs(origin) == ["dim-32", "dim-8"], err
    assert json.loads(out)["not_pushed"] == [f"refs/exps/{base[:2]}/{base[2:]}/at-head"]
    assert f"warning: not pushed: refs/exps/{base[:2]}/{base[2:]}/at-head points at its baseline" in err
    code, _, err = exp_push("origin", "at-head", capsys=capsys)
    assert code == 2 and "error: experiment at-head cannot be pushed: refs/exps/" in err


@pytest.mark.hostile
def test_train_layer_refuses_a_score_with_nothing_to_train():
    """A score has no layers: `halludetect train-layer` names its train stage instead of pulling the
    cell's states for nothing."""
    from support import ROOT

    from halludetect.config import load_params

    params = load_params(ROOT / "params.yaml")
    with pytest.raises(
        SharingError, match=r"p_sem is a score with nothing to train: .*dvc repro train@world-world-p_sem"
    ):
        sharing.check_in_grid(params, "world", "world", "p_sem")
    sharing.check_in_grid(params, "world", "world", "hami")  # a trained one passes
