"""Ragged bags -> padded batch + mask, by index arithmetic (no per-bag Python loop)."""

from __future__ import annotations

import numpy as np
import torch


def pad_bags(states: np.ndarray, offsets: np.ndarray, index: np.ndarray, max_len: int | None = None):
    """Bags `index` of a layer as x [B, T, d] and mask [B, T] (True at real tokens).

    states: [total_tokens, d]; offsets: [n + 1]; T = the longest selected bag (or max_len).
    """
    starts = offsets[index]  # [B]
    lengths = offsets[index + 1] - starts  # [B]
    if (lengths == 0).any():
        raise ValueError("empty bag selected: empty answers must be excluded before padding")
    width = int(lengths.max()) if max_len is None else max_len
    steps = np.arange(width)  # [T]
    mask = steps[None, :] < lengths[:, None]  # [B, T]
    rows = np.where(mask, starts[:, None] + steps[None, :], starts[:, None])  # pads read a real row...
    x = states[rows]  # [B, T, d]
    x[~mask] = 0  # ...and are zeroed, so a batch's bytes do not depend on where it was read from
    return torch.from_numpy(x), torch.from_numpy(mask)
