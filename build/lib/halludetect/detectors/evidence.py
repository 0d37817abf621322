"""Token evidence: every detector's bag logit split exactly into one contribution per token.

For each network of networks.py, z_B = bias_B + sum_{t in B} c_t holds exactly (to float
rounding; tests/detectors/test_evidence.py checks it on random bags for every registered method):

  PoolingNet max   z = b + sum_j w_j max_t u_tj. Feature j's term w_j u_{t*j} belongs to the token
                   t* where u_.j peaks (shared evenly by tokens that tie); bias = b.
  PoolingNet mean  z = b + sum_t (w . u_t) / T; bias = b.
  HaMI             z = (1/k) sum over the top k of the token logits s_t: c_t = s_t / k on the k
                   tokens top-k keeps, 0 on the others; bias = 0.
  LastTokenProbe   z = w . h_last + b: all of it on the last position; bias = b.
  TokenLinear      z = w . h_i + b on the one token i it reads (the SEP probes: the first or the
                   second-last position): all of it on that token; bias = b.
  TokenMLP         z = MLP(h_i) (SAPLMA) on the one token i it reads: z - b_out on that token, where
                   b_out is the output layer's bias; bias = b_out. The network is not linear, but
                   nothing else of the bag enters it, so the split is exact and trivial.
  EigenScore       none: it scores a question's K answers together (the log-determinant of their
                   states' covariance), so no token of one answer carries its score.
  RawPoolingNet,   the MLP after pooling, z = w2 . relu(W1 v + b1) + b2, is linear in the pooled
  AttentionNet     vector v on the hidden units this bag switches on (A = {k: (W1 v + b1)_k > 0}):
                   z = b2 + w2_A . b1_A + g . v with g = W1_A^T w2_A. v is linear in the tokens
                   (mean: sum_t h_t / T; attention: sum_t a_t h_t; max: coordinate i from the token
                   where h_.i peaks), so c_t = g . (token t's part of v), and bias_B = b2 + w2_A .
                   b1_A depends on the bag through A. These `bias_varies`: a token's contribution
                   is read against its own bag's bias, not one shared by every answer.

As with max pooling, a token's contribution depends on the other tokens of its bag (which token
peaks, which units are on, the attention weights); the sum is exact for the bag as scored.

A network that is not listed here has no evidence: `evidence` raises `NoEvidence` naming it, and
a network registered with `no_evidence(cls, reason)` says what its method reports instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.detectors import networks
from halludetect.detectors.pooling import segment_max, segment_mean, segment_sum, topk_count


class NoEvidence(ValueError):
    """A detector whose network has no token evidence; the message says what it reports instead."""


@dataclass
class Evidence:
    """contributions [N] per token (packed like `Bags.tokens`) and bias [B]: z = bias + sum_t c_t."""

    contributions: torch.Tensor
    bias: torch.Tensor
    bias_varies: bool  # True: the bias depends on the bag (the MLP after pooling), False: one constant

    def logits(self, bags: Bags) -> torch.Tensor:
        """[B] bias + the sum of each bag's contributions: the bag logit, rebuilt."""
        return self.bias + segment_sum(self.contributions, bags)


def _peak_share(u: torch.Tensor, bags: Bags) -> torch.Tensor:
    """[N, D] 1 / (number of tokens of the bag that hold feature j's max) where token t holds it, else 0."""
    v = segment_max(u, bags)  # [B, D]
    holds = (u == v[bags.bag_of_token]).to(u.dtype)  # [N, D]
    return holds / segment_sum(holds, bags)[bags.bag_of_token]


def _pooling_net(net: networks.PoolingNet, bags: Bags) -> Evidence:
    u = net.feature(bags.tokens)  # [N, D]
    w = net.head.weight[0]  # [D]
    if net.pool is segment_max:
        c = (u * _peak_share(u, bags)) @ w  # [N]
    elif net.pool is segment_mean:
        c = (u @ w) / bags.per_token(bags.lengths).to(u.dtype)
    else:
        raise NoEvidence(f"PoolingNet with pooling {net.pool.__name__} has no token evidence")
    return Evidence(c, net.head.bias.expand(len(bags)), bias_varies=False)


