"""The whole DAG on a very small world, DVC's recompute contract, sharing through a real S3
remote and sweeps that end in tables.

Runs in a temporary copy of the repository (its own git and DVC repo), so it never touches
the working tree's data/ or metrics/. The tests run in file order: the ones that read the
DAG's first results (the bundle, the remote, the sweep) come before those that change params.
What each needs, and what it repeats: the fixture runs the whole DAG once (about half of the
module's time); the recompute tests re-run only what a change re-runs, and two of them (a
sampling and a dump change, which re-run nearly everything) check DVC's plan with
`dvc repro --dry` instead of repeating the DAG.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
COPY = ["halludetect", "stages", "dvc.yaml", "params.yaml", "pyproject.toml", "inputs/README.md", ".dvc/config",
        ".dvc/plots", ".dvcignore", ".gitignore"]

SMALL = {
    "world": {"n_people": 60, "exposures": [0, 30], "epochs": 10, "hidden_size": 64, "intermediate_size": 128,
              "n_heads": 4, "n_layers": 2, "vocab_size": 512},
    "generate": {"n_samples": 3, "max_new_tokens": 16},
    "train": {"epochs": 8, "seeds": [0]},
    "evaluate": {"bootstrap": 20, "throughput_repeats": 1},
    "analyze": {"steps": 50},
    # one of each kind of stage; every method is covered by the unit tests
    "grid": {"methods": ["hami", "max"], "sp_methods": ["hami_sp"], "layers": [1, 2]},
    "detectors": {m: {"dim": 16} for m in ("hami", "hami_sp", "max")},
}
LAYERS = (1, 2)
METHODS = ("hami", "max")
DETECTOR_STAGES = (
    {f"train@world-world-{m}-{layer}" for m in METHODS for layer in LAYERS}
    | {f"{kind}@world-world-{m}" for m in METHODS for kind in ("evaluate", "export")}
    | {f"train_sp@world-world-hami_sp-{layer}" for layer in LAYERS}
    | {"evaluate_sp@world-world-hami_sp", "export_sp@world-world-hami_sp"}
)
SP_STAGES = {s for s in DETECTOR_STAGES if "hami_sp" in s}
ANALYSIS_STAGES = {"analyze@world-world-hami_sp", "analyze@world-world-hami"}


def run(cmd: list[str], cwd: Path, check: bool = True, **extra_env: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(cwd), **extra_env}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bindir}:{env['PATH']}"  # `python` (dvc.yaml) and `halludetect` (README) are this venv's
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and res.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def set_params(repo: Path, updates: dict) -> None:
    path = repo / "params.yaml"
    data = yaml.safe_load(path.read_text())

    def merge(dst, src):
        for k, v in src.items():
            if isinstance(v, dict):
                merge(dst.setdefault(k, {}), v)
            else:
                dst[k] = v

    merge(data, updates)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def changed(repo: Path) -> set[str]:
    """Stages `dvc status` marks as changed (their own deps or params changed)."""
    return set(json.loads(run([sys.executable, "-m", "dvc", "status", "--json"], repo) or "{}"))


def ran(log: str) -> set[str]:
    return {line.split("'")[1] for line in log.splitlines() if line.startswith("Running stage '")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for rel in COPY:
        src = ROOT / rel
        if src.exists():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, repo / rel) if src.is_dir() else shutil.copy(src, repo / rel)
    for pycache in repo.rglob("__pycache__"):
        shutil.rmtree(pycache)
    set_params(repo, SMALL)
    run(["git", "init", "-q"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"], repo)
    run([sys.executable, "-m", "dvc", "repro"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "results"], repo)
    return repo


def test_dag_writes_the_comparison_table(repo):
    table = (repo / "metrics/tables/detection_auroc.md").read_text()
    assert "world / world" in table
    for name in ("HaMI", "Max pooling", "HaMI (SP)", "P_sem", "Semantic entropy", "Mean token log-prob",
                 "Answer length"):
        assert f"| {name} |" in table
    for name in ("auroc", "margin", "throughput", "label_distribution", "expected_c_int_world_test"):
        assert (repo / f"metrics/tables/{name}.md").exists() and (repo / f"metrics/tables/{name}.tex").exists()
    for method in ("hami_sp", "hami"):
        a = json.loads((repo / f"metrics/eval/world/world/analysis/{method}.json").read_text())
        assert set(a["layers"][str(a["best_layer"])]) == {"train", "test"}
    assert json.loads((repo / "metrics/latency/world/world.json").read_text())["questions"] > 0
    assert {p.name for p in (repo / "metrics/figures/world/world").iterdir()} == {
        "auroc_by_layer.png", "roc.png", "scores.png", "responses.png", "sensitivity_hami_sp.png",
        "sensitivity_hami.png"}
    for method in (*METHODS, "hami_sp"):
        m = json.loads((repo / f"metrics/eval/world/world/{method}.json").read_text())
        assert 0.0 <= m["test"]["auroc"]["mean"] <= 1.0 and m["best_layer"] in LAYERS
        assert [r["layer"] for r in m["layers"]] == list(LAYERS)
        assert m["throughput"]["end_to_end_samples_per_s"] > 0
    cost = json.loads((repo / "metrics/eval/world/world/hami_sp.json").read_text())["cost"]
    assert cost["seconds_per_sample"] > 0 and cost["sequential_samples_per_s"] > 0
    assert "samples/s" in (repo / "metrics/tables/throughput.md").read_text()
    labels = json.loads((repo / "metrics/labels/world/world.json").read_text())
    assert labels["splits"]["test"]["kept"] > 0
    assert changed(repo) == set()  # everything up to date


def test_bundle_scores_equal_the_dag_evaluate_scores(repo):
    """The exported bundle scores the world's test answers from scratch as evaluate scored them,
    seed by seed, at the bundle's layer (reads data/scores/..., written by evaluate since issue 14)."""
    from contract_layout import assert_bundle_scores_match_dag

    from halludetect.responses import select_answers

    dumped, _ = select_answers(pl.read_parquet(repo / "data/generations/world/world.parquet"))
    batch_size = yaml.safe_load((repo / "params.yaml").read_text())["dump"]["batch_size"]
    n = assert_bundle_scores_match_dag(repo / "data/bundles/world/world/max.safetensors",
                                       repo / "data/scores/world/world/max",
                                       pl.read_parquet(repo / "data/questions/world.parquet"), dumped,
                                       repo / "data/world/model", batch_size)
    assert n > 0


