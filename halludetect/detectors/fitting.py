"""Detectors fitted without the shared SGD loop: the `fitter` of their kind (`Method.fit`,
methods/spec.py; loop.py sends every kind with one here).

  fit_logistic  LOGISTIC_REGRESSION and SE_PROBE (the semantic-entropy probes, methods/sep.py):
                scikit-learn's LogisticRegression on each bag's state, copied into the network's
                linear head, fitted to the judge's labels or to the train split's semantic
                entropies binarised at the SEP code's best split;
  fit_nothing   UNSUPERVISED, a score with nothing to fit (EigenScore).

Both are deterministic, so every seed gives the same detector; the result has the shape of an SGD
run's (one "epoch", its validation AUROC against the judge's labels) so that the stages, the
metrics and the bundles treat every method alike.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from halludetect.core.errors import DataError
from halludetect.detectors.build import build_detector, check_scores
from halludetect.detectors.data import SplitData
from halludetect.detectors.inference import score
from halludetect.methods import method as lookup_method
from halludetect.metrics import auroc


def best_split(entropy: np.ndarray, n: int = 100) -> float:
    """The SEP code's binarisation threshold: among n thresholds from 1e-10 to the largest entropy,
    the one minimising sum_low (h - mean_low)^2 + sum_high (h - mean_high)^2, low = h < t and
    high = h >= t (an empty side adds 0); the first on ties, as np.argmin."""
    h = np.asarray(entropy, dtype=np.float64)
    t = np.linspace(1e-10, h.max(), n)  # [n]
    high = h[None, :] >= t[:, None]  # [n, N]

    def sse(mask: np.ndarray) -> np.ndarray:
        count = mask.sum(1)
        total = np.where(mask, h, 0.0).sum(1)
        squares = np.where(mask, h * h, 0.0).sum(1)
        mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
        return squares - 2 * mean * total + count * mean * mean  # sum (h - mean)^2 over the side

    return float(t[int(np.argmin(sse(~high) + sse(high)))])


def binarise(entropy: np.ndarray, threshold: float) -> np.ndarray:
    """1 where the entropy is at least the threshold (best_split's high side), else 0."""
    return (np.asarray(entropy) >= threshold).astype(np.int64)


def fit_detector(
    method: str, method_params, train: SplitData, val: SplitData, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], float, dict]:
    """For a method whose kind has a `fitter` (module docstring): its weights, its validation
    AUROC and what the fit did (loop.py makes the `TrainResult` of one epoch)."""
    model = build_detector(method, train.tokens.shape[-1], method_params)
    info: dict = {"epoch": 1} | lookup_method(method).fit.fit(model, method, method_params, train)
    model = model.to(device)
    val_z = score(model, val.to(device))
    check_scores(method, val_z, len(val), "the validation split")  # a plugin's: one finite score per bag
    val_auroc = float(auroc(val.y.cpu().numpy(), val_z))
    info["val_auroc"] = val_auroc
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return state, val_auroc, info


def fit_nothing(model, method: str, params, train: SplitData) -> dict:
    """UNSUPERVISED: the network is the score; nothing is fitted."""
    return {}


def fit_logistic(model, method: str, params, train: SplitData) -> dict:
    """LOGISTIC_REGRESSION and SE_PROBE: the network's linear head (`model.linear` on
    `model.features`) fitted in closed form to the kind's target."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    if lookup_method(method).fit.target == "semantic_entropy":
        if train.entropy is None:
            raise DataError(f"{method} is trained on the semantic entropy: the train split carries none")
        h = train.entropy.cpu().numpy()
        threshold = best_split(h, params.thresholds)
        y = binarise(h, threshold)
        target = {"target": "semantic_entropy", "threshold": threshold, "positives": int(y.sum()), "n": len(y)}
        if y.min() == y.max():
            raise DataError(
                f"{method}: the binarised semantic entropy of the {len(y)} train answers is one class "
                f"({int(y.sum())} high at threshold {threshold:.4g}): the K answers of every train question "
                "agree or none do; sample more answers (generate.n_samples) or train on more questions"
            )
    else:
        y = train.y.cpu().numpy().astype(np.int64)
        target = {"target": "label"}
    with torch.no_grad():
        x = model.features(train.slice(0, len(train))).double().cpu().numpy()  # [B, d]
    reg = LogisticRegression(C=params.C, max_iter=params.max_iter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # recorded below instead
        reg.fit(x, y)
    with torch.no_grad():
        model.linear.weight.copy_(torch.as_tensor(reg.coef_, dtype=model.linear.weight.dtype))
        model.linear.bias.copy_(torch.as_tensor(reg.intercept_, dtype=model.linear.bias.dtype))
    return {
        **target,
        "train_loss": float(log_loss(y, reg.predict_proba(x)[:, 1], labels=[0, 1])),
        "iterations": int(reg.n_iter_[0]),
        "converged": bool(reg.n_iter_[0] < params.max_iter),
    }