def _head_gradient(head: nn.Sequential, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP head Linear-ReLU-Dropout-Linear at pooled vectors v [B, d], linear on each bag's
    active units: z = bias + g . v with g [B, d] and bias [B]."""
    first, last = head[0], head[-1]
    on = ((v @ first.weight.T + first.bias) > 0).to(v.dtype)  # [B, D] the active hidden units
    w2 = last.weight[0] * on  # [B, D]
    return w2 @ first.weight, last.bias + w2 @ first.bias  # [B, d], [B]


def _raw_pooling_net(net: networks.RawPoolingNet, bags: Bags) -> Evidence:
    h = bags.tokens  # [N, d]
    v = net.pool(h, bags)  # [B, d]
    g, bias = _head_gradient(net.head, v)
    if net.pool is segment_max:
        part = h * _peak_share(h, bags)  # [N, d] the coordinates of v each token holds
    elif net.pool is segment_mean:
        part = h / bags.per_token(bags.lengths).to(h.dtype)[:, None]
    else:
        raise NoEvidence(f"RawPoolingNet with pooling {net.pool.__name__} has no token evidence")
    return Evidence((part * bags.per_token(g)).sum(1), bias, bias_varies=True)


def _attention_net(net: networks.AttentionNet, bags: Bags) -> Evidence:
    a = net.weights(bags)  # [N]
    part = a[:, None] * bags.tokens  # [N, d]
    g, bias = _head_gradient(net.head, segment_sum(part, bags))
    return Evidence((part * bags.per_token(g)).sum(1), bias, bias_varies=True)


def _hami(net: networks.HaMI, bags: Bags) -> Evidence:
    s = net.token_logits(bags)  # [N]
    k = topk_count(bags.lengths, net.k_ratio)  # [B]
    padded = bags.pad(s).masked_fill(~bags.mask, float("-inf"))  # [B, T]
    order = torch.topk(padded, int(k.max()), dim=1).indices  # [B, kmax]
    rank_kept = torch.arange(order.shape[1], device=s.device)[None, :] < k[:, None]  # [B, kmax]
    kept = torch.zeros_like(bags.mask).scatter_(1, order, rank_kept)[bags.mask]  # [N] in packed order
    c = torch.where(kept, s / bags.per_token(k).to(s.dtype), 0)
    return Evidence(c, s.new_zeros(len(bags)), bias_varies=False)


def _last_token(net: networks.LastTokenProbe, bags: Bags) -> Evidence:
    c = torch.zeros(len(bags.tokens), dtype=bags.tokens.dtype, device=bags.tokens.device)
    c[bags.last] = bags.tokens[bags.last] @ net.linear.weight[0]
    return Evidence(c, net.linear.bias.expand(len(bags)), bias_varies=False)


def _one_token(net: nn.Module, bags: Bags, z: torch.Tensor, bias: torch.Tensor) -> Evidence:
    """A detector that reads one token per bag (`net.index`): z - bias on that token, 0 elsewhere."""
    c = torch.zeros(len(bags.tokens), dtype=bags.tokens.dtype, device=bags.tokens.device)
    c[bags.token_rows(net.index)] = (z - bias).to(c.dtype)
    return Evidence(c, bias.expand(len(bags)), bias_varies=False)


def _token_linear(net: networks.TokenLinear, bags: Bags) -> Evidence:
    return _one_token(net, bags, net(bags), net.linear.bias[0])


def _token_mlp(net: networks.TokenMLP, bags: Bags) -> Evidence:
    return _one_token(net, bags, net(bags), net.net[-1].bias[0])


EXPLAINERS: dict[type, Callable[[nn.Module, Bags], Evidence] | str] = {
    networks.PoolingNet: _pooling_net,
    networks.RawPoolingNet: _raw_pooling_net,
    networks.AttentionNet: _attention_net,
    networks.HaMI: _hami,
    networks.LastTokenProbe: _last_token,
    networks.TokenLinear: _token_linear,
    networks.TokenMLP: _token_mlp,
    networks.EigenScore: "EigenScore scores the K answers of a question together (the log-determinant of "
    "their states' covariance at one token), so no token of one answer carries its score; it reports the "
    "question's score for each of its answers",
}

# One line per network: how its contributions are made, for the docs, the CLI and the HTML page.
DESCRIPTIONS = {
    networks.PoolingNet: "each feature's term w_j max_t u_tj goes to the token where the feature peaks "
    "(max), or each token's w . u_t / T (mean); bias = the head's bias",
    networks.RawPoolingNet: "the MLP after pooling is linear on this answer's active units: each token's "
    "part of the pooled state times that linear map; bias = the head's biases through those units (per answer)",
    networks.AttentionNet: "each token's attention-weighted state a_t h_t times the MLP's linear map on this "
    "answer's active units; bias = the head's biases through those units (per answer)",
    networks.HaMI: "each of the top-k tokens' logit / k, 0 for the others; bias = 0",
    networks.LastTokenProbe: "all of it on the last position (w . h_last); bias = the probe's bias",
    networks.TokenLinear: "all of it on the one token the probe reads (w . h); bias = the probe's bias",
    networks.TokenMLP: "all of it on the one token the MLP reads (its logit minus the output bias); "
    "bias = the output layer's bias",
}


def no_evidence(cls: type, reason: str) -> None:
    """Declare that networks of `cls` have no token evidence; `reason` says what their method
    reports instead (shown by `halludetect score --explain` and the report)."""
    EXPLAINERS[cls] = reason


def _explainer(net: nn.Module) -> Callable[[nn.Module, Bags], Evidence]:
    name = type(net).__name__
    a = f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
    for cls in type(net).__mro__:
        found = EXPLAINERS.get(cls)
        if callable(found):
            return found
        if isinstance(found, str):
            raise NoEvidence(f"{a} detector has no token evidence: {found}")
    raise NoEvidence(
        f"{a} detector has no token evidence: it reports its bag logit alone "
        "(give its network a decomposition in halludetect/detectors/evidence.py)"
    )


def has_evidence(net: nn.Module) -> bool:
    try:
        _explainer(net)
    except NoEvidence:
        return False
    return True


def describe(net: nn.Module) -> str:
    """How `net`'s contributions are made (one line), or why it has none."""
    _explainer(net)
    return next(DESCRIPTIONS[c] for c in type(net).__mro__ if c in DESCRIPTIONS)


@torch.no_grad()
def evidence(net: nn.Module, bags: Bags) -> Evidence:
    """The token evidence of one detector (in eval mode) on a batch of bags."""
    if net.training:
        raise ValueError("token evidence is read from a detector in eval mode (dropout off): call .eval()")
    return _explainer(net)(net, bags)


@torch.no_grad()
def ensemble_evidence(nets: list[nn.Module], bags: Bags) -> Evidence:
    """The evidence of the mean of several detectors' logits (a bundle's seeds): each token's mean
    contribution and the mean bias, so that it sums to the ensemble's logit as each seed's does."""
    parts = [evidence(n, bags) for n in nets]
    return Evidence(
        torch.stack([p.contributions for p in parts]).mean(0),
        torch.stack([p.bias for p in parts]).mean(0),
        any(p.bias_varies for p in parts),
    )


# ---------------------------------------------------------------------------------- sparsity
def tokens_carrying(contributions: torch.Tensor, bags: Bags, share: float) -> torch.Tensor:
    """[B] the fewest tokens whose positive contributions reach `share` of the bag's positive
    evidence (the sum of its positive contributions), largest first; NaN for a bag without any."""
    if not 0 < share <= 1:
        raise ValueError(f"share {share} is not in (0, 1]")
    pos = bags.pad(contributions.clamp(min=0).double())  # [B, T], padding 0
    ranked = torch.sort(pos, dim=1, descending=True).values
    reached = torch.cumsum(ranked, 1) >= share * ranked.sum(1, keepdim=True) * (1 - 1e-12)  # [B, T]
    n = (~reached).sum(1).to(torch.float64) + 1  # the first position that reaches the share, 1-based
    return torch.where(ranked[:, 0] > 0, n, torch.nan)
