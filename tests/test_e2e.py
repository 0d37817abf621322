"""The whole DAG on a very small world and DVC's recompute contract.

Runs in a temporary copy of the repository (its own git and DVC repo, tests/e2e_support.py), so
it never touches the working tree's data/ or metrics/. The tests run in file order: the ones
that read the DAG's first results (the tables, the bundle) come before those that change params.
What each needs, and what it repeats: the DAG is built once per session, beside the unit
modules, and shared with the sharing module (test_e2e_sharing.py, which the other test worker
runs at the same time; each works on a copy of it). The recompute tests re-run only what a change
re-runs, and two of them (a sampling and a dump change, which re-run nearly everything) check
DVC's plan with `dvc status` after re-running only the changed stage instead of repeating the DAG.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml
from e2e_support import (
    LAYERS,
    METHODS,
    SCORES,
    SP_METHODS,
    changed,
    ran,
    run,
    set_params,
    shared_dag,
    stage_cmd,
    stale_after_params,
)

pytestmark = pytest.mark.e2e

DETECTOR_STAGES = {f"{kind}@world-world-{m}" for m in (*METHODS, *SP_METHODS) for kind in ("train", "evaluate")}
SP_STAGES = {s for s in DETECTOR_STAGES if any(m in s for m in SP_METHODS)}
SCORE_STAGES = {f"{kind}@world-world-{m}" for m in SCORES for kind in ("train", "evaluate")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the session's DAG (tests/e2e_support.py): the field's methods, the plugin, hf sampling."""
    return shared_dag(tmp_path_factory.getbasetemp(), tmp_path_factory.mktemp("e2e"))


def test_dag_writes_the_comparison_table(repo):
    table = (repo / "metrics/tables/detection_auroc.md").read_text()
    assert "world / world" in table
    for name in ("HaMI", "Max pooling", "HaMI (SP)", "P_sem"):
        assert f"| {name} |" in table
    for name in (  # the field's baselines and the plugin, each with what it needs
        "EigenScore [sampling, hidden states]",
        "SEP (SLT) [SE labels (sampling + NLI) to train, hidden states]",
        "Mean token log-prob [token log-probs]",
        "p(True) [sampling, a forward pass]",
        "Wide max pooling [labels, hidden states]",
    ):
        for t in ("detection_auroc", "detection_prr", "detection_fpr95", "auroc", "throughput"):
            assert f"| {name} |" in (repo / f"metrics/tables/{t}.md").read_text(), (name, t)
    main = (repo / "metrics/tables/auroc.md").read_text()
    assert main.index("| Max pooling |") < main.index("| EigenScore [") < main.index("| Wide max pooling [")
    assert "s/resp." in main  # the cost per response of the field's baselines
    p_true = json.loads((repo / "metrics/eval/world/world/p_true.json").read_text())
    assert p_true["cost_per_response"]["seconds"] > 0 and p_true["test"]["n"] > 0 and p_true["best_layer"] is None
    for name in SCORES:  # a detector like the others, with nothing trained: no weights, no layers, a bundle
        for out in (f"data/detectors/world/world/{name}", f"metrics/layers/world/world/{name}"):
            assert [p.name for p in (repo / out).iterdir()] == ["nothing_trained.json"], out
        assert (repo / f"data/bundles/world/world/{name}.safetensors").stat().st_size > 0
        assert json.loads((repo / f"metrics/plots/world/world/{name}.json").read_text()) == []
    sep = json.loads((repo / "metrics/layers/world/world/sep_slt/layer_1.json").read_text())
    assert "too_short" in sep["excluded"]["train"]
    # the only DVC metrics are the headline files, a row each, whatever else the DAG wrote
    # (docs/sweeps-and-sharing.md "Readable views"; tests/report/test_headline.py: the world's width)
    shown = run(["dvc", "metrics", "show", "--md"], repo).strip().splitlines()
    headline = sorted((repo / "metrics/headline").rglob("*.json"))
    assert len(shown) == 2 + len(headline) == 2 + len(METHODS) + len(SP_METHODS) + len(SCORES), shown
    assert all(row.startswith("| metrics/headline/eval/world/world/") for row in shown[2:])
    assert max(map(len, shown)) <= 200
    eigen = json.loads((repo / "metrics/eval/world/world/eigenscore.json").read_text())
    assert eigen["test"]["margin"] is None and eigen["cost_per_response"]["extra_seconds"] > 0
    for name in (
        "auroc",
        "margin",
        "throughput",
        "label_distribution",
        "expected_c_int_world_test",
        "evidence_sparsity",
        "gradient_ratio",
    ):
        assert (repo / f"metrics/tables/{name}.md").exists() and (repo / f"metrics/tables/{name}.tex").exists()
    for method in ("hami_sp", "hami"):
        a = json.loads((repo / f"metrics/eval/world/world/analysis/{method}.json").read_text())
        assert set(a["layers"][str(a["best_layer"])]) == {"train", "test"}
    assert json.loads((repo / "metrics/latency/world/world.json").read_text())["questions"] > 0
    assert {p.name for p in (repo / "metrics/figures/world/world").iterdir()} == {
        "auroc_by_layer.png",
        "roc.png",
        "scores.png",
        "responses.png",
        "sensitivity_hami_sp.png",
        "sensitivity_hami.png",
        "margins_by_epoch.png",
        "selection.png",
        "evidence.png",
        "sparsity.png",
        "gradient_ratio.png",
    }
    for method in (*METHODS, *SP_METHODS):
        m = json.loads((repo / f"metrics/eval/world/world/{method}.json").read_text())
        assert 0.0 <= m["test"]["auroc"]["mean"] <= 1.0 and m["best_layer"] in LAYERS
        assert [r["layer"] for r in m["layers"]] == list(LAYERS)
        assert m["throughput"]["end_to_end_samples_per_s"] > 0
    cost = json.loads((repo / "metrics/eval/world/world/hami_sp.json").read_text())["cost"]
    assert cost["seconds_per_sample"] > 0 and cost["sequential_samples_per_s"] > 0
    assert "samples/s" in (repo / "metrics/tables/throughput.md").read_text()
    labels = json.loads((repo / "metrics/labels/world/world.json").read_text())
    assert labels["splits"]["test"]["kept"] > 0
    evidence = json.loads((repo / "metrics/evidence/world/world.json").read_text())["methods"]
    assert set(evidence) == {*METHODS, *SP_METHODS}
    assert (
        evidence["eigenscore"]["evidence"] is None
        and "K answers of a question together" in evidence["eigenscore"]["why"]
    )
    for method, e in evidence.items():
        if method != "eigenscore":
            assert e["classes"]["hallucinated"]["n"] > 0 and len(e["examples"]) == 4, method
    rows = pl.read_parquet(repo / "data/evidence/world/world.parquet").filter(pl.col("s90").is_not_nan())
    assert (
        rows.height
        and rows.filter(
            (pl.col("s50") < 1) | (pl.col("s50") > pl.col("s90")) | (pl.col("s90") > pl.col("T"))
        ).is_empty()
    )
    assert set(evidence["max"]["gradient_ratio"]) == {"seed_0"} and "gradient_ratio" not in evidence["hami"]
    assert changed(repo) == set()  # everything up to date


