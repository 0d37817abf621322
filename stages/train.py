"""Train one detector method on every layer of grid.layers, every seed, and score each layer's
validation and test responses with each seed's best weights (the layer's own evaluation).

One stage per method (not per layer: docs/development.md#stage-granularity). On the CPU the layers
train side by side in single-threaded processes, one per core, this one among them (the seeds of
a layer train together as one batched model in its process: detectors/batched.py), so the stage
keeps every core busy and holds at most one layer's states per process; a layer gives the same
bytes whatever the number of processes. A layer too small to be worth a worker's start trains here
(`workers_for`); HALLUDETECT_TRAIN_PROCESSES=N fixes the count. On a GPU the layers train one after
another in this process. `--layers` trains
a subset into the same directories (what `halludetect train-layer` runs for a colleague who pulled
one layer file).
"""

import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from halludetect.activations.layer_format import layer_filename
from halludetect.activations.layer_reader import open_layer, read_layer
from halludetect.core.atomic_io import write_json
from halludetect.core.devices import resolve_device
from halludetect.core.errors import DataError
from halludetect.detectors.build import build_detector, section
from halludetect.detectors.data import SPLITS, entropy_for, p_sem_for, split_data
from halludetect.detectors.training import train_layer, training_time
from halludetect.labels.readers import read_judgments
from halludetect.labels.routing import take_routed
from halludetect.methods import method
from stages import common

_JOB: dict = {}  # what a layer's training reads besides its file: set in each worker by `setup`


def check_layer_files(activations: Path, layers: list[int]) -> int:
    """Every layer file there, well formed and of its layer, before any training (states unread);
    returns the largest layer's tokens x dimensions."""
    if missing := [layer_filename(k) for k in layers if not (activations / layer_filename(k)).exists()]:
        raise DataError(
            f"{activations} has no {', '.join(missing)}: dump.layers must cover grid.layers "
            "(the dump stage writes them; `dvc pull` fetches a pushed one)"
        )
    size = 0
    for k in layers:
        path = activations / layer_filename(k)
        f, _, _ = open_layer(path)
        with f:
            if "layer" in f.attrs and int(f.attrs["layer"]) != k:
                raise DataError(f"{path} holds layer {int(f.attrs['layer'])}, not layer {k}: re-run dump")
            size = max(size, int(np.prod(f["states"].shape)))
    return size


def train_one_layer(k: int) -> tuple[int, dict]:
    """Read layer k, train every seed on it, write its outputs; returns (k, its training time)."""
    job, args = _JOB, _JOB["args"]
    path = Path(args.activations) / layer_filename(k)
    layer = read_layer(path, dtype=None, expect_layer=k)
    build_detector(args.method, layer.states.shape[1], job["method_params"])  # a plugin's build, before any work
    split = {
        s: split_data(
            layer,
            job["judgments"],
            s,
            str(path),
            job["p_sem"],
            method=args.method,
            entropy=job["entropy"] if s == "train" else None,
        )
        for s in SPLITS
    }
    del layer
    t0 = time.perf_counter()
    tp = job["train"]
    results = train_layer(
        args.method,
        job["method_params"],
        split,
        tp.seeds,
        layer=k,
        epochs=tp.epochs,
        batch_size=tp.batch_size,
        device=job["device"],
        out_dir=Path(args.out) / f"layer_{k}",
        scores_path=Path(args.scores) / f"layer_{k}.parquet",
        metrics_path=Path(args.metrics) / f"layer_{k}.json",
        recipe=tp.recipe,
        log=common.log.info,
    )
    wall = time.perf_counter() - t0
    common.log.info("%s layer %d: %.1f s", args.method, k, wall)
    return k, training_time(results, wall, job["workers"], job["device"])


# A spawned worker spends 2 to 3 s of CPU importing torch and the pipeline before its first layer;
# a layer whose training is estimated below that trains in this process instead.
WORKER_START_S = 2.0
# What one core trains a second, in tokens x dimensions x epochs x seeds: the world's `max` layer
# (44,748 tokens x 128 x 100 epochs x 3 seeds) took about 29 s on the 2-core AMD EPYC, 2026-11-27
# (metrics/timing/world/world/max.json). The methods differ by a few times, which is close enough to
# tell a layer of seconds from one of minutes; the bytes never depend on the choice.
TRAIN_RATE = 6e7
PROCESSES_ENV = "HALLUDETECT_TRAIN_PROCESSES"
# The cores this stage may count on, where it shares the machine: `halludetect repro --jobs N` gives
# each command its share (runner/parallel_repro.py, which names it too), so that stages side by side
# do not each spawn a worker per core.
CORES_ENV = "HALLUDETECT_CORES"


