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

Everything is batched over bags and path steps, with no per-bag loop. C_B is autograd's: Z_B
depends on p_B only, so one backward pass of sum_B Z_B(p_B), with a tensor of per-bag p, gives
every bag's derivative at once. The N path slopes use the same derivative in closed form for the
active sets at each step (equal to autograd's, a test holds it to that). Along the path each ReLU
unit switches at most once, so one pass finds where, and a step then costs O(tokens) rather than
O(tokens x D) (_crossing_path_sum): N = 1000 steps cost about as much as a few forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from halludetect.activations.bags import Bags
from halludetect.detectors.networks import Dropout, HaMI
from halludetect.detectors.pooling import topk_count, topk_mean

# Elements of one [steps, tokens] chunk of the path (x4 tensors, 128 MiB in float64): bounds
# memory whatever the number of tokens, while keeping enough steps per pass to stay vectorised.
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
    """dZ_B/dp at every p [S, B] -> [S, B] by autograd through the model's own modules: one
    backward pass of the sum (each Z depends on its own p only)."""
    p = p.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        z = scaled_logits(model, projected, bags, p)
        (grad,) = torch.autograd.grad(z.sum(), p)
    return grad


@dataclass
class _Folded:
    """The eval-mode network folded into per-token and per-unit terms: the pre-activation of unit
    j of token i at scaling p is (1 + p) xg_ij + c_j, with xg = g * (W h) / s (batch norm's gain g
    over its running standard deviation s) and c = g * (b - mu) / s + beta. Exact algebra, no
    approximation: it only moves batch norm's affine map out of the loop over path steps."""

    xg: torch.Tensor  # [N, D]
    xgw: torch.Tensor  # [N, D]  xg * w (w: the last layer's weights)
    c: torch.Tensor  # [D]
    cw: torch.Tensor  # [D]  c * w
    b2: torch.Tensor  # []


def _fold(model: HaMI, projected: torch.Tensor) -> _Folded:
    first, bn, relu, drop, last = model.net
    kinds = (torch.nn.Linear, torch.nn.BatchNorm1d, torch.nn.ReLU, (Dropout, torch.nn.Dropout), torch.nn.Linear)
    if not all(isinstance(m, k) for m, k in zip((first, bn, relu, drop, last), kinds)):
        raise TypeError("the path integral folds HaMI's Linear-BN-ReLU-Dropout-Linear; this network differs")
    g = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # [D]
    xg = projected * g  # [N, D]
    c = (first.bias - bn.running_mean) * g + bn.bias  # [D]
    w = last.weight[0]  # [D]
    return _Folded(xg, xg * w, c, c * w, last.bias[0])


def _topk_mean_by(keys: torch.Tensor, values: torch.Tensor, bags: Bags, k_ratio: float) -> torch.Tensor:
    """keys, values [S, N] per token -> [S, B]: the mean of `values` over each bag's top-k tokens
    ranked by `keys` (the token logits), for S path steps at once."""
    steps, n_bags = keys.shape[0], len(bags)
    slots = torch.nonzero(bags.mask.flatten()).squeeze(1)  # [N] each token's place in a bag-major [B*T]
    # [S, N] -> [S*B, T] with -inf at padding (never in a top k: k <= n), laid out as is, no transpose
    padded = keys.new_full((steps, bags.mask.numel()), float("-inf")).index_copy_(1, slots, keys)
    k = topk_count(bags.lengths, k_ratio).repeat(steps)  # [S*B]
    top = torch.topk(padded.view(steps * n_bags, -1), int(k.max()), dim=1).indices  # [S*B, kmax]
    keep = torch.arange(top.shape[1], device=keys.device)[None, :] < k[:, None]
    # the values at those tokens, read from the packed [S, N] (token t of bag b is row start_b + t)
    starts = (torch.cumsum(bags.lengths, 0) - bags.lengths).repeat(steps)  # [S*B]
    rows = (starts[:, None] + top).view(steps, -1)  # [S, B*kmax]
    picked = values.gather(1, rows.clamp(max=values.shape[1] - 1)).view(steps * n_bags, -1)  # [S*B, kmax]
    return ((picked * keep).sum(1) / k.to(values.dtype)).reshape(steps, n_bags)


def _path_slopes(f: _Folded, bags: Bags, k_ratio: float, p: torch.Tensor) -> torch.Tensor:
    """dZ_B/dp at every p [S, B] -> [S, B], in closed form for the active sets at p, densely.

    A token's logit is z_i = sum_j w_j relu((1 + p) xg_ij + c_j) + b2, so where unit j is active
    dz_i/dp = sum_j w_j xg_ij; Z's slope is the mean of dz_i/dp over the bag's top-k tokens at p.
    Equal to autograd's (a test holds it to that). One pass over [S, N, D]: the reference that
    _crossing_path_sum, which bag_sensitivity runs, is tested against.
    """
    scale = 1 + bags.per_token(p.T).T  # [S, N]
    active = torch.addcmul(f.c, scale[:, :, None], f.xg[None]) > 0  # [S, N, D]
    dz = (active * f.xgw).sum(-1)  # [S, N]  dz_i/dp
    z = scale * dz + active.to(f.cw.dtype) @ f.cw + f.b2  # [S, N]  the token logits
    return _topk_mean_by(z, dz, bags, k_ratio)


def _crossing_path_sum(f: _Folded, bags: Bags, k_ratio: float, p: torch.Tensor, steps: int) -> torch.Tensor:
    """Sum over the N midpoints t_k = (k + 1/2) / N of dZ_B/dp at t_k p_B -> [B].

    The path is where the network is piecewise-affine (the paper's appendix): along it, unit j of
    token i changes state at most once, where (1 + t p_B) xg_ij + c_j crosses zero, at
    t = -(xg_ij + c_j) / (p_B xg_ij). So the token slopes dz_i/dp and the active parts of the
    logits are step functions of t, known from the few units that cross: one [N, D] pass finds
    them, and each of the N steps then costs O(tokens), not O(tokens x D). The top-k set is
    re-ranked at every step, as in _path_slopes, which this equals (tested).
    """
    xg, xgw, c, cw = f.xg.double(), f.xgw.double(), f.c.double(), f.cw.double()
    pt = bags.per_token(p.double())  # [N] each token's p_B
    pre0 = xg + c  # [N, D] at t = 0
    on0, on1 = pre0 > 0, (1 + pt)[:, None] * xg + c > 0  # active at t = 0 and at t = 1
    dz, cz = (on0 * xgw).sum(1), on0.double() @ cw  # [N] at t = 0: slope, active-bias part of z
    i, j = torch.nonzero(on0 != on1, as_tuple=True)  # the units that cross on the way
    tau = -pre0[i, j] / (pt[i] * xg[i, j])  # where, in (0, 1]
    first = torch.floor(tau * steps - 0.5).long() + 1  # the first midpoint past the crossing
    sign = torch.where(on1[i, j], 1.0, -1.0).double()  # switched on or off
    order = torch.argsort(first)
    first, i, d_dz, d_cz = first[order], i[order], (sign * xgw[i, j])[order], (sign * cw[j])[order]
    t = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, 4 * len(pt)))  # [S, N] float64 tensors, a few of them
    total = torch.zeros(len(bags), dtype=torch.float64)
    for a in range(0, steps, per_chunk):
        b = min(steps, a + per_chunk)
        lo, hi = (int(torch.searchsorted(first, v)) for v in (a, b))  # crossings taking effect in [a, b)
        delta = torch.zeros(2, b - a, len(pt), dtype=torch.float64)
        delta[0].index_put_((first[lo:hi] - a, i[lo:hi]), d_dz[lo:hi], accumulate=True)
        delta[1].index_put_((first[lo:hi] - a, i[lo:hi]), d_cz[lo:hi], accumulate=True)
        dz_t = dz + delta[0].cumsum(0)  # [S, N] token slopes at each step of the chunk
        cz_t = cz + delta[1].cumsum(0)
        dz, cz = dz_t[-1], cz_t[-1]
        z_t = (1 + t[a:b, None] * pt[None]) * dz_t + cz_t + f.b2.double()  # [S, N] token logits
        total += _topk_mean_by(z_t, dz_t, bags, k_ratio).sum(0)
    return total


