"""Scoring new answers (halludetect/scoring/scorer.py): the bundle's scores equal the DAG's evaluate
scores, text answers tokenize as the model writes them, sampled answers are scored as if given,
another model, position convention or hub revision is refused before any weights load, empty and
too long answers get a reason and are counted, methods that read P_sem need it, a killed run
resumes without losing a finished part; and the hostile cases: two runs on one output (one
correct output or one clear refusal), counts of zero, a device that does not exist, a revision
with a local model, a score that comes out non-finite."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import polars as pl
import pytest
import torch
from support import ROOT, write_jsonl

from halludetect.config import GenerateParams
from halludetect.detectors.build import build_detector, params_for
from halludetect.scoring.answer_files import EXPLAIN_SCHEMA
from halludetect.scoring.bundle import load_bundle, save_bundle
from halludetect.scoring.scorer import ModelMismatch, Scorer, score_answers, score_file


def dag_rows(contract, split="test", token_ids=True):
    """The responses of a split as scoring input, in the dump's order."""
    qs = pl.read_parquet(contract / "questions.parquet").select(question_id="id", question="question")
    gens = pl.read_parquet(contract / "generations.parquet").sort("question_id", "sample_index")
    if split:
        gens = gens.filter(pl.col("split") == split)
    gens = gens.join(qs, on="question_id", maintain_order="left")
    return [
        {
            "id": f"{r['question_id']}/{r['sample_index']}",
            "question": r["question"],
            "answer": r["text"],
            **({"answer_token_ids": r["token_ids"]} if token_ids else {}),
        }
        for r in gens.iter_rows(named=True)
    ]


# ------------------------------------------------------------------------------ bundle scores
def test_bundle_scores_equal_the_dag_evaluate_scores(contract, bundle_path, tiny_model_dir):
    """The test split's evaluate logits at the bundle's layer, seed by seed, from answers scored
    from scratch (contract_layout.assert_bundle_scores_match_dag; test_e2e runs it on the DAG)."""
    from contract_layout import assert_bundle_scores_match_dag

    qs, gens = (pl.read_parquet(contract / f) for f in ("questions.parquet", "generations.parquet"))
    n = assert_bundle_scores_match_dag(bundle_path, contract / "scores" / "max", qs, gens, tiny_model_dir, 64)
    assert n == 2 * pl.read_parquet(contract / "judgments.parquet").filter(pl.col("split") == "test").height
    # the score is the mean of the seeds' logits, the probability Platt's, the flag at the threshold
    b = load_bundle(bundle_path)
    df = score_answers(bundle_path, dag_rows(contract), model=str(tiny_model_dir), per_seed=True, device="cpu")
    z = df["score"].to_numpy()
    np.testing.assert_allclose(z, np.mean(np.stack(df["seed_scores"].to_list()), axis=1))
    np.testing.assert_allclose(df["probability"].to_numpy(), b.probability(z))
    assert df["flag"].to_list() == (z >= b.threshold()[1]).tolist()
    assert df["n_tokens"].to_list() == [len(r["answer_token_ids"]) for r in dag_rows(contract)]


def test_a_model_given_loaded_scores_as_the_one_loaded_from_its_directory(contract, bundle_path, tiny_model_dir, tiny):
    """score_answers(..., model=<a loaded model>, tokenizer=...) (what bench.serve's check does) loads
    nothing more and gives the same rows (it failed before its first row: the prompt cache was set in load)."""
    model, tok = tiny
    rows = dag_rows(contract)[:6]
    given = score_answers(bundle_path, rows, model, tokenizer=tok, device="cpu")
    loaded = score_answers(bundle_path, rows, model=str(tiny_model_dir), device="cpu")
    assert given.equals(loaded)


def test_text_answers_are_tokenized_as_the_model_writes_them(contract, bundle_path, tiny_model_dir, tiny):
    """Without token ids the answer text is tokenized after a space (prompt 1 ends with
    "Answer:"): where that gives the sampled tokens, the score is the same."""
    _, tok = tiny
    rows = dag_rows(contract, split=None)
    same = [r for r in rows if tok(" " + r["answer"], add_special_tokens=False)["input_ids"] == r["answer_token_ids"]]
    assert same, "no answer of the tiny model re-tokenizes to its own tokens"
    with_ids = score_answers(bundle_path, same, model=str(tiny_model_dir), device="cpu")
    text_only = score_answers(
        bundle_path,
        [{k: r[k] for k in ("id", "question", "answer")} for r in same],
        model=str(tiny_model_dir),
        device="cpu",
    )
    np.testing.assert_allclose(with_ids["score"].to_numpy(), text_only["score"].to_numpy(), rtol=1e-6, atol=1e-6)


