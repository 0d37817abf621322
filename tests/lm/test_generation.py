"""Batched sampling (halludetect/lm/generation.py): per-answer random streams, resume (a truncated unit
is recomputed), sharding, empty answers, the context check, the sampler's distribution and the
model's raw log-probs."""

import logging

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.config import GenerateParams
from halludetect.core.unit_store import UnitStore
from halludetect.lm import generation
from halludetect.lm.generation import generate, row_uniforms, trim_answer
from halludetect.lm.hf_models import ModelError
from halludetect.lm.model_inputs import encode_prompt
from halludetect.lm.parallel import Workers


def questions(n=6):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{'a' * i} born?" for i in range(n)],  # prompts of different lengths
            "split": ["train", "val", "test"] * (n // 3) + ["test"] * (n % 3),
        }
    )


PARAMS = GenerateParams(n_samples=3, max_new_tokens=6, stop=["\n"], batch_size=2, temperature=1.0)


def no_seconds(df):
    return df.drop("seconds")


_no_seconds = no_seconds  # the name test_generate_discards_a_truncated_unit_... uses


def test_answers_do_not_depend_on_batch_mates(tiny):
    model, tok = tiny
    big = generate(model, tok, questions(), PARAMS.model_copy(update={"batch_size": 6}))
    small = generate(model, tok, questions(), PARAMS.model_copy(update={"batch_size": 1}))
    assert big["token_ids"].to_list() == small["token_ids"].to_list()
    np.testing.assert_allclose(
        big["token_logprobs"].explode().to_numpy(), small["token_logprobs"].explode().to_numpy(), atol=1e-5
    )  # float noise of different padding only
    # Rows come back in the questions' order, then by sample.
    assert big["question_id"].to_list() == [f"q{i}" for i in range(6) for _ in range(3)]
    assert big["sample_index"].to_list() == [0, 1, 2] * 6
    # Different samples of one question draw from different streams.
    assert big.group_by("question_id").agg(pl.col("text").n_unique())["text"].max() > 1


