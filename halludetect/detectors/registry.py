"""Detector registry. Every detector maps (x [B, T, d], mask [B, T]) -> logits z [B].

Positive logits mean hallucination. Pooling is always masked: padded positions never
change a score.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from halludetect.registry import lookup


def masked_mean(u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """u [B, T, D], mask [B, T] -> [B, D]: mean over real tokens."""
    m = mask.unsqueeze(-1).to(u.dtype)  # [B, T, 1]
    return (u * m).sum(1) / m.sum(1).clamp(min=1)


def masked_max(u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """u [B, T, D], mask [B, T] -> [B, D]: max over real tokens."""
    return u.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)


POOLINGS = {"mean": masked_mean, "max": masked_max}


class PoolingNet(nn.Module):
    """Embedding-based MIL (the paper's max-pooling network and its mean twin):
    per token u = Dropout(ReLU(W h)), bag v = pool_t(u), z = w^T v + b."""

    def __init__(self, d: int, dim: int, dropout: float, pool: str):
        super().__init__()
        self.feature = nn.Sequential(nn.Linear(d, dim), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(dim, 1)
        self.pool = POOLINGS[pool]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        u = self.feature(x)  # [B, T, D]
        return self.head(self.pool(u, mask)).squeeze(-1)  # [B]


DETECTORS: dict[str, Callable[..., nn.Module]] = {
    "mean": lambda d, p: PoolingNet(d, p.dim, p.dropout, "mean"),
    "max": lambda d, p: PoolingNet(d, p.dim, p.dropout, "max"),
}


def save_detector(path, state_dict: dict, meta: dict) -> None:
    """Weights as safetensors with `meta` (method, d, params, ...) as one JSON metadata entry.

    One sorted entry, not one per key: safetensors writes its metadata map in no fixed
    order, so several keys would give different bytes for the same detector, and DVC would
    take an unchanged detector for a changed one.
    """
    import json

    from safetensors.torch import save_file

    save_file(state_dict, str(path), metadata={"detector": json.dumps(meta, sort_keys=True)})


def load_detector(path) -> tuple[nn.Module, dict]:
    """A trained detector from its safetensors file, rebuilt from the metadata saved with it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    from halludetect.config import DetectorsParams

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["detector"])
    method = meta["method"]
    params = DetectorsParams.model_fields[method].annotation.model_validate(meta["params"])
    model = build_detector(method, int(meta["d"]), params)
    model.load_state_dict(load_file(path))
    return model.eval(), meta


def build_detector(method: str, d: int, params) -> nn.Module:
    """`params` is the method's section of params.yaml (detectors.<method>)."""
    return lookup("detector", method, DETECTORS)(d, params)