# ------------------------------------------------------------- sharing through a remote
@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3-compatible server (moto's) on 127.0.0.1, started and stopped by the test, and the
    shell variables the README's commands read: the remote's URL and endpoint, and credentials
    from the environment (never in .dvc/config)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    creds = {"AWS_ACCESS_KEY_ID": "e2e-key-id", "AWS_SECRET_ACCESS_KEY": "e2e-secret",
             "AWS_DEFAULT_REGION": "us-east-1"}
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket="halludetect-e2e")
    origin = tmp_path_factory.mktemp("origin") / "world.git"  # the team's git server
    run(["git", "init", "-q", "--bare", str(origin)], origin.parent)
    yield {"REMOTE_URL": "s3://halludetect-e2e/dvc", "S3_ENDPOINT": endpoint, "GIT_ORIGIN": str(origin), **creds}
    server.stop()


def readme_blocks(title: str) -> list[str]:
    """The bash blocks of a README section, in order: the tests run them as written."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [code for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S) if lang == "bash"]


def bash(code: str, cwd: Path, env: dict) -> str:
    return run(["bash", "-euo", "pipefail", "-c", code], cwd, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t", **env)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def copies(exps: Path) -> int:
    """Bytes of layer files in experiments' temporary workspaces that are copies, not links into
    DVC's cache (a hardlink has a link count above 1)."""
    total = 0
    for f in exps.glob("*/data/activations/*/*/layer_*.h5") if exps.exists() else []:
        try:
            st = f.stat()
        except FileNotFoundError:  # the workspace went away while we looked
            continue
        total += st.st_size if st.st_nlink == 1 else 0
    return total


