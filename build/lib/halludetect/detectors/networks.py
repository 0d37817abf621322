"""The detectors the paper compares. Each maps packed `Bags` to bag logits z [B].

Positive logits mean hallucination; every score is a logit (before any sigmoid), so the
margin mean(y z) is measured in logit space as the paper defines it.

Per-token maps run on the packed real tokens (N rows, no padding); poolings reduce by
segment (pooling.py), so no padded [B, T, D] tensor is ever built. Two families, as in the paper:
  instance-based   hami, hami_sp        token logit z_i = f(h_i), bag = top-k mean of z_i
  embedding-based  mean, max            u_i = ReLU(W h_i), bag = w^T pool(u)
                   raw_mean, raw_max    bag = MLP(pool(h))
                   attention, gated     bag = MLP(sum_i a_i h_i), a = ABMIL attention weights
and the field's baselines on one token of the bag (`Bags.token_rows`): the last-token linear
probe, SAPLMA's MLP, the semantic-entropy probes' logistic regression, and EigenScore over a
question's answers (methods/ says which token each reads under each position convention).
"""

from __future__ import annotations

import torch
from torch import nn

from halludetect.activations.bags import Bags
from halludetect.detectors.pooling import POOLINGS, segment_softmax, segment_sum, topk_mean, topk_sigmoid_logit


class Dropout(nn.Module):
    """Inverted dropout, as `nn.Dropout`: zero each element with probability p in training and
    scale the rest by 1 / (1 - p). The mask comes from `torch.rand` (vectorised) rather than
    `bernoulli_`, which on the CPU draws one number at a time and took a fifth of a training
    step on the world; this takes half of that (bench.training). Deterministic for torch's seed."""

    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability {p} is not in [0, 1)")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.rand_like(x) >= self.p  # [*x.shape]
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


BAG_SCORES = ("logits", "sigmoid")


class HaMI(nn.Module):
    """Token MLP Linear(d, D)-BN-ReLU-Dropout-Linear(D, 1) (the HaMI code's network, without
    its final sigmoid: the bag logit is the top-k mean of token logits, the paper's Z_B).

    `lam` > 0 is HaMI (SP): each token state is scaled by (1 + lam * P_sem) of its response.
    Batch norm sees real tokens only, because it runs on the packed rows.
    `bag_score="sigmoid"` scores a bag as the HaMI code does, by the top-k mean of the tokens'
    sigmoid scores; the bag logit is then logit(that mean), so that sigmoid(z) is the HaMI code's
    score and z ranks bags as it does. The top-k set is the same either way (sigmoid is monotone).
    """

    def __init__(self, d: int, dim: int, dropout: float, k_ratio: float, lam: float = 0.0, bag_score: str = "logits"):
        super().__init__()
        if bag_score not in BAG_SCORES:
            raise ValueError(f"unknown bag_score '{bag_score}'; choose from {BAG_SCORES}")
        self.net = nn.Sequential(nn.Linear(d, dim), nn.BatchNorm1d(dim), nn.ReLU(), Dropout(dropout), nn.Linear(dim, 1))
        self.k_ratio, self.lam, self.bag_score = k_ratio, lam, bag_score

    def token_logits(self, bags: Bags) -> torch.Tensor:
        """[N] one logit per real token."""
        h = bags.tokens
        if self.lam:
            if bags.p_sem is None:
                raise ValueError("hami_sp needs the semantic probability of every response (Bags.p_sem)")
            h = h * bags.per_token(1 + self.lam * bags.p_sem)[:, None]  # [N, d]
        return self.net(h).squeeze(-1)

    def forward(self, bags: Bags) -> torch.Tensor:
        s = bags.pad(self.token_logits(bags))  # [B, T]
        if self.bag_score == "sigmoid":
            return topk_sigmoid_logit(s, bags.mask, self.k_ratio)
        return topk_mean(s, bags.mask, self.k_ratio)


class PoolingNet(nn.Module):
    """The paper's max-pooling network and its mean twin: u_i = Dropout(ReLU(W h_i)),
    v = pool_i(u_i), z = w^T v + b."""

    def __init__(self, d: int, dim: int, dropout: float, pool: str):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(d, dim), nn.ReLU(), Dropout(dropout))
        self.head = nn.Linear(dim, 1)
        self.pool = POOLINGS[pool]

    def forward(self, bags: Bags) -> torch.Tensor:
        u = self.feature(bags.tokens)  # [N, D]
        return self.head(self.pool(u, bags)).squeeze(-1)  # [B, D] -> [B]


def mlp_head(d: int, dim: int, dropout: float) -> nn.Sequential:
    """Linear(d, D)-ReLU-Dropout-Linear(D, 1): the MLP placed after pooling raw states."""
    return nn.Sequential(nn.Linear(d, dim), nn.ReLU(), Dropout(dropout), nn.Linear(dim, 1))


