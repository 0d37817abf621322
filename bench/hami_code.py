"""HaMI and HaMI (SP) under `train.recipe: authors` against the HaMI code's own training loop, paired
by seed on the world's states (issue 36).

  hami_code  the HaMI code's loop (github.com/mala-lab/HaMI at 3d27760), transcribed: main.py:24-29
             (init_seed: random, numpy and torch seeded), main.py:55-56 (one DataLoader per class,
             batch_size 128 each, shuffle=True, drop_last=True), main.py:64 and hami.py:8-36 (the
             network: Linear-BatchNorm-ReLU-Dropout(0.3)-Linear-Sigmoid on every token),
             hami.py:40-82 (MIL_loss), train.py:16-61 (Adam lr 1e-3, wd 5e-4; ReduceLROnPlateau
             (min, factor 0.1, patience 20, min lr 1e-6) stepped on every step's training loss;
             `--epoch 100` steps, each followed by validation and the best-model choice) and
             validate.py:6-25 (eval mode, bag by bag, the top-k mean of the tokens' sigmoid scores).
             HaMI (SP) scales the states by (a + b P_sem), a = 1, b = lam (utils.py:53-54, mode
             `se`), with our P_sem variant. The best model's test AUROC is validate's on our test split.
  ours       `train_seeds(method, ..., recipe="authors")`, the train stage's call (the seeds batched,
             batched.py), with `bag_score: sigmoid` (the HaMI code's validation and test score) unless
             --bag-score says otherwise; the test AUROC of each seed's best weights.

Same data for both: the world's train / val / test splits of the layer evaluate chose (read from
metrics/eval/world/world/<method>.json), params.yaml's method section, epochs and batch size. A
seed gives both the same initial weights (tests/bench/test_hami_code.py); after that their random
streams differ (the HaMI code draws batches and dropout from torch's global generator, ours its
batches from a generator of the seed's own), so a seed pairs the two runs, not their draws.
Prints one JSON line per method: per-seed test AUROCs, the paired differences ours - hami_code and
their mean and sd.

    python -m bench.hami_code [--root /tmp/repro_clone] [--seeds 0,1,2,3,4] [--methods hami,hami_sp]
"""

from __future__ import annotations

from halludetect.core import numerics

numerics.pin(threads=1)  # as the train stage's workers

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from bench.common import emit, need  # noqa: E402
from halludetect.activations.layer_format import layer_filename  # noqa: E402
from halludetect.activations.layer_reader import read_layer  # noqa: E402
from halludetect.config import load_params  # noqa: E402
from halludetect.detectors.build import section  # noqa: E402
from halludetect.detectors.data import SplitData, p_sem_for, split_data  # noqa: E402
from halludetect.detectors.training import train_seeds  # noqa: E402
from halludetect.labels.readers import read_judgments  # noqa: E402
from halludetect.metrics import auroc  # noqa: E402

CELL = "world/world"


# ------------------------------------------------------------------ the HaMI code, transcribed
def init_seed(seed: int) -> None:  # main.py:24-29
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def hami_net(d: int) -> nn.Module:  # hami.py:14-21
    return nn.Sequential(
        nn.Linear(d, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 1), nn.Sigmoid()
    )


def mil_loss(scores: torch.Tensor, n_len: list[int], a_len: list[int], k_ratio: float) -> torch.Tensor:
    """hami.py:40-82, as written (len_thresh 8, smoothness weight 0.0008)."""
    smooth, loss, start, nor_max = torch.tensor(0.0), torch.tensor(0.0), 0, []
    for n in n_len:
        s = scores[start : start + n]
        start += n
        nor_max.append(torch.topk(s, int(n * k_ratio) + 1).values.mean())
        if n > 8:
            smooth = smooth + torch.sum((s[: n - 1] - s[1:]) ** 2) * 0.0008
    for i, n in enumerate(a_len):
        s = scores[start : start + n]
        start += n
        a = torch.topk(s, int(n * k_ratio) + 1).values.mean()
        if n > 8:
            smooth = smooth + torch.sum((s[: n - 1] - s[1:]) ** 2) * 0.0008
        loss = loss + (1.0 - a**2 + nor_max[i] ** 2)
    return loss / len(n_len) + smooth / len(n_len)


def validate(model: nn.Module, bags: list[torch.Tensor], y: np.ndarray, k_ratio: float) -> float:
    """validate.py:6-25: eval mode, one bag at a time, the top-k mean of its sigmoid scores."""
    model.eval()
    with torch.no_grad():
        scores = [torch.topk(model(h).flatten(), int(h.shape[0] * k_ratio) + 1).values.mean().item() for h in bags]
    return float(roc_auc_score(y, np.array(scores)))


