"""Training wall time on the world: every method on every dumped layer, one seed, against a
per-bag-loop trainer (how the paper's code trains) on one layer; and a layer's seeds trained
side by side in single-threaded workers (the train stage's way) against one after another on
every core (the layout before).

  ours      `train_detector` (packed batches, segment pooling) for every registered method on
            every layer file, the epochs and batch size of params.yaml (100 and 128)
  loop      the `max` network trained on one layer with a Python loop over the bags of each
            batch and of the validation set, same epochs, batch size, optimiser and seed
  same      ours for `max` on that layer, so `ratio_vs_loop_same_work` compares equal work
  seeds     train.seeds of `max` on that layer: `train_seeds` (a single-threaded worker per
            seed, as the train stage runs them) against the seeds one after another with one
            thread per core (the layout before); twice, alternating, best of each

    python -m bench.training [--layer 4] [--epochs 100]
"""

from __future__ import annotations

import os

from halludetect.core import numerics

numerics.pin(threads=os.cpu_count() or 1)  # as the stages, but every core for the sequential layout

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import polars as pl  # noqa: E402
import torch  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

from bench.common import emit, need, setup_threads  # noqa: E402
from halludetect.activations.layer_format import layer_files  # noqa: E402
from halludetect.activations.layer_reader import read_layer  # noqa: E402
from halludetect.config import load_params  # noqa: E402
from halludetect.detectors.build import DETECTORS, build_detector, section  # noqa: E402
from halludetect.detectors.data import SplitData, p_sem_table, split_data  # noqa: E402
from halludetect.detectors.training import train_detector, train_seeds  # noqa: E402
from halludetect.methods import SP_METHODS  # noqa: E402

CELL = Path("data/activations/world/world")
LABELS = Path("data/labels/world/world")


def loop_train(params, train: SplitData, val: SplitData, epochs: int, batch_size: int, seed: int) -> float:
    """The `max` network, one bag at a time; returns the best validation AUROC."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_detector("max", train.tokens.shape[1], params)
    feature, head = model.feature, model.head
    opt = torch.optim.Adam(model.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    bce = torch.nn.BCEWithLogitsLoss()
    train_bags = train.tokens.split(train.lengths.tolist())
    val_bags = val.tokens.split(val.lengths.tolist())
    best = 0.0
    for _ in range(epochs):
        model.train()
        for batch in torch.randperm(len(train), generator=gen).split(batch_size):
            z = torch.stack([head(feature(train_bags[i]).max(0).values).squeeze() for i in batch.tolist()])
            loss = bce(z, train.y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            z = torch.stack([head(feature(h).max(0).values).squeeze() for h in val_bags])
        best = max(best, roc_auc_score(val.y.numpy(), z.numpy()))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", type=int, default=None, help="layer for the loop baseline (default: the last)")
    ap.add_argument("--epochs", type=int, default=None, help="default: train.epochs of params.yaml")
    args = ap.parse_args()
    need(CELL, LABELS / "judgments.parquet", LABELS / "clusters.parquet")
    threads = setup_threads()
    params = load_params()
    epochs, batch_size, seed = args.epochs or params.train.epochs, params.train.batch_size, 0
    judgments = pl.read_parquet(LABELS / "judgments.parquet")
    clusters = pl.read_parquet(LABELS / "clusters.parquet")
    files = layer_files(CELL)
    layer_of_loop = args.layer if args.layer is not None else max(files)

    per_method = {m: 0.0 for m in DETECTORS}
    t_all = time.perf_counter()
    for path in files.values():
        data = read_layer(path, dtype=None)
        for method in DETECTORS:
            mp = section(params.detectors, method)
            p_sem = p_sem_table(clusters, mp.p_sem) if method in SP_METHODS else None
            train, val = (
                split_data(data, judgments, "train", str(path), p_sem),
                split_data(data, judgments, "val", str(path), p_sem),
            )
            t0 = time.perf_counter()
            train_detector(method, mp, train, val, epochs=epochs, batch_size=batch_size, seed=seed)
            per_method[method] += time.perf_counter() - t0
    all_s = time.perf_counter() - t_all

    data = read_layer(files[layer_of_loop], dtype=None)
    train, val = split_data(data, judgments, "train"), split_data(data, judgments, "val")
    mp = params.detectors.max
    t0 = time.perf_counter()
    ours = train_detector("max", mp, train, val, epochs=epochs, batch_size=batch_size, seed=seed)
    same_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loop_auroc = loop_train(mp, train, val, epochs, batch_size, seed)
    loop_s = time.perf_counter() - t0

    test = split_data(data, judgments, "test")
    seeds = params.train.seeds
    sequential_s, parallel_s = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        for s in seeds:  # the former stage: one training at a time, every core on it
            train_detector("max", mp, train, val, epochs=epochs, batch_size=batch_size, seed=s)
        sequential_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        train_seeds("max", mp, train, val, {"val": val, "test": test}, seeds, epochs=epochs, batch_size=batch_size)
        parallel_s.append(time.perf_counter() - t0)

    emit(
        {
            "bench": "training",
            "threads": threads,
            "epochs": epochs,
            "batch_size": batch_size,
            "layers": len(files),
            "methods": len(DETECTORS),
            "all_methods_all_layers_s": all_s,
            "seconds_per_method_all_layers": per_method,
            "loop_layer": layer_of_loop,
            "loop_max_one_layer_s": loop_s,
            "ours_max_one_layer_s": same_s,
            "ratio_vs_loop_same_work": loop_s / same_s,
            "all_methods_all_layers_over_loop_one_layer": all_s / loop_s,
            "best_val_auroc": {"ours": ours.best_val_auroc, "loop": loop_auroc},
            "seeds": seeds,
            "seeds_sequential_all_cores_s": min(sequential_s),
            "seeds_parallel_workers_s": min(parallel_s),
            "seeds_ratio": min(sequential_s) / min(parallel_s),
        }
    )


if __name__ == "__main__":
    main()