def test_bundle_scores_equal_the_dag_evaluate_scores(repo):
    """The exported bundle scores the world's test answers from scratch as evaluate scored them,
    seed by seed, at the bundle's layer (reads data/scores/..., written by evaluate since issue 14)."""
    from contract_layout import assert_bundle_scores_match_dag

    from halludetect.qa.responses import select_answers

    dumped, _ = select_answers(pl.read_parquet(repo / "data/generations/world/world.parquet"))
    batch_size = yaml.safe_load((repo / "params.yaml").read_text())["dump"]["batch_size"]
    n = assert_bundle_scores_match_dag(
        repo / "data/bundles/world/world/max.safetensors",
        repo / "data/scores/world/world/max",
        pl.read_parquet(repo / "data/questions/world.parquet"),
        dumped,
        repo / "data/world/model",
        batch_size,
    )
    assert n > 0


def test_halludetect_serve_answers_the_openai_client_with_halludetect_scores_scores(repo, tmp_path):
    """`halludetect serve --bundle data/bundles/world/world/max.safetensors` (the command, in the DAG's
    repository): the openai client's answers come with scores equal to `halludetect score`'s on the same
    questions and answers; SIGTERM stops it."""
    import numpy as np
    from openai import OpenAI

    bundle = "data/bundles/world/world/max.safetensors"
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "halludetect.cli", "serve", "--bundle", bundle, "--port", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        while url is None:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server stopped before listening"
            if " on http://" in line:
                url = line.rsplit(" on ", 1)[1].strip()
        client = OpenAI(base_url=url, api_key="-", max_retries=0)
        questions = pl.read_parquet(repo / "data/questions/world.parquet")["question"].to_list()[:4]
        answers = []
        for k, q in enumerate(questions):
            r = client.chat.completions.create(
                model="data/world/model", messages=[{"role": "user", "content": q}], n=2, seed=k
            )
            answers += [(q, c) for c in r.choices if c.hallucination["score"] is not None]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert answers
    rows = tmp_path / "answers.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"question": q, "answer": c.message.content, "answer_token_ids": c.token_ids}) + "\n"
            for q, c in answers
        )
    )
    run(["halludetect", "score", "--bundle", bundle, "--input", str(rows), "--out", str(tmp_path / "s.jsonl"),
         "--device", "cpu", "--no-progress"], repo)  # fmt: skip
    offline = pl.read_ndjson(tmp_path / "s.jsonl")
    served = [c.hallucination for _, c in answers]
    assert np.allclose([h["score"] for h in served], offline["score"].to_numpy(), atol=1e-3)
    assert [h["flag"] for h in served] == offline["flag"].to_list()