def test_generate_scores_the_sampled_answers(contract, bundle_path, tiny_model_dir, tmp_path):
    qs = pl.read_parquet(contract / "questions.parquet").head(5)
    src = tmp_path / "questions.jsonl"
    src.write_text("".join(json.dumps({"id": r["id"], "question": r["question"]}) + "\n" for r in qs.to_dicts()))
    out = tmp_path / "generated.parquet"
    params = GenerateParams(max_new_tokens=6, stop=[])
    summary = score_file(
        bundle_path, src, out, str(tiny_model_dir), generate=params, device="cpu", progress=False, log=lambda *_: None
    )
    df = pl.read_parquet(out)
    assert df.columns == [
        "row",
        "id",
        "answer",
        "answer_token_ids",
        "finish_reason",
        "n_tokens",
        "score",
        "probability",
        "flag",
        "reason",
        "in_distribution",
        "ood_reason",
        "mean_logprob",
        "min_logprob",
    ]
    assert summary["rows"] == 5 and summary["scored"] == df["score"].count()
    # each sampled answer checked against the bundle's range, on the sampler's own log-probs
    scored = df.filter(pl.col("score").is_not_null())
    assert scored["in_distribution"].null_count() == 0 and summary["in_distribution"]["checked"]
    # the answers are scored as if given: teacher-forced on the sampled tokens, equal up to float noise
    again = score_answers(
        bundle_path,
        [
            {"id": r["id"], "question": q, "answer": r["answer"], "answer_token_ids": r["answer_token_ids"]}
            for r, q in zip(df.to_dicts(), qs["question"])
            if r["score"] is not None
        ],
        model=str(tiny_model_dir),
        device="cpu",
    )
    np.testing.assert_allclose(df["score"].drop_nulls().to_numpy(), again["score"].to_numpy(), atol=1e-3)
    for stat in ("mean_logprob", "min_logprob"):  # the sampler's log-probs are the teacher-forced pass's
        np.testing.assert_allclose(scored[stat].to_numpy(), again[stat].to_numpy(), atol=1e-4)


# ------------------------------------------------------------------------------ token evidence
def check_explained(df: pl.DataFrame, tok) -> None:
    """Every scored row's contributions and bias make its score; its pieces are its tokens, and
    where they spell the answer the offsets are exact and cover it."""
    for r in df.filter(pl.col("score").is_not_null()).iter_rows(named=True):
        assert r["bias"] + sum(r["contributions"]) == pytest.approx(r["score"], abs=1e-5)
        assert len(r["tokens"]) == len(r["contributions"]) == len(r["token_start"]) == r["n_tokens"]
        if r["offsets_exact"]:
            shown = [r["answer"][a:b] for a, b in zip(r["token_start"], r["token_end"])]
            # whitespace around the answer is not in it (answers are stored stripped): cut off the ends
            assert "".join(shown) == r["answer"].strip()
            assert all(part in piece for part, piece in zip(shown, r["tokens"]))
    for r in df.filter(pl.col("score").is_null()).iter_rows(named=True):
        assert r["tokens"] is None and r["contributions"] is None


def test_explain_splits_each_score_over_the_answers_tokens(contract, bundle_path, tiny_model_dir, tiny):
    _, tok = tiny
    rows = dag_rows(contract)
    plain = score_answers(bundle_path, rows, model=str(tiny_model_dir), device="cpu")
    df = score_answers(bundle_path, rows, model=str(tiny_model_dir), device="cpu", explain=True)
    assert df.columns == [*plain.columns, "question", "answer", *EXPLAIN_SCHEMA]
    assert df["score"].to_list() == plain["score"].to_list()  # explaining changes no score
    check_explained(df, tok)
    # the sampled tokens decode to the stored text (stripped): exact offsets for every answer
    assert df["offsets_exact"].all()
    # tokens that do not spell the given answer: offsets aligned and marked approximate, score as given
    odd = [{**rows[0], "answer": rows[0]["answer"].upper() + " (sic)"}]
    row = score_answers(bundle_path, odd, model=str(tiny_model_dir), device="cpu", explain=True).row(0, named=True)
    assert row["offsets_exact"] is False and row["score"] == df["score"][0]
    assert all(0 <= a <= b <= len(odd[0]["answer"]) for a, b in zip(row["token_start"], row["token_end"]))


