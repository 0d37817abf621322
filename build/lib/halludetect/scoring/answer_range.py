"""Is an answer one the detector's base model could have written? Its own token log-probs against
the range of the answers the detector was fit on.

A detector reads the states of the base model's own answers: it was trained on answers the model
sampled for the bundle's prompt. Text written elsewhere (typed by hand, another model's, edited)
runs through the model all the same and gets a score, but the model did not choose its tokens, and
its states are not the kind the detector learnt from. The model itself says how unlikely such text
is: an answer it would not have written holds tokens it gives a far lower probability than any
token of its sampled answers (a known person's wrong city, which it would never sample).

At export (`answer_range`), the answers the bundle was fit on (the train split's, on which the
detector's weights were trained, and validation's, which chose its layer, thresholds and
calibration: the kept, labelled answers of both) give three statistics each, from their token
log-probs as sampled (the generations table's `token_logprobs`, log-softmax of the raw logits):

    mean_logprob   the mean of the answer's token log-probs
    min_logprob    its lowest token log-prob (the least likely token)
    n_tokens       its length in tokens

The bundle keeps each statistic's minimum, maximum and quantiles (`QUANTILES`), and the bounds of
the rule (`RULE`): a row is out of distribution when its mean or its lowest token log-prob is
below the lowest of the fit answers', or its length is outside theirs. Higher log-probs than any
fit answer's are not out of distribution (the model would write such an answer all the more).
The rule's false alarms are measured at export on the test split, which chose nothing, and kept
with the range (`test`). For an answer drawn like the fit answers, the chance that one statistic
falls below the lowest of n of them is 1 / (n + 1).

`halludetect score` computes the same statistics from the logits of its own pass over the row
(`scorer.py`), and `check` gives the reason a row is out of distribution, naming the statistic,
its value and the range, or None.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from halludetect.core.errors import DataError

if TYPE_CHECKING:  # polars is imported where a table is read: `halludetect score --help` quotes CAN_SCORE
    import polars as pl

STATS = ("mean_logprob", "min_logprob", "n_tokens")
QUANTILES = (0.005, 0.01, 0.5, 0.99, 0.995)
FIT_SPLITS = ("train", "val")
RULE = (
    "out of distribution when the answer's mean or lowest token log-prob under the base model is below "
    "the lowest of the answers the detector was fit on (train and validation), or its length in tokens "
    "is outside theirs"
)
# What a detector can score: `halludetect score --help`, its summary, `show` and docs/scoring.md say it.
CAN_SCORE = (
    "answers the base model could have sampled for the bundle's prompt: its own answers "
    "(--generate, or a generations table's with answer_token_ids). Text written elsewhere (typed by "
    "hand, another model's, edited) is out of its distribution, and its score says little about "
    "whether it is true; each row's in_distribution is false where the answer's token log-probs under "
    "the base model fall outside the range of the answers the detector was fit on"
)


def answer_stats(logprobs: Sequence[float]) -> dict:
    """The statistics of one answer's token log-probs (at least one token), and where its least
    likely token is (`argmin`, 0-based)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    if lp.size == 0 or not np.isfinite(lp).all():
        raise ValueError(f"an answer's token log-probs must be finite and at least one: got {lp.tolist()}")
    return {
        "mean_logprob": float(lp.mean()),
        "min_logprob": float(lp.min()),
        "n_tokens": int(lp.size),
        "argmin": int(lp.argmin()),
    }


def kept_answers(generations: pl.DataFrame, judgments: pl.DataFrame, source: str = "generations") -> pl.DataFrame:
    """The kept (labelled) answers with tokens, as the detectors read them: split and token_logprobs."""
    import polars as pl

    need = {"question_id", "sample_index", "token_logprobs"}
    if missing := sorted(need - set(generations.columns)):
        raise DataError(f"{source}: no column(s) {', '.join(missing)}: not a generations table; re-run generate")
    kept = judgments.filter(pl.col("kept")).select("question_id", "sample_index", "split")
    answers = kept.join(
        generations.select("question_id", "sample_index", "token_logprobs"),
        on=["question_id", "sample_index"],
        how="left",
    )
    lost = answers.filter(pl.col("token_logprobs").is_null())
    if lost.height:
        eg = ", ".join(f"{r['question_id']}/{r['sample_index']}" for r in lost.head(3).iter_rows(named=True))
        raise DataError(
            f"{source}: {lost.height} judged answer(s) are not in the generations table (e.g. {eg}): "
            "labels and generations disagree; re-run generate and judge"
        )
    return answers.filter(pl.col("token_logprobs").list.len() > 0)


