"""Theorem 2 of the paper, measured during training: the squared gradient-norm ratio of max to
mean pooling per bag, against (T/s)^2.

For the embedding-based network z = w . pool_t(relu(W h_t + b1)) + b at parameters theta, the
paper compares ||grad_theta z^max||^2 with ||grad_theta z^mean||^2 for the same theta and bag
(Theorem 2: the ratio is Omega((T/s)^2) for a positive bag whose evidence sits on s of its T
tokens). Both norms have closed forms (the paper's appendix, with the biases b1 and b, which
training updates too). With q_tj the weight token t has in feature j's pooled value (max: 1 at the
peak token, shared on ties; mean: 1/T) and a_tj = 1{(W h_t + b1)_j > 0}:

    ||grad z||^2 = 1 + sum_j v_j^2 + sum_j w_j^2 || sum_t q_tj a_tj [h_t, 1] ||^2

where v is the pooled vector (dz/db = 1, dz/dw_j = v_j, dz/d[W_j, b1_j] = w_j sum_t q_tj a_tj [h_t, 1]).
The last norm is a quadratic form in the bag's Gram matrix [h_t . h_t' + 1], so nothing of size
[B, D, d] is built, and the Gram matrices, which depend on the states only, are computed once.
For max pooling the form is read off at each feature's peak token (`_max_quad`, the same bits).
tests/detectors/test_gradient_ratio.py checks both against autograd.

s is measured as the sparsity everywhere else (evidence.tokens_carrying): the tokens that carry
50% and 90% of the bag's positive evidence under the network being trained; `s_paper` is the
assumption's own s_B = max_j #{t: u_tj > 0}.

`GradientRatioTrace` records it after every epoch of a `mean` or `max` network's training, on the
hallucinated (positive) bags of the training split, in eval mode (no dropout), at most MAX_BAGS of
them; it uses no random numbers, so training gives the same weights with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from halludetect.activations.bags import Bags
from halludetect.detectors.evidence import evidence, tokens_carrying
from halludetect.detectors.networks import PoolingNet
from halludetect.detectors.pooling import segment_max, segment_mean, segment_sum

MAX_BAGS = 512  # positive training bags traced per epoch (the first ones): bounded cost at paper scale
CHUNK = 256  # bags per closed-form batch: [CHUNK, T, T] and [CHUNK, T, D] at a time
SHARES = (0.5, 0.9)


def _weights(u: torch.Tensor, bags: Bags, pool: str) -> torch.Tensor:
    """[N, D] q_tj: token t's weight in feature j's pooled value."""
    if pool == "mean":
        return (1 / bags.per_token(bags.lengths).to(u.dtype))[:, None].expand_as(u)
    holds = (u == segment_max(u, bags)[bags.bag_of_token]).to(u.dtype)
    return holds / segment_sum(holds, bags)[bags.bag_of_token]


def gram(bags: Bags) -> torch.Tensor:
    """[B, T, T] h_t . h_t' + 1 between the real tokens of each bag (0 at padding), in float64. It
    depends on the states only, so a trace computes it once for all epochs."""
    hp = bags.pad(bags.tokens.double())  # [B, T, d]
    mask = bags.mask  # [B, T]
    return (hp @ hp.transpose(1, 2) + 1) * (mask[:, :, None] & mask[:, None, :])


# A batch's quadratic forms run on groups of its bags of similar length (the longest of a group at
# most WIDTH_RATIO x its shortest), each padded to its own longest: a [B, T, T] form over the whole
# batch costs B T_max^2, so one long answer among short ones multiplies the work of every bag (the
# world's traced bags: 3 to 32 tokens, half of them 12 to 14).
WIDTH_RATIO = 1.25


@dataclass
class WidthGroup:
    """Bags of one batch of similar length, padded to the longest of them (W)."""

    bags: torch.Tensor  # [n] their positions in the batch
    mask: torch.Tensor  # [n, W] real tokens
    rows: torch.Tensor  # [R] their tokens' packed rows in the batch, bag after bag (where mask is True)
    gram: torch.Tensor  # [n, W, W] their `gram`, cut to W: the batch's own entries


@dataclass
class TracedBatch:
    """A batch of traced bags with what depends on their states only, computed once for all epochs."""

    bags: Bags
    tokens64: torch.Tensor  # [N, d] the states in float64
    gram: torch.Tensor  # [B, T, T]
    groups: list[WidthGroup]

    @classmethod
    def of(cls, bags: Bags) -> TracedBatch:
        g = gram(bags)
        starts = torch.cumsum(bags.lengths, 0) - bags.lengths  # [B] first packed row of each bag
        groups = []
        for members in _similar_lengths(bags.lengths):
            lengths = bags.lengths[members]
            width = int(lengths.max())
            mask = torch.arange(width)[None, :] < lengths[:, None]  # [n, W]
            rows = (starts[members][:, None] + torch.arange(width)[None, :])[mask]  # [R]
            groups.append(WidthGroup(members, mask, rows, g[members][:, :width, :width]))
        return cls(bags, bags.tokens.double(), g, groups)


def _similar_lengths(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Positions of `lengths` [B] in groups whose longest is at most WIDTH_RATIO x their shortest."""
    order = torch.argsort(lengths, stable=True)
    ranked = lengths[order].tolist()
    groups, start = [], 0
    for i, n in enumerate(ranked):
        if n > WIDTH_RATIO * ranked[start]:
            groups.append(order[start:i])
            start = i
    return [*groups, order[start:]] if len(ranked) else []


