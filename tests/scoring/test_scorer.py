"""Scoring new answers: early exit equals the dump bit for bit, the bundle's scores equal the
DAG's evaluate scores, states from the sampling pass equal the teacher-forced ones, and bad
input (another model, malformed rows, empty or too long answers) is caught and named."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.activations.capture import bag_positions, bag_slice, dump
from halludetect.activations.early_exit import load_until, states_until
from halludetect.activations.layer_format import layer_files
from halludetect.activations.layer_reader import read_layer
from halludetect.activations.sampled_states import sample_with_states
from halludetect.config import GenerateParams, ModelPreset
from halludetect.detectors.build import build_detector, params_for
from halludetect.lm.hf_models import eos_ids
from halludetect.lm.model_inputs import encode_prompt, pad_ids
from halludetect.scoring import scorer as scoring
from halludetect.scoring.answer_files import InputError
from halludetect.scoring.bundle import load_bundle, save_bundle
from halludetect.scoring.scorer import ModelMismatch, Scorer, score_answers, score_file

ROOT = Path(__file__).resolve().parents[1]


def dag_rows(contract, split="test", token_ids=True):
    """The responses of a split as scoring input, in the dump's order."""
    qs = pl.read_parquet(contract / "questions.parquet").select(question_id="id", question="question")
    gens = pl.read_parquet(contract / "generations.parquet").sort("question_id", "sample_index")
    if split:
        gens = gens.filter(pl.col("split") == split)
    gens = gens.join(qs, on="question_id", maintain_order="left")
    return [{"id": f"{r['question_id']}/{r['sample_index']}", "question": r["question"], "answer": r["text"],
             **({"answer_token_ids": r["token_ids"]} if token_ids else {})} for r in gens.iter_rows(named=True)]


# ------------------------------------------------------------------------------ early exit
@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_early_exit_states_equal_the_dump_bit_for_bit(tiny, tiny_model_dir, contract, tmp_path, positions):
    """Same batches as the dump (order, size, right padding): the states of blocks 1..L are the
    dump's to the bit, from a model loaded with only those blocks and from the whole model."""
    model, tok = tiny
    qs = pl.read_parquet(contract / "questions.parquet")
    gens = pl.read_parquet(contract / "generations.parquet").sort("question_id", "sample_index")
    dump(model, tok, qs, gens, tmp_path, [0, 1, 3], positions=positions, dtype="float32", batch_size=16,
         attrs={}, log=lambda *_: None)
    prompts = {q: encode_prompt(tok, text, False) for q, text in qs.select("id", "question").iter_rows()}
    preset = ModelPreset(path=str(tiny_model_dir), dtype="float32")
    for layer in (0, 1, 3):
        want = read_layer(tmp_path / f"layer_{layer}.h5").states
        for m in (load_until(preset, layer, "cpu"), model):
            got = []
            for a in range(0, gens.height, 16):
                batch = gens.slice(a, 16).to_dicts()
                seqs = [prompts[r["question_id"]] + r["token_ids"] for r in batch]
                starts = [bag_slice(len(prompts[r["question_id"]]), r["n_tokens"], positions).start for r in batch]
                ids, mask = pad_ids(seqs, tok.pad_token_id, left=False)
                h = states_until(m, layer, 3, ids, mask)
                row, col = bag_positions(starts, [r["n_tokens"] for r in batch])
                got.append(h[row, col].numpy())
            assert np.array_equal(np.concatenate(got), want), (layer, type(m).__name__)


def test_early_exit_neither_loads_nor_runs_the_blocks_above(tiny, tiny_model_dir):
    model, _ = tiny
    cut = load_until(ModelPreset(path=str(tiny_model_dir), dtype="float32"), 1, "cpu")
    assert len(cut.layers) == 1 and not hasattr(cut, "lm_head")
    kept = model.model.embed_tokens.weight.numel() + sum(p.numel() for p in model.model.layers[0].parameters())
    assert sum(p.numel() for p in cut.parameters()) == kept + model.model.norm.weight.numel()
    calls = []
    above = [*model.model.layers[1:], model.model.norm, model.lm_head]
    handles = [m.register_forward_hook(lambda *_, i=i: calls.append(i)) for i, m in enumerate(above)]
    first = model.model.layers[0].register_forward_hook(lambda *_: calls.append("block 1"))
    try:
        ids = torch.randint(3, 100, (2, 7))
        states_until(model, 1, 3, ids, torch.ones_like(ids))
    finally:
        for h in [*handles, first]:
            h.remove()
    assert calls == ["block 1"]  # the whole model given: still nothing above block 1 runs


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


