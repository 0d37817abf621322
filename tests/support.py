"""Helpers that several test modules share; tests/ is on pytest's pythonpath, so `from support import ...`.

Test modules never import each other: what two of them need lives here (the random packed bags
and detectors of the property tests live in detector_support.py, the end-to-end repository in
e2e_support.py, the miniature DAG in contract_layout.py, the serve tests' client helpers in
serve_support.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import yaml

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import Layer
from halludetect.activations.layer_writer import LayerWriter
from halludetect.labels.text import YES_NO, parse_choice

ROOT = Path(__file__).resolve().parents[1]  # the repository
# The real QA samples the tests read (TriviaQA, SQuAD v2, NQ-open, TruthfulQA, HaluEval QA, SVAMP) ship
# with the repository; their sources and licences are in LICENSES.md and MANIFEST.json there.
QA_SAMPLES = ROOT / "tests" / "fixtures" / "qa_samples"


def qa_sample(name: str) -> str:
    """The path of a QA sample shipped in tests/fixtures/qa_samples; a clear failure where it is missing."""
    path = QA_SAMPLES / name
    assert path.exists(), f"{path}: no such QA sample in tests/fixtures/qa_samples (see its MANIFEST.json)"
    return str(path)


# ------------------------------------------------------------------ stages, as DVC runs them
def stage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m <args>` in the repository root, as DVC runs a stage."""
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, env=env or dict(os.environ)
    )


def base_params() -> dict:
    """The shipped params.yaml, as a dict to change."""
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def write_params(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_jsonl(path: Path, rows: list) -> Path:
    """One line per row: a dict as JSON, a string as written (to plant a malformed line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------- synthetic layers and labels
D = 8  # hidden size of the synthetic layers


def synthetic(n_per_split=60, seed=0):
    """Bags of 2-6 tokens; a hallucinated bag hides one token with a shifted first feature."""
    rng = np.random.default_rng(seed)
    bags, rows = [], []
    for split in ("train", "val", "test"):
        for i in range(n_per_split):
            y = i % 2
            bag = rng.normal(size=(rng.integers(2, 7), D)).astype(np.float32)
            if y:
                bag[rng.integers(len(bag)), 0] += 4.0
            bags.append(bag)
            rows.append({"question_id": f"{split}{i}", "sample_index": 0, "split": split, "label": y, "kept": True})
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])])
    ids = [f"{r['question_id']}/0" for r in rows]
    layer = Layer(np.concatenate(bags), offsets, ids, {})
    return layer, pl.DataFrame(rows).with_columns(pl.col("sample_index").cast(pl.Int32))


def write_layers(directory: Path) -> pl.DataFrame:
    """layer 0: pure noise; layer 1: the synthetic signal. Returns the labels."""
    layer, labels = synthetic()
    noise = np.random.default_rng(9).normal(size=layer.states.shape).astype(np.float32)
    for index, states in ((0, noise), (1, layer.states)):
        w = LayerWriter(directory / layer_filename(index), D, "float16", {"layer": index})
        w.append(states, np.diff(layer.offsets), layer.response_ids)
        w.close(fsync=False)
    return labels


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


def train_stage(
    out: Path,
    acts,
    judgments: Path,
    params: Path,
    layer: int | None = 1,
    timing: bool = False,
    processes: int | str | None = None,
) -> subprocess.CompletedProcess:
    """The train stage on the dump directory `acts`, on one layer (`--layers`; None: grid.layers), its
    outputs under `out` (dets/layer_<L>/, scores/layer_<L>.parquet, layers/layer_<L>.json, and with
    `timing` timing.json); `processes` sets HALLUDETECT_TRAIN_PROCESSES (these layers are too small to
    be worth a worker otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "HALLUDETECT_TRAIN_PROCESSES"}
    if processes is not None:
        env["HALLUDETECT_TRAIN_PROCESSES"] = str(processes)
    outs = {"--out": out / "dets", "--scores": out / "scores", "--metrics": out / "layers"}
    if timing:
        outs["--timing"] = out / "timing.json"
    return stage(
        "stages.train",
        "--params",
        str(params),
        "--method",
        "max",
        *(["--layers", str(layer)] if layer is not None else []),
        "--activations",
        str(acts),
        "--judgments",
        str(judgments),
        *(x for flag, path in outs.items() for x in (flag, str(path))),
        env=env,
    )


def random_bags(rng, n=40, d=64):
    """Random states of n bags (1-699 tokens each) and their lengths, as a layer file holds them."""
    lengths = rng.integers(1, 700, n)
    return rng.standard_normal((int(lengths.sum()), d)).astype(np.float32), lengths


def world_like_tables():
    """Labels, generations and clusters of 60 questions x 2 samples, the scores tracking the label."""
    rng = np.random.default_rng(0)
    rows, gens, clusters = [], [], []
    for split, nq in (("train", 10), ("val", 20), ("test", 30)):
        for q in range(nq):
            for s in range(2):
                y = int(rng.integers(0, 2))
                qid = f"{split}{q}"
                rows.append({"question_id": qid, "sample_index": s, "split": split, "label": y, "kept": True})
                gens.append(
                    {
                        "question_id": qid,
                        "sample_index": s,
                        "n_tokens": 3 + 2 * y,
                        "token_logprobs": [-0.1 - y * rng.random()] * (3 + 2 * y),
                    }
                )
                clusters.append(
                    {
                        "question_id": qid,
                        "sample_index": s,
                        "valid": qid != "test0",
                        "p_sem_mean": 0.5,
                        "p_sem_sum": 0.9 - 0.5 * y + 0.1 * rng.random(),  # the default variant: informative
                        "p_sem_count": 0.5,
                        "semantic_entropy_mean": 0.2 + y,
                        "semantic_entropy_sum": 0.0,
                        "semantic_entropy_discrete": 0.0,
                    }
                )
    return pl.DataFrame(rows), pl.DataFrame(gens), pl.DataFrame(clusters)


def layers():
    """Per-layer validation and test AUROCs of two methods, as evaluate's metrics hold them."""
    return {
        "hami": [{"layer": i, "val_auroc": 0.6 + 0.05 * i, "test_auroc": 0.62 + 0.04 * i} for i in range(4)],
        "max": [{"layer": i, "val_auroc": 0.7 - 0.02 * i, "test_auroc": 0.69 - 0.01 * i} for i in range(4)],
    }


# ------------------------------------------------- the chat API (tests/labels/conftest.py sets the key)
KEY = "HD_TEST_API_KEY"
SECRET = "sk-test-0123456789abcdef"  # never a real key; the redaction tests look for it
yes_no = lambda t: parse_choice(t, YES_NO)


def label_inputs(tmp_path: Path, url: str, n: int = 8) -> list[str]:
    """The judge and cluster stages' arguments: n questions (train, val, test, test, ...), three
    answers each, and params that send both to the endpoint at `url` with one retry."""
    questions = pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was person {i} born?" for i in range(n)],
            "answers": [[f"City{i}"] for i in range(n)],
            "context": [None] * n,
            "split": ["train", "val", "test", "test"] * (n // 4),
        },
        schema={
            "id": pl.String,
            "question": pl.String,
            "answers": pl.List(pl.String),
            "context": pl.String,
            "split": pl.String,
        },
    )
    rows = [
        {
            "question_id": f"q{i}",
            "sample_index": k,
            "split": questions["split"][i],
            "n_tokens": 3,
            "text": f"Born in City{i + k}.",
            "token_logprobs": [-0.5, -0.5, -0.5],
        }
        for i in range(n)
        for k in range(3)
    ]
    questions.write_parquet(tmp_path / "questions.parquet")
    pl.DataFrame(rows).write_parquet(tmp_path / "generations.parquet")
    data = base_params()
    for section in ("judge", "cluster"):
        data[section]["backend"] = "openai"
        data[section]["openai"].update(base_url=url, api_key_env=KEY, concurrency=4, parse_retries=1, max_retries=1)
    return [
        "--params",
        str(write_params(tmp_path / "params.yaml", data)),
        "--questions",
        str(tmp_path / "questions.parquet"),
        "--generations",
        str(tmp_path / "generations.parquet"),
    ]