def test_explain_with_generate_and_with_p_sem(contract, bundle_path, tiny_model_dir, tiny, tmp_path):
    _, tok = tiny
    qs = pl.read_parquet(contract / "questions.parquet").head(4)
    src = write_jsonl(tmp_path / "q.jsonl", [{"id": r["id"], "question": r["question"]} for r in qs.to_dicts()])
    out = tmp_path / "sampled.jsonl"
    params = GenerateParams(max_new_tokens=6, stop=[])
    summary = score_file(
        bundle_path, src, out, str(tiny_model_dir), generate=params, device="cpu", progress=False, explain=True
    )
    assert summary["evidence"].startswith("each feature's term")
    check_explained(pl.read_ndjson(out), tok)
    sp = sp_bundle(bundle_path, tmp_path / "sp.safetensors")
    rows = [
        {"question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar.", "p_sem": p}
        for p in (0.2, 0.9)
    ]
    df = score_answers(sp, rows, model=str(tiny_model_dir), device="cpu", explain=True)
    check_explained(df, tok)
    assert df["bias"].to_list() == [0.0, 0.0]  # HaMI: top-k token logits / k, no bias
    assert df["contributions"][0].to_list() != df["contributions"][1].to_list()  # P_sem scales the states


@pytest.mark.hostile
def test_explain_with_a_method_without_token_evidence_says_what_it_reports(bundle_path, tiny_model_dir, no_loading):
    from halludetect.detectors import evidence
    from halludetect.detectors.networks import PoolingNet
    from halludetect.scoring.bundle import BundleError

    saved = evidence.EXPLAINERS[PoolingNet]
    evidence.no_evidence(PoolingNet, "its score is the bag logit alone, reported per answer")
    try:
        with pytest.raises(BundleError, match=r"\('max'\): a PoolingNet detector has no token evidence: its score is"):
            Scorer(bundle_path, str(tiny_model_dir), explain=True)
        Scorer(bundle_path, str(tiny_model_dir))  # without --explain it scores as before
    finally:
        evidence.EXPLAINERS[PoolingNet] = saved


