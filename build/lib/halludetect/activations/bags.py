"""Bags of token states, packed: the real tokens of every bag back to back, plus lengths.

That is the layout of the HDF5 layer files (`states` + `offsets`), so reading a batch costs no
padding, and a detector's per-token map runs on real tokens only: padding cannot change a
score, and no work is spent on it. Poolings that need a [B, T, ...] view get one from `pad`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(eq=False)
class Bags:
    """B bags: tokens [N, d] packed in bag order, lengths [B] (every bag >= 1 token).

    `p_sem` [B] is the semantic probability of each response, for the methods that read it;
    `groups` [B] the question of each response (an integer id), for the methods that score a
    question's answers together (EigenScore).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    p_sem: torch.Tensor | None = None
    groups: torch.Tensor | None = None

    def __post_init__(self):
        if self.lengths.numel() and int(self.lengths.min()) < 1:
            raise ValueError("empty bag: responses without tokens must be excluded before batching")
        if int(self.lengths.sum()) != len(self.tokens):
            raise ValueError(f"lengths sum to {int(self.lengths.sum())} but there are {len(self.tokens)} tokens")

    def __len__(self) -> int:
        return len(self.lengths)

    @cached_property
    def width(self) -> int:
        return int(self.lengths.max())

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, T] True at real tokens, T = the longest bag."""
        steps = torch.arange(self.width, device=self.lengths.device)
        return steps[None, :] < self.lengths[:, None]

    @cached_property
    def bag_of_token(self) -> torch.Tensor:
        """[N] the bag each token belongs to."""
        return torch.repeat_interleave(torch.arange(len(self), device=self.lengths.device), self.lengths)

    @cached_property
    def last(self) -> torch.Tensor:
        """[B] the packed row of each bag's last token."""
        return torch.cumsum(self.lengths, 0) - 1

    def token_rows(self, index: int) -> torch.Tensor:
        """[B] the packed row of token `index` of every bag: 0 the first, -1 the last, -2 the one
        before it. A bag too short to have that token is an error, never another bag's token."""
        need = index + 1 if index >= 0 else -index
        if len(self) and int(self.lengths.min()) < need:
            raise ValueError(
                f"a bag of {int(self.lengths.min())} token(s) has no token {index}: bags shorter than "
                f"{need} must be left out before batching"
            )
        return self.last - self.lengths + 1 + index if index >= 0 else self.last + 1 + index

    def pad(self, u: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-token values u [N, ...] -> [B, T, ...], `fill` at padded positions."""
        out = u.new_full((len(self), self.width, *u.shape[1:]), fill)
        out[self.mask] = u  # boolean indexing walks bags in order, tokens in order: the packed order
        return out

    def per_token(self, v: torch.Tensor) -> torch.Tensor:
        """A per-bag value v [B, ...] repeated for each token -> [N, ...]."""
        return v[self.bag_of_token]

    @classmethod
    def from_padded(
        cls, x: torch.Tensor, mask: torch.Tensor, p_sem: torch.Tensor | None = None, groups: torch.Tensor | None = None
    ) -> Bags:
        """x [B, T, d] with mask [B, T]: what is under a False is dropped, whatever it holds."""
        return cls(x[mask], mask.sum(1), p_sem, groups)


def gather_rows(offsets: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows and lengths of bags `index` of a ragged store with `offsets` [n + 1].

    Index arithmetic, no per-bag loop: token j of the batch is row j + (start of its bag -
    where its bag starts in the batch).
    """
    starts = offsets[index]  # [B]
    lengths = offsets[index + 1] - starts  # [B]
    shift = starts - (torch.cumsum(lengths, 0) - lengths)  # [B]
    rows = torch.arange(int(lengths.sum()), device=offsets.device) + torch.repeat_interleave(shift, lengths)
    return rows, lengths


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
