"""What choosing answers by their score buys, on a built world's test split (issue 54 item 3).

For each cell of the grid (model x dataset), the test questions and their n = generate.n_samples
sampled answers as the DAG judged and scored them (every detector of grid.detectors at its best
layer, its seeds' logits averaged as a bundle averages them), against:

  greedy        the model's greedy answer, judged by the DAG's judge (generated and judged here;
                a local model only: the world's)
  one sample    each question's first sampled answer (what serving without a choice returns)
  best of n     the answer of the lowest score, per detector: logprob (minus the mean token
                log-prob) is the field's own way of choosing, p_sem and semantic_entropy need
                the clustering, the rest are the trained detectors
  oracle        a question counts as correct when any of its n answers is: no choice does better

and, per detector, the abstention curve of its best-of-n choice: the accuracy of the answered
questions when the highest-scored ones are left unanswered, at 100, 90, 80 and 50% coverage, and
its area (evaluation/selection.py). A question is counted where every one of its n answers was
judged (kept), so that every row chooses among the same answers.

    python -m bench.select                  # every cell of grid; --no-greedy skips generating
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

from bench.common import emit, need
from halludetect.config import load_params
from halludetect.evaluation import selection


def cell_scores(model: str, dataset: str, method: str) -> pl.DataFrame | None:
    """The method's test scores at its best layer (mean over seeds), one row per answer; None when
    the DAG has not evaluated it."""
    ev = Path(f"metrics/eval/{model}/{dataset}/{method}.json")
    if not ev.exists():
        return None
    layer = json.loads(ev.read_text()).get("best_layer")
    base = Path(f"data/scores/{model}/{dataset}/{method}")
    path = base / ("answers.parquet" if layer is None else f"layer_{layer}.parquet")
    frame = pl.read_parquet(path).filter(pl.col("split") == "test")
    return frame.group_by("question_id", "sample_index", maintain_order=True).agg(
        pl.first("label"), pl.col("score").mean()
    )


def greedy_accuracy(params, model: str, dataset: str, questions: list[str]) -> float:
    """The greedy answers of `questions` judged by the DAG's judge (two passes where it has them)."""
    from halludetect.labels.judges import judge_from, two_pass
    from halludetect.lm.generation import generate
    from halludetect.lm.hf_models import load_model, load_tokenizer
    from halludetect.qa.questions import read_questions

    preset = params.models[model]
    table = read_questions(f"data/questions/{dataset}.parquet").filter(pl.col("id").is_in(questions))
    lm, tokenizer = load_model(preset, "cpu"), load_tokenizer(preset)
    answers = generate(lm, tokenizer, table, params.generate.model_copy(update={"n_samples": 1}), greedy=True)
    judged = two_pass(judge_from(params.judge), table, answers, second_pass=params.judge.two_pass)
    kept = judged.filter(pl.col("kept"))
    return float((kept["label"] == 0).mean())


def row(name: str, chosen: pl.DataFrame, curve: bool) -> dict:
    out = {"policy": name, "accuracy": selection.accuracy(chosen)}
    return out | (selection.abstention_curve(chosen) if curve else {})


def cell(params, model: str, dataset: str, greedy: bool) -> dict:
    judgments = pl.read_parquet(f"data/labels/{model}/{dataset}/judgments.parquet")
    answers = selection.complete(judgments)
    ids = answers["question_id"].unique().sort()
    rows = [row("one sample", selection.first_sample(answers), curve=False)]
    if greedy:
        rows.insert(0, {"policy": "greedy", "accuracy": greedy_accuracy(params, model, dataset, ids.to_list())})
    for method in params.grid.detectors:
        scores = cell_scores(model, dataset, method)
        if scores is None:
            continue
        frame = answers.join(scores.drop("label"), on=["question_id", "sample_index"], how="inner")
        if frame["question_id"].n_unique() != len(ids) or frame.height != answers.height:
            continue  # a method that scores only some of the answers (eigenscore's groups): not comparable
        frame = selection.check(frame, f"{model}/{dataset}/{method}")
        rows.append(row(f"best of {params.generate.n_samples}: {method}", selection.best_of_n(frame), curve=True))
    rows.append({"policy": "oracle", "accuracy": selection.oracle(answers)})
    return {"questions": len(ids), "n": params.generate.n_samples, "rows": rows}


def markdown(name: str, result: dict) -> str:
    cols = ["accuracy", *(f"accuracy_at_{c:g}" for c in selection.COVERAGES[1:]), "area"]
    head = f"{name}: {result['questions']} test questions, n = {result['n']}\n\n"
    head += "| policy | " + " | ".join(c.replace("accuracy_at_", "at ") for c in cols) + " |\n"
    head += "|---" * (len(cols) + 1) + "|\n"
    body = ""
    ordered = sorted(result["rows"], key=lambda r: (r["policy"].startswith("best"), -r.get("area", 0)))
    for r in ordered:
        body += f"| {r['policy']} | " + " | ".join(f"{r[c]:.3f}" if c in r else "" for c in cols) + " |\n"
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy answers (generated and judged here)")
    args = ap.parse_args()
    params = load_params()
    out = {}
    for model in params.grid.models:
        for dataset in params.grid.datasets:
            need(Path(f"data/labels/{model}/{dataset}/judgments.parquet"))
            local = Path(params.models[model].path).exists()
            result = cell(params, model, dataset, greedy=local and not args.no_greedy)
            out[f"{model}/{dataset}"] = result
            print(markdown(f"{model}/{dataset}", result), flush=True)
    emit({"bench": "select", "cells": out})


if __name__ == "__main__":
    main()
