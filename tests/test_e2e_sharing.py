"""Sharing through a real S3 remote and sweeps that end in tables, as docs/sweeps-and-sharing.md says,
and sampling through a serving engine.

The bash blocks of docs/sweeps-and-sharing.md ("Sweeps", "Sharing through a remote", "Sharing a
sweep") run as written and in the page's order, one test per section, on a copy of the session's
small-world DAG (tests/e2e_support.py; the commands use its `max` method and layer 2). So the DVC
remote is configured (and committed) after the sweep ran, which is the order plain `dvc exp push`
cannot share. A real S3-compatible server (moto's) on 127.0.0.1 and a bare git repository stand for
the team's remotes.

Then the generate and dump stages sample through the fake vLLM engine
(halludetect/testing/fake_vllm.py) on 127.0.0.1, serving the DAG's world model with hidden-state
extraction of its every layer (`generate.backend: completions`, one answer per request), on the
world's first questions: the dump of the states the engine kept (`dump.source: engine`) passes the
log-prob check and equals the hf dump of the same answers, a re-run of generate gives the same
bytes, and the hf dump fails on an engine that serves another revision of the model or processed
log-probs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from e2e_support import ran, run, set_params, shared_dag, stage_cmd
from support import doc_blocks

from halludetect.testing.fake_vllm import FakeVLLM

pytestmark = pytest.mark.e2e
WORLD_LAYERS = [0, 1, 2]  # the small world model's every layer (2 blocks), as `vllm serve` is told to extract


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the session's DAG (tests/e2e_support.py), committed, no remote yet."""
    return shared_dag(tmp_path_factory.getbasetemp(), tmp_path_factory.mktemp("sharing"))