# ------------------------------------------------------------------------------ the model given
def other_model_dir(tiny_model_dir, tmp_path):
    """The tiny model's architecture and tokenizer with other weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_model_dir)).save_pretrained(other)
    return other


def test_another_local_model_is_refused_naming_both(bundle_path, tiny_model_dir, tmp_path, no_loading):
    other = other_model_dir(tiny_model_dir, tmp_path)
    with pytest.raises(ModelMismatch) as e:
        Scorer(bundle_path, str(other))
    msg = str(e.value)
    assert str(tiny_model_dir) in msg and str(other) in msg and "model.safetensors" in msg


def test_another_position_convention_is_refused_naming_both(bundle_path, tiny_model_dir, no_loading):
    with pytest.raises(ModelMismatch, match="trained on 'predicting' token positions; 'generated' was asked"):
        Scorer(bundle_path, str(tiny_model_dir), positions="generated")


def hub_bundle(bundle_path, out, commit):
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    meta["base_model"] |= {"path": "org/tiny", "revision": "main", "resolved_revision": commit, "files": None}
    meta["base_model"]["preset"] |= {"path": "org/tiny", "revision": "main"}
    save_bundle(out, {s: d.state_dict() for s, d in b.detectors.items()}, meta)
    return out


def fake_hub_cache(root, model_dir, commit):
    """A Hugging Face cache holding org/tiny at `commit` as its main branch (offline resolution)."""
    repo = root / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_another_hub_revision_or_model_is_refused_naming_both(
    bundle_path, tiny_model_dir, tmp_path, monkeypatch, no_loading
):
    trained, other = "a" * 40, "b" * 40
    b = hub_bundle(bundle_path, tmp_path / "hub.safetensors", trained)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))  # read at call time
    snapshot = fake_hub_cache(tmp_path / "hub", tiny_model_dir, other)
    with pytest.raises(ModelMismatch, match=f"org/tiny at revision main \\(commit {trained}\\).*is commit {other}"):
        Scorer(b)
    with pytest.raises(ModelMismatch, match="trained on org/tiny at revision main.*the model given is org/other"):
        Scorer(b, "org/other")
    # a local copy says which commit it holds (a cache snapshot, or a --local-dir download's records)
    with pytest.raises(ModelMismatch, match=f"is commit {other}"):
        Scorer(b, str(snapshot))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    with pytest.raises(ModelMismatch, match="does not say which commit it holds.*--local-dir"):
        Scorer(b, str(copy))
    (copy / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (copy / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text(f"{trained}\netag\n1.0\n")
    assert Scorer(b, str(copy)).identity["commit"] == trained  # the right commit: accepted


def test_a_local_model_bundle_refuses_a_hub_id(bundle_path, no_loading):
    with pytest.raises(ModelMismatch, match="the model given is the hub model org/tiny"):
        Scorer(bundle_path, "org/tiny")


def test_empty_and_too_long_answers_get_a_reason_and_are_counted(bundle_path, tiny_model_dir, tmp_path):
    long = " ".join(["born"] * 200)  # the tiny model's context is 128 tokens
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "ok", "question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."},
            {"id": "empty", "question": "Where was Tavo Mir born?", "answer": "  "},
            {"id": "long", "question": "Where was Tavo Mir born?", "answer": long},
        ],
    )
    logged = []
    summary = score_file(
        bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False, log=logged.append, device="cpu"
    )
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == ["ok", "empty", "long"] and [r["row"] for r in out] == [0, 1, 2]
    assert [r["reason"] for r in out] == [None, "empty_answer", "too_long"]
    assert out[0]["score"] is not None and out[1]["score"] is None is out[2]["score"]
    assert summary["not_scored"] == {"empty_answer": 1, "too_long": 1} and summary["scored"] == 1
    assert any("line 3 (id 'long')" in m and "do not fit the model's context of 128" in m for m in logged)


@pytest.mark.hostile
def test_a_one_token_answer_to_a_sep_slt_bundle_gets_a_reason_never_a_crash(bundle_path, tiny_model_dir, tmp_path):
    """sep_slt reads the answer's second-last token: a one-token answer has none. It is left out
    with `too_short` and named in the log, as the DAG leaves such bags out; the others are scored."""
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    params = params_for("sep_slt")
    meta |= {"method": "sep_slt", "params": params.model_dump()}
    torch.manual_seed(0)
    slt = tmp_path / "sep_slt.safetensors"
    save_bundle(slt, {s: build_detector("sep_slt", 32, params).state_dict() for s in b.seeds}, meta)
    q = "Where was Tavo Mir born?"
    rows = [
        {"id": "one", "question": q, "answer": "Calomar", "answer_token_ids": [7]},
        {"id": "two", "question": q, "answer": "Calomar.", "answer_token_ids": [7, 8]},
    ]
    logged = []
    summary = score_file(
        slt,
        write_jsonl(tmp_path / "in.jsonl", rows),
        tmp_path / "out.jsonl",
        str(tiny_model_dir),
        progress=False,
        log=logged.append,
        device="cpu",
    )
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["score"] is None) for r in out] == [("too_short", True), (None, False)]
    assert summary["not_scored"] == {"too_short": 1} and summary["scored"] == 1
    assert any("line 1 (id 'one')" in m and "'sep_slt' reads answers of at least 2" in m for m in logged)
    sampled = score_answers(
        slt, [{"question": q}], model=str(tiny_model_dir), device="cpu", generate=GenerateParams(max_new_tokens=1)
    )  # one sampled token (or none, at once the end of the text)
    assert sampled["reason"][0] in ("too_short", "empty_answer") and sampled["score"][0] is None


def sp_bundle(bundle_path, out):
    """A hami_sp bundle (random weights): its detector reads each answer's P_sem."""
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    params = params_for("hami_sp", {"dim": 8})
    meta |= {"method": "hami_sp", "params": params.model_dump()}
    torch.manual_seed(0)
    save_bundle(out, {s: build_detector("hami_sp", 32, params).state_dict() for s in b.seeds}, meta)
    return out


