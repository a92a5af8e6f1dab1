"""Masks as typed objects (in the spirit of xformers' attn_bias).

A mask describes which keys each query row may attend; it materialises a dense
tensor only when a MASK graph needs one. Construction is vectorised (one
broadcast comparison, no Python loop over tokens) and dense tensors are cached
by (layout, shape), so a repeated layout costs nothing to rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from attnpolicy.layout import BatchLayout

#: Dense masks kept per process (each at most rows×cols bytes as bool).
DENSE_CACHE_SIZE = 16


def _row_ids(starts: tuple[int, ...], lens: tuple[int, ...], rows: int) -> torch.Tensor:
    """Sequence id of each row (-1 for padding rows)."""
    ids = torch.full((rows,), -1, dtype=torch.int32)
    for i, (s, n) in enumerate(zip(starts, lens)):
        ids[s:s + n] = i
    return ids


@dataclass(frozen=True)
class BlockDiagonalMask:
    """Each query attends every key of its own sequence (bidirectional blocks).

    Query rows that belong to no sequence (padding) are allowed everything so no
    softmax row is empty; callers discard those rows.
    """

    layout: BatchLayout

    def _parts(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lay = self.layout
        if rows < lay.q_tokens or cols < lay.kv_tokens:
            raise ValueError(
                f"mask shape ({rows}, {cols}) is smaller than the layout ({lay.q_tokens}, {lay.kv_tokens})"
            )
        q_ids = _row_ids(lay.q_starts, lay.q_lens, rows)
        k_ids = _row_ids(lay.kv_starts, lay.kv_lens, cols)
        allowed = q_ids[:, None] == k_ids[None, :]
        allowed |= (q_ids < 0)[:, None]
        return allowed, q_ids, k_ids

    def materialize(self, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
        """Build a fresh dense boolean mask ``[rows, cols]`` (True = attend), uncached."""
        rows = self.layout.q_tokens if rows is None else rows
        cols = self.layout.kv_tokens if cols is None else cols
        return self._parts(rows, cols)[0]

    def dense(self, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
        """The dense boolean mask, cached per (mask, shape). Do not modify it."""
        rows = self.layout.q_tokens if rows is None else rows
        cols = self.layout.kv_tokens if cols is None else cols
        return _dense_cached(self, rows, cols)

    def additive(self, dtype: torch.dtype = torch.float32, rows: int | None = None,
                 cols: int | None = None) -> torch.Tensor:
        """The mask as an additive bias: 0 where allowed, -inf elsewhere."""
        allowed = self.dense(rows, cols)
        bias = torch.zeros(allowed.shape, dtype=dtype)
        return bias.masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Causal within each sequence, aligned bottom-right: query ``j`` of a sequence
    with ``c`` cached context keys sees keys ``0 .. c + j``."""

    def _parts(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        allowed, q_ids, k_ids = super()._parts(rows, cols)
        lay = self.layout
        q_pos = torch.zeros(rows, dtype=torch.int32)
        k_pos = torch.zeros(cols, dtype=torch.int32)
        for qs, ql, ks, kl in zip(lay.q_starts, lay.q_lens, lay.kv_starts, lay.kv_lens):
            q_pos[qs:qs + ql] = torch.arange(kl - ql, kl, dtype=torch.int32)
            k_pos[ks:ks + kl] = torch.arange(kl, dtype=torch.int32)
        allowed &= (k_pos[None, :] <= q_pos[:, None]) | (q_ids < 0)[:, None]
        return allowed, q_ids, k_ids


@lru_cache(maxsize=DENSE_CACHE_SIZE)
def _dense_cached(mask: BlockDiagonalMask, rows: int, cols: int) -> torch.Tensor:
    return mask.materialize(rows, cols)


def mask_for(layout: BatchLayout) -> BlockDiagonalMask:
    """The typed mask that keeps ``layout``'s sequences apart."""
    return BlockDiagonalCausalMask(layout) if layout.causal else BlockDiagonalMask(layout)


def bounded_mask(rows: int, cols: int, lens: torch.Tensor, causal: bool) -> torch.Tensor:
    """In-graph mask of one sequence padded to ``(rows, cols)`` from its true
    ``lens = [q_len, kv_len]`` (a tensor, so one compiled graph serves all lengths
    of a bucket). Padded key columns are excluded; padded query rows see all keys."""
    q_idx = torch.arange(rows, device=lens.device)[:, None]
    k_idx = torch.arange(cols, device=lens.device)[None, :]
    allowed = k_idx < lens[1]
    if causal:
        allowed = allowed & (k_idx <= q_idx + (lens[1] - lens[0]))
    return allowed