def test_a_colleague_trains_one_layer_from_an_s3_remote_as_the_readme_says(repo, s3, tmp_path):
    """README "Sharing through a remote": A pushes; a fresh clone B with an empty cache fetches one
    layer file and the labels, trains and evaluates one method on that layer, runs nothing
    upstream, leaves `dvc status` of what it ran clean, and gets A's figures byte for byte."""
    push, colleague = readme_blocks("Sharing through a remote")
    run(["git", "remote", "add", "origin", s3["GIT_ORIGIN"]], repo)  # the team's git server, already there
    bash(push, repo, s3)
    assert "e2e-secret" not in (repo / ".dvc/config").read_text()  # credentials stay in the environment
    b = tmp_path / "b"
    run(["git", "clone", "-q", s3["GIT_ORIGIN"], str(b)], tmp_path)
    assert not (b / ".dvc/cache").exists() and not (b / "data").exists()
    log = bash(colleague, b, s3)
    assert ran(log) == {"train@world-world-max-2"}  # no world, no generation, no dump: one layer's stage
    assert changed(b) >= {"world"} and "train@world-world-max-2" not in changed(b)  # what B ran is clean
    assert json.loads(run([sys.executable, "-m", "dvc", "status", "--json", "train@world-world-max-2"], b)) == {}
    for rel in ("metrics/layers/world/world/max/layer_2.json", "data/scores/world/world/max/layer_2.parquet"):
        assert (b / rel).read_bytes() == (repo / rel).read_bytes(), rel
    fetched = json.loads(log[log.index("{"):log.rindex("}") + 1])
    layer_file = "data/activations/world/world/layer_2.h5"
    assert set(fetched["fetched"]) == {layer_file, "data/labels/world/world/judgments.parquet"}
    assert sorted(p.name for p in (b / "data/activations/world/world").iterdir()) == ["layer_2.h5"]
    whole = dir_bytes(repo / "data/activations/world/world")
    assert fetched["fetched"][layer_file] < whole / 2
    print(f"\nB fetched {fetched['fetched_bytes']:,} bytes; the activation directory is {whole:,} bytes")

    # A layer that was never dumped, and a remote that is not configured: clear errors, nothing run.
    bad = run([sys.executable, "-m", "halludetect.console", "train-layer", "--model", "world", "--dataset", "world",
               "--method", "max", "--layer", "7"], b, check=False, **s3)
    assert "layer 7 was never dumped for world/world: data/activations/world/world holds layers [0, 1, 2]" in bad
    c = tmp_path / "c"
    run(["git", "clone", "-q", s3["GIT_ORIGIN"], str(c)], tmp_path)
    run([sys.executable, "-m", "dvc", "remote", "remove", "shared"], c)
    bad = run([sys.executable, "-m", "halludetect.console", "train-layer", "--model", "world", "--dataset", "world",
               "--method", "max", "--layer", "2"], c, check=False)
    assert "ERROR" in bad and "remote" in bad.lower() and "Running stage" not in bad