def test_text_answers_are_tokenized_as_the_model_writes_them(contract, bundle_path, tiny_model_dir, tiny):
    """Without token ids the answer text is tokenized after a space (prompt 1 ends with
    "Answer:"): where that gives the sampled tokens, the score is the same."""
    _, tok = tiny
    rows = dag_rows(contract, split=None)
    same = [r for r in rows if tok(" " + r["answer"], add_special_tokens=False)["input_ids"] == r["answer_token_ids"]]
    assert same, "no answer of the tiny model re-tokenizes to its own tokens"
    with_ids = score_answers(bundle_path, same, model=str(tiny_model_dir), device="cpu")
    text_only = score_answers(bundle_path, [{k: r[k] for k in ("id", "question", "answer")} for r in same],
                              model=str(tiny_model_dir), device="cpu")
    np.testing.assert_allclose(with_ids["score"].to_numpy(), text_only["score"].to_numpy(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ sampling pass
@pytest.mark.parametrize("positions", ["predicting", "generated"])
def test_states_of_the_sampling_pass_equal_the_teacher_forced_ones(tiny, tmp_path, positions):
    """max_new_tokens 5 cuts most answers: the `generated` bag then needs the last token's state,
    computed by one decode step on the sampling pass's cache."""
    model, tok = tiny
    qs = pl.DataFrame({"id": [f"q{i}" for i in range(6)],
                       "question": [f"Where was Tavo Mir{i} born?" for i in range(6)]})
    prompts = [encode_prompt(tok, q, False) for q in qs["question"]]
    params = GenerateParams(max_new_tokens=5, stop=[])
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        sampled = sample_with_states(model, tok, prompts, [(0, q, 0, 0) for q in qs["id"]], params, eos_ids(model, tok),
                                     layer=2, positions=positions, states_dtype=torch.float32)
    finally:
        hook.remove()
    answers = [s.answer.token_ids for s in sampled]
    assert all(answers) and any(len(a) == 5 for a in answers)
    # one forward per sampled token (prefill, then decode steps), one more only for a cut `generated` bag
    assert len(forwards) == max(map(len, answers)) + (positions == "generated")
    gens = pl.DataFrame({"question_id": qs["id"], "sample_index": [0] * 6, "token_ids": answers,
                         "n_tokens": [len(a) for a in answers]})
    dump(model, tok, qs, gens, tmp_path, [2], positions=positions, dtype="float32", batch_size=4, attrs={},
         log=lambda *_: None)
    layer = read_layer(layer_files(tmp_path)[2])
    for i, s in enumerate(sampled):
        np.testing.assert_allclose(s.states.numpy(), layer.states[layer.offsets[i] : layer.offsets[i + 1]], atol=1e-4)


def test_generate_scores_the_sampled_answers(contract, bundle_path, tiny_model_dir, tmp_path):
    qs = pl.read_parquet(contract / "questions.parquet").head(5)
    src = tmp_path / "questions.jsonl"
    src.write_text("".join(json.dumps({"id": r["id"], "question": r["question"]}) + "\n" for r in qs.to_dicts()))
    out = tmp_path / "generated.parquet"
    params = GenerateParams(max_new_tokens=6, stop=[])
    summary = score_file(bundle_path, src, out, str(tiny_model_dir), generate=params, device="cpu", progress=False,
                         log=lambda *_: None)
    df = pl.read_parquet(out)
    assert df.columns == ["row", "id", "answer", "answer_token_ids", "finish_reason", "n_tokens", "score",
                          "probability", "flag", "reason"]
    assert summary["rows"] == 5 and summary["scored"] == df["score"].count()
    # the answers are scored as if given: teacher-forced on the sampled tokens, equal up to float noise
    again = score_answers(bundle_path, [{"id": r["id"], "question": q, "answer": r["answer"],
                                         "answer_token_ids": r["answer_token_ids"]}
                                        for r, q in zip(df.to_dicts(), qs["question"]) if r["score"] is not None],
                          model=str(tiny_model_dir), device="cpu")
    np.testing.assert_allclose(df["score"].drop_nulls().to_numpy(), again["score"].to_numpy(), atol=1e-3)


# ------------------------------------------------------------------------------ the model given
@pytest.fixture
def no_loading(monkeypatch):
    """Mismatches must be refused before any weights are loaded."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the mismatch was found")

    monkeypatch.setattr("halludetect.activations.early_exit.load_until", refuse)
    monkeypatch.setattr(scoring, "load_model", refuse)


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


def test_another_hub_revision_or_model_is_refused_naming_both(bundle_path, tiny_model_dir, tmp_path, monkeypatch,
                                                              no_loading):
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


# ------------------------------------------------------------------------------ bad rows
def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("rows", "match"), [
    ([{"question": "Q?", "answer": "A."}, "{not json", {"question": "Q?", "answer": "A."}],
     r"in\.jsonl, line 2: not valid JSON"),
    ([{"question": "Q?", "answer": "A."}, {"question": "Q?"}],
     r"line 2: 'answer' must be a string \(missing; .*--generate"),
    ([{"question": "", "answer": "A."}], "line 1: 'question' must be a non-empty string"),
    ([{"id": 1, "question": "Q?", "answer": "A."}, {"id": "b", "question": "Q?", "answer": "A."}],
     "line 2: 'id' is str here but int at line 1"),
    ([{"question": "Q?", "answer": "A.", "answer_token_ids": [1, "x"]}], "line 1: 'answer_token_ids' must be a list"),
    ([{"question": "Q?", "answer": "A.", "answer_token_ids": [1, 10**6]}], "line 1: answer_token_ids 1000000 is "
                                                                           "outside the model's vocabulary"),
    ([{"question": "Q?", "answer": "A.", "p_sem": 1.5}], r"line 1: 'p_sem' must be a number in \[0, 1\]"),
    ([[1, 2]], "line 1: expected a JSON object, got list"),
])
def test_malformed_rows_are_named_before_the_model_loads(bundle_path, tiny_model_dir, tmp_path, no_loading, rows,
                                                         match):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(InputError, match=match):
        score_file(bundle_path, src, tmp_path / "out.parquet", str(tiny_model_dir), progress=False)
    assert not (tmp_path / "out.parquet").exists()


def test_malformed_parquet_rows_are_named(bundle_path, tiny_model_dir, tmp_path, no_loading):
    src = tmp_path / "in.parquet"
    pl.DataFrame({"question": ["Q?", "Q?", None], "answer": ["A.", "B.", "C."]}).write_parquet(src)
    with pytest.raises(InputError, match=r"in\.parquet, row 2: 'question' must be a non-empty string"):
        score_file(bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False)
    with pytest.raises(InputError, match="unknown output format '.csv'"):
        score_file(bundle_path, src, tmp_path / "out.csv", str(tiny_model_dir), progress=False)
    pl.DataFrame({"question": ["Q?"]}).write_parquet(src)
    with pytest.raises(InputError, match="'answer' must be a string"):
        score_file(bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False)
    with pytest.raises(InputError, match="--generate samples the answers"):
        score_file(bundle_path, write_jsonl(tmp_path / "q.jsonl", [{"question": "Q?", "answer": "A."}]),
                   tmp_path / "out.jsonl", str(tiny_model_dir), generate=GenerateParams(), progress=False)


def test_empty_and_too_long_answers_get_a_reason_and_are_counted(bundle_path, tiny_model_dir, tmp_path):
    long = " ".join(["born"] * 200)  # the tiny model's context is 128 tokens
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok", "question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."},
        {"id": "empty", "question": "Where was Tavo Mir born?", "answer": "  "},
        {"id": "long", "question": "Where was Tavo Mir born?", "answer": long},
    ])
    logged = []
    summary = score_file(bundle_path, src, tmp_path / "out.jsonl", str(tiny_model_dir), progress=False,
                         log=logged.append, device="cpu")
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == ["ok", "empty", "long"] and [r["row"] for r in out] == [0, 1, 2]
    assert [r["reason"] for r in out] == [None, "empty_answer", "too_long"]
    assert out[0]["score"] is not None and out[1]["score"] is None is out[2]["score"]
    assert summary["not_scored"] == {"empty_answer": 1, "too_long": 1} and summary["scored"] == 1
    assert any("line 3 (id 'long')" in m and "do not fit the model's context of 128" in m for m in logged)


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
    rows = [{"question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar.", "p_sem": 0.4},
            {"question": "Where was Tavo Mir born?", "answer": "Tavo Mir was born in Calomar."}]
    df = score_answers(b, rows, model=str(tiny_model_dir), device="cpu")
    assert df["reason"].to_list() == [None, "no_p_sem"] and df["score"][0] is not None
    with_other_p = score_answers(b, [{**rows[0], "p_sem": 0.9}], model=str(tiny_model_dir), device="cpu")
    assert with_other_p["score"][0] != df["score"][0]  # P_sem scales the states it reads
    with pytest.raises(Exception, match="add a p_sem column"):
        score_file(b, write_jsonl(tmp_path / "in.jsonl", rows[1:]), tmp_path / "o.jsonl", str(tiny_model_dir),
                   progress=False)
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
    return subprocess.run([sys.executable, "-c", KILL_AFTER_PARTS, *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_a_killed_run_loses_no_finished_part(contract, bundle_path, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", dag_rows(contract, split=None))  # 72 rows: 9 parts of 8
    args = ["score", "--bundle", str(bundle_path), "--input", str(src), "--model", str(tiny_model_dir),
            "--device", "cpu", "--rows-per-part", "8", "--batch-size", "4", "--no-progress"]
    killed = run_cli([*args, "--out", str(tmp_path / "out.parquet")], tmp_path, kill_after=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    parts = tmp_path / ".out.parquet.parts"
    assert len(list(parts.glob("unit_*.parquet"))) == 3 and not (tmp_path / "out.parquet").exists()
    resumed = run_cli([*args, "--out", str(tmp_path / "out.parquet")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 3 of 9 parts kept from an earlier run" in resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["parts_kept_from_earlier_run"] == 3
    assert not parts.exists()
    score_file(bundle_path, src, tmp_path / "whole.parquet", str(tiny_model_dir), device="cpu", rows_per_part=8,
               batch_size=4, progress=False, log=lambda *_: None)  # the same, uninterrupted
    assert pl.read_parquet(tmp_path / "out.parquet").equals(pl.read_parquet(tmp_path / "whole.parquet"))
    assert (tmp_path / "out.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()


def test_parts_from_other_options_are_discarded(contract, bundle_path, tiny_model_dir, tmp_path, monkeypatch):
    from halludetect.core.unit_store import UnitStore

    src = write_jsonl(tmp_path / "in.jsonl", dag_rows(contract)[:6])
    out = tmp_path / "out.jsonl"
    put = UnitStore.put

    def put_two_then_stop(self, unit, df):
        if len(self.finished()) == 2:
            raise KeyboardInterrupt
        put(self, unit, df)

    kw = dict(model=str(tiny_model_dir), device="cpu", rows_per_part=2, progress=False)
    monkeypatch.setattr(UnitStore, "put", put_two_then_stop)
    with pytest.raises(KeyboardInterrupt):
        score_file(bundle_path, src, out, **kw)
    monkeypatch.undo()
    assert len(list((tmp_path / ".out.jsonl.parts").glob("unit_*"))) == 2
    logged = []
    score_file(bundle_path, src, out, threshold="fpr_0.05", log=logged.append, **kw)
    assert not any("resuming" in m for m in logged)  # another threshold: the two parts are not reused
    assert [json.loads(line)["row"] for line in out.read_text().splitlines()] == list(range(6))


def test_reading_rows_is_streamed(tmp_path):
    """The first pass and the parts keep one part of rows at a time: the peak of Python
    allocations while reading 20,000 rows is that of reading 2,000."""
    import tracemalloc

    from halludetect.scoring.answer_files import AnswerFile

    def peak(n: int) -> int:
        rows = [{"id": i, "question": f"Where was Tavo Mir{i} born?", "answer": "Tavo Mir was born in " + "x" * 80}
                for i in range(n)]
        src = write_jsonl(tmp_path / f"{n}.jsonl", rows)
        del rows
        tracemalloc.start()
        f = AnswerFile(src).check()
        parts = sum(len(p) for _, p in f.parts(500))
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert f.n_rows == parts == n
        return top

    small, large = peak(2_000), peak(20_000)
    assert large < 1.5 * small, (small, large)


def test_the_command_reports_bad_input_in_one_line_and_exits_2(bundle_path, tiny_model_dir, tmp_path, capsys):
    from halludetect import cli as console

    def fails(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            console.main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "no such bundle" in fails(["show", str(tmp_path / "none.safetensors")])
    score = ["score", "--bundle", str(bundle_path), "--model", str(tiny_model_dir), "--out", str(tmp_path / "o.jsonl")]
    assert "pass --generate, or drop them" in fails([*score, "--input", "in.jsonl", "--seed", "3"])
    assert "no such input file" in fails([*score, "--input", str(tmp_path / "none.jsonl")])
    src = write_jsonl(tmp_path / "in.jsonl", [{"question": "Q?", "answer": "A."}])
    assert "unknown threshold 'f1'" in fails([*score, "--input", str(src), "--threshold", "f1"])
    console.main(["show", str(bundle_path)])
    assert json.loads(capsys.readouterr().out)["method"] == "max"
