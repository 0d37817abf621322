"""The dump's log-prob check (halludetect/activations/logprob_check.py) through the dump itself, on the
tiny Llama: the hf sampler's own answers pass (the teacher-forced log-probs equal the recorded ones
within float noise); answers whose log-probs came from another model, a processed distribution, or
one bad replica among several fail the dump, naming the model and the largest difference, before
any layer file is kept; a non-finite log-prob fails it too."""

import numpy as np
import polars as pl
import pytest
import torch

from halludetect.activations.capture import dump
from halludetect.activations.logprob_check import LogprobCheck, LogprobMismatch, teacher_forced_logprobs
from halludetect.config import GenerateParams, LogprobCheckParams
from halludetect.core.atomic_io import atomic_path
from halludetect.lm.generation import generate
from halludetect.lm.model_inputs import encode_prompt

DEFAULTS = LogprobCheckParams()


def questions(n=8):
    return pl.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"Where was Tavo Mir{i} born?" for i in range(n)],
            "split": ["train", "val", "test", "test"] * (n // 4),
        }
    )


@pytest.fixture(scope="module")
def answers(tiny):
    model, tok = tiny
    df = generate(model, tok, questions(), GenerateParams(n_samples=2, max_new_tokens=8, stop=["\n"], temperature=1.0))
    return df.filter(pl.col("n_tokens") > 0)


def check(**tolerances) -> LogprobCheck:
    t = DEFAULTS.model_dump() | tolerances
    return LogprobCheck("models.tiny (tests/tiny)", t["mean_tolerance"], t["answer_tolerance"], t["answer_share"])


def run_dump(tiny, gens, tmp_path, c):
    model, tok = tiny
    logs = []
    with atomic_path(tmp_path / "acts", is_dir=True) as tmp:
        dump(model, tok, questions(), gens, tmp, [1], positions="generated", dtype="float32", batch_size=4,
             attrs={}, check=c, log=logs.append)  # fmt: skip
    return logs


def test_the_samplers_own_answers_pass_within_float_noise(tiny, answers, tmp_path):
    c = check()
    logs = run_dump(tiny, answers, tmp_path, c)
    assert c.tokens == answers["n_tokens"].sum() and c.worst[0] < 1e-4  # every answer token, float32 noise
    assert any(line.startswith("log-prob check passed: mean |difference|") for line in logs)
    assert (tmp_path / "acts").is_dir()


@pytest.mark.hostile
def test_log_probs_of_another_model_fail_the_dump_naming_the_model_and_the_largest_difference(tiny, answers, tmp_path):
    """Another model's numbers for the same tokens: the tiny model with every weight perturbed (another revision)."""
    model, tok = tiny
    other = type(model)(model.config)
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std())
    recorded = []
    for r in answers.to_dicts():
        prompt = encode_prompt(tok, questions()["question"][int(r["question_id"][1:])], False)
        with torch.no_grad():
            logits = other(torch.tensor([prompt + r["token_ids"]])).logits
        n = len(r["token_ids"])
        rows, cols = torch.zeros(n, dtype=torch.long), torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
        recorded.append(teacher_forced_logprobs(logits, rows, cols, torch.tensor(r["token_ids"])).tolist())
    wrong = answers.with_columns(pl.Series("token_logprobs", recorded, dtype=pl.List(pl.Float64)))
    with pytest.raises(LogprobMismatch) as e:
        run_dump(tiny, wrong, tmp_path, check())
    msg = str(e.value)
    assert msg.startswith("the generations' log-probs are not those of models.tiny (tests/tiny): ")
    assert "The largest difference: answer 'q" in msg and "recomputed from the weights" in msg
    assert "--logprobs-mode raw_logprobs" in msg and "dump.logprob_check" in msg
    assert not (tmp_path / "acts").exists()  # nothing kept


@pytest.mark.hostile
def test_a_share_of_bad_answers_fails_on_the_answer_tolerance(tiny, answers, tmp_path):
    """A replica of several serving another model spoils a share of the answers only: the answers' own
    means catch what the mean over the file could dilute; a share under `answer_share` (a bf16
    engine's outliers) passes."""
    shifted = answers["token_logprobs"].to_list()
    shifted[3] = [x - 2.0 for x in shifted[3]]  # one answer, 2 nats a token off
    wrong = answers.with_columns(pl.Series("token_logprobs", shifted, dtype=pl.List(pl.Float64)))
    rid = f"{answers['question_id'][3]}/{answers['sample_index'][3]}"
    n = answers.height
    with pytest.raises(
        LogprobMismatch,
        match=rf"1 of {n} answers differ by more than dump.logprob_check.answer_tolerance = 0.5 nats a token on "
        rf"average \(at most answer_share = 0.01 of them may\); the worst, '{rid}', by 2",
    ):
        run_dump(tiny, wrong, tmp_path, check(mean_tolerance=None))
    assert 1 / n < 0.1
    run_dump(tiny, wrong, tmp_path, check(mean_tolerance=None, answer_share=0.1))  # within the share: it passes


@pytest.mark.hostile
def test_a_non_finite_recorded_log_prob_fails_the_dump(tiny, answers, tmp_path):
    bad = answers["token_logprobs"].to_list()
    bad[0] = [float("nan")] + bad[0][1:]
    wrong = answers.with_columns(pl.Series("token_logprobs", bad, dtype=pl.List(pl.Float64)))
    with pytest.raises(LogprobMismatch, match="a log-prob that is not a finite number"):
        run_dump(tiny, wrong, tmp_path, check())


def test_the_mean_waits_for_enough_tokens_then_judges_every_batch():
    c = check(mean_tolerance=0.1, answer_tolerance=None)
    c.add(np.zeros(10), np.full(10, -0.5), np.array([5, 5]), ["a/0", "a/1"])  # 10 tokens off by 0.5: too few
    with pytest.raises(LogprobMismatch, match=r"mean \|difference\| over 10 tokens is 0.5 nats"):
        c.finish()
    c = check(mean_tolerance=0.1, answer_tolerance=None)
    with pytest.raises(LogprobMismatch, match=r"over 600 tokens is 0.5"):
        c.add(np.zeros(600), np.full(600, -0.5), np.array([300, 300]), ["a/0", "a/1"])
