"""Masks as typed objects (in the spirit of xformers' attn_bias).

A mask describes which keys each query row may attend; it materialises a dense
tensor only when a MASK graph needs one. Construction is vectorised (one
block write per sequence, no Python loop over tokens) and dense tensors are cached
by (layout, shape), so a repeated layout costs nothing to rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from attnpolicy.core.layout import BatchLayout

#: Dense masks kept per process (each at most rows×cols bytes as bool).
DENSE_CACHE_SIZE = 16


@dataclass(frozen=True)
class BlockDiagonalMask:
    """Each query attends every key of its own sequence (bidirectional blocks).

    Query rows that belong to no sequence (padding) are allowed everything so no
    softmax row is empty; callers discard those rows.
    """

    layout: BatchLayout

    def _block(self, q_len: int, kv_len: int) -> torch.Tensor | bool:
        return True

    def materialize(self, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
        """Build a fresh dense boolean mask ``[rows, cols]`` (True = attend), uncached.

        Padded to ``rows × cols`` (a bucket); one block write per sequence, so the
        cost is one allocation plus the blocks, not a comparison per token pair.
        """
        lay = self.layout
        rows = lay.q_tokens if rows is None else rows
        cols = lay.kv_tokens if cols is None else cols
        if rows < lay.q_tokens or cols < lay.kv_tokens:
            raise ValueError(f"mask shape ({rows}, {cols}) is smaller than the layout "
                             f"({lay.q_tokens}, {lay.kv_tokens})")
        allowed = torch.zeros(rows, cols, dtype=torch.bool)
        for qs, ql, ks, kl in zip(lay.q_starts, lay.q_lens, lay.kv_starts, lay.kv_lens):
            allowed[qs:qs + ql, ks:ks + kl] = self._block(ql, kl)
        if lay.is_padded or rows > lay.q_tokens:
            allowed[~real_rows(lay.q_starts, lay.q_lens, rows)] = True
        return allowed

    def dense(self, rows: int | None = None, cols: int | None = None, device: str = "cpu") -> torch.Tensor:
        """The dense boolean mask, cached per (mask, shape, device). Do not modify it."""
        rows = self.layout.q_tokens if rows is None else rows
        cols = self.layout.kv_tokens if cols is None else cols
        return _dense_cached(self, rows, cols, device)

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

    def _block(self, q_len: int, kv_len: int) -> torch.Tensor | bool:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril_(diagonal=kv_len - q_len)


@lru_cache(maxsize=DENSE_CACHE_SIZE)
def _dense_cached(mask: BlockDiagonalMask, rows: int, cols: int, device: str) -> torch.Tensor:
    return mask.materialize(rows, cols).to(device)


@lru_cache(maxsize=256)
def real_rows(starts: tuple[int, ...], lens: tuple[int, ...], tokens: int, device: str = "cpu") -> torch.Tensor:
    """Boolean ``[tokens]``: True on rows owned by a sequence (cached; do not modify)."""
    real = torch.zeros(tokens, dtype=torch.bool)
    for s, n in zip(starts, lens):
        real[s:s + n] = True
    return real.to(device)


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