@pytest.fixture(scope="module")
def engine(repo, tmp_path_factory):
    """The engine serving the DAG's world model under the preset's path, keeping every layer's states."""
    states = tmp_path_factory.mktemp("shm")
    with FakeVLLM(
        repo / "data/world/model",
        "data/world/model",
        hidden_states=WORLD_LAYERS,
        states_dir=states,
        allow_custom_save_path=True,  # as docs/models-and-generation.md starts vLLM
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3-compatible server (moto's) on 127.0.0.1, started and stopped by the test, and the
    shell variables the documented commands read: the remote's URL and endpoint, and credentials
    from the environment (never in .dvc/config)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    creds = {
        "AWS_ACCESS_KEY_ID": "e2e-key-id",
        "AWS_SECRET_ACCESS_KEY": "e2e-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket="halludetect-e2e")
    origin = tmp_path_factory.mktemp("origin") / "world.git"  # the team's git server
    run(["git", "init", "-q", "--bare", str(origin)], origin.parent)
    yield {"REMOTE_URL": "s3://halludetect-e2e/dvc", "S3_ENDPOINT": endpoint, "GIT_ORIGIN": str(origin), **creds}
    server.stop()


def readme_blocks(title: str) -> list[str]:
    """The bash blocks of a section of docs/sweeps-and-sharing.md, in order: run as written."""
    return doc_blocks("docs/sweeps-and-sharing.md", title).get("bash", [])


def bash(code: str, cwd: Path, env: dict) -> str:
    return run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
        **env,
    )


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


def queue_finished(repo: Path, tasks: int, look=lambda: None) -> str:
    """`dvc queue status` once the queue's worker has finished `tasks` tasks in all. Each finished
    task leaves a result file of celery's (`.dvc/tmp/exps/celery/result/`), which is what is watched,
    every 0.5 s: each `dvc queue status` is a DVC process, a second of CPU the experiments' stages
    would have. `look()` runs at each watch."""
    results, deadline = repo / ".dvc/tmp/exps/celery/result", time.monotonic() + 600
    while True:
        look()
        if results.is_dir() and len(list(results.iterdir())) >= tasks:
            status = run([sys.executable, "-m", "dvc", "queue", "status"], repo)
            if "Queued" not in status and "Running" not in status:
                return status
        assert time.monotonic() < deadline, run([sys.executable, "-m", "dvc", "queue", "status"], repo)
        time.sleep(0.5)


def test_a_queued_sweep_ends_in_a_table_as_the_readme_says(repo, s3):
    """docs "Sweeps": a two-value sweep queued and run by `dvc queue start`, one table of it
    (the committed baseline is a third point). An experiment that fails (its train stage refuses
    dim 0), queued before the documented commands so that one worker runs all three, is a row
    marked failed, with its error."""
    queue, table = readme_blocks("Sweeps")
    before = dir_bytes(repo / ".dvc/cache")
    run([sys.executable, "-m", "dvc", "exp", "run", "--queue", "-S", "detectors.max.dim=0"], repo)
    bash(queue, repo, s3)
    copied = 0  # bytes of activation files copied into an experiment's workspace, looked at every 0.5 s

    def look() -> None:
        nonlocal copied
        copied = max(copied, copies(repo / ".dvc/tmp/exps"))

    status = queue_finished(repo, 3, look)
    assert status.count("Success") == 2 and status.count("Failed") == 1, status
    growth = (dir_bytes(repo / ".dvc/cache") - before) / 2  # the failed one stored nothing of its own
    activations = dir_bytes(repo / "data/activations")
    print(
        f"\nper queued experiment: cache growth {growth:,.0f} bytes, activation bytes copied into its workspace "
        f"{copied:,} (the activations: {activations:,} bytes; cache.type hardlink)"
    )
    # an experiment's cache growth is its own outputs (mostly the cell's figures, about 1 MB), no copy of a layer
    assert copied == 0 and growth < activations / 2
    out = bash(table, repo, s3)
    md = (repo / "metrics/sweeps/detectors_max_dim.md").read_text()
    assert (repo / "metrics/sweeps/detectors_max_dim.tex").exists() and md in out
    rows = [line.split(" |")[0][2:] for line in md.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert rows == ["0", "8", "16", "32"], md  # the failed one, the two, and the baseline's dim 16
    why = "params.yaml: 1 problem(s) detectors.max.dim: Input should be greater than 0 (got 0)"
    assert "| 0 | failed |" in md and f" failed: {why} (`dvc queue logs " in md, md
    bad = run([sys.executable, "-m", "halludetect.cli", "sweep", "detectors.hami.lr"], repo, check=False)
    assert "no experiment varies detectors.hami.lr" in bad and "detectors.max.dim" in bad


def test_a_colleague_trains_one_layer_from_an_s3_remote_as_the_readme_says(repo, s3, tmp_path):
    """docs "Sharing through a remote", after the sweep: A configures the remote, commits it with
    dvc.lock and pushes; a fresh clone B with an empty cache fetches one layer file and the labels,
    trains and evaluates one method on that layer, runs nothing upstream, leaves `dvc status` of
    what it ran clean, and gets A's figures byte for byte."""
    push, colleague = readme_blocks("Sharing through a remote")
    run(["git", "remote", "add", "origin", s3["GIT_ORIGIN"]], repo)  # the team's git server, already there
    bash(push, repo, s3)
    assert run(["git", "status", "--porcelain", ".dvc/config", "dvc.lock"], repo).strip() == ""  # both committed
    assert "e2e-secret" not in (repo / ".dvc/config").read_text()  # credentials stay in the environment
    b = tmp_path / "b"
    run(["git", "clone", "-q", s3["GIT_ORIGIN"], str(b)], tmp_path)
    assert not (b / ".dvc/cache").exists() and not (b / "data").exists()
    log = bash(colleague, b, s3)
    assert ran(log) == set()  # no world, no generation, no dump: the train stage's command on one layer
    for rel in ("metrics/layers/world/world/max/layer_2.json", "data/scores/world/world/max/layer_2.parquet"):
        assert (b / rel).read_bytes() == (repo / rel).read_bytes(), rel
    fetched = json.loads(log[log.index("{") : log.rindex("}") + 1])
    # every file the layer wrote is the version A's dvc.lock records (read from the remote's listing)
    recorded = fetched["recorded"]
    assert "data/detectors/world/world/max/layer_2/seed_0.safetensors" in recorded
    assert "data/scores/world/world/max/layer_2.parquet" in recorded
    assert set(recorded.values()) == {"identical"}, recorded
    layer_file = "data/activations/world/world/layer_2.h5"
    # and the route stage's directory for max: its manifest alone (max reads no clustering)
    routed = "data/routed/world/world/train/max"
    assert set(fetched["fetched"]) == {layer_file, "data/labels/world/world/judgments.parquet", routed}
    assert sorted(p.name for p in (b / "data/activations/world/world").iterdir()) == ["layer_2.h5"]
    whole = dir_bytes(repo / "data/activations/world/world")
    assert fetched["fetched"][layer_file] == (b / layer_file).stat().st_size < whole / 2
    print(f"\nB fetched {fetched['fetched_bytes']:,} bytes; the activation directory is {whole:,} bytes")
    # Again: everything is in B's cache now, so nothing comes from the remote (before: the file sizes again).
    layer_2 = ["--model", "world", "--dataset", "world", "--method", "max", "--layer", "2"]
    again = run([sys.executable, "-m", "halludetect.cli", "train-layer", *layer_2], b, **s3)
    again = json.loads(again[again.index("{") : again.rindex("}") + 1])
    assert again["fetched_bytes"] == 0 and set(again["fetched"]) == set(fetched["fetched"]), again

    # A layer that was never dumped, and a remote that is not configured: clear errors, nothing run.
    bad = run(
        [
            sys.executable,
            "-m",
            "halludetect.cli",
            "train-layer",
            "--model",
            "world",
            "--dataset",
            "world",
            "--method",
            "max",
            "--layer",
            "7",
        ],
        b,
        check=False,
        **s3,
    )
    assert "layer 7 was never dumped for world/world: data/activations/world/world holds layers [0, 1, 2]" in bad
    c = tmp_path / "c"
    run(["git", "clone", "-q", s3["GIT_ORIGIN"], str(c)], tmp_path)
    run([sys.executable, "-m", "dvc", "remote", "remove", "shared"], c)
    bad = run(
        [
            sys.executable,
            "-m",
            "halludetect.cli",
            "train-layer",
            "--model",
            "world",
            "--dataset",
            "world",
            "--method",
            "max",
            "--layer",
            "2",
        ],
        c,
        check=False,
    )
    assert "ERROR" in bad and "remote" in bad.lower() and "Running stage" not in bad


def test_a_colleague_gets_the_sweep_table_from_the_remotes_as_the_readme_says(repo, s3, tmp_path):
    """docs "Sharing a sweep": A's experiments ran before the DVC remote was configured and HEAD has
    moved since (the remote's commit); `halludetect exp-push` still sends their outputs, and a
    fresh clone B gets A's table from the experiments' git refs and the few metrics files it reads
    from the DVC remote, downloading nothing into its cache."""
    share, pull = readme_blocks("Sharing a sweep")
    log = bash(share, repo, s3)
    pushed = json.loads(log[log.index("{") : log.rindex("}") + 1])
    assert len(pushed["experiments"]) == 2 and pushed["files_uploaded"] > 0, pushed
    b = tmp_path / "b"
    run(["git", "clone", "-q", s3["GIT_ORIGIN"], str(b)], tmp_path)
    out = bash(pull, b, s3)
    # A's table but its failed experiment's row and note: a failed experiment stays in A's queue
    lines = (repo / "metrics/sweeps/detectors_max_dim.md").read_text().splitlines(keepends=True)
    md = "".join(x for x in lines if "failed" not in x)
    assert (b / "metrics/sweeps/detectors_max_dim.md").read_text() == md and md in out
    # Nothing was downloaded but the small headline metrics `dvc exp show` reads (it keeps them in the
    # cache); the evaluation files the table reads were streamed.
    cached = [f for f in (b / ".dvc/cache").rglob("*") if f.is_file()] if (b / ".dvc/cache").exists() else []
    assert all(set(json.loads(f.read_text())) <= {"best_layer", "test", "gamma"} for f in cached), cached
    print(f"\nB's cache after the sweep table: {len(cached)} files, {sum(f.stat().st_size for f in cached):,} bytes")
    assert not (b / "data").exists() and not (b / "metrics/eval").exists()


# ------------------------------------------------------------------ sampling through the engine
QUESTIONS = 24  # of the world's 180: about 90 answers, each in a request of its own


def engine_params(repo: Path, srv: FakeVLLM, out: Path, source: str) -> Path:
    """The DAG's params sampling through `srv` (its every layer's states kept), dumping from `source`."""
    out.mkdir(parents=True, exist_ok=True)
    params = out / "params.yaml"
    params.write_text((repo / "params.yaml").read_text())
    endpoint = {"base_url": srv.url, "concurrency": 8, "per_request": "answer", "hidden_states": WORLD_LAYERS}
    # The defaults and ".": the world's answers end with EOS, and "." ends most of them in the engine's front
    # end instead, where vLLM's reply names no states file (the case generate must read its own file for)
    sampling = {"backend": "completions", "endpoint": endpoint, "stop": ["\n", "Question:", "."]}
    set_params(out, {"generate": sampling, "dump": {"source": source}})
    questions = out / "questions.parquet"
    pl.read_parquet(repo / "data/questions/world.parquet").head(QUESTIONS).write_parquet(questions)
    return params


def generate(repo: Path, out: Path, params: Path) -> str:
    """The generate stage's command on the world's first questions, into `out` (its own progress)."""
    return run(stage_cmd("generate", out, out / "questions.parquet", params=params), repo)


def dump(repo: Path, out: Path, params: Path, generations: Path) -> str:
    """The dump stage's command on `generations`, into out/acts; its log, whether or not it failed."""
    return run(stage_cmd("dump", out, out / "questions.parquet", generations, params), repo, check=False)


def test_sampling_through_the_engine_dumps_its_states_as_the_hf_dump_and_again_gives_the_same_bytes(
    repo, engine, tmp_path
):
    """generate through the engine, then dump.source engine: the layer files come from the engine's
    kept states (no second model), pass the log-prob check, and equal the teacher-forced pass over
    the same answers up to float16 rounding; a second run of generate asks again and gets the same bytes."""
    import h5py
    import numpy as np

    from halludetect.activations.layer_format import decode_ids

    a = tmp_path / "a"
    params = engine_params(repo, engine, a, "engine")
    before = engine.count
    generate(repo, a, params)
    metrics = json.loads((a / "gen.json").read_text())
    assert metrics["backend"] == "completions" and metrics["endpoint"]["requests_sent"] >= QUESTIONS
    asked = engine.requests[before:]  # the one-token probe, then one answer per request, each asking for its states
    assert len(asked) == metrics["endpoint"]["requests_sent"] + 1
    assert all(b["n"] == 1 and b["model"] == "data/world/model" for b in asked)
    assert all(b["kv_transfer_params"]["include_output_tokens"] is True for b in asked)
    assert len({b["kv_transfer_params"]["hidden_states_path"] for b in asked}) == len(asked)  # a file each
    assert engine.stop_string_endings > 0  # the default stops ended answers whose replies named no file
    log = dump(repo, a, params, a / "gen.parquet")
    assert "log-prob check passed" in log, log
    hf = engine_params(repo, engine, tmp_path / "hf", "hf")
    assert "log-prob check passed" in dump(repo, tmp_path / "hf", hf, a / "gen.parquet")
    for layer in WORLD_LAYERS:
        name = f"layer_{layer}.h5"
        with h5py.File(a / "acts" / name) as e, h5py.File(tmp_path / "hf/acts" / name) as h:
            assert e.attrs["source"] == "engine" and "source" not in h.attrs
            assert decode_ids(e["response_id"][:]) == decode_ids(h["response_id"][:])
            assert (e["offsets"][:] == h["offsets"][:]).all()
            np.testing.assert_allclose(e["states"][:].astype(np.float32), h["states"][:].astype(np.float32),
                                       rtol=2e-3, atol=2e-3)  # fmt: skip
    b = tmp_path / "b"
    generate(repo, b, engine_params(repo, engine, b, "engine"))
    assert (b / "gen.parquet").read_bytes() == (a / "gen.parquet").read_bytes()
    assert engine.count - before == 2 * (metrics["endpoint"]["requests_sent"] + 1)  # a new run asks again
    assert not list(a.glob(".*.engine-r*")) and not list(b.glob(".*.engine-r*")), "no states file of ours left"


@pytest.mark.parametrize(
    "change",
    [{"weight_noise": 0.5}, {"logprobs_mode": "processed_logprobs"}],  # after temperature 0.5
    ids=["another_revision", "processed_logprobs"],
)
def test_the_dump_fails_on_an_engine_that_serves_another_model_or_logprob_mode(repo, engine, tmp_path, change):
    params = engine_params(repo, engine, tmp_path, "hf")
    engine.reload(**change)
    try:  # the first questions' answers (about 90) show either change
        generate(repo, tmp_path, params)
    finally:
        engine.reload(weight_noise=0.0, logprobs_mode="raw_logprobs")
    log = dump(repo, tmp_path, params, tmp_path / "gen.parquet")
    assert "error: the generations' log-probs are not those of models.world (data/world/model)" in log
    assert "the mean |difference|" in log or "answers differ by more than" in log
    assert "The largest difference: answer '" in log and "--logprobs-mode raw_logprobs" in log
    assert not (tmp_path / "acts").exists()
