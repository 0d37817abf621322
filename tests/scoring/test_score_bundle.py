"""Score bundles (halludetect/scoring/score_bundle.py): a score with nothing to train exported with
thresholds and calibration chosen on validation as a detector's are, loaded back (damage named),
and scored by `halludetect score`: p_sem from the rows alone, length with the tokenizer, logprob
with the model teacher forced (checked against a direct computation); the scores that read the
question's other answers refused before anything loads; and the hostile cases (a p_sem outside
[0, 1], no p_sem column, options a score bundle cannot honour)."""

import json

import numpy as np
import polars as pl
import pytest
import torch
from support import write_jsonl

from halludetect.config import ExportParams, ModelPreset
from halludetect.core.errors import UserError
from halludetect.evaluation.thresholds import choose_thresholds, fit_platt
from halludetect.lm.model_inputs import encode_prompt
from halludetect.lm.model_manifest import dir_fingerprint
from halludetect.prompts import GENERATION
from halludetect.scoring.answer_files import InputError
from halludetect.scoring.bundle import BundleError, load_bundle
from halludetect.scoring.bundle_summary import summary_text
from halludetect.scoring.score_bundle import ScoreBundle, export_score_bundle
from halludetect.scoring.scorer import OptionError, ScoreBundleScorer, score_answers, score_file

EXPORT = ExportParams()  # fpr_0.05 by default, targets 0.01, 0.05, 0.1
QUESTIONS = ["Where was Sergi Poboum born?", "What is the job of Ana Lita?"]


@pytest.fixture(scope="module")
def manifest(tiny_model_dir):
    """The model manifest of the tiny local model, as stages.manifest writes it."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    return {
        "name": "tiny",
        "preset": ModelPreset(path=str(tiny_model_dir), dtype="float32").model_dump(),
        "num_hidden_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "files": dir_fingerprint(tiny_model_dir),
    }


def answers_table(scale: float = 1.0, n: int = 60, seed: int = 0) -> pl.DataFrame:
    """val and test answers whose scores rise with the label, plus one unscored (null) and one NaN row."""
    rng = np.random.default_rng(seed)
    rows = []
    for split in ("val", "test"):
        for i in range(n):
            label = int(i % 3 == 0)
            score = scale * (rng.normal() + 1.5 * label)
            rows.append(
                {
                    "response_id": f"{split}q{i // 5}/{i % 5}",
                    "question_id": f"{split}q{i // 5}",
                    "sample_index": i % 5,
                    "split": split,
                    "label": label,
                    "score": score,
                }
            )
        rows.append({**rows[-1], "response_id": f"{split}-null", "score": None})
        rows.append({**rows[-1], "response_id": f"{split}-nan", "score": float("nan")})
    return pl.DataFrame(rows)


def export(out, manifest, score: str, answers: pl.DataFrame | None = None, **kw) -> dict:
    params = {"p_sem": {"variant": "count"}}.get(score, {})
    return export_score_bundle(
        out,
        score=score,
        params=params,
        answers=answers_table() if answers is None else answers,
        manifest=manifest,
        export=EXPORT,
        model="tiny",
        dataset="mini",
        generation={"samples_per_question": 5, "equivalence": "EE-EN-NE", "backend": "deberta"},
        **kw,
    )


def of_split(answers: pl.DataFrame, split: str) -> tuple[np.ndarray, np.ndarray]:
    ok = answers.filter((pl.col("split") == split) & pl.col("score").is_not_nan()).drop_nulls("score")
    ok = ok.sort("response_id")
    return ok["label"].to_numpy(), ok["score"].to_numpy()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, manifest):
    """One bundle per score the tests score or refuse; the p_sem one's scores are in [0, 1]."""
    root = tmp_path_factory.mktemp("score_bundles")
    out = {}
    for score, scale in (("p_sem", 0.2), ("length", 3.0), ("logprob", 1.0), ("semantic_entropy", 1.0), ("p_true", 1.0)):
        out[score] = root / f"{score}.safetensors"
        answers = answers_table(scale)
        if score == "p_sem":
            answers = answers.with_columns(pl.col("score").clip(0, 1))
        if score == "length":  # token counts: whole numbers from 1
            answers = answers.with_columns((pl.col("score").abs().round() + 1).fill_nan(None))
        export(out[score], manifest, score, answers)
    return out


