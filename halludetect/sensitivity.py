"""How HaMI's bag logit answers the semantic scaling: the paper's analysis of HaMI (SP).

For a trained HaMI network f (eval mode, so batch norm uses its running statistics) and a bag
B of token states h_i, scaling every state by (1 + p) gives the bag logit

    Z_B(p) = top-k mean_i f((1 + p) h_i),        HaMI (SP) applies p_B = lam * P_sem(B).

The paper's quantities, per bag:
  C_B       = -dZ_B/dp at p = 0 (autograd). Where the ReLU active set and the top-k set do not
              change, it equals the closed form -mean_{i in top-k} sum_{j active} w_j g_j x_ij / s_j
              (x = W h, g the batch-norm weight, s its running standard deviation).
  C_B^int   = -(1/p_B) int_0^p_B Z_B'(p) dp, the average slope along the path, approximated with
              N midpoint steps (the paper: N = 1000). Z is continuous piecewise-linear in p, so
              Z_B(p_B) = Z_B(0) - p_B C_B^int holds whatever the active set does on the way.
  C_B^exact = (Z_B(0) - Z_B(p_B)) / p_B, the value the integral must reach: a check of the
              discretisation (undefined where p_B = 0).
Per class (the paper's "neg" = correct = label 0, "pos" = hallucinated = label 1):
  E[P_sem], E[C], E[P_sem C], gamma = E_neg[P_sem C] / E_pos[P_sem C], and the margin condition
  |S_neg| / |S_pos| > 1 / gamma, under which the scaling widens the margin mean(y Z).

Everything is batched: Z_B depends on p_B only, so one backward pass of sum_B Z_B(p_B), with a
tensor of per-bag (and per-step) p, gives every bag's derivative at once. The first linear layer
is applied once: W((1 + p) h) + b = (1 + p) (W h) + b, so a path step costs only the
D-dimensional rest of the network, not the d-dimensional projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from halludetect.detectors.bags import Bags
from halludetect.detectors.networks import HaMI
from halludetect.detectors.pooling import topk_mean

# Elements of one [steps, tokens, D] pre-activation chunk (64 MiB in float32): bounds memory
# whatever the number of tokens, while keeping enough steps per pass to stay vectorised.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class BagSensitivity:
    """Per bag [B]: the scaling p_B, Z_B(0), Z_B(p_B), C_B at 0, C_B^int and the exact value."""

    p: np.ndarray
    z0: np.ndarray
    z_p: np.ndarray
    c0: np.ndarray
    c_int: np.ndarray
    c_exact: np.ndarray  # NaN where p_B = 0


def _check(model) -> HaMI:
    if not isinstance(model, HaMI):
        raise TypeError(f"the sensitivity analysis is defined for HaMI networks, not {type(model).__name__}")
    if model.training:
        raise ValueError("put the detector in eval mode first: the analysis uses batch norm's running statistics")
    return model


def scaled_logits(model: HaMI, projected: torch.Tensor, bags: Bags, p: torch.Tensor) -> torch.Tensor:
    """Z_B(p) for every row of p [S, B] (S values of p per bag) -> [S, B].

    `projected` [N, D] is W h of the bags' tokens (the first linear layer without its bias).
    """
    first, rest = model.net[0], model.net[1:]  # Linear(d, D) | BN-ReLU-Dropout-Linear(D, 1)
    steps = p.shape[0]
    scale = 1 + bags.per_token(p.T).T  # [S, N]
    pre = scale[:, :, None] * projected[None] + first.bias  # [S, N, D]
    z = rest(pre.reshape(-1, pre.shape[-1])).reshape(steps, -1)  # [S, N] token logits
    padded = bags.pad(z.T)  # [B, T, S]
    flat = padded.permute(2, 0, 1).reshape(steps * len(bags), -1)  # [S*B, T]
    mask = bags.mask.repeat(steps, 1)  # [S*B, T]
    return topk_mean(flat, mask, model.k_ratio).reshape(steps, len(bags))


def _slopes(model: HaMI, projected: torch.Tensor, bags: Bags, p: torch.Tensor) -> torch.Tensor:
    """dZ_B/dp at every p [S, B] -> [S, B]: one backward pass of the sum (each Z depends on its own p)."""
    p = p.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        z = scaled_logits(model, projected, bags, p)
        (grad,) = torch.autograd.grad(z.sum(), p)
    return grad


def bag_sensitivity(model, bags: Bags, p: torch.Tensor, steps: int = 1000) -> BagSensitivity:
    """The paper's sensitivities of every bag to its scaling p [B] (p_B = lam * P_sem)."""
    model = _check(model)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if p.shape != (len(bags),):
        raise ValueError(f"p must hold one scaling per bag: shape {tuple(p.shape)} for {len(bags)} bags")
    if bool((p < 0).any()):
        raise ValueError("p = lam * P_sem must be >= 0")
    p = p.to(bags.tokens.dtype)
    with torch.no_grad():
        projected = bags.tokens @ model.net[0].weight.T  # [N, D]
        z = scaled_logits(model, projected, bags, torch.stack([torch.zeros_like(p), p]))  # [2, B]
    c0 = -_slopes(model, projected, bags, torch.zeros_like(p)[None])[0]
    # Midpoints of N equal steps along [0, p_B]: (k + 1/2) / N * p_B, k = 0..N-1.
    t = (torch.arange(steps, dtype=p.dtype) + 0.5) / steps  # [N]
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, projected.numel()))
    total = torch.zeros_like(p)
    for a in range(0, steps, per_chunk):
        total += _slopes(model, projected, bags, t[a : a + per_chunk, None] * p[None]).sum(0)
    c_int = -total / steps
    z0, z_p = z[0], z[1]
    c_exact = torch.where(p > 0, (z0 - z_p) / torch.where(p > 0, p, 1), torch.nan)
    as_np = lambda v: v.detach().cpu().double().numpy()  # noqa: E731
    return BagSensitivity(as_np(p), as_np(z0), as_np(z_p), as_np(c0), as_np(c_int), as_np(c_exact))