@torch.no_grad()
def squared_gradient_norms(net: PoolingNet, bags: Bags | TracedBatch) -> dict[str, torch.Tensor]:
    """{"max": [B], "mean": [B]}: ||grad_theta z_B||^2 of `net`'s parameters with max pooling and
    with mean pooling in place of its own, in eval mode (dropout off), in float64. `bags` may come
    as a TracedBatch, with what depends on their states already computed."""
    batch = bags if isinstance(bags, TracedBatch) else TracedBatch.of(bags)
    bags, g = batch.bags, batch.gram  # g [B, T, T]
    linear = net.feature[0]
    pre = batch.tokens64 @ linear.weight.double().T + linear.bias.double()  # [N, D]
    u, on = pre.clamp(min=0), pre > 0
    w2 = net.head.weight[0].double() ** 2  # [D]
    out = {}
    for pool, reduce in (("max", segment_max), ("mean", segment_mean)):
        v = reduce(u, bags)  # [B, D]
        if pool == "max":
            quad = _max_quad(u, on, v, bags, g)
        else:
            quad = _grouped_quad(_weights(u, bags, pool) * on, batch.groups)
        out[pool] = 1 + (v**2).sum(1) + quad @ w2
    return out


def _quad(qa: torch.Tensor, bags: Bags, g: torch.Tensor) -> torch.Tensor:
    """[B, D] ||sum_t q_tj a_tj [h_t, 1]||^2 from qa [N, D] = q_tj a_tj, as the quadratic form in the
    bags' Gram matrices g [B, T, T]."""
    qp = bags.pad(qa)  # [B, T, D]
    return (torch.bmm(g, qp) * qp).sum(1)


def _grouped_quad(qa: torch.Tensor, groups: list[WidthGroup]) -> torch.Tensor:
    """`_quad` group by group, each at its own width (the padding adds zeros to the sums either way)."""
    quad = qa.new_empty((sum(len(grp.bags) for grp in groups), qa.shape[1]))  # [B, D]
    for grp in groups:
        qp = qa.new_zeros((*grp.mask.shape, qa.shape[1]))  # [n, W, D]
        qp[grp.mask] = qa[grp.rows]
        quad[grp.bags] = (torch.bmm(grp.gram, qp) * qp).sum(1)
    return quad


def _max_quad(u: torch.Tensor, on: torch.Tensor, peak: torch.Tensor, bags: Bags, g: torch.Tensor) -> torch.Tensor:
    """`_quad` of max pooling's weights, with the same bits at a fraction of the work. Where one token
    t* holds feature j's peak, q a is 1 at t* (if it is on) and 0 elsewhere, so the quadratic form is
    g[t*, t*] a_t*j: `_quad`'s sums add only zeros to that one product, so taking it directly is exact.
    Bags where a positive peak is shared by tokens (equal states: layer 0 gives a repeated token the
    same embedding) weight each holder 1/count and go through `_quad` itself."""
    holds = u == peak[bags.bag_of_token]  # [N, D]
    count = segment_sum(holds.double(), bags)  # [B, D] tokens holding each peak
    shared = ((count > 1) & (peak > 0)).any(1)  # [B] bags with a shared positive peak
    diag = g.diagonal(dim1=1, dim2=2)[bags.mask]  # [N] g[t, t], packed as the tokens are
    quad = segment_sum((holds & on).double() * diag[:, None], bags)  # [B, D]: one term per (bag, feature)
    if shared.any():  # those bags alone, padded to the same width as the whole batch
        rows = shared[bags.bag_of_token]  # [N] tokens of those bags
        qa = (holds / count[bags.bag_of_token] * on)[rows]  # as _weights(u, bags, "max") * on
        qp = qa.new_zeros((int(shared.sum()), bags.width, qa.shape[1]))  # [S, T, D]
        qp[bags.mask[shared]] = qa
        quad[shared] = (torch.bmm(g[shared], qp) * qp).sum(1)
    return quad