# ---------------------------------------------------------------------------- sweeps
def test_a_queued_sweep_ends_in_a_table_as_the_readme_says(repo, s3, tmp_path):
    """README "Sweeps": a two-value sweep queued and run by `dvc queue start`, one table of it
    (the committed baseline is a third point), its results pushed with `dvc exp push` and pulled
    by a colleague, whose table is the same."""
    queue, table, share, pull = readme_blocks("Sweeps")
    before = dir_bytes(repo / ".dvc/cache")
    bash(queue, repo, s3)
    copied, deadline = 0, time.monotonic() + 600  # bytes of activation files copied into an experiment's workspace
    while (status := run([sys.executable, "-m", "dvc", "queue", "status"], repo)) and \
            ("Queued" in status or "Running" in status):
        assert time.monotonic() < deadline, status
        copied = max(copied, copies(repo / ".dvc/tmp/exps"))
        time.sleep(0.5)
    assert status.count("Success") == 2, status
    growth = (dir_bytes(repo / ".dvc/cache") - before) / 2
    activations = dir_bytes(repo / "data/activations")
    print(f"\nper queued experiment: cache growth {growth:,.0f} bytes, activation bytes copied into its workspace "
          f"{copied:,} (the activations: {activations:,} bytes; cache.type hardlink)")
    assert copied == 0 and growth < activations / 4
    out = bash(table, repo, s3)
    md = (repo / "metrics/sweeps/detectors_max_dim.md").read_text()
    assert (repo / "metrics/sweeps/detectors_max_dim.tex").exists() and md in out
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert [r.split(" |")[0][2:] for r in rows] == ["8", "16", "32"], md  # the baseline's dim 16 and the two
    bad = run([sys.executable, "-m", "halludetect.console", "sweep", "detectors.hami.lr"], repo, check=False)
    assert "no experiment varies detectors.hami.lr" in bad and "detectors.max.dim" in bad
    bash(share, repo, s3)
    b = tmp_path / "b"
    run(["git", "clone", "-q", s3["GIT_ORIGIN"], str(b)], tmp_path)
    bash(pull, b, s3)
    assert (b / "metrics/sweeps/detectors_max_dim.md").read_text() == md



def test_training_param_reruns_only_training_and_after(repo):
    set_params(repo, {"detectors": {"max": {"lr": 0.001}}})
    assert changed(repo) == {f"train@world-world-max-{layer}" for layer in LAYERS}
    log = run([sys.executable, "-m", "dvc", "repro"], repo)
    assert ran(log) == {f"train@world-world-max-{layer}" for layer in LAYERS} | {
        "evaluate@world-world-max", "export@world-world-max", "figures@world-world", "report"}


def test_judge_param_leaves_generation_dump_and_cluster(repo):
    set_params(repo, {"judge": {"match": {"lenient_recall": 0.9}}})
    assert changed(repo) == {"judge@world-world"}
    log = run([sys.executable, "-m", "dvc", "repro"], repo)
    assert "judge@world-world" in ran(log)
    assert not ran(log) & {"generate@world-world", "dump@world-world", "cluster@world-world", "world"}


def restore(repo: Path) -> None:
    """Back to the committed DAG: its params, its lock, and its outputs from DVC's cache."""
    run(["git", "checkout", "-q", "HEAD", "--", "params.yaml", "dvc.lock"], repo)  # HEAD: DVC autostages the lock
    run([sys.executable, "-m", "dvc", "checkout", "--force"], repo)
    assert changed(repo) == set()


def test_generation_param_reruns_generation_and_everything_after(repo):
    set_params(repo, {"generate": {"temperature": 0.7}})
    # the latency stage samples with these settings itself
    assert changed(repo) == {"generate@world-world", "latency@world-world"}
    log = run([sys.executable, "-m", "dvc", "repro", "dump@world-world"], repo)
    assert ran(log) == {"generate@world-world", "dump@world-world"}
    # Everything after is now stale (what `dvc repro` would re-run), nothing before: checked
    # without repeating the whole DAG.
    stale = changed(repo)
    assert stale >= {"judge@world-world", "cluster@world-world", "baselines@world-world", "latency@world-world"} | {
        s for s in DETECTOR_STAGES if s.startswith(("train", "evaluate"))}
    assert not stale & {"world", "world_check", "manifest@world", "prepare@world"}
    restore(repo)