def hami_code(train: list, val: tuple, test: tuple, seed: int, steps: int, batch_size: int, k_ratio: float) -> dict:
    """main.py:53-69 and train.py:16-61 for one layer: the best step's test AUROC."""
    nor, abn = train
    init_seed(seed)
    nor_loader = DataLoader(
        TensorDataset(torch.arange(len(nor)), torch.zeros(len(nor))), batch_size, shuffle=True, drop_last=True
    )
    abn_loader = DataLoader(
        TensorDataset(torch.arange(len(abn)), torch.ones(len(abn))), batch_size, shuffle=True, drop_last=True
    )
    model = hami_net(nor[0].shape[1])
    opt = torch.optim.Adam(model.parameters(), lr=0.001, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.1, patience=20, min_lr=1e-6)
    best, best_step, model_best, lrs = 0.0, 0, None, []
    for step in range(1, steps + 1):
        if (step - 1) % len(nor_loader) == 0:
            n_iter = iter(nor_loader)
        if (step - 1) % len(abn_loader) == 0:
            a_iter = iter(abn_loader)
        model.train()
        n_idx, _ = next(n_iter)
        a_idx, _ = next(a_iter)
        ninput, ainput = [nor[i] for i in n_idx], [abn[i] for i in a_idx]
        scores = model(torch.cat([torch.cat(ninput), torch.cat(ainput)])).flatten()
        loss = mil_loss(scores, [h.shape[0] for h in ninput], [h.shape[0] for h in ainput], k_ratio)
        opt.zero_grad()
        loss.backward()
        opt.step()
        lrs.append(opt.param_groups[0]["lr"])
        with warnings.catch_warnings():  # it passes the loss tensor itself, which torch warns about
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step(loss)
        val_auc = validate(model, *val, k_ratio)
        if val_auc > best:
            best, best_step, model_best = val_auc, step, copy.deepcopy(model)
    return {"test_auroc": validate(model_best, *test, k_ratio), "best_step": best_step, "last_lr": lrs[-1]}


# ------------------------------------------------------------------ our data, as the train stage reads it
def bag_list(data: SplitData, lam: float) -> list[torch.Tensor]:
    """Each response's [T, d] states, scaled by (1 + lam P_sem) for HaMI (SP) (utils.py:53-54)."""
    bags = list(data.tokens.split(data.lengths.tolist()))
    if data.p_sem is not None and lam:
        bags = [h * (1 + lam * float(p)) for h, p in zip(bags, data.p_sem, strict=True)]
    return bags


def compare(root: Path, method: str, seeds: list[int], bag_score: str) -> dict:
    params = load_params(root / "params.yaml")
    tp = params.train
    method_params = section(params.detectors, method).model_copy(update={"bag_score": bag_score})
    layer_k = json.loads((root / f"metrics/eval/{CELL}/{method}.json").read_text())["best_layer"]
    labels = root / f"data/labels/{CELL}"
    path = root / f"data/activations/{CELL}" / layer_filename(layer_k)
    need(path, labels / "judgments.parquet")
    layer = read_layer(path, dtype=None, expect_layer=layer_k)
    p_sem = p_sem_for(method, labels / "clusters.parquet" if method == "hami_sp" else None, method_params)
    judgments = read_judgments(labels / "judgments.parquet")
    data = {s: split_data(layer, judgments, s, str(path), p_sem, method=method) for s in ("train", "val", "test")}
    lam = getattr(method_params, "lam", 0.0)

    t0 = time.perf_counter()
    ours = train_seeds(
        method,
        method_params,
        data["train"],
        data["val"],
        {"test": data["test"]},
        seeds,
        epochs=tp.epochs,
        batch_size=tp.batch_size,
        recipe="authors",
    )
    ours_s = time.perf_counter() - t0
    y_test = data["test"].y.numpy()
    train_bags, ytr = bag_list(data["train"], lam), data["train"].y.tolist()
    train = (
        [h for h, c in zip(train_bags, ytr, strict=True) if c == 0],
        [h for h, c in zip(train_bags, ytr, strict=True) if c == 1],
    )
    val = (bag_list(data["val"], lam), data["val"].y.numpy())
    test = (bag_list(data["test"], lam), y_test)
    t0 = time.perf_counter()
    code = [hami_code(train, val, test, s, tp.epochs, tp.batch_size, method_params.k_ratio) for s in seeds]
    code_s = time.perf_counter() - t0
    mine = [float(auroc(y_test, r.scores["test"])) for r in ours]
    theirs = [c["test_auroc"] for c in code]
    diff = np.subtract(mine, theirs)
    return {
        "method": method,
        "layer": layer_k,
        "bag_score": bag_score,
        "seeds": seeds,
        "n_train": {"correct": len(train[0]), "hallucinated": len(train[1])},
        "hami_code": {
            "test_auroc": theirs,
            "mean": float(np.mean(theirs)),
            "best_step": [c["best_step"] for c in code],
            "last_lr": [c["last_lr"] for c in code],
            "seconds": code_s,
        },
        "ours_authors": {
            "test_auroc": mine,
            "mean": float(np.mean(mine)),
            "best_step": [r.result.best_epoch for r in ours],
            "last_lr": [r.result.curve[-1]["lr"] for r in ours],
            "seconds": ours_s,
        },
        "paired_diff_ours_minus_code": {
            "per_seed": diff.tolist(),
            "mean": float(diff.mean()),
            "sd": float(diff.std(ddof=1)),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="a repository whose world DAG has run (dvc repro)")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds, each run by both loops")
    ap.add_argument("--methods", default="hami,hami_sp", help="hami, hami_sp or both")
    ap.add_argument(
        "--bag-score", default="sigmoid", choices=["sigmoid", "logits"], help="our bag score (the HaMI code's: sigmoid)"
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    for method in args.methods.split(","):
        emit(compare(args.root, method, seeds, args.bag_score))


if __name__ == "__main__":
    main()
