"""Training wall time on the world: every method on every dumped layer, one seed, against a
per-bag-loop trainer (how the paper's code trains) on one layer; and a layer's seeds trained
side by side in single-threaded workers (the train stage's way) against one after another on
every core (the layout before).

  ours      `train_detector` (packed batches, segment pooling) for every registered method on
            every layer file, the epochs and batch size of params.yaml (100 and 128)
  loop      the `max` network trained on one layer with a Python loop over the bags of each
            batch and of the validation set, same epochs, batch size, optimiser and seed
  same      ours for `max` on that layer, so `ratio_vs_loop_same_work` compares equal work
  seeds     train.seeds of `max` on that layer: `train_seeds` (the seeds batched in one
            single-threaded process, as the train stage runs them) against the seeds one after
            another with one thread per core (the layout before the worker pool); twice,
            alternating, best of each

  batched   (`--batched`, alone) a layer's seeds as the train stage trained them before, one
            forked single-threaded worker process per seed (`forked_seeds`, kept here), against
            `train_seeds` now: the seeds trained together as one batched model in one
            single-threaded process (detectors/batched.py). Per method: wall time, CPU time
            (the process's and its children's, user + system), and the largest absolute
            difference between the two paths' weights (best and last epoch) per seed. On the
            world's last layer when the demo world is built; otherwise on synthetic bags of the
            world's shape (d = 128, 600 train bags of about 13 tokens, 1,000 val and 1,000 test
            bags: `world_shaped`), which is what the figures in the report of issue 33 used.

  epoch cost  (`--epoch-cost`, alone) what one epoch of one seed costs on one layer of the world, in
            the train stage's own path (the seeds batched, one thread), split into its parts: the
            training steps, the validation split scored in eval mode (the best-epoch rule reads
            its AUROC), the training split scored again (the margin curve of curves.json, the
            paper's Theorem 1) and the gradient-ratio trace (mean and max networks: Theorem 2,
            gradient_ratio.json); each part timed where train_batched calls it. Issue 53 asked
            where the train stages' time goes; every part but the steps is an output's.

    python -m bench.training [--layer 4] [--epochs 100]
    python -m bench.training --batched [--epochs 100] [--methods max,hami,attention,saplma]
    python -m bench.training --epoch-cost [--layer 2] [--epochs 20] [--methods max,mean,hami,...]
"""

from __future__ import annotations

import os

from halludetect.core import numerics

numerics.pin(threads=os.cpu_count() or 1)  # as the stages, but every core for the sequential layout

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import torch  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

from bench.common import emit, need, setup_threads  # noqa: E402
from halludetect.activations.layer_format import layer_files  # noqa: E402
from halludetect.activations.layer_reader import read_layer  # noqa: E402
from halludetect.config import load_params  # noqa: E402
from halludetect.detectors.build import DETECTORS, build_detector, section  # noqa: E402
from halludetect.detectors.data import SplitData, p_sem_table, split_data  # noqa: E402
from halludetect.detectors.inference import score  # noqa: E402
from halludetect.detectors.training import SeedResult, train_detector, train_seeds  # noqa: E402
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


# ------------------------------------------------------------ seeds: forked workers vs batched
_JOB: dict = {}  # what forked workers read: set before the pool starts, inherited copy-on-write


def _train_one(seed: int) -> SeedResult:
    """One seed in a forked worker, as training.train_seeds did before the batched trainer."""
    job = _JOB
    with numerics.fixed_threads(1):
        t0 = time.perf_counter()
        res = train_detector(
            job["method"],
            job["params"],
            job["train"],
            job["val"],
            epochs=job["epochs"],
            batch_size=job["batch_size"],
            seed=seed,
        )
        seconds = time.perf_counter() - t0
        model = build_detector(job["method"], job["train"].tokens.shape[-1], job["params"])
        scores = {}
        for which, state in (("best", res.state_dict), ("last", res.last_state_dict)):
            model.load_state_dict(state)
            scores[which] = {split: score(model, data) for split, data in job["score"].items()}
    return SeedResult(seed, res, scores["best"], scores["last"], seconds)


