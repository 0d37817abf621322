"""Batched inference of a detector over a packed split: one logit per bag, in order."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


@torch.no_grad()
def score(model: nn.Module, data, batch_size: int = 2048) -> np.ndarray:
    """Logits for every bag of a split, in eval mode, in order (contiguous slices, no copy)."""
    model.eval()
    out = [model(data.slice(a, min(a + batch_size, len(data)))) for a in range(0, len(data), batch_size)]
    return torch.cat(out).cpu().numpy()
