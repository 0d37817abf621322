"""Whether a scored answer is one the base model could have written (halludetect/scoring/answer_range.py):
the export keeps the range of the token log-probs of the answers the detector was fit on, `score`
marks each row against it (`in_distribution`, with the reason when it is out) and warns in its
summary, and a bundle exported before the check scores with `in_distribution` null and a note,
never as if it had been checked. Issue 36: a hand-typed wrong answer about a famous person of the
world scored as confidently correct with nothing saying it was out of distribution (the world's
case is measured in docs/scoring.md; a random tiny model knows no fact, so these tests set the
bounds around a row's own figures)."""

import argparse
import json

import numpy as np
import polars as pl
import pytest

from halludetect.lm.token_text import token_pieces
from halludetect.scoring.answer_range import CAN_SCORE, FIT_SPLITS, answer_stats, check, kept_answers
from halludetect.scoring.bundle import load_bundle, save_bundle
from halludetect.scoring.bundle_summary import summary_text
from halludetect.scoring.scorer import score_answers, score_file


def answers_of(contract) -> pl.DataFrame:
    return kept_answers(*(pl.read_parquet(contract / f) for f in ("generations.parquet", "judgments.parquet")))


def rows_of(contract, split: str) -> list[dict]:
    """A split's kept answers as scoring input, with their sampled tokens and log-probs."""
    qs = pl.read_parquet(contract / "questions.parquet").select(question_id="id", question="question")
    kept = pl.read_parquet(contract / "judgments.parquet").filter(pl.col("kept") & (pl.col("split") == split))
    gens = (
        pl.read_parquet(contract / "generations.parquet")
        .join(kept.select("question_id", "sample_index"), on=["question_id", "sample_index"])
        .join(qs, on="question_id")
        .filter(pl.col("n_tokens") > 0)
        .sort("question_id", "sample_index")
    )
    return [
        {
            "id": f"{r['question_id']}/{r['sample_index']}",
            "question": r["question"],
            "answer": r["text"],
            "answer_token_ids": r["token_ids"],
            "token_logprobs": r["token_logprobs"],
        }
        for r in gens.iter_rows(named=True)
    ]


def resaved(bundle_path, out, change):
    """The bundle written again (a valid digest of what it holds), its metadata changed."""
    b = load_bundle(bundle_path)
    meta = json.loads(json.dumps(b.meta))
    change(meta)
    save_bundle(out, {s: d.state_dict() for s, d in b.detectors.items()}, meta)
    return out


def score_one(bundle, row, model_dir, **kw) -> dict:
    keep = ("id", "question", "answer", "answer_token_ids")
    return score_answers(bundle, [{k: row[k] for k in keep}], model=str(model_dir), device="cpu", **kw).row(
        0, named=True
    )


# ------------------------------------------------------------------------------ export
def test_the_export_keeps_the_range_of_the_fit_answers(contract, bundle_path):
    """Every figure recomputed from the generations' log-probs of the kept train and validation
    answers; the share of test answers the rule marks, from the test answers."""
    rng = load_bundle(bundle_path).meta["answer_range"]
    answers = answers_of(contract)
    fit = answers.filter(pl.col("split").is_in(FIT_SPLITS))
    stats = [answer_stats(lp) for lp in fit["token_logprobs"].to_list()]
    assert rng["fit_splits"] == ["train", "val"] and rng["n"] == fit.height > 0
    for stat in ("mean_logprob", "min_logprob", "n_tokens"):
        x = np.asarray([s[stat] for s in stats], dtype=np.float64)
        assert rng["stats"][stat]["min"] == x.min() and rng["stats"][stat]["max"] == x.max()
        assert rng["stats"][stat]["q0.01"] == pytest.approx(np.quantile(x, 0.01))
    assert rng["bounds"] == {
        "mean_logprob": {"low": min(s["mean_logprob"] for s in stats), "high": None},
        "min_logprob": {"low": min(s["min_logprob"] for s in stats), "high": None},
        "n_tokens": {"low": float(min(s["n_tokens"] for s in stats)), "high": float(max(s["n_tokens"] for s in stats))},
    }
    test = answers.filter(pl.col("split") == "test")["token_logprobs"].to_list()
    out = sum(check(answer_stats(lp), rng) is not None for lp in test)
    assert rng["test"] == {"n": len(test), "out": out, "share": out / len(test)}
    text = summary_text(load_bundle(bundle_path))
    assert f"distribution {rng['n']:,} answers (train and val): mean token log-prob from" in text