def test_cluster_param_retrains_only_the_methods_that_read_p_sem(repo):
    set_params(repo, {"cluster": {"equivalence": "strict"}})
    assert changed(repo) == {"cluster@world-world", "latency@world-world"}  # latency makes the NLI calls itself
    log = run([sys.executable, "-m", "dvc", "repro"], repo)
    assert "cluster@world-world" in ran(log)
    assert not ran(log) & (DETECTOR_STAGES - SP_STAGES)


def test_dump_param_reruns_dump_but_not_sampling_or_labels(repo):
    set_params(repo, {"dump": {"positions": "generated"}})
    # the bundles record the position convention their detectors read
    assert changed(repo) == {"dump@world-world"} | {f"export@world-world-{m}" for m in METHODS} | {
        "export_sp@world-world-hami_sp"}
    log = run([sys.executable, "-m", "dvc", "repro", "dump@world-world"], repo)
    assert ran(log) == {"dump@world-world"}
    stale = changed(repo)
    assert stale >= {s for s in DETECTOR_STAGES if s.startswith("train")}
    assert not stale & {"generate@world-world", "judge@world-world", "cluster@world-world", "latency@world-world"}
    restore(repo)


def stage_args(repo: Path, tmp: Path, stage: str) -> list[str]:
    """The stage's own command from dvc.yaml, with outputs redirected under tmp."""
    if stage == "generate":
        return ["--model", "world", "--questions", "data/questions/world.parquet", "--manifest",
                "data/models/world.json", "--progress", str(tmp / "progress"), "--out", str(tmp / "gen.parquet"),
                "--metrics", str(tmp / "gen.json")]
    return ["--model", "world", "--questions", "data/questions/world.parquet", "--generations",
            "data/generations/world/world.parquet", "--manifest", "data/models/world.json", "--out", str(tmp / "acts")]


def test_killed_generate_resumes_under_dvc_repro_to_the_same_bytes(repo, tmp_path):
    set_params(repo, {"generate": {"batch_size": 4}})  # many small units, so the kill lands mid-way
    env = {**os.environ, "PYTHONPATH": str(repo),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "generate@world-world"], cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    progress = repo / "data/generations/world/.world.progress"
    deadline = time.monotonic() + 120
    while len(list(progress.glob("unit_*.parquet"))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "generate ended before it could be killed"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: dvc and the stage under it
    proc.wait()
    kept = len(list(progress.glob("unit_*.parquet")))
    n_units = -(-pl.read_parquet(repo / "data/questions/world.parquet").height // 4)
    assert not (repo / "data/generations/world/world.parquet").exists()
    log = run([sys.executable, "-m", "dvc", "repro", "generate@world-world"], repo)
    assert 3 <= kept < n_units and f"resuming: {kept} of {n_units} units already done" in log
    assert not progress.exists()  # removed once the output is written
    run([sys.executable, "-m", "stages.generate", *stage_args(repo, tmp_path, "generate")], repo)
    resumed = (repo / "data/generations/world/world.parquet").read_bytes()
    assert resumed == (tmp_path / "gen.parquet").read_bytes()


def test_two_processes_give_the_one_process_bytes(repo, tmp_path):
    """`HALLUDETECT_PROCESSES=2` relaunches the stage under `accelerate launch` (gloo on CPU)."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    for stage in ("generate", "dump"):
        run([sys.executable, "-m", f"stages.{stage}", *stage_args(repo, one, stage)], repo)
        log = run([sys.executable, "-m", f"stages.{stage}", *stage_args(repo, two, stage)], repo,
                  HALLUDETECT_PROCESSES="2")
        assert stage == "generate" or "process 1: dumped" in log
    assert (one / "gen.parquet").read_bytes() == (two / "gen.parquet").read_bytes()
    assert json.loads((two / "gen.json").read_text())["processes"] == 2
    files = sorted(p.name for p in (one / "acts").iterdir())
    assert files and files == sorted(p.name for p in (two / "acts").iterdir())
    for name in files:
        assert (one / "acts" / name).read_bytes() == (two / "acts" / name).read_bytes()