def test_row_streams_are_keyed_not_positional():
    u = row_uniforms([(0, "q1", 0, 0), (0, "q1", 1, 0), (1, "q1", 0, 0)], 4)
    again = row_uniforms([(1, "q1", 0, 0), (0, "q1", 0, 0)], 4)
    torch.testing.assert_close(u[0], again[1])
    torch.testing.assert_close(u[2], again[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_killed_run_resumes_to_the_same_output(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    clean = generate(model, tok, questions(), PARAMS)
    store = UnitStore(tmp_path / "progress", {"run": 1})
    assert store.prepare() == 0
    real, calls = generation.generate_unit, []

    def dies_on_third(*args, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt  # like a kill: nothing after this unit runs
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(generation, "generate_unit", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        generate(model, tok, questions(), PARAMS, store=store)
    monkeypatch.setattr(generation, "generate_unit", real)
    assert store.finished() == {0, 1}
    store.release()  # the killed run's claim ends with it
    # A re-run with the same fingerprint keeps the two units and computes only the third.
    again = UnitStore(tmp_path / "progress", {"run": 1})
    assert again.prepare() == 2
    computed = []
    monkeypatch.setattr(generation, "generate_unit", lambda *a, **k: computed.append(1) or real(*a, **k))
    resumed = generate(model, tok, questions(), PARAMS, store=again)
    assert len(computed) == 1
    assert no_seconds(resumed).equals(no_seconds(clean))
    again.release()
    # A different fingerprint (say, another temperature) discards what was kept.
    assert UnitStore(tmp_path / "progress", {"run": 2}).prepare() == 0


@pytest.mark.hostile
def test_generate_discards_a_truncated_unit_with_a_warning_and_recomputes_it(tiny, tmp_path, caplog):
    from halludetect.core.unit_store import UnitStore
    from halludetect.lm.generation import GENERATIONS_SCHEMA, generate

    model, tok = tiny
    clean = generate(model, tok, questions(), PARAMS)
    first = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    first.prepare()
    generate(model, tok, questions(), PARAMS, store=first)
    n_units = len(first.finished())
    first.release()
    unit = tmp_path / "progress" / "unit_000001.parquet"
    unit.write_bytes(unit.read_bytes()[:40])  # what a power loss can leave of a unit renamed without fsync
    again = UnitStore(tmp_path / "progress", {"run": 1}, schema=GENERATIONS_SCHEMA)
    with caplog.at_level(logging.WARNING, logger="halludetect"):
        assert again.prepare() == n_units - 1
    assert f"discarding damaged work unit {unit} (unreadable: ComputeError: " in caplog.text
    assert "it will be recomputed" in caplog.text
    resumed = generate(model, tok, questions(), PARAMS, store=again)
    assert _no_seconds(resumed).equals(_no_seconds(clean))


def test_shards_merge_to_the_one_process_output(tiny, tmp_path):
    model, tok = tiny
    clean = generate(model, tok, questions(), PARAMS)
    store = UnitStore(tmp_path / "progress", {})
    store.prepare()
    # Two processes, run one after the other (the barrier is a no-op without a launcher).
    assert generate(model, tok, questions(), PARAMS, store=store, workers=Workers(1, 2)) is None
    assert store.finished() == {1}
    merged = generate(model, tok, questions(), PARAMS, store=store, workers=Workers(0, 2))
    assert no_seconds(merged).equals(no_seconds(clean))


def test_empty_answers_are_resampled_a_bounded_number_of_times(tiny):
    model, tok = tiny
    # Stop at any vowel or space: most answers of the random tiny model end up empty.
    params = PARAMS.model_copy(update={"stop": ["a", "e", "i", "o", "u", " "], "empty_retries": 2})
    df = generate(model, tok, questions(), params)
    assert df["attempts"].min() == 1 and df["attempts"].max() <= 3
    assert (df["attempts"] > 1).any()
    still_empty = df.filter(pl.col("n_tokens") == 0)
    assert (still_empty["attempts"] == 3).all()  # only given up after every retry
    assert (df.filter(pl.col("attempts") < 3)["n_tokens"] > 0).all()  # a retry stops once it has an answer
    none = generate(model, tok, questions(), params.model_copy(update={"empty_retries": 0}))
    assert (none["attempts"] == 1).all() and (none["n_tokens"] == 0).sum() >= (df["n_tokens"] == 0).sum()


def test_prompt_longer_than_the_context_is_refused(tiny):
    model, tok = tiny  # max_position_embeddings = 128
    long = pl.DataFrame({"id": ["long"], "question": ["Tavo " * 200], "split": ["test"]})
    with pytest.raises(ModelError, match=r"1 question\(s\) do not fit the model's context of 128 tokens.*'long'"):
        generate(model, tok, long, PARAMS)


def test_greedy_and_repetition_penalty_match_transformers(tiny):
    model, tok = tiny
    params = PARAMS.model_copy(update={"max_new_tokens": 20, "stop": []})
    prompt = encode_prompt(tok, questions(1)["question"][0], False)
    answers = {}
    for penalty in (1.0, 5.0):
        ours = generate(
            model, tok, questions(1), params.model_copy(update={"repetition_penalty": penalty}), greedy=True
        ).row(0, named=True)
        ref = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=20,
            repetition_penalty=penalty,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt) :].tolist()
        assert ours["token_ids"] == trim_answer(tok, ref, [], 20).token_ids
        answers[penalty] = ours
    assert answers[1.0]["token_ids"] != answers[5.0]["token_ids"]  # the penalty did something
    # Log-probs stay those of the raw model, also for the penalised answer.
    r = answers[5.0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + r["token_ids"]])).logits[0].float(), -1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r["token_ids"])]
    np.testing.assert_allclose(r["token_logprobs"], want, atol=1e-4)


