"""The token evidence of one grid cell (stage evidence@<m>-<d>): how sparse each detector's
evidence is, a few test answers per method with their evidence highlighted, and Theorem 2's
gradient-norm ratio as training measured it.

For every method of the grid, at its best layer (evaluate's choice, on validation) on the test
split, each seed's detector splits each answer's logit into token contributions
(detectors/evidence.py). Sparsity: the fewest tokens carrying 50% and 90% of an answer's positive
evidence (s50, s90), per seed, pooled over seeds (each seed is one network, as Theorem 2
considers one), by class. The evidence figure shows, per method, four test answers chosen by a
fixed rule on the seeds' mean score (the score a bundle gives): the highest- and lowest-scored
hallucinated answers and the highest- and lowest-scored correct ones (ties: the first response
id), each token coloured by its contribution to that mean. Theorem 2: the `gradient_ratio.json`
that training wrote beside the mean and max detectors of the best layer (detectors/gradient_ratio.py).

Writes the cell's figures (evidence.png, sparsity.png, gradient_ratio.png: a note when no mean
or max network was trained), its per-response values (Parquet) and its figures as JSON, which the report
stage turns into tables (report/evidence_tables.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import torch

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.config import GridParams
from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json, write_parquet
from halludetect.core.errors import DataError
from halludetect.detectors.build import trained_params
from halludetect.detectors.data import SplitData, p_sem_table, split_data
from halludetect.detectors.evidence import (
    NoEvidence,
    describe,
    evidence,
    has_evidence,
    tokens_carrying,
)
from halludetect.evaluation.evaluate import load_models
from halludetect.labels.readers import read_clusters, read_judgments
from halludetect.lm.token_text import char_spans, token_pieces
from halludetect.methods import METHODS, trained
from halludetect.qa.responses import response_ids
from halludetect.report import evidence_figures, figures

SHARES = {"s50": 0.5, "s90": 0.9}
CLASS_NAMES = {1: "hallucinated", 0: "correct"}
BATCH = 512  # bags per evidence batch


def split_evidence(models: list, data: SplitData) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """Per seed: [B, 2] s50 and s90 of every bag; the seeds' mean logit [B]; each bag's
    contributions to that mean (one array per bag)."""
    per_seed = [[] for _ in models]
    z, mean_c = [], []
    for a in range(0, len(data), BATCH):
        bags = data.slice(a, min(a + BATCH, len(data)))
        seeds_c = [evidence(m, bags).contributions for m in models]  # as ensemble_evidence, seed by seed
        for k, c in enumerate(seeds_c):
            per_seed[k].append(torch.stack([tokens_carrying(c, bags, q) for q in SHARES.values()], 1))
        with torch.no_grad():
            z.append(torch.stack([m(bags) for m in models]).mean(0))  # the score a bundle of these seeds gives
        mean_c += list(torch.stack(seeds_c).mean(0).double().split(bags.lengths.tolist()))
    return (
        [torch.cat(p).numpy() for p in per_seed],
        torch.cat(z).double().numpy(),
        [c.numpy() for c in mean_c],
    )


def summarise(frame: pl.DataFrame) -> dict:
    """Per class: bags x seeds, those with positive evidence, and s50, s90, s/T (median and
    quartiles over bags x seeds with positive evidence), T's median."""
    out = {}
    for label, name in CLASS_NAMES.items():
        part = frame.filter(pl.col("label") == label)
        has = part.filter(pl.col("s90").is_not_nan())
        row = {"n": part.height, "n_with_positive_evidence": has.height, "median_T": _q(part["T"], 0.5)}
        for s in SHARES:
            row[s] = {"median": _q(has[s], 0.5), "q25": _q(has[s], 0.25), "q75": _q(has[s], 0.75)}
            share = has[s] / has["T"]
            row[f"{s}_share"] = {"median": _q(share, 0.5), "q25": _q(share, 0.25), "q75": _q(share, 0.75)}
        out[name] = row
    return out


def _q(values: pl.Series, q: float) -> float | None:
    return None if values.len() == 0 else float(np.quantile(values.to_numpy(), q))


def pick_examples(ids: list[str], y: np.ndarray, z: np.ndarray) -> list[tuple[int, str]]:
    """The fixed rule: per class (hallucinated, correct), the highest- and lowest-scored answer
    (ties: the first response id). Returns (index, what it is) in that order, without repeats."""
    out = []
    order = sorted(range(len(ids)), key=lambda i: ids[i])  # ties: first id
    for label, name in CLASS_NAMES.items():
        members = [i for i in order if y[i] == label]
        if not members:
            continue
        high = max(members, key=lambda i: z[i])  # max/min keep the first of equals
        low = min(members, key=lambda i: z[i])
        out.append((high, f"{name}, highest score"))
        if low != high:
            out.append((low, f"{name}, lowest score"))
    return out


def gradient_ratio_summary(path: Path) -> dict | None:
    """The best epoch's figures of every traced seed, and their per-epoch medians (for the figure)."""
    if not path.exists():
        return None
    traced = json.loads(path.read_text())
    seeds = {}
    for seed, t in sorted(traced.items()):
        best = next(e for e in t["epochs"] if e["epoch"] == t["best_epoch"])
        seeds[seed] = {"best_epoch": t["best_epoch"], "at_best_epoch": best, "epochs": t["epochs"], "bags": t["bags"]}
    return seeds