# ------------------------------------------------------------------------------ export and load
def test_export_then_load_round_trip(tmp_path, manifest):
    answers = answers_table()
    summary = export(tmp_path / "lp.safetensors", manifest, "logprob", answers)
    b = load_bundle(tmp_path / "lp.safetensors")
    assert isinstance(b, ScoreBundle) and b.method == "logprob" and b.reads == "model" and not b.warnings
    meta = b.meta
    assert (meta["format"], meta["format_version"], meta["kind"]) == ("halludetect-score-bundle", 1, "score")
    assert meta["score"] == {
        "name": "logprob",
        "display": "Mean token log-prob",
        "needs": ["token log-probs"],
        "source": "answers",
        "family": "field",
    }
    assert (meta["model"], meta["dataset"], meta["base_model"]["name"]) == ("tiny", "mini", "tiny")
    assert meta["base_model"]["files"] == manifest["files"] and meta["inputs"]["prompt_template"] == GENERATION
    assert meta["generation"]["samples_per_question"] == 5
    # the unscored rows (a null and a NaN score per split) are left out and counted
    assert meta["evaluation"]["unscored"] == {"val": 2, "test": 2}
    y_val, z_val = of_split(answers, "val")
    y_test, z_test = of_split(answers, "test")
    assert meta["evaluation"]["n_val"] == len(y_val) == 60 and meta["evaluation"]["n_val_hallucinated"] == y_val.sum()
    # thresholds and calibration: evaluation/thresholds.py's on the same validation (and test) scores
    assert meta["thresholds"] == choose_thresholds(y_val, z_val, EXPORT.fpr_targets, (y_test, z_test))
    assert meta["default_threshold"] == EXPORT.threshold == summary["default_threshold"]
    assert meta["calibration"] == fit_platt(y_val, z_val) == summary["calibration"]
    assert summary["threshold"] == meta["thresholds"]["fpr_0.05"]
    assert (meta["score_range"]["min"], meta["score_range"]["max"]) == (z_val.min(), z_val.max())
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "lp.safetensors")
    np.testing.assert_array_equal(tensors["val_score"].numpy(), z_val)
    np.testing.assert_array_equal(tensors["val_label"].numpy(), y_val)
    # the same inputs write the same bytes
    export(tmp_path / "again.safetensors", manifest, "logprob", answers)
    assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / "lp.safetensors").read_bytes()


def test_export_refuses_what_cannot_make_a_bundle(tmp_path, manifest):
    from halludetect.core.errors import DataError
    from halludetect.core.lookup import UnknownName

    with pytest.raises(UnknownName, match="unknown score 'lenght'.*length"):
        export(tmp_path / "x.safetensors", manifest, "lenght")
    one_class = answers_table().with_columns(pl.lit(0).alias("label"))
    with pytest.raises(DataError, match="every val answer is correct"):
        export(tmp_path / "x.safetensors", manifest, "length", one_class)
    with pytest.raises(DataError, match="lack column"):
        export(tmp_path / "x.safetensors", manifest, "length", answers_table().drop("label"))
    with pytest.raises(DataError, match="split"):
        export(tmp_path / "x.safetensors", manifest, "length", answers_table().with_columns(split=pl.lit("train")))
    assert not (tmp_path / "x.safetensors").exists()