def test_row_sampler_draws_from_the_warped_distribution():
    from halludetect.lm.generation import RowSampler

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 40_000
    params = GenerateParams(temperature=0.5, top_k=4, top_p=0.95, max_new_tokens=1)
    sampler = RowSampler(row_uniforms([(0, "q", r, 0) for r in range(rows)], 1), 0, params, greedy=False)
    forced = sampler(torch.zeros(rows, 0, dtype=torch.long), logits.repeat(rows, 1))
    assert torch.isinf(forced).sum(1).eq(5).all()  # exactly one finite score per row: the choice
    picked = forced.argmax(1)
    # Reference: temperature, then top-k 4, then the smallest set with mass >= 0.95.
    p = torch.softmax(logits / 0.5, -1)
    p[4:] = 0
    p = p / p.sum()
    keep = torch.cumsum(p, 0) - p < 0.95
    want = torch.where(keep, p, 0) / p[keep].sum()
    freq = torch.bincount(picked, minlength=6).double() / rows
    assert freq[~keep].sum() == 0
    np.testing.assert_allclose(freq.numpy(), want.numpy(), atol=0.01)  # ~4 standard errors at 40k draws
    # The recorded log-prob is the raw model's, whatever the warping.
    np.testing.assert_allclose(sampler.logprobs[:, 0].numpy(), torch.log_softmax(logits, -1)[picked].numpy(), rtol=1e-6)


def test_shared_prompt_prefill_changes_nothing(tiny):
    from halludetect.lm.generation import sample_rows
    from halludetect.lm.hf_models import eos_ids

    model, tok = tiny
    prompts = [encode_prompt(tok, q, False) for q in questions(3)["question"] for _ in range(4)]
    keys = [(0, f"q{i // 4}", i % 4, 0) for i in range(12)]
    params = PARAMS.model_copy(update={"max_new_tokens": 10, "stop": []})
    shared, shared_lp, _ = sample_rows(model, tok, prompts, keys, params, eos_ids(model, tok), repeats=4)
    plain, plain_lp, _ = sample_rows(model, tok, prompts, keys, params, eos_ids(model, tok), repeats=1)
    assert [t.token_ids for t in shared] == [t.token_ids for t in plain]
    for a, b in zip(shared_lp, plain_lp):
        np.testing.assert_allclose(a, b, atol=1e-5)


def bookkeeping_questions(n=4):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{i} born?" for i in range(n)],
            "split": ["train", "val", "test", "test"][:n],
        }
    )


def test_generate_bookkeeping(tiny):
    model, tok = tiny
    params = GenerateParams(n_samples=3, max_new_tokens=8, batch_size=3, stop=["\n"])
    df = generate(model, tok, bookkeeping_questions(), params)
    assert df.height == 12
    for r in df.to_dicts():
        assert len(r["token_ids"]) == len(r["token_logprobs"]) == r["n_tokens"]
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True).strip()
        assert tok.eos_token_id not in r["token_ids"] and "\n" not in r["text"]
        assert all(lp <= 0 for lp in r["token_logprobs"])
    again = generate(model, tok, bookkeeping_questions(), params)
    assert again["text"].to_list() == df["text"].to_list()  # same params, same samples


def test_logprobs_are_raw_model_logprobs(tiny):
    model, tok = tiny
    params = GenerateParams(n_samples=1, max_new_tokens=5, stop=[])
    df = generate(model, tok, bookkeeping_questions(1), params, greedy=True)
    r = df.row(0, named=True)
    prompt = encode_prompt(tok, "Where was Tavo Mir0 born?", False)
    ids = torch.tensor([prompt + r["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r["token_ids"])]
    np.testing.assert_allclose(r["token_logprobs"], want, atol=1e-4)


def test_trim_answer_stop_and_eos(tiny):
    _, tok = tiny
    text_ids = tok.encode(" born in Arvella.\nQuestion: next", add_special_tokens=False)
    t = trim_answer(tok, text_ids, ["\n", "Question:"], 64)
    assert t.finish_reason == "stop" and "\n" not in t.text and t.text.startswith("born in")
    assert tok.decode(t.token_ids).strip() == t.text
    eos = trim_answer(tok, [*tok.encode(" yes", add_special_tokens=False), tok.eos_token_id, 5], [], 64)
    assert eos.finish_reason == "eos" and eos.text == "yes"