def _stage_inputs(tmp_path: Path, srv_url: str, n_questions: int = 40) -> tuple[Path, list[str]]:
    """The judge and cluster stages' arguments: n test questions, five answers each (three of them
    distinct), and params that send both to the endpoint at `srv_url`."""
    questions = pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n_questions)],
            "question": [f"Where was person {i} born?" for i in range(n_questions)],
            "answers": [[f"City{i}"] for i in range(n_questions)],
            "context": [""] * n_questions,
            "split": ["test"] * n_questions,
        }
    )
    rows = [
        {
            "question_id": f"q{i}",
            "sample_index": k,
            "split": "test",
            "n_tokens": 3,
            "text": f"Born in City{i if k % 2 == 0 else i + k}.",
            "token_logprobs": [-0.5, -0.5, -0.5],
        }
        for i in range(n_questions)
        for k in range(5)
    ]
    questions.write_parquet(tmp_path / "questions.parquet")
    pl.DataFrame(rows).write_parquet(tmp_path / "generations.parquet")
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section in ("judge", "cluster"):
        data[section]["backend"] = "openai"
        data[section]["openai"].update(base_url=srv_url, api_key_env=KEY, concurrency=4)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    args = [
        "--params",
        str(tmp_path / "params.yaml"),
        "--questions",
        str(tmp_path / "questions.parquet"),
        "--generations",
        str(tmp_path / "generations.parquet"),
    ]
    return tmp_path, args


def doc_blocks(doc: str, title: str) -> dict[str, list[str]]:
    """The fenced code blocks of a section (`## title` up to the next `## `) of a Markdown file of
    the repository (README.md, docs/*.md), by language, in order: the tests run them as written."""
    text = (ROOT / doc).read_text()
    if f"## {title}\n" not in text:
        raise AssertionError(f"{doc} has no section '## {title}': a test runs its code blocks")
    body = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S):
        blocks.setdefault(lang, []).append(code)
    return blocks