def test_methods_that_read_p_sem_need_it(bundle_path, tiny_model_dir, tmp_path):
    b = sp_bundle(bundle_path, tmp_path / "sp.safetensors")
    rows = [
        {"question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar.", "p_sem": 0.4},
        {"question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."},
    ]
    df = score_answers(b, rows, model=str(tiny_model_dir), device="cpu")
    assert df["reason"].to_list() == [None, "no_p_sem"] and df["score"][0] is not None
    with_other_p = score_answers(b, [{**rows[0], "p_sem": 0.9}], model=str(tiny_model_dir), device="cpu")
    assert with_other_p["score"][0] != df["score"][0]  # P_sem scales the states it reads
    with pytest.raises(Exception, match="add a p_sem column"):
        score_file(
            b, write_jsonl(tmp_path / "in.jsonl", rows[1:]), tmp_path / "o.jsonl", str(tiny_model_dir), progress=False
        )
    with pytest.raises(Exception, match="--generate samples one answer"):
        Scorer(b, str(tiny_model_dir), generate=GenerateParams())


# ------------------------------------------------------------------------------ resume
KILL_AFTER_PARTS = """
import os, signal, sys
from halludetect import cli as console
from halludetect.core import unit_store
put, n = unit_store.UnitStore.put, []
def put_then_die(self, unit, df):
    put(self, unit, df)
    n.append(unit)
    if len(n) == int(os.environ["KILL_AFTER"]):
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: as a power cut would
unit_store.UnitStore.put = put_then_die
console.main(sys.argv[1:])
"""