def _pool_of(net: PoolingNet) -> str:
    return "max" if net.pool is segment_max else "mean"


class GradientRatioTrace:
    """Theorem 2's quantities per epoch for a PoolingNet under training (module docstring)."""

    def __init__(self, bags: list[Bags]):
        self.batches = [TracedBatch.of(b) for b in bags]  # the states' part of the norms: the same every epoch
        self.epochs: list[dict] = []
        self.per_bag: dict[int, dict[str, np.ndarray]] = {}

    @classmethod
    def for_training(cls, model, data) -> GradientRatioTrace | None:
        """A trace over `data`'s (a SplitData) first MAX_BAGS positive bags, or None when the model
        is not a mean or max pooling network (Theorem 2 is about those)."""
        if not isinstance(model, PoolingNet):
            return None
        index = torch.nonzero(data.y == 1).squeeze(1)[:MAX_BAGS]
        if not len(index):
            return None
        return cls([data.bags(index[a : a + CHUNK]) for a in range(0, len(index), CHUNK)])

    @classmethod
    def sharing(cls, other: GradientRatioTrace) -> GradientRatioTrace:
        """A fresh trace of `other`'s bags, sharing their Gram matrices (another seed of one training:
        batched.py), so that they are computed once."""
        trace = cls.__new__(cls)
        trace.batches = other.batches
        trace.epochs, trace.per_bag = [], {}
        return trace

    @torch.no_grad()
    def measure(self, net: PoolingNet) -> dict[str, np.ndarray]:
        """Per traced bag: T, the squared gradient norms of max and mean pooling at net's
        parameters, their ratio, and s (50%, 90% of the positive evidence; the paper's s_B)."""
        was_training = net.training
        net.eval()
        try:
            cols: dict[str, list] = {k: [] for k in ("T", "max_norm2", "mean_norm2", "s50", "s90", "s_paper")}
            for batch in self.batches:
                bags = batch.bags
                cols["T"].append(bags.lengths.double())
                norms = squared_gradient_norms(net, batch)
                cols["max_norm2"].append(norms["max"])
                cols["mean_norm2"].append(norms["mean"])
                c = evidence(net, bags).contributions
                cols["s50"].append(tokens_carrying(c, bags, 0.5))
                cols["s90"].append(tokens_carrying(c, bags, 0.9))
                active = segment_sum((net.feature(bags.tokens) > 0).double(), bags)  # [B, D] tokens on per feature
                cols["s_paper"].append(active.max(1).values)
        finally:
            net.train(was_training)
        out = {k: torch.cat(v).cpu().numpy() for k, v in cols.items()}
        out["ratio"] = out["max_norm2"] / out["mean_norm2"]
        return out

    def record(self, epoch: int, net: PoolingNet) -> None:
        m = self.measure(net)
        self.per_bag[epoch] = m
        self.epochs.append({"epoch": epoch, "pooling": _pool_of(net), **summarise(m)})

    def result(self, best_epoch: int) -> dict:
        """What train writes to gradient_ratio.json for one seed: every epoch's summary, and the
        best epoch's per-bag values."""
        bags = self.per_bag.get(best_epoch, {})
        return {
            "epochs": self.epochs,
            "best_epoch": best_epoch,
            "bags": {k: [None if np.isnan(x) else float(x) for x in v] for k, v in bags.items()},
        }


def summarise(m: dict[str, np.ndarray]) -> dict:
    """One epoch's figures: medians of the ratio and of (T/s)^2 for each s, the share of bags
    whose ratio reaches (T/s)^2, and the Spearman correlation of the ratio with (T/s90)^2."""
    from scipy.stats import spearmanr

    out = {"n_bags": int(len(m["T"])), "median_ratio": float(np.median(m["ratio"]))}
    for s in ("s50", "s90", "s_paper"):
        ok = np.isfinite(m[s]) & (m[s] > 0)
        bound = (m["T"][ok] / m[s][ok]) ** 2
        out[f"n_{s}"] = int(ok.sum())
        out[f"median_t_over_{s}_sq"] = float(np.median(bound)) if ok.any() else None
        out[f"share_ratio_at_least_t_over_{s}_sq"] = float(np.mean(m["ratio"][ok] >= bound)) if ok.any() else None
    ok = np.isfinite(m["s90"]) & (m["s90"] > 0)
    x, y = m["ratio"][ok], (m["T"][ok] / m["s90"][ok]) ** 2
    varies = ok.sum() > 2 and np.ptp(x) > 0 and np.ptp(y) > 0  # a rank correlation needs two ranks on each side
    out["spearman_ratio_t_over_s90_sq"] = float(spearmanr(x, y).statistic) if varies else None
    return out