def copy_of_the_code(dest: Path) -> Path:
    """halludetect/, stages/ and params.yaml copied into `dest`: a test adds a part there as the docs say."""
    import shutil

    for part in ("halludetect", "stages"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "params.yaml", dest / "params.yaml")
    return dest


def register_in_copy(dest: Path, kind: str, line: str) -> None:
    """One line added to `BUILTINS[kind]` of the copy's core/registry.py, as the docs tell a user to."""
    reg = dest / "halludetect" / "core" / "registry.py"
    text = reg.read_text()
    opening = f'    "{kind}": {{\n'
    assert opening in text, f"registry.py has no {opening!r}"
    reg.write_text(text.replace(opening, opening + "        " + line.strip() + "\n", 1))


def run_in_copy(dest: Path, code: str, *args: str) -> dict:
    """`python -c code args` in the copy (its own halludetect first on the path); its last stdout line
    read as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=dest,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(dest)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def pdflatex(tables, directory: Path) -> subprocess.CompletedProcess:
    """Compile `tables` (report Tables) into one LaTeX document in `directory`, as a paper would
    include them (booktabs, graphicx): the real check of their escaping."""
    from halludetect.report.tables import to_latex

    doc = directory / "all.tex"
    doc.write_text(
        "\\documentclass{article}\\usepackage[T1]{fontenc}\\usepackage{booktabs,graphicx}\\begin{document}\n"
        + "".join(to_latex(t) for t in tables)
        + "\\end{document}\n"
    )
    return subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name],
        cwd=directory,
        capture_output=True,
        text=True,
    )


# ------------------------------------------------------------------ experiments, without running any
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
EVAL_FILE = "metrics/eval/world/world/max.json"


def git(repo: Path, *args: str, check: bool = True) -> str:
    res = subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, capture_output=True, text=True)
    if check and res.returncode:
        raise AssertionError(f"git {' '.join(args)}: {res.stdout}{res.stderr}")
    return res.stdout.strip()


def _record_run(repo: Path, dim: int) -> None:
    """What `dvc repro` of an evaluate stage at detectors.max.dim = dim leaves: params.yaml, the
    metrics file (test AUROC dim / 100) in the workspace and DVC's cache, dvc.lock recording it."""
    body = json.dumps({"best_layer": 1, "test": {"auroc": {"mean": dim / 100, "stderr": 0.01}, "n": 10}}).encode()
    md5 = hashlib.md5(body).hexdigest()
    for path in (repo / EVAL_FILE, repo / ".dvc/cache/files/md5" / md5[:2] / md5[2:]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    (repo / "params.yaml").write_text(yaml.safe_dump({"detectors": {"max": {"dim": dim}}}))
    out = {"path": EVAL_FILE, "hash": "md5", "md5": md5, "size": len(body)}
    stage = {"cmd": "true", "params": {"params.yaml": {"detectors.max.dim": dim}}, "outs": [out]}
    (repo / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"evaluate": stage}}))


def experiments_repo(repo: Path, dims: tuple[int, ...] = (8, 32), history: int = 6) -> dict[str, str]:
    """A git + DVC repository as a sweep leaves it, made in a second without running anything:
    `history` commits, then the baseline (HEAD, detectors.max.dim 16) whose dvc.lock records
    metrics/eval/world/world/max.json, and one experiment per value of `dims`: a commit on the
    baseline and its ref refs/exps/<baseline>/dim-<value>, as `dvc exp run` leaves them. Returns
    {"baseline": sha, "dim-8": sha, ...}."""
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q")
    (repo / ".dvc").mkdir()  # what `dvc init` writes, without its process or its logger
    (repo / ".dvc/config").write_text("")
    (repo / ".dvc/.gitignore").write_text("/config.local\n/tmp\n/cache\n")
    for i in range(history):
        git(repo, "commit", "-q", "--allow-empty", "-m", f"history {i}")
    (repo / "dvc.yaml").write_text(
        yaml.safe_dump(
            {"stages": {"evaluate": {"cmd": "true", "params": ["detectors.max.dim"], "metrics": [EVAL_FILE]}}}
        )
    )
    (repo / EVAL_FILE).parent.mkdir(parents=True)
    (repo / EVAL_FILE).with_name(".gitignore").write_text("/max.json\n")
    _record_run(repo, 16)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "baseline")
    shas = {"baseline": git(repo, "rev-parse", "HEAD")}
    base = shas["baseline"]
    for dim in dims:
        _record_run(repo, dim)
        git(repo, "commit", "-q", "-am", f"dim {dim}")
        shas[f"dim-{dim}"] = git(repo, "rev-parse", "HEAD")
        git(repo, "update-ref", f"refs/exps/{base[:2]}/{base[2:]}/dim-{dim}", shas[f"dim-{dim}"])
        git(repo, "reset", "-q", "--hard", base)
    _record_run(repo, 16)
    return shas
