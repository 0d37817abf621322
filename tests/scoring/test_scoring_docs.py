"""docs/scoring.md "Scoring new answers" and "Where in the answer": their shell commands and the
Python example run as written, and so do the README's examples (its explain example building
answers.jsonl from the DAG's test answers first), in a directory laid out like the repository
(data/world/model, data/bundles/world/world/max.safetensors, the DAG's generations, questions and
evidence) with the tiny test model and a bundle exported from the miniature DAG on it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
from support import doc_blocks

from halludetect.scoring.bundle import load_bundle, save_bundle


def world_like(tmp_path: Path, bundle_path: Path, model_dir: Path) -> Path:
    """The tiny model at data/world/model and its bundle at the path the README uses, naming the
    model by that relative path, as the export of the world's DAG does."""
    shutil.copytree(model_dir, tmp_path / "data" / "world" / "model")
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    meta["base_model"]["path"] = meta["base_model"]["preset"]["path"] = "data/world/model"
    out = tmp_path / "data" / "bundles" / "world" / "world" / "max.safetensors"
    out.parent.mkdir(parents=True)
    save_bundle(out, {s: d.state_dict() for s, d in b.detectors.items()}, meta)
    return tmp_path


def with_the_dags_answers(repo: Path, contract: Path) -> None:
    """The DAG's generations and questions where the README's examples read the world's."""
    for src, dst in (("generations", "data/generations/world/world"), ("questions", "data/questions/world")):
        (repo / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(contract / f"{src}.parquet", repo / f"{dst}.parquet")


def test_scoring_docs_run_as_written(bundle_path, tiny_model_dir, contract, tmp_path, monkeypatch):
    blocks = doc_blocks("docs/scoring.md", "Scoring new answers")
    readme = doc_blocks("README.md", "Scoring new answers")
    assert len(blocks["bash"]) == 1 and len(blocks["python"]) >= 1 and list(readme) == ["python"]
    repo = world_like(tmp_path, bundle_path, tiny_model_dir)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", blocks["bash"][0]], cwd=repo, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "detector     max (Max pooling)" in res.stdout and "(the default)" in res.stdout  # halludetect show
    scores = pl.read_parquet(repo / "scores.parquet")
    assert scores["id"].to_list() == ["a1", "a2", "a3"]
    assert scores["reason"].to_list() == [None, None, "empty_answer"] and scores["score"].null_count() == 1
    sampled = [json.loads(line) for line in (repo / "sampled.jsonl").read_text().splitlines()]
    assert [r["id"] for r in sampled] == ["q1", "q2"] and all("answer" in r and "flag" in r for r in sampled)
    # "Where in the answer": the same answers explained, in the terminal and as a page
    explain = doc_blocks("docs/scoring.md", "Where in the answer: token evidence")["bash"]
    assert len(explain) == 1
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", explain[0]], cwd=repo, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    explained = pl.read_parquet(repo / "explained.parquet")
    assert explained["score"].to_list() == scores["score"].to_list()
    assert "2 of 2 scored answers" in res.stdout and "not scored: empty_answer 1" in res.stdout
    assert (repo / "explained.html").read_text().count('<section class="answer"') == 2
    monkeypatch.chdir(repo)
    scope: dict = {}
    exec(compile(blocks["python"][0], "docs/scoring.md", "exec"), scope)  # the example as written
    assert scope["df"].height == 1 and scope["df"]["score"][0] is not None
    with_the_dags_answers(repo, contract)  # the README scores four of the base model's own test answers
    scope = {}
    exec(compile(readme["python"][0], "README.md", "exec"), scope)
    assert scope["df"].height == 4 and scope["df"]["score"].null_count() == 0
    assert scope["df"]["in_distribution"].dtype == pl.Boolean


def test_the_readme_explain_example_runs_as_written(bundle_path, tiny_model_dir, contract, tmp_path):
    """README "Where in the answer": answers.jsonl built from the DAG's test answers that the
    evidence stage picked (metrics/evidence, data/generations, data/questions), then scored with
    --explain and shown, as written."""
    blocks = doc_blocks("README.md", "Where in the answer")
    assert list(blocks) == ["bash"] and len(blocks["bash"]) == 1
    repo = world_like(tmp_path, bundle_path, tiny_model_dir)
    with_the_dags_answers(repo, contract)
    gens = pl.read_parquet(contract / "generations.parquet").filter(pl.col("split") == "test")
    picked = [f"{q}/{i}" for q, i in gens.select("question_id", "sample_index").rows()][:4][::-1]  # not file order
    evidence = {"methods": {"max": {"examples": [{"response_id": r, "what": "w", "score": 0.0} for r in picked]}}}
    (repo / "metrics" / "evidence" / "world").mkdir(parents=True)
    (repo / "metrics" / "evidence" / "world" / "world.json").write_text(json.dumps(evidence))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", blocks["bash"][0]], cwd=repo, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    answers = [json.loads(line) for line in (repo / "answers.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == picked
    by_id = {f"{q}/{i}": r for q, i, r in gens.select("question_id", "sample_index", "token_ids").rows()}
    assert all(a["answer_token_ids"] == list(by_id[a["id"]]) and a["question"] and a["answer"] for a in answers)
    explained = pl.read_parquet(repo / "explained.parquet")
    assert explained["id"].to_list() == picked and explained["score"].null_count() == 0
    assert "\n#1  score " in res.stdout and "#2  score" not in res.stdout and "Q: Where was Tavo Mir" in res.stdout