def evidence_cell(
    model: str,
    dataset: str,
    grid: GridParams,
    seeds: list[int],
    tokenizer,
    *,
    eval_dir: Path,
    detectors_dir: Path,
    activations: Path,
    judgments: Path,
    clusters: Path,
    generations: Path,
    questions: Path,
    out: Path,
    responses: Path,
    figures_dir: Path,
    log: Callable[..., None] = lambda *a: None,
) -> dict:
    cell = f"{model} / {dataset}"
    methods = trained(grid.detectors)  # a score has no tokens to weigh
    if not methods:
        raise DataError("no detector to explain: grid.detectors has no detector trained on hidden states")
    judged = read_judgments(judgments)
    gens = read_parquet(generations, "generate", "generations table")
    gens = gens.select(response_ids(gens).alias("rid"), "question_id", "text", "token_ids")
    qs = read_parquet(questions, "prepare", "questions table").select(pl.col("id").alias("question_id"), "question")
    text_of = {r["rid"]: r for r in gens.join(qs, on="question_id", how="left").iter_rows(named=True)}
    clustered = None
    result = {
        "model": model,
        "dataset": dataset,
        "split": "test",
        "seeds": seeds,
        "shares": SHARES,
        "order": methods,  # the grid's order (the JSON's keys are sorted)
        "methods": {},
    }
    frames, examples, ratios = [], {}, {}
    for method in methods:
        best = int(json.loads((Path(eval_dir) / f"{method}.json").read_text())["best_layer"])
        layer_dir = Path(detectors_dir) / method / f"layer_{best}"
        p_sem = None
        if METHODS[method].reads.p_sem:  # HaMI (SP); the SEP probes read clusters only to train
            clustered = read_clusters(clusters) if clustered is None else clustered
            p_sem = p_sem_table(clustered, trained_params(layer_dir, method).p_sem)
        path = Path(activations) / layer_filename(best)
        layer = read_layer(path, dtype=None, expect_layer=best)
        # method=: what it cannot score is left out as evaluate leaves it out (SEP (SLT): one-token answers)
        data = split_data(layer, judged, "test", str(path), p_sem, method=method)
        models = load_models(layer_dir, method, best, seeds, data.tokens.shape[1])
        if not has_evidence(models[0]):
            try:
                describe(models[0])
            except NoEvidence as e:
                log("%s: %s has no token evidence (%s); left out", cell, method, e)
                result["methods"][method] = {"layer": best, "evidence": None, "why": str(e)}
            continue
        per_seed, z, contributions = split_evidence(models, data)
        y = data.y.numpy().astype(np.int64)
        lengths = data.lengths.numpy()
        mine = []
        for seed, s in zip(seeds, per_seed):
            mine.append(
                pl.DataFrame(
                    {
                        "response_id": data.response_ids,
                        "method": method,
                        "seed": seed,
                        "label": y,
                        "T": lengths,
                        "s50": s[:, 0],
                        "s90": s[:, 1],
                    },
                    schema_overrides={"seed": pl.Int32, "label": pl.Int8, "T": pl.Int32},
                )
            )
        frames += mine
        picked = pick_examples(data.response_ids, y, z)
        examples[method] = [
            _example(text_of[data.response_ids[i]], z[i], contributions[i], what, tokenizer) for i, what in picked
        ]
        result["methods"][method] = {
            "layer": best,
            "display": METHODS[method].display,
            "evidence": describe(models[0]),
            "bias_varies": evidence(models[0], data.slice(0, 1)).bias_varies,
            "classes": summarise(pl.concat(mine)),
            "examples": [
                {"response_id": data.response_ids[i], "what": what, "score": float(z[i])} for i, what in picked
            ],
        }
        traced = gradient_ratio_summary(layer_dir / "gradient_ratio.json")
        if traced is not None:
            ratios[method] = traced
            result["methods"][method]["gradient_ratio"] = {s: t["at_best_epoch"] for s, t in traced.items()}
    rows = pl.concat(frames) if frames else pl.DataFrame()
    write_parquet(responses, rows)
    figs = Path(figures_dir)
    panels = {f"{METHODS[m].display} (layer {result['methods'][m]['layer']})": ex for m, ex in examples.items()}
    figures.save_png(evidence_figures.examples(panels, f"Token evidence, test answers, {cell}"), figs / "evidence.png")
    figures.save_png(
        evidence_figures.sparsity(rows, METHODS, f"Sparsity of the evidence, test, {cell}"), figs / "sparsity.png"
    )
    figures.save_png(  # a note when no mean or max network is in the grid: the stage's outputs are fixed
        evidence_figures.gradient_ratio(ratios, f"Theorem 2: squared gradient-norm ratio, max / mean pooling, {cell}"),
        figs / "gradient_ratio.png",
    )
    write_json(out, result)
    log("evidence of %s: %d methods, figures in %s", cell, len(examples), figs)
    return result


def _example(rec: dict, z: float, contributions: np.ndarray, what: str, tokenizer) -> dict:
    pieces = token_pieces(tokenizer, list(rec["token_ids"]))
    spans = char_spans(pieces, rec["text"])
    return {
        "question": rec.get("question") or "",
        "answer": rec["text"],
        "what": what,
        "score": float(z),
        "tokens": pieces,
        "token_start": spans.start,
        "token_end": spans.end,
        "offsets_exact": spans.exact,
        "contributions": [float(c) for c in contributions],
    }