def test_the_export_stage_keeps_the_range_given_the_generations(contract, tmp_path, caplog):
    from halludetect.config import load_params
    from stages import export

    caplog.set_level("INFO", "halludetect")
    args = argparse.Namespace(
        metrics=contract / "metrics" / "max.json",
        detectors=contract / "detectors" / "max",
        scores=contract / "scores" / "max",
        manifest=contract / "manifest.json",
        out=tmp_path / "with.safetensors",
        generation_metrics=None,
        cluster_metrics=None,
        generations=contract / "generations.parquet",
        judgments=contract / "judgments.parquet",
    )
    params = load_params("params.yaml")
    export.run(args, params)
    rng = load_bundle(args.out).meta["answer_range"]
    assert f"it marks {rng['test']['out']} of {rng['test']['n']} test answers out of distribution" in caplog.text
    # without them: a bundle without the range, and a warning saying what `score` cannot do then
    without = argparse.Namespace(**{**vars(args), "generations": None, "out": tmp_path / "without.safetensors"})
    export.run(without, params)
    assert "answer_range" not in load_bundle(tmp_path / "without.safetensors").meta
    assert "leaves every row's in_distribution null" in caplog.text


# ------------------------------------------------------------------------------ scoring
def test_rows_within_the_range_are_not_marked_and_score_as_before(contract, bundle_path, tiny_model_dir):
    """The test answers, given with their sampled tokens: their log-prob statistics are the
    generations' (teacher-forced here, as sampled there), each is marked exactly as the export's
    count says, and their scores are the early-exit scores to the bit (the whole model runs for the
    logits; the states at the layer are the same)."""
    rows = rows_of(contract, "test")
    rng = load_bundle(bundle_path).meta["answer_range"]
    keep = ("id", "question", "answer", "answer_token_ids")
    df = score_answers(bundle_path, [{k: r[k] for k in keep} for r in rows], model=str(tiny_model_dir), device="cpu")
    sampled = [answer_stats(r["token_logprobs"]) for r in rows]
    np.testing.assert_allclose(df["mean_logprob"].to_numpy(), [s["mean_logprob"] for s in sampled], atol=1e-5)
    np.testing.assert_allclose(df["min_logprob"].to_numpy(), [s["min_logprob"] for s in sampled], atol=1e-5)
    inside = df["in_distribution"].to_list()
    assert inside == [check(s, rng) is None for s in sampled] and inside.count(False) == rng["test"]["out"]
    # each of three statistics falls past the extreme of n fit answers with chance about 1 / (n + 1)
    assert inside.count(True) >= 0.75 * len(rows)
    assert [r is None for r in df["ood_reason"].to_list()] == inside
    early = score_answers(
        bundle_path,
        [{k: r[k] for k in keep} for r in rows],
        model=str(tiny_model_dir),
        device="cpu",
        check_distribution=False,
    )
    np.testing.assert_array_equal(df["score"].to_numpy(), early["score"].to_numpy())
    assert early["in_distribution"].null_count() == early["mean_logprob"].null_count() == len(rows)