def _stats_table(answers: pl.DataFrame) -> dict[str, np.ndarray]:
    rows = [answer_stats(lp) for lp in answers["token_logprobs"].to_list()]
    return {s: np.asarray([r[s] for r in rows], dtype=np.float64) for s in STATS}


def _describe(x: np.ndarray) -> dict:
    q = np.quantile(x, QUANTILES)
    return {"min": float(x.min()), "max": float(x.max()), **{f"q{p:g}": float(v) for p, v in zip(QUANTILES, q)}}


def answer_range(answers: pl.DataFrame) -> dict:
    """The bundle's `answer_range`: from the kept answers of every split (`kept_answers`), the
    statistics of the fit splits' and the rule's bounds, and the share of test answers the rule
    marks (measured for the reader; test chooses nothing)."""
    import polars as pl

    fit = answers.filter(pl.col("split").is_in(FIT_SPLITS))
    if fit.height == 0:
        raise DataError("no kept train or validation answer with tokens: the answers' range needs some")
    stats = _stats_table(fit)
    rng = {
        "fit_splits": list(FIT_SPLITS),
        "n": fit.height,
        "rule": RULE,
        "stats": {s: _describe(stats[s]) for s in STATS},
        "bounds": {
            "mean_logprob": {"low": float(stats["mean_logprob"].min()), "high": None},
            "min_logprob": {"low": float(stats["min_logprob"].min()), "high": None},
            "n_tokens": {"low": float(stats["n_tokens"].min()), "high": float(stats["n_tokens"].max())},
        },
    }
    test = answers.filter(pl.col("split") == "test")
    if test.height:
        out = sum(check(answer_stats(lp), rng) is not None for lp in test["token_logprobs"].to_list())
        rng["test"] = {"n": test.height, "out": out, "share": out / test.height}
    return rng


def _num(x: float, stat: str) -> str:
    return f"{int(x)}" if stat == "n_tokens" else f"{x:.3f}"


def check(stats: dict, rng: dict, token: str | None = None) -> str | None:
    """Why an answer is out of distribution (each statistic outside its bounds, with its value and
    the fit answers' range), or None when it is within every bound. `token`: the text of its least
    likely token, named in the reason."""
    reasons = []
    n = rng["n"]
    for stat in STATS:
        bound = rng["bounds"].get(stat)
        if bound is None:
            continue
        value, lo, hi = stats[stat], bound.get("low"), bound.get("high")
        seen = rng["stats"][stat]
        span = f"[{_num(seen['min'], stat)}, {_num(seen['max'], stat)}]"
        if lo is not None and value < lo:
            where = ""
            if stat == "min_logprob":
                piece = "" if token is None else f"{json.dumps(token, ensure_ascii=False)}, "
                where = f" (token {piece}{stats['argmin'] + 1} of {stats['n_tokens']})"
            reasons.append(
                f"{stat} {_num(value, stat)}{where} is below the lowest of the {n:,} answers the detector was "
                f"fit on ({_num(lo, stat)}; their range {span})"
            )
        elif hi is not None and value > hi:
            reasons.append(
                f"{stat} {_num(value, stat)} is above the highest of the {n:,} answers the detector was fit on "
                f"({_num(hi, stat)}; their range {span})"
            )
    return "; ".join(reasons) or None


def describe_range(rng: dict | None) -> str:
    """One paragraph for `halludetect show`."""
    if rng is None:
        return (
            "not recorded: this bundle predates the check (or was exported without the generations), "
            "so `score` leaves in_distribution null; re-export it to add it"
        )
    s, b = rng["stats"], rng["bounds"]
    text = (
        f"{rng['n']:,} answers ({' and '.join(rng['fit_splits'])}): mean token log-prob from "
        f"{s['mean_logprob']['min']:.3f} (0.5% quantile {s['mean_logprob']['q0.005']:.3f}), lowest token "
        f"log-prob from {s['min_logprob']['min']:.3f} (0.5% quantile {s['min_logprob']['q0.005']:.3f}), "
        f"{int(b['n_tokens']['low'])} to {int(b['n_tokens']['high'])} tokens; a row is {RULE}"
    )
    if "test" in rng:
        t = rng["test"]
        text += f". On test it marks {t['out']:,} of {t['n']:,} answers ({100 * t['share']:.1f}%)"
    return text
