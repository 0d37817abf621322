"""Evaluate one detector method: every layer's figures, the best layer chosen on validation only,
its full metrics (bootstrap interval), its inference throughput, and HaMI (SP)'s extra cost; then
export that layer as a self-contained bundle for `halludetect score` (stages/export.py's run, in
this stage's process: a stage of its own cost DVC a dvc.lock rewrite for seconds of work)."""

import json
from pathlib import Path

import polars as pl

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import write_json
from halludetect.core.devices import resolve_device
from halludetect.core.errors import DataError
from halludetect.detectors.build import trained_params
from halludetect.detectors.data import p_sem_for, split_data
from halludetect.evaluation.costs import cost_per_response, sampling_seconds
from halludetect.evaluation.evaluate import (
    detector_throughput,
    evaluate_detector,
    hami_sp_cost,
    load_models,
    missing_layer_files,
)
from halludetect.labels.readers import read_judgments
from halludetect.labels.routing import take_routed
from halludetect.methods import method as lookup_method
from stages import common, export


def trained_layers(timing: str) -> list[int]:
    """The layers the train stage trained: the keys (`layer_<L>`) of its timing file."""
    path = Path(timing)
    try:
        keys = json.loads(path.read_text())
        return sorted(int(k.removeprefix("layer_")) for k in keys)
    except FileNotFoundError:
        raise DataError(
            f"{path} is missing: the train stage writes it with the layers it trained (re-run it)"
        ) from None
    except (ValueError, AttributeError, TypeError) as e:
        raise DataError(f"{path}: not the train stage's timing file (layer_<L> keys): {e}; re-run train") from None


