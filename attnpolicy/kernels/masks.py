"""Masks as typed objects (in the spirit of xformers' attn_bias).

A mask describes which keys each query row may attend; it materialises a dense
tensor only when a MASK graph needs one. Construction is vectorised (one
block write per sequence, no Python loop over tokens). Nothing is cached per
process: a :class:`~attnpolicy.kernels.mask_cache.MaskCache` (each Dispatcher owns one) keeps dense masks by
layout, shape, device and window (:func:`~attnpolicy.kernels.mask_cache.mask_entry`) within a byte bound, and the
small per-layout tensors (real-row masks, VARLEN bounds, zero padding blocks) within
a byte and an entry bound, so a repeated layout costs nothing to rebuild and everything is freed with
its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.kernels import mask_cache
from attnpolicy.kernels.mask_cache import MaskCache


@dataclass(frozen=True)
class BlockDiagonalMask:
    """Each query attends every key of its own sequence (bidirectional blocks).

    Query rows that belong to no sequence (padding) are allowed everything so no
    softmax row is empty; callers discard those rows. With a ``window`` ``W`` a query
    at position ``p`` sees the keys ``t`` with ``|p - t| < W`` only (see
    :mod:`attnpolicy.core.features`).
    """

    layout: BatchLayout
    window: int | None = None

    def _block(self, q_len: int, kv_len: int) -> torch.Tensor | bool:
        if self.window is None:
            return True
        return window_band(q_len, kv_len, self.window, causal=False)

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

    def dense(self, rows: int | None = None, cols: int | None = None, device: str = "cpu",
              cache: MaskCache | None = None) -> torch.Tensor:
        """The dense boolean mask on ``device``: built fresh, or taken from ``cache`` when
        this is its layout's own mask (:func:`mask_for`; keyed by :func:`mask_entry`; do not
        modify a cached mask)."""
        rows = self.layout.q_tokens if rows is None else rows
        cols = self.layout.kv_tokens if cols is None else cols
        if cache is None or self != mask_for(self.layout, self.window):  # a cache keeps a layout's own mask
            return self.materialize(rows, cols).to(device)
        return layout_mask(cache, self.layout, rows, cols, device, self.window)

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
        if self.window is not None:
            return window_band(q_len, kv_len, self.window, causal=True)
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril_(diagonal=kv_len - q_len)


def layout_mask(masks: MaskCache, layout: BatchLayout, rows: int, cols: int, device: torch.device | str,
                window: int | None = None) -> torch.Tensor:
    """:func:`mask_for` ``(layout, window)``'s dense ``rows × cols`` mask on ``device``,
    kept in ``masks`` per (layout, shape, device, window): the hot path of a MASK call
    (no mask object built on a hit). Do not modify it."""
    key, nbytes = mask_cache.mask_entry(layout, rows, cols, device, window)  # the rule, looked up when called
    dense: torch.Tensor = masks.lookup(key, nbytes,
                                       lambda: mask_for(layout, window).materialize(rows, cols).to(device))
    return dense


def window_band(q_len: int, kv_len: int, window: int, *, causal: bool,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[q_len, kv_len]`` of one sequence under a sliding ``window`` (queries
    are the last ``q_len`` positions): keys ``p - window < t <= p`` when causal,
    ``|p - t| < window`` otherwise. Two ``tril``/``triu`` of a block: no per-token loop."""
    band = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu_(diagonal=kv_len - q_len - window + 1)
    return band.tril_(diagonal=kv_len - q_len + (0 if causal else window - 1))


def real_rows(starts: tuple[int, ...], lens: tuple[int, ...], tokens: int, device: str = "cpu",
              cache: MaskCache | None = None) -> torch.Tensor:
    """Boolean ``[tokens]``: True on rows owned by a sequence (from ``cache`` if
    given; do not modify a cached one)."""
    def build() -> torch.Tensor:
        real = torch.zeros(tokens, dtype=torch.bool)
        for s, n in zip(starts, lens):
            real[s:s + n] = True
        return real.to(device)
    return build() if cache is None else cache.small(("rows", starts, lens, tokens, device), build)


def mask_for(layout: BatchLayout, window: int | None = None) -> BlockDiagonalMask:
    """The typed mask that keeps ``layout``'s sequences apart (under a sliding ``window``)."""
    return BlockDiagonalCausalMask(layout, window) if layout.causal else BlockDiagonalMask(layout, window)


def bounded_mask(rows: int, cols: int, q_len: torch.Tensor, kv_len: torch.Tensor, causal: bool,
                 window: int | None = None) -> torch.Tensor:
    """In-graph mask of one sequence padded to ``(rows, cols)`` from its true ``q_len``
    and ``kv_len`` (0-d tensors, so one compiled graph serves all lengths of a bucket;
    ``[R, 1, 1]`` tensors give a ROWS call's ``[R, rows, cols]`` masks, one a row),
    under a sliding ``window`` if given. Padded key columns are excluded; padded query
    rows see all keys (of the causal bound) and key 0, so no row is left empty (a
    padding row of a ROWS call has no keys of its own)."""
    q_idx = torch.arange(rows, device=q_len.device)[:, None]
    k_idx = torch.arange(cols, device=q_len.device)[None, :]
    allowed = k_idx < kv_len
    pos = q_idx + (kv_len - q_len)  # the query's position among the keys
    if causal:
        allowed = allowed & (k_idx <= pos)
    padding = q_idx >= q_len
    if window is not None:  # padded query rows keep their keys: no row is left empty
        inside = k_idx > pos - window
        if not causal:
            inside = inside & (k_idx < pos + window)
        allowed = allowed & (inside | padding)
    return allowed | (padding & (k_idx == 0))