def workers_for(device: str, n_layers: int, layer_work: float) -> int:
    """How many processes train the layers: on the CPU one per core (of $HALLUDETECT_CORES, the stage's
    share, where set), never more than layers, and one where a layer's training (`layer_work`: tokens x
    dimensions x epochs x seeds) is estimated to take less than a worker's start;
    $HALLUDETECT_TRAIN_PROCESSES, where set, instead. The GPU trains in this process."""
    if device != "cpu":
        return 1
    if fixed := os.environ.get(PROCESSES_ENV):
        if not fixed.isdigit() or int(fixed) < 1:
            raise DataError(f"{PROCESSES_ENV}={fixed!r}: a count of processes, 1 or more, is expected")
        return min(int(fixed), n_layers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if share := os.environ.get(CORES_ENV):
        if not share.isdigit() or int(share) < 1:
            raise DataError(f"{CORES_ENV}={share!r}: a count of cores, 1 or more, is expected")
        cores = min(cores, int(share))
    if layer_work / TRAIN_RATE < WORKER_START_S:
        return 1
    return max(1, min(cores, n_layers))


def setup(args, method_params, tp, device: str, workers: int) -> None:
    """What every layer's training reads besides its layer file: the labels, and P_sem or the semantic
    entropy for the methods that read the clustering (a missing or unexpected --clusters fails here)."""
    _JOB.update(
        args=args,
        method_params=method_params,
        p_sem=p_sem_for(args.method, args.clusters, method_params),
        entropy=entropy_for(args.method, args.clusters, method_params),
        judgments=read_judgments(args.judgments),
        train=tp,
        device=device,
        workers=workers,
    )


def train_beside_workers(layers: list[int], n: int, args, method_params, tp, device: str) -> list[tuple[int, dict]]:
    """`train_one_layer` of every layer on n processes: this one and n - 1 workers, each taking the
    next layer when it is free. This process trains too because it has imported and read what a
    layer needs already (a spawned worker spends about 2 s of CPU on its imports); every process is
    single-threaded (core/numerics.py), so a layer's bytes do not depend on which one trains it.
    The first error stops the handing out of layers and is raised once the running ones end."""
    pending, lock = iter(layers), threading.Lock()
    done: list[tuple[int, dict]] = []
    errors: list[BaseException] = []

    def take() -> int | None:
        with lock:
            return None if errors else next(pending, None)

    def keep(result=None, error: BaseException | None = None) -> None:
        with lock:
            if error is None:
                done.append(result)
            else:
                errors.append(error)

    # spawn, not fork: this process has used polars' and HDF5's thread pools, and a forked child
    # inherits their locks held (it hung). Each worker reads the labels itself.
    context = multiprocessing.get_context("spawn")
    init = (args, method_params, tp, device, n)
    with ProcessPoolExecutor(n - 1, mp_context=context, initializer=setup, initargs=init) as pool:

        def feed() -> None:  # one thread per worker: hands it layers, waits for each (no CPU)
            while (k := take()) is not None:
                try:
                    keep(pool.submit(train_one_layer, k).result())
                except BaseException as e:  # noqa: BLE001  (raised below, in the stage's thread)
                    keep(error=e)

        feeders = [threading.Thread(target=feed, daemon=True) for _ in range(n - 1)]
        for t in feeders:
            t.start()
        try:
            while (k := take()) is not None:
                keep(train_one_layer(k))
        except BaseException as e:
            keep(error=e)
        for t in feeders:
            t.join()
    if errors:
        raise errors[0]
    return sorted(done)


def run(args, params):
    if common.hand_over("train", args, params):  # a score: nothing to train (stages/train_score.py)
        return
    tp = params.train
    device = resolve_device(tp.device, "train.device")  # before any file is read
    method_params = section(params.detectors, args.method)
    take_routed(args, "train")  # the clustering, for a method that reads it
    layers = args.layers if args.layers is not None else params.grid.layers
    if unknown := sorted(set(layers) - set(params.grid.layers)):
        raise DataError(f"--layers {unknown}: not in grid.layers {params.grid.layers}")
    setup(args, method_params, tp, device, 1)  # here too: its checks stop the stage before any file is read
    size = check_layer_files(Path(args.activations), layers)
    passes = tp.epochs if method(args.method).fit.loop else 1  # a closed-form fit reads its data once
    n = _JOB["workers"] = workers_for(device, len(layers), size * passes * len(tp.seeds))
    try:
        if n <= 1:
            done = [train_one_layer(k) for k in layers]
        else:
            done = train_beside_workers(layers, n, args, method_params, tp, device)
    finally:
        _JOB.clear()
    timing = {f"layer_{k}": t for k, t in done}
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
    p.add_argument("--clusters", help="clusters Parquet (P_sem or SE), for the methods that read the clustering")
    p.add_argument(
        "--routed", help="the route stage's directory for this method (data/routed/<m>/<d>/train/<method>): --clusters"
    )
    p.add_argument("--out", required=True, help="output directory: layer_<L>/seed_<S>.safetensors, curves.json, ...")
    p.add_argument(
        "--scores", required=True, help="directory of Parquet files: layer_<L>.parquet, each response's logit per seed"
    )
    p.add_argument("--metrics", required=True, help="directory of the layers' val/test figures (layer_<L>.json)")
    p.add_argument(
        "--timing", help="the layers' training times (JSON, apart from the figures: wall times differ per run)"
    )
    p.add_argument("--generations", help="generations Parquet: what a score is computed from (stages/train_score.py)")
    p.add_argument("--questions", help="questions Parquet: p(True)'s prompt")
    p.add_argument(
        "--layers",
        type=layer_list,
        help="comma-separated layers to train (default: grid.layers); others are left as they are",
    )
    common.main(run, p)