def bag_sensitivity(model, bags: Bags, p: torch.Tensor, steps: int = 1000) -> BagSensitivity:
    """The paper's sensitivities of every bag to its scaling p [B] (p_B = lam * P_sem).

    Z(0), Z(p_B) and C_B come from the model's own forward pass (C_B by autograd); the N path
    slopes of C_B^int from the folded closed form, following the units that cross zero
    (_crossing_path_sum), checked against autograd in the tests. Needs autograd enabled (not
    inside torch.inference_mode()).
    """
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
    with torch.no_grad():
        total = _crossing_path_sum(_fold(model, projected), bags, model.k_ratio, p, steps)
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
    |S_neg| E_neg[P C] > |S_pos| E_pos[P C] (`margin_widens`, always defined). The paper's form,
    |S_neg| / |S_pos| > 1 / gamma, is that inequality divided by E_pos and E_neg: it holds only
    where both are positive (the paper's "logit suppression" regime, C > 0). Elsewhere dividing
    by a negative flips the inequality, so `condition_holds` is None there (`condition_applies`
    False) rather than a misleading True or False.
    """
    y = np.asarray(y).astype(bool)
    if y.all() or not y.any():
        raise ValueError("the class expectations need both classes")
    out: dict = {}
    for name, sel in (("neg", ~y), ("pos", y)):
        out[name] = {
            "n": int(sel.sum()),
            "p_sem": float(p_sem[sel].mean()),
            "c": float(c[sel].mean()),
            "p_sem_c": float((p_sem * c)[sel].mean()),
        }
    return out | ratios(out["neg"], out["pos"])


def ratios(neg: dict, pos: dict) -> dict:
    """gamma, 1/gamma, |S_neg|/|S_pos| and the margin condition from the class expectations."""
    gamma = _ratio(neg["p_sem_c"], pos["p_sem_c"])
    applies = neg["p_sem_c"] > 0 and pos["p_sem_c"] > 0
    class_ratio = neg["n"] / pos["n"]
    return {
        "gamma": gamma,
        "inv_gamma": None if not gamma else 1 / gamma,
        "class_ratio": class_ratio,
        "condition_applies": bool(applies),
        "condition_holds": bool(class_ratio > 1 / gamma) if applies else None,
        "margin_widens": bool(neg["n"] * neg["p_sem_c"] > pos["n"] * pos["p_sem_c"]),
    }


def margin_change(sens: BagSensitivity, y: np.ndarray) -> dict:
    """The margin mean(y Z), y in {-1, 1}, without and with the scaling, measured from the
    logits, beside its predictions: from the path-integrated sensitivities (exact up to the
    discretisation) and from C_B at p = 0 (first order, the paper's invariant-active-set form)."""
    sign = 2 * np.asarray(y, dtype=np.float64) - 1
    unscaled, scaled = float(np.mean(sign * sens.z0)), float(np.mean(sign * sens.z_p))
    return {
        "unscaled": unscaled,
        "scaled": scaled,
        "change": scaled - unscaled,
        "change_from_c_int": float(np.mean(-sign * sens.p * sens.c_int)),
        "change_from_c0": float(np.mean(-sign * sens.p * sens.c0)),
    }