def run(args, params):
    if common.hand_over("evaluate", args, params):  # a score: its figures and bundle (stages/evaluate_score.py)
        return
    ep, seeds = params.evaluate, params.train.seeds
    take_routed(args, "evaluate")  # the clustering's files, for a method that reads them
    # The layers evaluated are those the train stage trained (its timing file names them, one key
    # each): not grid.layers, which this stage need not declare (a change to it re-runs train, whose
    # outputs this stage reads), so that its dvc.lock entry stays small on the paper's 155 layers.
    layers = trained_layers(args.timing)
    # Every trained layer's files, before anything is read.
    cell = f"{args.model}-{args.dataset}"
    train = f"train@{cell}-{args.method}"
    dirs = {
        "layer_metrics": args.layer_metrics,
        "scores": args.scores,
        "detectors": args.detectors,
        "activations": args.activations,
    }
    if problems := missing_layer_files(layers, seeds, dirs, {"train": train, "dump": f"dump@{cell}"}):
        raise DataError(f"{args.method}: {len(problems)} file(s) of the trained layers missing: " + "; ".join(problems))
    per_layer = {}
    for layer in layers:
        per_layer[layer] = json.loads((Path(args.layer_metrics) / f"layer_{layer}.json").read_text())
    # each layer's training time, kept apart from its figures (wall times differ on every run)
    times = json.loads(Path(args.timing).read_text())
    timing = {layer: times[f"layer_{layer}"] for layer in layers}
    metrics = {
        "model": args.model,
        "dataset": args.dataset,
        "method": args.method,
        "family": "detector",
        "seeds": seeds,
    }
    metrics |= evaluate_detector(
        per_layer,
        Path(args.scores),
        seeds,
        bootstrap=ep.bootstrap,
        seed=ep.seed,
        logits=lookup_method(args.method).logits,
        timing=timing,
    )

    # Throughput of the chosen layer's detector, on its test responses.
    best = metrics["best_layer"]
    detectors = Path(args.detectors) / f"layer_{best}"
    method_params = trained_params(detectors, args.method)  # e.g. hami_sp's lam and P_sem variant
    metrics["params"] = method_params.model_dump()  # the report's captions name e.g. the P_sem variant
    p_sem = p_sem_for(args.method, args.clusters, method_params)
    layer_file = Path(args.activations) / layer_filename(best)
    judgments = read_judgments(args.judgments)
    layer = read_layer(layer_file, dtype=None, expect_layer=best)
    test = split_data(layer, judgments, "test", str(layer_file), p_sem, method=args.method)
    models = load_models(detectors, args.method, best, seeds, int(test.tokens.shape[-1]))
    t = metrics["throughput"] = detector_throughput(
        models, test, layer_file, ep.throughput_repeats, resolve_device(ep.device, "evaluate.device")
    )
    if p_sem is not None:
        if not (args.timings and args.generation_metrics and args.latency):
            raise DataError(
                f"{args.method}: pass --timings, --generation-metrics and --latency to charge its sampling and NLI"
            )
        metrics["cost"] = hami_sp_cost(
            json.loads(Path(args.generation_metrics).read_text()),
            read_parquet(args.timings, "cluster", "cluster timings table"),
            judgments.filter(pl.col("split") == "test")["question_id"].unique().to_list(),
            t["preloaded_samples_per_s"],
            json.loads(Path(args.latency).read_text()),
            t["single_response_seconds"],
        )
    spec = lookup_method(args.method)
    if metrics.get("cost"):  # HaMI (SP): its K - 1 samples and NLI calls, amortised
        extra, what = metrics["cost"]["extra_seconds_per_response"], "(K - 1) samples + NLI"
    elif spec.reads.question:  # EigenScore: the states of K - 1 more samples
        if not args.generation_metrics:
            raise DataError(f"{args.method}: pass --generation-metrics to charge its K - 1 more samples")
        k, extra = sampling_seconds(json.loads(Path(args.generation_metrics).read_text()))
        what = f"{k:g} - 1 more samples (generate's seconds per sample)"
    else:
        extra, what = 0.0, ""
    metrics["cost_per_response"] = cost_per_response(
        spec.needs, t["preloaded_samples_per_s"], extra_seconds=extra, extra_what=what
    )
    write_json(args.out, metrics)
    write_json(args.plot, metrics["layers"])
    common.log.info("%s: best layer %d, test AUROC %.3f", args.method, best, metrics["test"]["auroc"]["mean"])
    if args.bundle:
        export.run(args, params)


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--model", "model preset name"),
        ("--dataset", "dataset preset name"),
        ("--method", "detector method"),
        ("--layer-metrics", "directory of the per-layer figures (layer_<L>.json)"),
        ("--scores", "directory of the per-layer scores (layer_<L>.parquet)"),
        ("--detectors", "directory of the per-layer detectors (layer_<L>/seed_<S>.safetensors)"),
        ("--activations", "directory of layer files (for the throughput of the best layer)"),
        ("--judgments", "judgments Parquet"),
        ("--out", "metrics JSON"),
        ("--plot", "per-layer AUROC JSON (DVC plot)"),
    ]:
        p.add_argument(flag, required=True, help=text)
    p.add_argument("--clusters", help="clusters Parquet (P_sem), for the methods that read it")
    p.add_argument("--timings", help="cluster_timings Parquet, for hami_sp's cost")
    p.add_argument("--generation-metrics", help="generate metrics JSON (seconds_per_sample), for hami_sp's cost")
    p.add_argument("--latency", help="latency metrics JSON (one response at a time), for hami_sp's sequential cost")
    p.add_argument(
        "--timing",
        required=True,
        help="the layers' training times (JSON, a layer_<L> key per trained layer): train's --timing",
    )
    p.add_argument("--bundle", help="bundle file (.safetensors) of the best layer, for `halludetect score`")
    p.add_argument("--manifest", help="model manifest JSON (what pins the base model), with --bundle")
    p.add_argument("--cluster-metrics", help="cluster's metrics JSON (equivalence rule, backend), for hami_sp's bundle")
    p.add_argument(
        "--routed",
        help="the route stage's directory for this method (data/routed/<m>/<d>/evaluate/<method>): --clusters, "
        "--timings, --latency and --cluster-metrics where the method reads the clustering",
    )
    p.add_argument(
        "--generations",
        help="generations Parquet (the answers' token log-probs), with --bundle: the range of the fit answers' "
        "log-probs that `halludetect score` checks rows against",
    )
    common.main(run, p)