def forked_seeds(method, params, train, val, score_splits, seeds, *, epochs, batch_size) -> list[SeedResult]:
    """The former train_seeds on the CPU: one forked single-threaded worker process per seed."""
    _JOB.update(
        method=method, params=params, train=train, val=val, score=score_splits, epochs=epochs, batch_size=batch_size
    )
    try:
        with ProcessPoolExecutor(
            len(seeds), mp_context=multiprocessing.get_context("fork"), initializer=torch.set_num_threads, initargs=(1,)
        ) as pool:
            return list(pool.map(_train_one, seeds))
    finally:
        _JOB.clear()


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def world_shaped(seed: int = 0, d: int = 128, n: dict | None = None) -> dict[str, SplitData]:
    """Synthetic splits of the world's shape: bags of 5-21 tokens (13 on average) of d features, a
    third hallucinated, each of those with a shifted direction on 1-3 of its tokens."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    out = {}
    for split, count in (n or {"train": 600, "val": 1000, "test": 1000}).items():
        lengths = rng.integers(5, 22, count)
        y = (rng.random(count) < 1 / 3).astype(np.int64)
        y[:2] = [0, 1]  # both classes, whatever the draw
        tokens = rng.normal(size=(int(lengths.sum()), d)).astype(np.float32)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in np.nonzero(y)[0]:
            rows = offsets[i] + rng.choice(lengths[i], rng.integers(1, 4), replace=False)
            tokens[rows] += 1.5 * direction
        out[split] = SplitData(
            torch.from_numpy(tokens),
            torch.from_numpy(offsets),
            torch.from_numpy(y).float(),
            [f"{split}{i}/0" for i in range(count)],
        )
    return out


def max_abs_difference(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def batched_vs_forked(args) -> None:
    params = load_params()
    epochs, batch_size, seeds = args.epochs or params.train.epochs, params.train.batch_size, [0, 1, 2]
    if CELL.exists() and (LABELS / "judgments.parquet").exists():
        files = layer_files(CELL)
        layer = args.layer if args.layer is not None else max(files)
        data = read_layer(files[layer], dtype=None)
        judgments = pl.read_parquet(LABELS / "judgments.parquet")
        splits = {s: split_data(data, judgments, s) for s in ("train", "val", "test")}
        source = f"world layer {layer}"
    else:
        splits = world_shaped()
        source = "synthetic, world-shaped (no demo world here)"
    train, val = splits["train"], splits["val"]
    scored = {"val": val, "test": splits["test"]}
    per_method = {}
    for method in args.methods.split(","):
        mp = section(params.detectors, method)
        kw = {"epochs": epochs, "batch_size": batch_size}
        timing = {}
        for name, fn in (("forked", forked_seeds), ("batched", train_seeds)):
            c0, t0 = cpu_seconds(), time.perf_counter()
            timing[name] = (
                fn(method, mp, train, val, scored, seeds, **kw),
                time.perf_counter() - t0,
                cpu_seconds() - c0,
            )
        (old, old_wall, old_cpu), (new, new_wall, new_cpu) = timing["forked"], timing["batched"]
        per_method[method] = {
            "forked_wall_s": old_wall,
            "forked_cpu_s": old_cpu,
            "batched_wall_s": new_wall,
            "batched_cpu_s": new_cpu,
            "wall_ratio_forked_over_batched": old_wall / new_wall,
            "cpu_ratio_forked_over_batched": old_cpu / new_cpu,
            "max_abs_weight_difference": {
                str(a.seed): max(
                    max_abs_difference(a.result.state_dict, b.result.state_dict),
                    max_abs_difference(a.result.last_state_dict, b.result.last_state_dict),
                )
                for a, b in zip(old, new, strict=True)
            },
            "same_best_epochs": all(a.result.best_epoch == b.result.best_epoch for a, b in zip(old, new, strict=True)),
            "max_abs_test_score_difference": max(
                float(np.abs(a.scores["test"] - b.scores["test"]).max()) for a, b in zip(old, new, strict=True)
            ),
        }
        print(method, per_method[method], flush=True)
    emit(
        {
            "bench": "training_batched_seeds",
            "data": source,
            "shape": {
                s: {"bags": len(x), "tokens": int(x.tokens.shape[0]), "d": int(x.tokens.shape[1])}
                for s, x in splits.items()
            },
            "cpus": os.cpu_count(),
            "epochs": epochs,
            "batch_size": batch_size,
            "seeds": seeds,
            "methods": per_method,
        }
    )


def epoch_cost(args) -> None:
    """Seconds per seed and epoch of each part of train_batched (module docstring), per method."""
    from halludetect.detectors import batched
    from halludetect.detectors.data import entropy_for, p_sem_for

    need(CELL, LABELS / "judgments.parquet", LABELS / "clusters.parquet")
    params = load_params()
    epochs, batch_size, seeds = args.epochs or 20, params.train.batch_size, params.train.seeds
    files = layer_files(CELL)
    layer = args.layer if args.layer is not None else sorted(files)[len(files) // 2]
    data = read_layer(files[layer], dtype=None)
    judgments = pl.read_parquet(LABELS / "judgments.parquet")
    clusters = LABELS / "clusters.parquet"
    methods = args.methods.split(",") if args.methods != parser_default_methods() else list(TIMED_METHODS)
    from halludetect.methods import method as lookup_method

    spent: dict[str, float] = {}

    def timed_as(name, fn, key=None):  # fn, its time added to spent[key(args) or name]
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                part = key(*a) if key else name
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - t0

        return wrapper

    out = {}
    originals = (batched.score, batched.GradientRatioTrace.record)
    for method in methods:
        mp = section(params.detectors, method)
        reads = clusters if lookup_method(method).reads.p_sem else None  # only those that read the clustering
        split = {
            s: split_data(
                data,
                judgments,
                s,
                str(files[layer]),
                p_sem_for(method, reads, mp),
                method=method,
                entropy=entropy_for(method, reads, mp) if s == "train" else None,
            )
            for s in ("train", "val")
        }
        spent.clear()
        batched.score = timed_as(
            "score", originals[0], key=lambda _m, d, *r: "val_scores" if d is split["val"] else "train_margins"
        )
        batched.GradientRatioTrace.record = timed_as("gradient_ratio_trace", originals[1])
        try:
            with numerics.fixed_threads(1):  # as a train stage's process
                t0 = time.perf_counter()
                batched.train_batched(
                    method, mp, split["train"], split["val"], seeds, epochs=epochs, batch_size=batch_size
                )
                total = time.perf_counter() - t0
        finally:
            batched.score, batched.GradientRatioTrace.record = originals
        per = len(seeds) * epochs
        parts = {"steps": total - sum(spent.values()), **spent}
        out[method] = {
            "ms_per_seed_epoch": round(total / per * 1000, 2),
            **{f"{k}_share": round(v / total, 3) for k, v in parts.items()},
        }
        print(method, out[method], flush=True)
    emit(
        {
            "bench": "training_epoch_cost",
            "data": f"world layer {layer}",
            "shape": {s: {"bags": len(x), "tokens": int(x.tokens.shape[0])} for s, x in split.items()},
            "epochs": epochs,
            "seeds": seeds,
            "batch_size": batch_size,
            "methods": out,
        }
    )


# the methods trained in epochs (the others fit in closed form or compute a score)
TIMED_METHODS = (
    "hami",
    "hami_sp",
    "mean",
    "max",
    "raw_mean",
    "raw_max",
    "attention",
    "gated_attention",
    "probe",
    "saplma",
)


def parser_default_methods() -> str:
    return "max,hami,attention,saplma"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", type=int, default=None, help="layer for the loop baseline (default: the last)")
    ap.add_argument("--epochs", type=int, default=None, help="default: train.epochs of params.yaml")
    ap.add_argument("--batched", action="store_true", help="only the seeds' comparison: forked workers vs batched")
    ap.add_argument(
        "--methods",
        default=parser_default_methods(),
        help="with --batched: which methods (default max,hami,attention,saplma); with --epoch-cost: every method "
        "trained in epochs unless given",
    )
    ap.add_argument("--epoch-cost", action="store_true", help="only an epoch's parts per method (module docstring)")
    args = ap.parse_args()
    if args.epoch_cost:
        epoch_cost(args)
        return
    if args.batched:
        batched_vs_forked(args)
        return
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
            "seeds_batched_s": min(parallel_s),
            "seeds_ratio": min(sequential_s) / min(parallel_s),
        }
    )


if __name__ == "__main__":
    main()