class RawPoolingNet(nn.Module):
    """Pooling on the raw d-dimensional states, the MLP after it (the paper's 'Raw (d)' rows)."""

    def __init__(self, d: int, dim: int, dropout: float, pool: str):
        super().__init__()
        self.head = mlp_head(d, dim, dropout)
        self.pool = POOLINGS[pool]

    def forward(self, bags: Bags) -> torch.Tensor:
        return self.head(self.pool(bags.tokens, bags)).squeeze(-1)  # [B, d] -> [B]


class AttentionNet(nn.Module):
    """Attention-based deep MIL (Ilse et al. 2018) as the paper's appendix writes it:
    a_i = softmax_i(w^T tanh(V h_i)), gated: softmax_i(w^T (tanh(V h_i) * sigmoid(U h_i))),
    z = MLP(sum_i a_i h_i)."""

    def __init__(self, d: int, dim: int, dropout: float, attention_dim: int, gated: bool):
        super().__init__()
        self.V = nn.Linear(d, attention_dim)
        self.U = nn.Linear(d, attention_dim) if gated else None
        self.w = nn.Linear(attention_dim, 1)
        self.head = mlp_head(d, dim, dropout)

    def weights(self, bags: Bags) -> torch.Tensor:
        """[N] attention weight of every token: they sum to 1 over each bag."""
        a = torch.tanh(self.V(bags.tokens))  # [N, L]
        if self.U is not None:
            a = a * torch.sigmoid(self.U(bags.tokens))
        return segment_softmax(self.w(a).squeeze(-1), bags)

    def forward(self, bags: Bags) -> torch.Tensor:
        v = segment_sum(self.weights(bags)[:, None] * bags.tokens, bags)  # [B, d]
        return self.head(v).squeeze(-1)


class LastTokenProbe(nn.Module):
    """Logistic regression on the last state of each bag (a linear probe baseline)."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, 1)

    def forward(self, bags: Bags) -> torch.Tensor:
        return self.linear(bags.tokens[bags.last]).squeeze(-1)


class TokenLinear(nn.Module):
    """A linear logit on one token of each bag (`index`: 0 first, -1 last, -2 second-to-last): the
    semantic-entropy probes, fitted in closed form (detectors/fitting.py) rather than by SGD."""

    def __init__(self, d: int, index: int):
        super().__init__()
        self.linear = nn.Linear(d, 1)
        self.index = index

    def features(self, bags: Bags) -> torch.Tensor:
        """[B, d] the state each bag is scored from."""
        return bags.tokens[bags.token_rows(self.index)]

    def forward(self, bags: Bags) -> torch.Tensor:
        return self.linear(self.features(bags)).squeeze(-1)


class TokenMLP(nn.Module):
    """SAPLMA: Linear(d, h1)-ReLU-...-Linear(h_k, 1) on one token of each bag."""

    def __init__(self, d: int, hidden: list[int], dropout: float, index: int):
        super().__init__()
        layers, width = [], d
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), Dropout(dropout)]
            width = h
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.index = index

    def forward(self, bags: Bags) -> torch.Tensor:
        return self.net(bags.tokens[bags.token_rows(self.index)]).squeeze(-1)


class EigenScore(nn.Module):
    """INSIDE's EigenScore of each bag's question (methods/eigenscore.py): no parameters.

    Per question with K answers: Z [K, d] their states at token `index`, Sigma = Z_c Z_c^T / (d - 1)
    with each row centred over its d features (torch.cov of the K rows), score =
    mean_k log10(eig_k(Sigma + alpha I)). Batched by question size (a loop over the distinct K,
    not over questions), in float64 as the INSIDE code's numpy.
    """

    def __init__(self, alpha: float, index: int):
        super().__init__()
        self.alpha, self.index = alpha, index

    def forward(self, bags: Bags) -> torch.Tensor:
        if bags.groups is None:
            raise ValueError("EigenScore scores a question's answers together: the bags need their questions (groups)")
        z = bags.tokens[bags.token_rows(self.index)].double()  # [B, d]
        _, group, size = torch.unique(bags.groups, return_inverse=True, return_counts=True)  # [B], [G]
        if len(size) and int(size.min()) < 2:
            raise ValueError("EigenScore needs at least two answers per question: leave the others out first")
        out = z.new_empty(len(bags))  # [B]
        d = z.shape[1]
        for k in torch.unique(size).tolist():
            idx = torch.nonzero(size[group] == k).squeeze(1)  # bags of the questions with k answers
            idx = idx[torch.argsort(group[idx], stable=True)]  # grouped by question
            zk = z[idx].view(-1, k, d)  # [G_k, k, d]
            zc = zk - zk.mean(-1, keepdim=True)
            cov = zc @ zc.transpose(1, 2) / (d - 1)  # [G_k, k, k]
            eye = torch.eye(k, dtype=cov.dtype, device=cov.device)
            score = torch.log10(torch.linalg.eigvalsh(cov + self.alpha * eye)).mean(-1)  # [G_k]
            out[idx] = score.repeat_interleave(k)
        return out