def test_the_plugins_bundle_scores_as_the_dag_did_and_eigenscore_is_refused(repo):
    """The docs' plugin, registered by its entry point, scores the test answers from its bundle as
    evaluate scored them; an EigenScore bundle cannot score answers one at a time, and says so."""
    code = """
import polars as pl, yaml
from contract_layout import assert_bundle_scores_match_dag
from halludetect.qa.responses import select_answers
from halludetect.scoring.scorer import score_answers
dumped, _ = select_answers(pl.read_parquet("data/generations/world/world.parquet"))
n = assert_bundle_scores_match_dag(
    "data/bundles/world/world/wide_max.safetensors", "data/scores/world/world/wide_max",
    pl.read_parquet("data/questions/world.parquet"), dumped, "data/world/model",
    yaml.safe_load(open("params.yaml"))["dump"]["batch_size"])
try:
    score_answers("data/bundles/world/world/eigenscore.safetensors", [{"question": "q?", "answer": "a"}])
except Exception as e:
    print("RESULT", n, type(e).__name__, e)
"""
    out = run([sys.executable, "-c", code], repo, PYTHONPATH=f"{repo}{os.pathsep}{Path(__file__).parent}")
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    n, err = line.removeprefix("RESULT ").split(" ", 1)
    assert int(n) > 0 and err.startswith("UserError") and "scores the K answers of a question together" in err


def test_hami_sp_bundle_scores_equal_the_dag_evaluate_scores(repo):
    """HaMI (SP)'s bundle, given each answer's P_sem of the variant its params name (from the DAG's
    clustering), scores the test answers as evaluate did; `show` says what it needs."""
    from contract_layout import assert_bundle_scores_match_dag

    from halludetect.qa.responses import select_answers
    from halludetect.scoring.bundle import load_bundle, p_sem_requirement

    bundle = repo / "data/bundles/world/world/hami_sp.safetensors"
    meta = load_bundle(bundle).meta
    variant = meta["params"]["p_sem"]
    assert variant == "sum" and meta["inputs"]["p_sem"]["samples_per_question"] == 3  # SMALL: K = 3
    clusters = pl.read_parquet(repo / "data/labels/world/world/clusters.parquet").filter(pl.col("valid"))
    p_sem = {
        f"{q}/{s}": v for q, s, v in clusters.select("question_id", "sample_index", f"p_sem_{variant}").iter_rows()
    }
    dumped, _ = select_answers(pl.read_parquet(repo / "data/generations/world/world.parquet"))
    batch_size = yaml.safe_load((repo / "params.yaml").read_text())["dump"]["batch_size"]
    n = assert_bundle_scores_match_dag(
        bundle,
        repo / "data/scores/world/world/hami_sp",
        pl.read_parquet(repo / "data/questions/world.parquet"),
        dumped,
        repo / "data/world/model",
        batch_size,
        p_sem=p_sem,
    )
    assert n > 0
    assert "K = 3.0 answers per question" in p_sem_requirement(meta)


