"""Train one detector method on one dumped layer, for every seed, and score that layer's validation
and test responses with each seed's best weights (the layer's own evaluation).

One stage per layer, so a colleague who pulled a single layer file trains on it alone.
"""

from pathlib import Path

from halludetect.activations.layer_reader import read_layer
from halludetect.core.devices import resolve_device
from halludetect.detectors.build import build_detector, section
from halludetect.detectors.data import SPLITS, entropy_for, p_sem_for, split_data
from halludetect.detectors.training import train_layer
from halludetect.labels.readers import read_judgments
from stages import common


def run(args, params):
    tp = params.train
    device = resolve_device(tp.device, "train.device")  # before any file is read
    method_params = section(params.detectors, args.method)
    p_sem = p_sem_for(args.method, args.clusters, method_params)
    entropy = entropy_for(args.method, args.clusters, method_params)
    judgments = read_judgments(args.judgments)
    layer = read_layer(args.activations, dtype=None, expect_layer=args.layer)
    build_detector(args.method, layer.states.shape[1], method_params)  # a plugin's build is checked before any work
    data = {
        s: split_data(
            layer,
            judgments,
            s,
            str(args.activations),
            p_sem,
            method=args.method,
            entropy=entropy if s == "train" else None,
        )
        for s in SPLITS
    }
    del layer
    train_layer(
        args.method,
        method_params,
        data,
        tp.seeds,
        layer=args.layer,
        epochs=tp.epochs,
        batch_size=tp.batch_size,
        device=device,
        out_dir=Path(args.out),
        scores_path=Path(args.scores),
        metrics_path=Path(args.metrics),
        timing_path=Path(args.timing) if args.timing else None,
        recipe=tp.recipe,
        log=common.log.info,
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    p.add_argument("--method", required=True, help="detector method (params: detectors.<method>)")
    p.add_argument("--layer", required=True, type=int, help="the layer index (checked against the file's)")
    p.add_argument("--activations", required=True, help="the layer's HDF5 file (layer_<L>.h5)")
    p.add_argument("--judgments", required=True, help="judgments Parquet (labels)")
    p.add_argument("--clusters", help="clusters Parquet (P_sem), for the methods that read it (train_sp)")
    p.add_argument("--out", required=True, help="output directory: seed_<S>.safetensors, curves.json, summary.json")
    p.add_argument("--scores", required=True, help="Parquet: every val/test response's logit, per seed")
    p.add_argument("--metrics", required=True, help="the layer's val/test figures (JSON)")
    p.add_argument(
        "--timing", help="the layer's training time (JSON, apart from the figures: wall times differ per run)"
    )
    common.main(run, p)
