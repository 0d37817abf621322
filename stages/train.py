"""Train one detector method on every dumped layer of a grid cell, for every seed."""

import json
from pathlib import Path

from halludetect import cli
from halludetect.atomic_io import atomic_path
from halludetect.detector_data import check_layer_files, p_sem_for, split_data
from halludetect.detectors import save_detector, section
from halludetect.devices import resolve_device
from halludetect.label_tables import read_judgments
from halludetect.layer_format import layer_files
from halludetect.layer_reader import read_layer
from halludetect.training import train_detector


def run(args, params):
    tp = params.train
    device = resolve_device(tp.device, "train.device")  # before any file is read
    method_params = section(params.detectors, args.method)
    p_sem = p_sem_for(args.method, args.clusters, method_params)
    judgments = read_judgments(args.judgments)
    files = layer_files(args.activations)
    check_layer_files(files, judgments, ("train", "val"), p_sem)  # every layer, before any training
    curves, summary = {}, {}
    with atomic_path(Path(args.out), is_dir=True) as tmp:
        for layer, path in files.items():
            data = read_layer(path, dtype=None)
            train = split_data(data, judgments, "train", str(path), p_sem)
            val = split_data(data, judgments, "val", str(path), p_sem)
            del data
            for seed in tp.seeds:
                res = train_detector(args.method, method_params, train, val, epochs=tp.epochs,
                                     batch_size=tp.batch_size, seed=seed, device=device)
                key = f"layer_{layer:02d}_seed_{seed}"
                save_detector(tmp / f"{key}.safetensors", res.state_dict,
                              {"method": args.method, "layer": layer, "seed": seed, "best_epoch": res.best_epoch,
                               "d": int(train.tokens.shape[-1]), "params": method_params.model_dump()})
                curves[key] = res.curve
                summary[key] = {"layer": layer, "seed": seed, "best_epoch": res.best_epoch,
                                "val_auroc": res.best_val_auroc, "n_train": len(train), "n_val": len(val),
                                "excluded": {"train": train.excluded, "val": val.excluded}}
                cli.log.info("%s %s: best epoch %d, val AUROC %.3f", args.method, key, res.best_epoch,
                             res.best_val_auroc)
        (tmp / "curves.json").write_text(json.dumps(curves, indent=1))
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


if __name__ == "__main__":
    p = cli.parser(__doc__)
    p.add_argument("--method", required=True, help="detector method (params: detectors.<method>)")
    p.add_argument("--activations", required=True, help="directory of layer_XX.h5 files")
    p.add_argument("--judgments", required=True, help="judgments Parquet (labels)")
    p.add_argument("--clusters", help="clusters Parquet (P_sem), for hami_sp only")
    p.add_argument("--out", required=True, help="output directory of detector weights")
    cli.main(run, p)
