"""The paper's analysis of HaMI (SP): how each bag's logit answers the semantic scaling (C_B, C_B^int),
class expectations, gamma and the margin condition, at the best layer (and analyze.layers)."""

import json
from pathlib import Path

import polars as pl

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.core.atomic_io import atomic_path, write_json, write_parquet
from halludetect.core.errors import DataError
from halludetect.detectors.build import trained_params
from halludetect.detectors.data import p_sem_table, split_data
from halludetect.evaluation.analysis import QUANTITY, analyze_split, histograms
from halludetect.evaluation.evaluate import load_models
from halludetect.labels.readers import read_clusters, read_judgments
from halludetect.methods import ANALYZABLE, SP_METHODS
from halludetect.report import figures
from stages import common


def run(args, params):
    ap = params.analyze
    if args.method not in ANALYZABLE:
        raise DataError(
            f"the sensitivity analysis applies to HaMI networks ({', '.join(ANALYZABLE)}), "
            f"not '{args.method}': remove it from grid.analyze"
        )
    evaluation = json.loads(Path(args.evaluation).read_text())
    best = int(evaluation["best_layer"])
    layers = sorted({best, *ap.layers})
    # the layers train trained (its detector directories), not grid.layers: this stage need not
    # declare it (a change to it re-runs train, whose outputs it reads)
    names = [p.name.removeprefix("layer_") for p in Path(args.detectors).glob("layer_*") if p.is_dir()]
    trained_layers = sorted(int(n) for n in names if n.isdigit())
    untrained = [layer for layer in layers if layer not in trained_layers]
    if untrained:
        raise DataError(
            f"analyze.layers: {untrained} are not trained (the trained layers, grid.layers, are {trained_layers}); "
            "add them to grid.layers or drop them from analyze.layers"
        )
    detectors = Path(args.detectors)
    trained = trained_params(detectors / f"layer_{best}", args.method)
    if args.method in SP_METHODS:  # the scaling it was trained with, the only one it applies
        lam, variant = trained.lam, trained.p_sem
        why = "the lam and P_sem variant the detector was trained with (read from its files)"
    else:
        lam, variant = ap.hami_lam, ap.hami_p_sem
        why = (
            "HaMI applies no scaling: the analysis asks what HaMI (SP)'s scaling (analyze.hami_lam, "
            "analyze.hami_p_sem) would do to its margin"
        )
    p_sem = p_sem_table(read_clusters(args.clusters), variant)
    judgments = read_judgments(args.judgments)
    seeds = params.train.seeds
    out = {
        "model": args.model,
        "dataset": args.dataset,
        "method": args.method,
        "lam": lam,
        "p_sem": variant,
        "lam_source": why,
        "steps": ap.steps,
        "best_layer": best,
        "seeds": seeds,
        "classes": "neg = correct (label 0), pos = hallucinated (label 1)",
        "top_k": "C_B: the top-k tokens of the unscaled logits (p = 0); C_B^int: re-ranked at every step of "
        "the path from the unscaled (p = 0) to the scaled logits (p = p_B)",
        "layers": {},
    }
    frames = []
    for layer in layers:
        path = Path(args.activations) / layer_filename(layer)
        data = read_layer(path, dtype=None, expect_layer=layer)
        models = dict(
            zip(seeds, load_models(detectors / f"layer_{layer}", args.method, layer, seeds, data.states.shape[1]))
        )
        out["layers"][str(layer)] = {}
        for split in ap.splits:
            split_set = split_data(data, judgments, split, str(path), p_sem)
            rows, summary = analyze_split(models, split_set, lam, ap.steps, tolerance=ap.path_tolerance)
            summary["excluded"] = split_set.excluded
            out["layers"][str(layer)][split] = summary
            frames.append(rows.with_columns(pl.lit(split).alias("split"), pl.lit(layer).alias("layer")))
            m = summary["mean"]["c_int"]
            common.log.info(
                "%s layer %d %s: gamma %.3g, 1/gamma %.3g, |S_neg|/|S_pos| %.3g, condition holds in %d of "
                "the %d seeds where it applies",
                args.method,
                layer,
                split,
                m["gamma"] or float("nan"),
                m["inv_gamma"] or float("nan"),
                m["class_ratio"],
                *m["condition_holds_seeds"],
            )
            check = summary["path_check"]
            if not check["within_tolerance"]:
                common.log.warning(
                    "%s layer %d %s: the path identity Z(p_B) = Z(0) - p_B C_B^int misses by up to %.3g logits, "
                    "more than analyze.path_tolerance %.3g: raise analyze.steps (now %d)",
                    args.method,
                    layer,
                    split,
                    check["max_abs_identity_gap"],
                    check["tolerance"],
                    ap.steps,
                )
        del data
    rows = pl.concat(frames)
    write_parquet(args.responses, rows)
    # one file, a `panel` per quantity and split: DVC draws one chart of panels (.dvc/plots/panels.json)
    panels = []
    for split in ap.splits:
        at_best = rows.filter((pl.col("layer") == best) & (pl.col("split") == split))
        for name, frame in histograms(at_best, ap.bins).items():
            panels.append(frame.with_columns(pl.lit(f"{QUANTITY[name]} ({split})").alias("panel")))
    with atomic_path(args.plots) as tmp:
        pl.concat(panels).write_csv(tmp, float_precision=6)
    scaling = f"lam = {lam:g}" + ("" if args.method in SP_METHODS else ", HaMI (SP)'s, applied to HaMI")
    figures.save_png(
        figures.sensitivity(
            rows.filter(pl.col("layer") == best),
            f"{args.method}: sensitivity to the semantic scaling ({scaling}) at layer "
            f"{best}, seeds pooled, {args.model} / {args.dataset}",
        ),
        args.figure,
    )
    write_json(args.out, out)


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--model", "model preset name"),
        ("--dataset", "dataset preset name"),
        ("--method", "hami or hami_sp"),
        ("--evaluation", "the method's evaluate metrics JSON (its best layer)"),
        ("--activations", "directory of layer files (layer_<L>.h5)"),
        ("--judgments", "judgments Parquet"),
        ("--clusters", "clusters Parquet (P_sem)"),
        ("--detectors", "the method's detector directory (layer_<L>/seed_<S>.safetensors)"),
        ("--out", "analysis metrics JSON"),
        ("--responses", "per-response Parquet"),
        ("--plots", "CSV of the distributions by class, one panel per quantity and split (a DVC plot)"),
        ("--figure", "PNG of the C_B^int and P_sem C_B^int distributions per class"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