def closed_form_c(model, bags: Bags) -> np.ndarray:
    """The paper's C_B at p = 0 for fixed active and top-k sets, written out (a reference for tests
    and readers): C(x_i) = -sum_{j active} w_j g_j x_ij / s_j, averaged over the bag's top-k tokens."""
    model = _check(model)
    first, bn, last = model.net[0], model.net[1], model.net[4]
    with torch.no_grad():
        x = bags.tokens.double() @ first.weight.double().T  # [N, D]
        sigma = torch.sqrt(bn.running_var.double() + bn.eps)
        pre = bn.weight.double() * (x + first.bias.double() - bn.running_mean.double()) / sigma + bn.bias.double()
        active = pre > 0
        c_token = -(active * last.weight.double()[0] * bn.weight.double() * x / sigma).sum(1)  # [N]
        z_token = (torch.relu(pre) * last.weight.double()[0]).sum(1) + last.bias.double()  # [N]
        out = []
        for i, (zi, ci) in enumerate(zip(bags.pad(z_token, float("-inf")), bags.pad(c_token))):
            n = int(bags.lengths[i])
            k = int(np.floor(n * model.k_ratio)) + 1
            top = torch.topk(zi[:n], k).indices
            out.append(float(ci[top].mean()))
    return np.asarray(out)


# --------------------------------------------------------------------- class expectations
def _ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def class_expectations(p_sem: np.ndarray, c: np.ndarray, y: np.ndarray) -> dict:
    """E[P_sem], E[C] and E[P_sem C] per class, gamma, 1/gamma and the margin condition.

    y: 1 = hallucinated ("pos"), 0 = correct ("neg"). The scaling changes the margin
    mean(y Z) (y in {-1, 1}) by (sum_neg p C - sum_pos p C) / |S|, so it widens the margin iff
    |S_neg| E_neg[P C] > |S_pos| E_pos[P C]; with E_pos[P C] > 0 that is the paper's
    |S_neg| / |S_pos| > 1 / gamma. Both readings are returned; they differ only when
    E_pos[P C] <= 0, where the paper's ratio form no longer applies.
    """
    y = np.asarray(y).astype(bool)
    if y.all() or not y.any():
        raise ValueError("the class expectations need both classes")
    out: dict = {}
    for name, sel in (("neg", ~y), ("pos", y)):
        out[name] = {"n": int(sel.sum()), "p_sem": float(p_sem[sel].mean()), "c": float(c[sel].mean()),
                     "p_sem_c": float((p_sem * c)[sel].mean())}
    neg, pos = out["neg"], out["pos"]
    gamma = _ratio(neg["p_sem_c"], pos["p_sem_c"])
    out["gamma"] = gamma
    out["inv_gamma"] = None if not gamma else 1 / gamma
    out["class_ratio"] = neg["n"] / pos["n"]  # |S_neg| / |S_pos|
    out["condition_holds"] = None if out["inv_gamma"] is None else bool(out["class_ratio"] > out["inv_gamma"])
    out["margin_widens"] = bool(neg["n"] * neg["p_sem_c"] > pos["n"] * pos["p_sem_c"])
    return out


def margin_change(sens: BagSensitivity, y: np.ndarray) -> dict:
    """The margin mean(y Z), y in {-1, 1}, without and with the scaling, measured from the
    logits, beside its prediction from the path-integrated sensitivities."""
    sign = 2 * np.asarray(y, dtype=np.float64) - 1
    unscaled, scaled = float(np.mean(sign * sens.z0)), float(np.mean(sign * sens.z_p))
    return {"unscaled": unscaled, "scaled": scaled, "change": scaled - unscaled,
            "change_from_c_int": float(np.mean(-sign * sens.p * sens.c_int))}