def run_cli(args, cwd, kill_after=None):
    env = {**os.environ, "KILL_AFTER": str(kill_after or 0), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", KILL_AFTER_PARTS, *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_a_killed_run_loses_no_finished_part(contract, bundle_path, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", dag_rows(contract, split=None))  # 72 rows: 9 parts of 8
    args = [
        "score",
        "--bundle",
        str(bundle_path),
        "--input",
        str(src),
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--rows-per-part",
        "8",
        "--batch-size",
        "4",
        "--no-progress",
    ]
    killed = run_cli([*args, "--out", str(tmp_path / "out.parquet")], tmp_path, kill_after=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    parts = tmp_path / ".out.parquet.parts"
    assert len(list(parts.glob("unit_*.parquet"))) == 3 and not (tmp_path / "out.parquet").exists()
    resumed = run_cli([*args, "--out", str(tmp_path / "out.parquet")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 3 of 9 parts kept from an earlier run" in resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["parts_kept_from_earlier_run"] == 3
    assert not parts.exists()
    score_file(
        bundle_path,
        src,
        tmp_path / "whole.parquet",
        str(tiny_model_dir),
        device="cpu",
        rows_per_part=8,
        batch_size=4,
        progress=False,
        log=lambda *_: None,
    )  # the same, uninterrupted
    assert pl.read_parquet(tmp_path / "out.parquet").equals(pl.read_parquet(tmp_path / "whole.parquet"))
    assert (tmp_path / "out.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()


def interrupted_after_two_parts(bundle_path, src, out, monkeypatch, **kw) -> None:
    """A score run of `src` into `out` stopped (KeyboardInterrupt) once two parts are kept."""
    from halludetect.core.unit_store import UnitStore

    put = UnitStore.put

    def put_two_then_stop(self, unit, df):
        if len(self.finished()) == 2:
            raise KeyboardInterrupt
        put(self, unit, df)

    monkeypatch.setattr(UnitStore, "put", put_two_then_stop)
    with pytest.raises(KeyboardInterrupt):
        score_file(bundle_path, src, out, **kw)
    monkeypatch.undo()


def test_parts_from_other_options_are_discarded(contract, bundle_path, tiny_model_dir, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", dag_rows(contract)[:6])
    out = tmp_path / "out.jsonl"
    kw = dict(model=str(tiny_model_dir), device="cpu", rows_per_part=2, progress=False)
    interrupted_after_two_parts(bundle_path, src, out, monkeypatch, **kw)
    assert len(list((tmp_path / ".out.jsonl.parts").glob("unit_*"))) == 2
    logged = []
    score_file(bundle_path, src, out, threshold="best_f1", log=logged.append, **kw)
    assert not any("resuming" in m for m in logged)  # another threshold: the two parts are not reused
    assert [json.loads(line)["row"] for line in out.read_text().splitlines()] == list(range(6))


@pytest.mark.hostile
def test_a_part_copied_by_hand_over_another_is_recomputed_never_merged(
    contract, bundle_path, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    """A part copied over another part's name (one unit's rows over another's) would give repeated
    and missing rows with exit 0: each part records which unit it holds, and on resume a part that
    holds another is discarded with a warning naming it, then scored again."""
    import logging

    src = write_jsonl(tmp_path / "in.jsonl", dag_rows(contract)[:6])
    out = tmp_path / "out.jsonl"
    kw = dict(model=str(tiny_model_dir), device="cpu", rows_per_part=2, progress=False, log=lambda *_: None)
    interrupted_after_two_parts(bundle_path, src, out, monkeypatch, **kw)
    parts = tmp_path / ".out.jsonl.parts"
    shutil.copy(parts / "unit_000000.parquet", parts / "unit_000001.parquet")
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        score_file(bundle_path, src, out, **kw)
    assert [json.loads(line)["row"] for line in out.read_text().splitlines()] == list(range(6))
    assert f"discarding damaged work unit {parts / 'unit_000001.parquet'} (another unit's" in caplog.text
    score_file(bundle_path, src, tmp_path / "whole.jsonl", **kw)
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()


# ------------------------------------------------------------------ two runs, one output
PAUSE_AFTER_FIRST_PART = """
import os, sys, time
from pathlib import Path
from halludetect import cli as console
from halludetect.core import unit_store
put = unit_store.UnitStore.put
def put_then_pause(self, unit, df):
    put(self, unit, df)
    if not Path(os.environ["PAUSED"]).exists():
        Path(os.environ["PAUSED"]).touch()  # the test now starts a second run on the same --out
        while not Path(os.environ["GO"]).exists():
            time.sleep(0.05)
unit_store.UnitStore.put = put_then_pause
console.main(sys.argv[1:])
"""


def wait_for(path, proc):
    """Until `path` exists; the process must still be running (a deadline only against a hang)."""
    deadline = time.monotonic() + 600
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run never finished a part"
        time.sleep(0.05)


@pytest.mark.hostile
def test_two_runs_on_one_out_give_one_correct_output_or_one_clear_refusal(
    contract, bundle_path, tiny_model_dir, tmp_path
):
    """Before: both ran on one parts directory; one exited 0 with the other's answers in its
    rows, the other crashed after all its work. Now the second stops at once naming the first,
    and the first's output is what it alone would have written."""
    rows = dag_rows(contract, split=None)
    first = write_jsonl(tmp_path / "first.jsonl", rows[:24])  # 3 parts of 8
    second = write_jsonl(tmp_path / "second.jsonl", [{**r, "answer": "Nobody knows."} for r in rows[:20]])
    second_bytes = second.read_bytes()
    out = tmp_path / "out.parquet"
    common = ["--bundle", str(bundle_path), "--model", str(tiny_model_dir), "--device", "cpu", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAUSED": str(tmp_path / "paused"), "GO": str(tmp_path / "go")}
    a = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AFTER_FIRST_PART, "score", *common, "--input", str(first), "--out", str(out),
         "--rows-per-part", "8", "--batch-size", "4"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(tmp_path / "paused", a)  # the first run owns the parts and has finished one
        b = run_cli(["score", *common, "--input", str(second), "--out", str(out), "--rows-per-part", "8"], tmp_path)
    finally:
        (tmp_path / "go").touch()
        a_out, a_err = a.communicate(timeout=600)
    assert b.returncode == 2 and "Traceback" not in b.stderr, b.stderr
    assert b.stderr.count("\n") == 1 and b.stderr.startswith(
        f"error: {tmp_path / '.out.parquet.parts'} is in use by another run: process {a.pid}, started "
    )
    assert b.stderr.rstrip().endswith("wait for it to finish (or stop it), or write this run's scores to another --out")
    assert second.read_bytes() == second_bytes
    assert a.returncode == 0, a_err
    assert json.loads(a_out.splitlines()[-1])["rows"] == 24
    score_file(
        bundle_path, first, tmp_path / "alone.parquet", str(tiny_model_dir), device="cpu", rows_per_part=8,
        batch_size=4, progress=False, log=lambda *_: None,
    )  # fmt: skip
    assert out.read_bytes() == (tmp_path / "alone.parquet").read_bytes()  # none of the second run's rows
    assert not (tmp_path / ".out.parquet.parts").exists()


# ------------------------------------------------------------------ bad options, before any weights
@pytest.mark.hostile
def test_counts_of_zero_or_below_are_refused_before_anything_loads(bundle_path, tiny_model_dir, tmp_path, no_loading):
    from halludetect.scoring.scorer import OptionError

    src = write_jsonl(tmp_path / "in.jsonl", [{"question": "Q?", "answer": "A."}])
    for kw, name in (({"batch_size": 0}, "batch_size"), ({"rows_per_part": -3}, "rows_per_part")):
        with pytest.raises(OptionError, match=rf"^{name} \(--{name.replace('_', '-')}\) must be a whole number of at"):
            score_file(bundle_path, src, tmp_path / "o.jsonl", str(tiny_model_dir), progress=False, **kw)
    with pytest.raises(
        OptionError, match=r"^batch_size \(--batch-size\) must be a whole number of at least 1, got 2.5"
    ):
        Scorer(bundle_path, str(tiny_model_dir), batch_size=2.5)
    unchecked = GenerateParams().model_copy(update={"max_new_tokens": 0})  # model_copy skips pydantic's checks
    with pytest.raises(OptionError, match=r"^generate.max_new_tokens: input should be greater than 0 \(got 0\)"):
        Scorer(bundle_path, str(tiny_model_dir), generate=unchecked)
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.hostile
def test_a_device_that_does_not_exist_is_refused_before_anything_loads(bundle_path, tiny_model_dir, no_loading):
    from halludetect.core.devices import DeviceError

    with pytest.raises(DeviceError, match=r"^--device: 'banana' is not a device; use auto, cpu, cuda, cuda:N"):
        Scorer(bundle_path, str(tiny_model_dir), device="banana")
    with pytest.raises(DeviceError, match=r"^--device: 'cuda:x' is not a device"):
        Scorer(bundle_path, str(tiny_model_dir), device="cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"^--device: 'cuda:7' was asked for but CUDA is not available"):
            Scorer(bundle_path, str(tiny_model_dir), device="cuda:7")


@pytest.mark.hostile
def test_a_revision_with_a_local_model_is_checked_never_ignored(bundle_path, tiny_model_dir, tmp_path, no_loading):
    """A local directory holds files, not a hub revision: --revision is accepted only as the commit
    the directory says it holds."""
    with pytest.raises(ModelMismatch) as e:
        Scorer(bundle_path, str(tiny_model_dir), revision="main")
    assert str(e.value) == (
        f"--revision main was given with the local model directory {tiny_model_dir}, which does not say which "
        "commit it holds: drop --revision (the directory's files are checked against the bundle's), or pass the hub id"
    )
    with pytest.raises(ModelMismatch, match="--revision main was given with the local model directory"):
        Scorer(bundle_path, revision="main")  # the bundle's own local model
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (copy / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text(f"{'c' * 40}\netag\n1.0\n")
    with pytest.raises(ModelMismatch, match=f"--revision {'d' * 40} was given, but the local model directory {copy} "
                                            f"holds commit {'c' * 40}"):  # fmt: skip
        Scorer(bundle_path, str(copy), revision="d" * 40)


# ------------------------------------------------------------------ non-finite scores
@pytest.mark.hostile
def test_a_non_finite_score_stops_the_run_naming_the_row(bundle_path, tiny_model_dir, tmp_path):
    """Finite but huge weights (a bundle that passes every check) overflow the logit: the run stops
    at the row rather than write inf or NaN as a score."""
    from halludetect.scoring.scorer import NonFiniteScore

    b = load_bundle(bundle_path)
    state = {s: {k: v.clone() for k, v in d.state_dict().items()} for s, d in b.detectors.items()}
    for sd in state.values():
        sd["feature.0.bias"].fill_(10.0)  # every feature active
        sd["head.weight"].fill_(3e38)  # and a head that sums them past float32's range
    save_bundle(tmp_path / "huge.safetensors", state, b.meta)
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "a", "question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."}],
    )
    with pytest.raises(NonFiniteScore) as e:
        score_file(tmp_path / "huge.safetensors", src, tmp_path / "out.jsonl", str(tiny_model_dir), device="cpu",
                   progress=False, log=lambda *_: None)  # fmt: skip
    assert str(e.value).startswith("line 1 (id 'a'): its score is not a finite number: the detector's logit is [")
    assert "per seed on finite states (weights too large?). Nothing non-finite is written" in str(e.value)
    assert not (tmp_path / "out.jsonl").exists()
