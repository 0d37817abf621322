"""Train one detector method on every layer of grid.layers, every seed, and score each layer's
validation and test responses with each seed's best weights (the layer's own evaluation).

One stage per method (not per layer: docs/development.md#stage-granularity). The layers are read
one at a time, so memory holds one layer's states; `--layers` trains a subset into the same
directories (what `halludetect train-layer` runs for a colleague who pulled one layer file).
"""

import json
import time
from pathlib import Path

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import read_layer
from halludetect.core.atomic_io import write_json
from halludetect.core.devices import resolve_device
from halludetect.core.errors import DataError
from halludetect.detectors.build import build_detector, section
from halludetect.detectors.data import SPLITS, entropy_for, p_sem_for, split_data
from halludetect.detectors.training import train_layer, training_time
from halludetect.labels.readers import read_judgments
from stages import common


def run(args, params):
    tp = params.train
    device = resolve_device(tp.device, "train.device")  # before any file is read
    method_params = section(params.detectors, args.method)
    p_sem = p_sem_for(args.method, args.clusters, method_params)
    entropy = entropy_for(args.method, args.clusters, method_params)
    layers = args.layers if args.layers is not None else params.grid.layers
    if unknown := sorted(set(layers) - set(params.grid.layers)):
        raise DataError(f"--layers {unknown}: not in grid.layers {params.grid.layers}")
    activations = Path(args.activations)
    # every layer file before any training: a missing one is named with the stage that writes it
    if missing := [layer_filename(k) for k in layers if not (activations / layer_filename(k)).exists()]:
        raise DataError(
            f"{activations} has no {', '.join(missing)}: dump.layers must cover grid.layers "
            "(the dump stage writes them; `dvc pull` fetches a pushed one)"
        )
    judgments = read_judgments(args.judgments)
    out, scores, metrics = Path(args.out), Path(args.scores), Path(args.metrics)
    timing = {}
    for k in layers:  # one layer's states in memory at a time (gigabytes each at the paper's scale)
        path = activations / layer_filename(k)
        layer = read_layer(path, dtype=None, expect_layer=k)
        build_detector(args.method, layer.states.shape[1], method_params)  # a plugin's build is checked before any work
        split = {
            s: split_data(
                layer, judgments, s, str(path), p_sem, method=args.method, entropy=entropy if s == "train" else None
            )
            for s in SPLITS
        }
        del layer
        t0 = time.perf_counter()
        results = train_layer(
            args.method,
            method_params,
            split,
            tp.seeds,
            layer=k,
            epochs=tp.epochs,
            batch_size=tp.batch_size,
            device=device,
            out_dir=out / f"layer_{k}",
            scores_path=scores / f"layer_{k}.parquet",
            metrics_path=metrics / f"layer_{k}.json",
            recipe=tp.recipe,
            log=common.log.info,
        )
        wall = time.perf_counter() - t0
        timing[f"layer_{k}"] = training_time(results, wall, len(tp.seeds) if device == "cpu" else 1, device)
        common.log.info("%s layer %d: %.1f s", args.method, k, wall)
    if args.timing:
        # a subset (--layers) keeps the other layers' times of an earlier run
        earlier = Path(args.timing)
        if args.layers is not None and earlier.exists():
            timing = {**json.loads(earlier.read_text()), **timing}
        write_json(args.timing, dict(sorted(timing.items(), key=lambda kv: int(kv[0].split("_")[1]))))


def layer_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--method", required=True, help="detector method (params: detectors.<method>)")
    p.add_argument("--activations", required=True, help="the dump's directory of layer files (layer_<L>.h5)")
    p.add_argument("--judgments", required=True, help="judgments Parquet (labels)")
    p.add_argument("--clusters", help="clusters Parquet (P_sem), for the methods that read it (train_sp)")
    p.add_argument("--out", required=True, help="output directory: layer_<L>/seed_<S>.safetensors, curves.json, ...")
    p.add_argument(
        "--scores", required=True, help="directory of Parquet files: layer_<L>.parquet, each response's logit per seed"
    )
    p.add_argument("--metrics", required=True, help="directory of the layers' val/test figures (layer_<L>.json)")
    p.add_argument(
        "--timing", help="the layers' training times (JSON, apart from the figures: wall times differ per run)"
    )
    p.add_argument(
        "--layers",
        type=layer_list,
        help="comma-separated layers to train (default: grid.layers); others are left as they are",
    )
    common.main(run, p)
