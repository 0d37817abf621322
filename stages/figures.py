"""Figures of one grid cell (PNGs in metrics/figures, and their data as DVC plots): AUROC by layer
of every method, ROC curves and score distributions at the best layer, answer length and P_sem by
class. (The sensitivity distributions of the analysed HaMI detectors are the analyze stage's.)"""

import json
from pathlib import Path

import numpy as np
import polars as pl

from halludetect.activations.layer_format import layer_filename
from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import atomic_path
from halludetect.core.errors import DataError
from halludetect.evaluation.baselines import baseline_scores
from halludetect.evaluation.evaluate import read_scores
from halludetect.evaluation.plot_data import class_histogram_data
from halludetect.labels.readers import read_clusters, read_judgments
from halludetect.metrics import auroc
from halludetect.qa.responses import response_ids
from halludetect.report import figures
from stages import common


def run(args, params):
    g = params.grid
    cell = f"{args.model} / {args.dataset}"
    detectors = [*g.methods, *g.sp_methods]
    evals = {m: json.loads((Path(args.eval_dir) / f"{m}.json").read_text()) for m in detectors}
    best = {m: int(e["best_layer"]) for m, e in evals.items()}
    judgments = read_judgments(args.judgments)
    clusters = read_clusters(args.clusters)
    generations = read_parquet(args.generations, "generate", "generations table")
    figs, plots = Path(args.figures), Path(args.plots)

    curves, aurocs, score_panels, score_data = {}, {}, {}, {}
    for m in detectors:
        # train's per-response scores at the best layer (checked: its seeds are train.seeds)
        path = Path(args.scores_dir) / m / layer_filename(best[m]).replace(".h5", ".parquet")
        y, per_seed, _ = read_scores(path, params.train.seeds)["test"]
        curves[m] = (y, per_seed)
        a = evals[m]["test"]["auroc"]
        aurocs[m] = f"{a['mean']:.3f}" + (f" ± {a['stderr']:.3f}" if a.get("stderr") is not None else "")
        pooled = np.concatenate(per_seed)
        score_panels[f"{m} (layer {best[m]})"] = (pooled, np.tile(y, len(per_seed)))
        score_data[m] = class_histogram_data(pooled, np.tile(y, len(per_seed)))
    labels = judgments.filter(pl.col("kept")).select(response_ids(judgments).alias("rid"), "split", "label")
    for name in g.baselines:  # the same test responses' scores without hidden states
        s = labels.filter(pl.col("split") == "test").join(
            baseline_scores(name, generations, clusters, params.baselines), on="rid", how="inner")
        s = s.filter(pl.col("score").is_finite())
        y, score = s["label"].to_numpy(), s["score"].to_numpy()
        curves[name] = (y, [score])
        aurocs[name] = f"{auroc(y, score):.3f}, baseline"

    # Answer length and P_sem (the variant baselines.p_sem names) by class, per split, over the labelled responses.
    lengths = generations.select(response_ids(generations).alias("rid"), "n_tokens")
    p_sem = clusters.filter(pl.col("valid")).select(response_ids(clusters).alias("rid"),
                                                    pl.col(f"p_sem_{params.baselines.p_sem}").alias("p_sem"))
    per_response = labels.join(lengths, on="rid", how="left").join(p_sem, on="rid", how="left")
    response_panels, response_data = {}, {}
    for split in ("train", "test"):
        part = per_response.filter(pl.col("split") == split)
        if part.height == 0:
            continue
        y = part["label"].to_numpy()
        response_panels[f"answer tokens ({split})"] = (part["n_tokens"].to_numpy(), y)
        response_data[f"{split}_n_tokens"] = class_histogram_data(part["n_tokens"].to_numpy(), y, discrete=True)
        has = part.filter(pl.col("p_sem").is_not_null())
        response_panels[f"P_sem ({split})"] = (has["p_sem"].to_numpy(), has["label"].to_numpy())
        response_data[f"{split}_p_sem"] = class_histogram_data(has["p_sem"].to_numpy(), has["label"].to_numpy())

    if not curves:
        raise DataError("no method to draw: grid.methods, grid.sp_methods and grid.baselines are empty")
    layers = {m: evals[m]["layers"] for m in detectors}
    # One file per figure, each written atomically: analyze writes sensitivity_<method>.png beside them.
    figures.save_png(figures.auroc_by_layer(layers, best, f"Test AUROC by layer, {cell}"), figs / "auroc_by_layer.png")
    figures.save_png(figures.roc(curves, aurocs, f"ROC at the best layer, test, {cell}"), figs / "roc.png")
    figures.save_png(figures.class_panels(score_panels, f"Test scores (logits) by class, seeds pooled, {cell}",
                                          {k: "bag logit" for k in score_panels}, counted="responses x seeds"),
                     figs / "scores.png")
    figures.save_png(figures.class_panels(
        response_panels, f"Answer length and P_sem by class, {cell}",
        {k: "answer tokens" if k.startswith("answer") else "P_sem" for k in response_panels}, cols=2,
        discrete=tuple(k for k in response_panels if k.startswith("answer"))), figs / "responses.png")
    figures.save_csv(figures.auroc_by_layer_data(layers), plots / "layers" / args.model / f"{args.dataset}.csv")
    figures.save_csv(figures.roc_data(curves), plots / "roc" / args.model / f"{args.dataset}.csv")
    for sub, data in (("scores", score_data), ("responses", response_data)):
        with atomic_path(plots / "distributions" / args.model / args.dataset / sub, is_dir=True) as tmp:
            for name, frame in data.items():
                frame.write_csv(tmp / f"{name}.csv", float_precision=6)
    common.log.info("figures of %s in %s", cell, figs)


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [("--model", "model preset name"), ("--dataset", "dataset preset name"),
                       ("--eval-dir", "directory of the cell's <method>.json evaluate metrics"),
                       ("--scores-dir", "directory of <method>/layer_LL.parquet per-response scores"),
                       ("--judgments", "judgments Parquet"), ("--clusters", "clusters Parquet"),
                       ("--generations", "generations Parquet"), ("--figures", "directory of the PNGs"),
                       ("--plots", "root of the plot data (layers/, roc/, distributions/)")]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