def _rewrite(src, dst, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        meta = json.loads(f.metadata()["bundle"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    raw = edit(meta)
    save_file(tensors, str(dst), metadata={"bundle": raw if isinstance(raw, str) else json.dumps(raw)})
    return dst


def test_a_damaged_score_bundle_is_named(bundles, tmp_path):
    src = bundles["length"]
    bad_types = _rewrite(
        src, tmp_path / "types.safetensors", lambda m: {**m, "calibration": {**m["calibration"], "a": "1"}}
    )
    with pytest.raises(BundleError, match=r"types.safetensors: bundle metadata 'calibration.a': input should be"):
        load_bundle(bad_types)
    # a value changed within its type: the digest names it
    flipped = _rewrite(src, tmp_path / "flipped.safetensors", lambda m: {**m, "dataset": "other"})
    with pytest.raises(BundleError, match=r"flipped.safetensors: its metadata does not match the digest"):
        load_bundle(flipped)
    not_json = _rewrite(src, tmp_path / "json.safetensors", lambda m: json.dumps(m)[:-5])
    with pytest.raises(BundleError, match=r"json.safetensors: the bundle metadata is not valid JSON"):
        load_bundle(not_json)
    newer = _rewrite(src, tmp_path / "v2.safetensors", lambda m: {**m, "format_version": 2})
    with pytest.raises(BundleError, match=r"v2.safetensors: format 'halludetect-score-bundle' version 2"):
        load_bundle(newer)
    missing = _rewrite(src, tmp_path / "missing.safetensors", lambda m: {k: v for k, v in m.items() if k != "score"})
    with pytest.raises(BundleError, match=r"missing.safetensors: bundle metadata 'score': field required"):
        load_bundle(missing)


# ------------------------------------------------------------------------------ scoring
def test_p_sem_is_scored_from_the_rows_alone(bundles, tmp_path, no_loading, monkeypatch):
    monkeypatch.setattr("halludetect.scoring.scorer.load_tokenizer", lambda *a: pytest.fail("a tokenizer loaded"))
    b = load_bundle(bundles["p_sem"])
    rows = [
        {"id": i, "question": QUESTIONS[i % 2], "answer": "Calomar.", "p_sem": p} for i, p in enumerate((0.0, 0.4, 1.0))
    ]
    rows.append({"id": 3, "question": QUESTIONS[0], "answer": "Calomar."})  # no p_sem: not scored
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = score_file(bundles["p_sem"], src, tmp_path / "out.parquet", progress=False, log=lambda *_: None)
    df = pl.read_parquet(tmp_path / "out.parquet")
    z = np.array([1.0, 0.6, 0.0])
    np.testing.assert_allclose(df["score"].to_numpy()[:3], z)
    np.testing.assert_allclose(df["probability"].to_numpy()[:3], b.probability(z))
    assert df["flag"].to_list()[:3] == (z >= b.threshold()[1]).tolist()
    assert df["reason"].to_list() == [None, None, None, "no_p_sem"] and df["n_tokens"].null_count() == 4
    assert summary["kind"] == "score" and summary["method"] == "p_sem" and summary["model"] is None
    assert summary["can_score"].startswith("answers given one at a time")
    assert summary["scored"] == 3 and summary["not_scored"] == {"no_p_sem": 1}
    # the same output schema as a detector's (no seeds, no evidence)
    assert df.columns[:5] == ["row", "id", "n_tokens", "score", "probability"]
    # a threshold by name or by value on the score's scale
    named = score_answers(bundles["p_sem"], rows[:3], threshold="best_f1", log=lambda *_: None)
    assert named["flag"].to_list() == (z >= b.meta["thresholds"]["best_f1"]["threshold"]).tolist()
    assert score_answers(bundles["p_sem"], rows[:3], threshold=0.5, log=lambda *_: None)["flag"].to_list() == [
        True,
        True,
        False,
    ]
    # in_distribution: within the validation scores' range
    rng = b.meta["score_range"]
    inside = [(z_, rng["min"] <= z_ <= rng["max"]) for z_ in z]
    assert df["in_distribution"].to_list()[:3] == [ok for _, ok in inside]


def test_length_counts_the_answer_tokens_of_the_tokenizer(bundles, tiny, tiny_model_dir, no_loading):
    _, tok = tiny
    rows = [
        {"question": QUESTIONS[0], "answer": "Sergi Poboum was born in Calomar."},
        {"question": QUESTIONS[1], "answer": "  a baker  "},
        {"question": QUESTIONS[1], "answer": "a baker", "answer_token_ids": [5, 6, 7, 8]},  # as sampled
        {"question": QUESTIONS[1], "answer": "   "},
    ]
    df = score_answers(bundles["length"], rows, log=lambda *_: None, device="cpu")
    want = [len(tok(" " + r["answer"].strip(), add_special_tokens=False)["input_ids"]) for r in rows[:2]] + [4]
    assert df["score"].to_list()[:3] == [float(n) for n in want] and df["n_tokens"].to_list()[:3] == want
    assert df["reason"].to_list() == [None, None, None, "empty_answer"]
    assert df["mean_logprob"].null_count() == 4  # no model ran


def test_logprob_is_minus_the_mean_teacher_forced_log_prob(bundles, tiny, tiny_model_dir):
    model, tok = tiny
    rows = [
        {"question": QUESTIONS[0], "answer": "Sergi Poboum was born in Calomar."},
        {"question": QUESTIONS[1], "answer": "a baker"},
        {"question": QUESTIONS[1], "answer": "a"},
    ]
    df = score_answers(bundles["logprob"], rows, model=str(tiny_model_dir), batch_size=2, log=lambda *_: None)
    for r, got, lowest in zip(rows, df["score"].to_list(), df["min_logprob"].to_list()):
        prompt = encode_prompt(tok, r["question"], False, GENERATION)
        answer = tok(" " + r["answer"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].double()  # [W, V]
        lp = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1), answer]
        assert got == pytest.approx(-lp.mean().item(), abs=1e-5)
        assert lowest == pytest.approx(lp.min().item(), abs=1e-5)
    b = load_bundle(bundles["logprob"])
    np.testing.assert_allclose(df["probability"].to_numpy(), b.probability(df["score"].to_numpy()))
    # a model already loaded gives the same rows
    given = score_answers(bundles["logprob"], rows, model, tokenizer=tok, log=lambda *_: None)
    np.testing.assert_allclose(given["score"].to_numpy(), df["score"].to_numpy(), rtol=1e-6)


@pytest.mark.parametrize("score", ["semantic_entropy", "p_true"])
def test_scores_that_read_the_other_answers_are_refused(bundles, score, tmp_path, no_loading):
    src = write_jsonl(tmp_path / "in.jsonl", [{"question": QUESTIONS[0], "answer": "Calomar."}])
    needs = {"semantic_entropy": "semantic clustering", "p_true": "one more forward pass"}[score]
    with pytest.raises(UserError, match=rf"{score}.safetensors is a score bundle of '{score}' .*{needs}.*one answer"):
        score_file(bundles[score], src, tmp_path / "out.parquet", progress=False, log=lambda *_: None)
    assert not (tmp_path / "out.parquet").exists()


def test_options_a_score_bundle_cannot_honour_are_refused(bundles, tiny_model_dir, no_loading):
    from halludetect.config import GenerateParams

    for option, value in (
        ("explain", True),
        ("per_seed", True),
        ("positions", "predicting"),
        ("generate", GenerateParams()),
    ):
        with pytest.raises(OptionError, match=f"reads no hidden states.*drop --{option.replace('_', '-')}"):
            ScoreBundleScorer(bundles["length"], **{option: value}, log=lambda *_: None)
    with pytest.raises(OptionError, match="runs no model; drop --model"):
        ScoreBundleScorer(bundles["p_sem"], str(tiny_model_dir), log=lambda *_: None)


def test_serve_refuses_a_score_bundle(bundles):
    from halludetect.scoring.serve import serve

    with pytest.raises(UserError, match="length.safetensors is a score bundle of 'length'.*halludetect score"):
        serve(bundles["length"], log=lambda *_: None)


# ------------------------------------------------------------------------------ hostile cases
@pytest.mark.hostile
def test_p_sem_outside_zero_one_is_named(bundles, tmp_path):
    rows = [
        {"question": QUESTIONS[0], "answer": "Calomar.", "p_sem": 0.5},
        {"question": QUESTIONS[0], "answer": "x", "p_sem": 1.5},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(InputError, match=r"in.jsonl, line 2: 'p_sem' must be a number in \[0, 1\] or null, got 1.5"):
        score_file(bundles["p_sem"], src, tmp_path / "out.parquet", progress=False, log=lambda *_: None)


@pytest.mark.hostile
def test_no_p_sem_column_is_named(bundles, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"question": QUESTIONS[0], "answer": "Calomar."}])
    with pytest.raises(
        UserError, match=r"p_sem.safetensors is a score bundle of 'p_sem'.*in.jsonl has no p_sem values.*'count'"
    ):
        score_file(bundles["p_sem"], src, tmp_path / "out.parquet", progress=False, log=lambda *_: None)


# ------------------------------------------------------------------------------ show
def test_show_summarises_a_score_bundle(bundles):
    text = summary_text(load_bundle(bundles["p_sem"]))
    assert "score bundle" in text and "p_sem (P_sem)" in text and "1 - p_sem" in text
    assert "P_sem variant 'count'" in text and "K = 5 answers per question" in text
    assert "flag = score >= threshold; --threshold NAME (or a score) picks another" in text
    refused = summary_text(load_bundle(bundles["p_true"]))
    assert "cannot compute it" in refused
