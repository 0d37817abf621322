"""Batched inference of a detector over a packed split: one score per bag, in order."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


@torch.no_grad()
def score(model: nn.Module, data, batch_size: int = 2048) -> np.ndarray:
    """Scores for every bag of a split, in eval mode, in order (contiguous slices, no copy; a
    question's answers share a batch when the split carries its questions)."""
    model.eval()
    out = [model(data.slice(a, b)) for a, b in data.batches(batch_size)]
    return torch.cat(out).cpu().numpy()
