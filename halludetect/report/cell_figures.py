"""The figures of one grid cell, from what the earlier stages wrote (stage figures@<m>-<d>).

Reads each trained detector's evaluate metrics (its best layer, chosen on validation), train's
per-response test scores at that layer (checked: its seeds are train.seeds), the scores' (those
with nothing to train: their train stage's answers.parquet) on the test responses, and the
labelled answers' lengths and P_sem; draws the six
PNGs of figures.py and writes their data as DVC plots. (The sensitivity distributions of the
analysed HaMI detectors are the analyze stage's.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from halludetect.activations.layer_format import layer_filename
from halludetect.config import GridParams
from halludetect.core.artifacts import read_parquet
from halludetect.core.errors import DataError
from halludetect.evaluation import selection
from halludetect.evaluation.plot_data import class_histogram_data
from halludetect.evaluation.score_tables import read_scores
from halludetect.labels.readers import read_clusters, read_judgments
from halludetect.methods import METHODS, SCORES, trained
from halludetect.metrics import auroc
from halludetect.qa.responses import response_ids
from halludetect.report import figures


def draw_cell(
    model: str,
    dataset: str,
    grid: GridParams,
    seeds: list[int],
    p_sem_variant: str,
    *,
    eval_dir: Path,
    scores_dir: Path,
    judgments: Path,
    clusters: Path,
    generations: Path,
    figures_dir: Path,
    plots_dir: Path,
    log: Callable[..., None] = lambda *a: None,
) -> None:
    cell = f"{model} / {dataset}"
    detectors = trained(grid.detectors)  # a best layer each
    scores = [m for m in grid.detectors if m in SCORES]
    evals = {m: json.loads((Path(eval_dir) / f"{m}.json").read_text()) for m in detectors}
    best = {m: int(e["best_layer"]) for m, e in evals.items()}
    judged = read_judgments(judgments)
    clustered = read_clusters(clusters)
    generated = read_parquet(generations, "generate", "generations table")
    figs, plots = Path(figures_dir), Path(plots_dir)

    curves, aurocs, score_panels, score_data = {}, {}, {}, {}
    answer_scores: dict[str, pl.DataFrame] = {}  # method -> rid, score (its test answers)
    for m in detectors:
        # train's per-response scores at the best layer (checked: its seeds are train.seeds)
        path = Path(scores_dir) / m / layer_filename(best[m]).replace(".h5", ".parquet")
        y, per_seed, _ = read_scores(path, seeds)["test"]
        answer_scores[m] = (
            pl.read_parquet(path, columns=["response_id", "split", "score"])
            .filter(pl.col("split") == "test")
            .group_by(pl.col("response_id").alias("rid"))
            .agg(pl.col("score").mean())  # the seeds' mean logit, as a bundle scores
        )
        curves[m] = (y, per_seed)
        a = evals[m]["test"]["auroc"]
        aurocs[m] = f"{a['mean']:.3f}" + (f" ± {a['stderr']:.3f}" if a.get("stderr") is not None else "")
        pooled = np.concatenate(per_seed)
        score_panels[f"{m} (layer {best[m]})"] = (pooled, np.tile(y, len(per_seed)))
        score_data[f"{m} (layer {best[m]})"] = class_histogram_data(pooled, np.tile(y, len(per_seed)))
    labels = judged.filter(pl.col("kept")).select(response_ids(judged).alias("rid"), "split", "label")
    for name in scores:  # the same test responses' scores with nothing to train (their train stage's)
        s = read_parquet(Path(scores_dir) / name / "answers.parquet", f"train@{model}-{dataset}-{name}", "score table")
        s = s.filter((pl.col("split") == "test") & pl.col("score").is_not_null() & pl.col("score").is_finite())
        y, score = s["label"].to_numpy(), s["score"].to_numpy()
        curves[name] = (y, [score])
        answer_scores[name] = s.select(pl.col("response_id").alias("rid"), "score")
        aurocs[name] = f"{auroc(y, score):.3f}, baseline"

    # Answer length and P_sem (detectors.p_sem.variant) by class, per split, over the labelled responses.
    lengths = generated.select(response_ids(generated).alias("rid"), "n_tokens")
    p_sem = clustered.filter(pl.col("valid")).select(
        response_ids(clustered).alias("rid"), pl.col(f"p_sem_{p_sem_variant}").alias("p_sem")
    )
    per_response = labels.join(lengths, on="rid", how="left").join(p_sem, on="rid", how="left")
    response_panels, response_data = {}, {}
    for split in ("train", "test"):
        part = per_response.filter(pl.col("split") == split)
        if part.height == 0:
            continue
        y = part["label"].to_numpy()
        response_panels[f"answer tokens ({split})"] = (part["n_tokens"].to_numpy(), y)
        response_data[f"answer tokens ({split})"] = class_histogram_data(part["n_tokens"].to_numpy(), y, discrete=True)
        has = part.filter(pl.col("p_sem").is_not_null())
        response_panels[f"P_sem ({split})"] = (has["p_sem"].to_numpy(), has["label"].to_numpy())
        response_data[f"P_sem ({split})"] = class_histogram_data(has["p_sem"].to_numpy(), has["label"].to_numpy())

    if not curves:
        raise DataError("no method to draw: grid.detectors is empty")
    layers = {m: evals[m]["layers"] for m in detectors}
    # One file per figure, each written atomically: analyze writes sensitivity_<method>.png beside them.
    figures.save_png(figures.auroc_by_layer(layers, best, f"Test AUROC by layer, {cell}"), figs / "auroc_by_layer.png")
    figures.save_png(figures.roc(curves, aurocs, f"ROC at the best layer, test, {cell}"), figs / "roc.png")
    figures.save_png(
        figures.class_panels(
            score_panels,
            f"Test scores (logits) by class, seeds pooled, {cell}",
            {k: "bag logit" for k in score_panels},
            counted="responses x seeds",
        ),
        figs / "scores.png",
    )
    figures.save_png(
        figures.class_panels(
            response_panels,
            f"Answer length and P_sem ({p_sem_variant}: detectors.p_sem.variant) by class, {cell}",
            {k: "answer tokens" if k.startswith("answer") else "P_sem" for k in response_panels},
            cols=2,
            discrete=tuple(k for k in response_panels if k.startswith("answer")),
        ),
        figs / "responses.png",
    )
    # Margins after every epoch at the best layer (evaluate copies them from the layer's figures).
    by_epoch = {m: e["margin_by_epoch"] for m, e in evals.items() if e.get("margin_by_epoch")}
    looped = [m for m in detectors if METHODS[m].fit.loop and METHODS[m].logits]  # by epochs, in logits
    if missing := [m for m in looped if m not in by_epoch]:
        raise DataError(f"{cell}: no margins by epoch in the evaluation of {missing}: re-run their train stages")
    figures.save_png(
        figures.margins_by_epoch(
            by_epoch,
            best,
            f"Margins after every epoch at the best layer, mean over seeds, {cell}\n"
            "(Theorem 1: training expands them; the paper: faster for max than mean)",
        ),
        figs / "margins_by_epoch.png",
    )
    figures.save_csv(figures.margins_by_epoch_data(by_epoch), plots / "epochs" / model / f"{dataset}.csv")
    figures.save_csv(figures.auroc_by_layer_data(layers), plots / "layers" / model / f"{dataset}.csv")
    figures.save_csv(figures.roc_data(curves), plots / "roc" / model / f"{dataset}.csv")
    # One file per cell and purpose, a `panel` column per method (or quantity): DVC draws one chart
    # of panels from it (.dvc/plots/panels.json), where a file per panel made a chart each.
    # Choosing among a question's n answers by each method's score, and abstaining (evaluation/selection.py).
    answers = selection.complete(judged)
    keyed = answers.with_columns(response_ids(answers).alias("rid"))
    chosen_curves = {}
    for m, frame in answer_scores.items():
        scored = keyed.join(frame, on="rid", how="inner").drop("rid")
        if scored.height == answers.height and answers.height:  # every answer scored (EigenScore's groups may not be)
            chosen_curves[m] = selection.curve(selection.best_of_n(scored))
    n = int(answers.group_by("question_id").len()["len"].max() or 0)
    one = selection.accuracy(selection.first_sample(answers)) if answers.height else float("nan")
    best_possible = selection.oracle(answers) if answers.height else float("nan")
    if not chosen_curves:  # drawn all the same (a stage output): the baselines alone, said in the log
        log("%s: no method scored every judged test answer of a complete question: no selection curve", cell)
    title = f"Best of {n} by each score, then abstaining, test, {cell}\n"
    title += f"({answers['question_id'].n_unique()} questions whose {n} answers were all judged)"
    figures.save_png(
        figures.selection(chosen_curves, selection.COVERAGE_GRID, one, best_possible, n, title), figs / "selection.png"
    )
    data = figures.selection_data(chosen_curves, selection.COVERAGE_GRID)
    figures.save_csv(data, plots / "selection" / model / f"{dataset}.csv")
    for sub, data in (("scores", score_data), ("responses", response_data)):
        frame = pl.concat([f.with_columns(pl.lit(name).alias("panel")) for name, f in data.items()])
        figures.save_csv(frame, plots / sub / model / f"{dataset}.csv")
    log("figures of %s in %s", cell, figs)