def test_the_tables_state_their_conventions_and_training_is_measured_by_epoch(repo):
    """The paper's conventions in the captions (P_sem variant, seeds), the margins after the last
    epoch beside the best epoch's, the margin growth and the training time; every method's
    per-epoch margins in curves.json."""
    tables = repo / "metrics/tables"
    auroc = (tables / "auroc.md").read_text()
    assert "ours over 1 seed per cell" in auroc and "HaMI (SP) scales by (1 + λ P_sem), λ = 1, P_sem summed" in auroc
    margin = (tables / "margin.md").read_text()
    assert "| HaMI, after epoch 8 |" in margin and "| Max pooling, at the best validation epoch |" in margin
    assert "| HaMI (SP) over HaMI, % (after epoch 8) |" in margin
    assert "P_sem summed" in (tables / "p_sem_auroc.md").read_text()
    expected = (tables / "expected_c_int_world_test.md").read_text()
    assert "| the paper (range over its cells) |" in expected and "P_sem summed" in expected
    for name in ("margin_growth", "training_time"):
        assert (tables / f"{name}.md").exists() and (tables / f"{name}.tex").exists()
    for method in (*METHODS, *SP_METHODS):
        m = json.loads((repo / f"metrics/eval/world/world/{method}.json").read_text())
        assert m["train"]["recipe"] == "paper" and m["training_time"]["layers"] == len(LAYERS)
        if method in ("eigenscore", "sep_slt"):  # fitted in one step: one "epoch", no per-epoch margins
            assert m["last_epoch"]["epoch"] == 1 and "margin_by_epoch" not in m
            continue
        assert m["last_epoch"]["epoch"] == 8 and len(m["margin_by_epoch"]["train"]) == 8
        for layer in LAYERS:
            curves = json.loads((repo / f"data/detectors/world/world/{method}/layer_{layer}/curves.json").read_text())
            assert {"train_margin", "val_margin", "lr"} <= set(curves["seed_0"][0])
    epochs = pl.read_csv(repo / "metrics/plots/epochs/world/world.csv")
    assert {"max (train)", "max (val)", "hami_sp (train)"} <= set(epochs["series"])


def test_training_param_reruns_only_training_and_after(repo):
    set_params(repo, {"detectors": {"max": {"lr": 0.001}}})
    # DVC sees params.yaml change for the params stage, and `detectors` for the code stage (the plugins' keys)
    assert changed(repo) == {"params", "code"}
    # `halludetect repro`'s plan works out both stages' files (runner/repro.py) instead of counting every
    # stage below them as running: the stages that will run are max's and what reads its evaluation
    plan = "import json; from halludetect.runner.repro import plan; print(json.dumps(plan([])))"
    fates = dict(json.loads(run([sys.executable, "-c", plan], repo)))
    assert {s for s, f in fates.items() if f == "run"} == {
        "code",
        "params",
        "train@world-world-max",
        "evaluate@world-world-max",
        "figures@world-world",
        "evidence@world-world",
        "transfer@world-world-world",
        "report",
    }, fates
    log = run([sys.executable, "-m", "dvc", "repro", "evaluate@world-world-max"], repo)
    assert ran(log) == {"code", "params", "train@world-world-max", "evaluate@world-world-max"}
    # what reads the evaluation is stale now (what `dvc repro` runs next), and nothing else
    assert changed(repo) == {"figures@world-world", "evidence@world-world", "transfer@world-world-world", "report"}
    restore(repo)


def stale_after_edit(repo: Path, rel: str, text: str) -> set[str]:
    """The stages an edit of `rel` makes stale: DVC sees the code stage's folders change, the code stage
    re-runs (a second), and what its changed digests feed is stale. The edit is undone after."""
    path = repo / rel
    before = path.read_text() if path.exists() else None
    path.write_text(text if before is None else before + text)
    try:
        assert changed(repo) == {"code"}
        run([sys.executable, "-m", "dvc", "repro", "code"], repo)
        return changed(repo)
    finally:
        path.unlink() if before is None else path.write_text(before)
        run([sys.executable, "-m", "dvc", "repro", "code"], repo)
        assert changed(repo) == set()


def test_one_methods_code_edit_re_runs_that_method_only(repo):
    """A comment in methods/pooling.py (max; mean and the raw poolings are not in this grid) re-runs
    max's train and evaluate stages and the stages of the cell that read every method (route, which
    reads whether each reads the clustering; figures, evidence, transfer, report), never another
    method's (the plugin's included: it builds its network from detectors/networks.py, not from
    pooling.py), and nothing upstream."""
    stale = stale_after_edit(repo, "halludetect/methods/pooling.py", "# a comment\n")
    cell = {"route@world-world", "figures@world-world", "evidence@world-world", "transfer@world-world-world", "report"}
    assert stale == {"train@world-world-max", "evaluate@world-world-max"} | cell, stale
    # one of the field's methods: SEP's file re-runs the SE probe's stages alone
    stale = stale_after_edit(repo, "halludetect/methods/sep.py", "# a comment\n")
    assert stale == {"train@world-world-sep_slt", "evaluate@world-world-sep_slt"} | cell, stale