def test_a_row_outside_the_range_is_marked_with_its_reason(contract, bundle_path, tiny_model_dir, tmp_path, tiny):
    """Bounds set around one answer's own figures: its lowest token log-prob below the fit answers'
    lowest, its mean too, then its length above theirs; each reason names the statistic, its value,
    the token, and the range. The summary counts the row and the log warns."""
    _, tok = tiny
    row = rows_of(contract, "test")[0]
    first = score_one(bundle_path, row, tiny_model_dir)
    stats = answer_stats(row["token_logprobs"])
    assert first["min_logprob"] == pytest.approx(stats["min_logprob"], abs=1e-5)
    piece = json.dumps(token_pieces(tok, row["answer_token_ids"])[stats["argmin"]], ensure_ascii=False)

    def bounds(mean=None, low=None, high=None):
        def change(meta):
            rng = meta["answer_range"]
            b, s = rng["bounds"], rng["stats"]
            b["min_logprob"]["low"] = s["min_logprob"]["min"] = low if low is not None else -1e9
            b["mean_logprob"]["low"] = s["mean_logprob"]["min"] = mean if mean is not None else -1e9
            b["n_tokens"]["high"] = s["n_tokens"]["max"] = high if high is not None else 1e9
            b["n_tokens"]["low"] = s["n_tokens"]["min"] = 1.0

        return change

    rng = load_bundle(bundle_path).meta["answer_range"]
    n, top = rng["n"], rng["stats"]["min_logprob"]["max"]
    low = first["min_logprob"] + 0.5
    out = score_one(resaved(bundle_path, tmp_path / "a.safetensors", bounds(low=low)), row, tiny_model_dir)
    assert out["in_distribution"] is False and out["score"] == first["score"]
    assert out["ood_reason"] == (
        f"min_logprob {first['min_logprob']:.3f} (token {piece}, {stats['argmin'] + 1} of "
        f"{len(row['answer_token_ids'])}) is below the lowest of the {n:,} answers the detector was fit on "
        f"({low:.3f}; their range [{low:.3f}, {top:.3f}])"
    )
    both = resaved(bundle_path, tmp_path / "b.safetensors", bounds(mean=first["mean_logprob"] + 0.1, low=low))
    reason = score_one(both, row, tiny_model_dir)["ood_reason"]
    assert reason.startswith(f"mean_logprob {first['mean_logprob']:.3f} is below the lowest")
    assert "; min_logprob" in reason
    short = resaved(bundle_path, tmp_path / "c.safetensors", bounds(high=first["n_tokens"] - 1))
    assert score_one(short, row, tiny_model_dir)["ood_reason"].startswith(
        f"n_tokens {first['n_tokens']} is above the highest of the {n:,} answers the detector was fit on "
        f"({first['n_tokens'] - 1}; their range [1, {first['n_tokens'] - 1}])"
    )
    # just inside every bound: in distribution
    inside = resaved(
        bundle_path,
        tmp_path / "d.safetensors",
        bounds(mean=first["mean_logprob"] - 1e-3, low=first["min_logprob"] - 1e-3, high=first["n_tokens"]),
    )
    assert score_one(inside, row, tiny_model_dir)["in_distribution"] is True
    # the file's summary counts it, warns, and says what a detector can score
    src = tmp_path / "rows.jsonl"
    keep = ("id", "question", "answer", "answer_token_ids")
    src.write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows_of(contract, "test")[:3]))
    logs = []
    summary = score_file(
        tmp_path / "a.safetensors",
        src,
        tmp_path / "out.jsonl",
        str(tiny_model_dir),
        device="cpu",
        progress=False,
        log=logs.append,
    )
    marked = pl.read_ndjson(tmp_path / "out.jsonl")["in_distribution"].to_list().count(False)
    assert marked >= 1 and summary["in_distribution"]["out_of_distribution"] == marked
    assert summary["in_distribution"]["checked"] and summary["can_score"] == CAN_SCORE
    warning = f"warning: {marked} of 3 scored row(s) are out of the detector's distribution"
    assert any(m.startswith(warning) for m in logs)
    assert logs[-1].endswith(f"out of distribution: {marked}")


def test_an_old_bundle_scores_with_in_distribution_null_and_a_note(
    contract, bundle_path, tiny_model_dir, tmp_path, monkeypatch
):
    """A bundle exported before the check: every row scores, in_distribution and the log-prob
    columns are null, and the log and the summary say the bundle predates the check (the model
    runs with early exit: no LM head is loaded for figures nobody compares)."""
    from halludetect.scoring import scorer as scoring

    old = resaved(bundle_path, tmp_path / "old.safetensors", lambda meta: meta.pop("answer_range"))

    def refuse(*a, **k):
        raise AssertionError("the whole model was loaded for a bundle without a range")

    monkeypatch.setattr(scoring, "load_model", refuse)
    src = tmp_path / "rows.jsonl"
    keep = ("id", "question", "answer", "answer_token_ids")
    rows = rows_of(contract, "test")[:4]
    src.write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows))
    logs = []
    summary = score_file(
        old, src, tmp_path / "out.parquet", str(tiny_model_dir), device="cpu", progress=False, log=logs.append
    )
    df = pl.read_parquet(tmp_path / "out.parquet")
    assert df["score"].null_count() == 0
    for col in ("in_distribution", "ood_reason", "mean_logprob", "min_logprob"):
        assert df[col].null_count() == len(rows), col
    note = summary["in_distribution"]["note"]
    assert summary["in_distribution"] == {"checked": False, "out_of_distribution": None, "rule": None, "note": note}
    assert f"{old} predates the distribution check" in note and "Re-export it" in note
    assert f"note: {note}" in logs and logs[-1].endswith("out of distribution: not checked")
    assert "distribution not recorded: this bundle predates the check" in summary_text(load_bundle(old))


def test_score_help_says_what_a_detector_can_score():
    from halludetect.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["score"]
    text = " ".join(sub.format_help().split())
    assert "A detector can score answers the base model could have sampled for the bundle's prompt" in text
    assert "--no-distribution-check" in text
