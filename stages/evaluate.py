"""Score val and test with every trained layer; pick the best layer on validation only."""

from pathlib import Path

import numpy as np
import polars as pl

from halludetect import cli
from halludetect.activations import layer_files, read_layer
from halludetect.detectors import load_detector
from halludetect.evaluation import split_metrics, throughput
from halludetect.io import write_json
from halludetect.training import score, split_data


def run(args, params):
    ep, seeds = params.evaluate, params.train.seeds
    judgments = pl.read_parquet(args.judgments)
    per_layer, scored = [], {}
    for layer, path in layer_files(args.activations).items():
        data = read_layer(path)
        splits = {s: split_data(data, judgments, s, str(path)) for s in ("val", "test")}
        models = []
        for seed in seeds:
            weights = Path(args.detectors) / f"layer_{layer:02d}_seed_{seed}.safetensors"
            if not weights.exists():
                raise FileNotFoundError(f"{weights} is missing: train this layer and seed first")
            model, meta = load_detector(weights)
            if meta["method"] != args.method:
                raise ValueError(f"{weights} holds a '{meta['method']}' detector, not '{args.method}'")
            models.append(model)
        scores = {s: [score(m, d) for m in models] for s, d in splits.items()}
        val = split_metrics(splits["val"].y.numpy(), scores["val"])
        test = split_metrics(splits["test"].y.numpy(), scores["test"])
        per_layer.append({"layer": layer, "val_auroc": val["auroc"]["mean"], "test_auroc": test["auroc"]["mean"],
                          "test_margin": test["margin"]["mean"]})
        scored[layer] = (splits, scores, models)
    best = max(per_layer, key=lambda r: r["val_auroc"])["layer"]  # chosen on validation only
    splits, scores, models = scored[best]
    test_y = splits["test"].y.numpy()
    metrics = {
        "model": args.model, "dataset": args.dataset, "method": args.method, "seeds": seeds,
        "best_layer": best, "layer_selection": "highest mean validation AUROC over seeds",
        "val": split_metrics(splits["val"].y.numpy(), scores["val"]),
        "test": split_metrics(test_y, scores["test"], bootstrap=ep.bootstrap, seed=ep.seed),
        "layers": per_layer,
        "throughput": {
            "samples_per_s": throughput(models[0], splits["test"].x, splits["test"].mask),
            "what": "detector inference on preloaded padded test tensors, best of 5, this machine's CPU",
        },
    }
    metrics["test"]["scores_mean_by_label"] = {
        str(lab): float(np.mean([s[test_y == lab].mean() for s in scores["test"]])) for lab in (0, 1)
    }
    write_json(args.out, metrics)
    write_json(args.plot, per_layer)
    cli.log.info("%s: best layer %d, test AUROC %.3f", args.method, best, metrics["test"]["auroc"]["mean"])


if __name__ == "__main__":
    p = cli.parser(__doc__)
    for flag, text in [("--model", "model preset name"), ("--dataset", "dataset preset name"),
                       ("--method", "detector method"), ("--activations", "directory of layer files"),
                       ("--judgments", "judgments Parquet"), ("--detectors", "trained detector directory"),
                       ("--out", "metrics JSON"), ("--plot", "per-layer AUROC JSON (DVC plot)")]:
        p.add_argument(flag, required=True, help=text)
    cli.main(run, p)