def test_a_new_method_file_re_runs_only_what_reads_every_method(repo):
    """Adding a detection method is one file (methods/): the stages that draw, report or compare
    every method see it; no method's training does (its own digest holds its own file), nor does
    sampling, dumping or labelling (config.py imports methods/ only to validate params)."""
    text = (
        '"""A method that only needs to exist."""\n\nfrom halludetect.methods.pooling import PoolingParams\n'
        "from halludetect.methods.spec import Method, register\n\n"
        'register(Method("extra", "Extra", PoolingParams, build=lambda net, d, p: net.LastTokenProbe(d)))\n'
    )
    stale = stale_after_edit(repo, "halludetect/methods/extra.py", text)
    every = {"route@world-world", "figures@world-world", "evidence@world-world", "transfer@world-world-world"}
    assert stale == every | {"report"}, stale


def test_the_transfer_diagonal_is_the_evaluation_and_a_transfer_param_re_runs_only_the_pairs(repo):
    """The in-distribution cell comes from the transfer code on the dataset's own test split: the
    evaluation's layer and test AUROC, per seed. A transfer setting re-runs the transfer stages
    and the report, nothing else; and the transfer tables are written."""
    cell = json.loads((repo / "metrics/eval/world/transfer/world__world.json").read_text())
    assert cell["in_distribution"] and set(cell["methods"]) == {*METHODS, *SP_METHODS}
    for method, m in cell["methods"].items():
        ev = json.loads((repo / f"metrics/eval/world/world/{method}.json").read_text())
        assert m["layer"] == ev["best_layer"], method
        assert m["test"]["auroc"]["per_seed"] == pytest.approx(ev["test"]["auroc"]["per_seed"], abs=1e-9), method
    assert (repo / "metrics/tables/transfer_max.md").exists() and (
        repo / "metrics/tables/transfer_hami_sp.tex"
    ).exists()
    set_params(repo, {"transfer": {"ece_bins": 5}})
    assert stale_after_params(repo) == {"transfer@world-world-world"}
    log = run([sys.executable, "-m", "dvc", "repro"], repo)
    assert ran(log) == {"transfer@world-world-world", "report"}
    restore(repo)


def test_judge_param_leaves_generation_dump_and_cluster(repo):
    set_params(repo, {"judge": {"match": {"lenient_recall": 0.9}}})
    assert stale_after_params(repo) == {"judge@world-world"}
    log = run([sys.executable, "-m", "dvc", "repro"], repo)
    assert "judge@world-world" in ran(log)
    assert not ran(log) & {"generate@world-world", "dump@world-world", "cluster@world-world", "world"}


