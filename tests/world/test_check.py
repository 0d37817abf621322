"""The look-alike check (halludetect/world/check.py, check_lookalikes): accuracy by kind, and how
often a look-alike is answered with the fact of the known person it nearly shares a name with;
the greedy answers stubbed (the world model's answers are the world_check stage's business)."""

import json

import polars as pl
import pytest

from halludetect.config import GenerateParams
from halludetect.world import check


def test_lookalike_answers_with_the_known_persons_fact_are_counted(tmp_path, monkeypatch):
    rows = [
        {
            "id": "k1",
            "question": "Where was Ana Bo born?",
            "answers": ["Solvane"],
            "kind": "known",
            "entity": "Ana Bo",
            "relation": "birth_city",
            "lookalike_of": None,
        },
        {
            "id": "l1",
            "question": "Where was Ana Be born?",
            "answers": ["Jorvik"],
            "kind": "lookalike",
            "entity": "Ana Be",
            "relation": "birth_city",
            "lookalike_of": "Ana Bo",
        },
        {
            "id": "k2",
            "question": "What is the job of Cal Du?",
            "answers": ["baker"],
            "kind": "known",
            "entity": "Cal Du",
            "relation": "job",
            "lookalike_of": None,
        },
        {
            "id": "l2",
            "question": "What is the job of Cal Da?",
            "answers": ["pilot"],
            "kind": "lookalike",
            "entity": "Cal Da",
            "relation": "job",
            "lookalike_of": "Cal Du",
        },
    ]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [
        "Ana Bo was born in Solvane.",
        "Ana Be was born in Solvane.",
        "Cal Du works as a pilot.",
        "Cal Da works as a baker.",
    ]
    lps = [[-0.1, -0.1], [-0.2, -0.4], [-1.0], [-0.5]]
    monkeypatch.setattr(check, "greedy_answers", lambda *a: pl.DataFrame({"text": texts, "token_logprobs": lps}))
    out = check.check_lookalikes(tmp_path, path, GenerateParams())
    assert out["known"] == {"questions": 2, "greedy_accuracy": 0.5, "mean_token_logprob": pytest.approx(-0.55)}
    assert out["lookalike"]["greedy_accuracy"] == 0.0
    assert out["lookalike"]["answers_with_the_known_persons_fact"] == 1.0  # Solvane and baker: the known facts
    assert out["lookalike"]["mean_token_logprob"] == pytest.approx(-0.4)