def test_the_engines_transport_re_runs_nothing_and_the_served_model_re_runs_sampling(repo):
    """How generate's requests would reach a serving engine (replicas, concurrency, timeout, retries,
    the key's variable) changes no sample, so DVC re-runs nothing; the served model does."""
    saved = (repo / "params.yaml").read_text()
    transport = {"base_url": ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"], "concurrency": 3}
    set_params(repo, {"generate": {"endpoint": transport | {"timeout": 5, "max_retries": 1, "api_key_env": "K"}}})
    assert stale_after_params(repo) == set()
    set_params(repo, {"generate": {"endpoint": {"model": "another-name"}}})
    assert stale_after_params(repo) == {"generate@world-world"}
    (repo / "params.yaml").write_text(saved)
    assert stale_after_params(repo) == set()
    restore(repo)


def restore(repo: Path) -> None:
    """Back to the committed DAG: its params, its lock, and its outputs from DVC's cache."""
    run(["git", "checkout", "-q", "HEAD", "--", "params.yaml", "dvc.lock"], repo)  # HEAD: DVC autostages the lock
    run([sys.executable, "-m", "dvc", "checkout", "--force"], repo)
    assert changed(repo) == set()


def test_generation_param_reruns_generation_and_everything_after(repo):
    set_params(repo, {"generate": {"temperature": 0.7}})
    # the latency stage samples with these settings itself
    assert stale_after_params(repo) == {"generate@world-world", "latency@world-world"}
    log = run([sys.executable, "-m", "dvc", "repro", "dump@world-world"], repo)
    assert ran(log) == {"generate@world-world", "dump@world-world"}
    # Everything after is now stale (what `dvc repro` would re-run), nothing before: checked
    # without repeating the whole DAG.
    stale = changed(repo)
    assert stale >= {"judge@world-world", "cluster@world-world", "latency@world-world"} | {
        s for s in DETECTOR_STAGES | SCORE_STAGES if s.startswith(("train", "evaluate"))
    }
    assert not stale & {"world", "world_check", "manifest@world", "prepare@world"}
    restore(repo)


def test_cluster_param_retrains_only_the_methods_that_read_p_sem(repo):
    """...or the semantic entropy (the SE probe), and the scores of the clustering (P_sem).
    Checked as the generation test checks it: the clustering re-run, then what is stale."""
    set_params(repo, {"cluster": {"equivalence": "strict"}})
    assert stale_after_params(repo) == {"cluster@world-world", "latency@world-world"}  # latency: its own NLI calls
    log = run([sys.executable, "-m", "dvc", "repro", "cluster@world-world"], repo)
    assert ran(log) == {"cluster@world-world"}
    # Stale now: what reads the clustering's outputs (its timings change on every run; on this small
    # world the strict rule gives the same clusters), never a detector that does not read them.
    stale = changed(repo)
    assert stale >= {"latency@world-world", "route@world-world"}
    assert not stale & (DETECTOR_STAGES - SP_STAGES) and not stale & SCORE_STAGES
    # The route stage hands the new clustering to the detectors that read it, and to no other: every
    # detector is in one list (grid.detectors), one train and one evaluate family.
    log = run([sys.executable, "-m", "dvc", "repro", "--single-item", "route@world-world"], repo)  # not latency's
    assert ran(log) == {"route@world-world"}
    stale = changed(repo)
    assert {f"evaluate@world-world-{m}" for m in (*SP_METHODS, "p_sem")} <= stale  # the timings, routed to them
    assert not stale & (DETECTOR_STAGES - SP_STAGES) and not stale & {s for s in SCORE_STAGES if "p_sem" not in s}
    restore(repo)


def test_dump_param_reruns_dump_but_not_sampling_or_labels(repo):
    set_params(repo, {"dump": {"positions": "generated"}})
    # the bundles record the position convention their detectors read; the scores' evaluate stages share
    # the family's params (a DVC matrix gives all its stages the same: docs/pipeline.md), seconds each
    assert stale_after_params(repo) == {"dump@world-world"} | {
        f"evaluate@world-world-{m}" for m in (*METHODS, *SP_METHODS, *SCORES)
    }
    log = run([sys.executable, "-m", "dvc", "repro", "dump@world-world"], repo)
    assert ran(log) == {"dump@world-world"}
    stale = changed(repo)
    assert stale >= {s for s in DETECTOR_STAGES if s.startswith("train")}
    assert not stale & {"generate@world-world", "judge@world-world", "cluster@world-world", "latency@world-world"}
    restore(repo)


def test_killed_generate_resumes_under_dvc_repro_to_the_same_bytes(repo, tmp_path):
    set_params(repo, {"generate": {"batch_size": 4}})  # many small units, so the kill lands mid-way
    env = {**os.environ, "PYTHONPATH": str(repo), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", "generate@world-world"],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
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
    run(stage_cmd("generate", tmp_path), repo)
    resumed = (repo / "data/generations/world/world.parquet").read_bytes()
    assert resumed == (tmp_path / "gen.parquet").read_bytes()
    restore(repo)  # the committed params (batch_size) and outputs for the tests after this one


def test_two_processes_give_the_one_process_bytes(repo, tmp_path):
    """`HALLUDETECT_PROCESSES=2` relaunches the stage under `accelerate launch` (gloo on CPU): the
    world's first 24 questions, generated and dumped by one process and by two."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    questions = str(tmp_path / "questions.parquet")
    pl.read_parquet(repo / "data/questions/world.parquet").head(24).write_parquet(questions)
    for stage in ("generate", "dump"):
        run(stage_cmd(stage, one, questions), repo)
        log = run(stage_cmd(stage, two, questions), repo, HALLUDETECT_PROCESSES="2")
        assert stage == "generate" or "process 1: dumped" in log
    assert (one / "gen.parquet").read_bytes() == (two / "gen.parquet").read_bytes()
    assert json.loads((two / "gen.json").read_text())["processes"] == 2
    files = sorted(p.name for p in (one / "acts").iterdir())
    assert files and files == sorted(p.name for p in (two / "acts").iterdir())
    for name in files:
        assert (one / "acts" / name).read_bytes() == (two / "acts" / name).read_bytes()
