"""BatchLayout from a HF-style boolean attention mask ``[batch, q_len, kv_len]``.

Self-attention rows are aligned bottom-right: query row ``i`` is the token at key
position ``kv_len - q_len + i``. A row whose own key is masked is padding (its
output is not used). Every other row must see one contiguous interval of keys:
for a causal layout the rows of a sequence share the interval's start and end at
their own position; for a bidirectional one they share the whole interval. The
result is exact: a mask that is not such a block structure (sliding window,
prefix-LM, custom patterns) raises :class:`~attnpolicy.errors.LayoutError`.
Tensor rows: batch row ``b`` owns packed rows ``b * q_len ...`` (queries) and
``b * kv_len ...`` (keys).
"""

from __future__ import annotations

import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import LayoutError


def layout_from_mask(allowed: torch.Tensor, *, causal: bool) -> BatchLayout:
    """The layout whose attention pattern is exactly ``allowed`` (True = attend) on its
    non-padding rows; raises :class:`LayoutError` if there is none."""
    if allowed.dim() != 3 or allowed.dtype != torch.bool:
        raise LayoutError(f"mask must be a 3-D bool tensor [batch, q_len, kv_len], "
                          f"got {allowed.dtype} {tuple(allowed.shape)}")
    batch, lq, lk = allowed.shape
    off = lk - lq
    if off < 0:
        raise LayoutError(f"mask has more query rows ({lq}) than keys ({lk})")
    real = allowed.diagonal(offset=off, dim1=1, dim2=2)  # each row sees its own token
    first = allowed.to(torch.uint8).argmax(dim=-1)
    last = lk - 1 - allowed.flip(-1).to(torch.uint8).argmax(dim=-1)
    contiguous = allowed.sum(dim=-1) == last - first + 1
    if not bool((contiguous | ~real).all()):
        raise LayoutError("mask rows are not contiguous intervals of keys")
    if causal:
        own = torch.arange(lq, device=allowed.device) + off
        if not bool(((last == own) | ~real).all()):
            raise LayoutError("causal mask rows must end at their own position")
    base = torch.arange(batch, device=allowed.device)[:, None] * lk
    real, first, last = real.reshape(-1), (first + base).reshape(-1), (last + base).reshape(-1)
    prev_real = torch.cat([real.new_zeros(1), real[:-1]])
    new_first = torch.cat([first.new_ones(1), (first[1:] != first[:-1]).to(first.dtype)]).bool()
    starts = real & (~prev_real | new_first)
    if not causal:
        new_last = torch.cat([last.new_ones(1), (last[1:] != last[:-1]).to(last.dtype)]).bool()
        starts |= real & new_last
    if not bool(starts.any()):
        raise LayoutError("mask has no query row that sees its own token")
    group = torch.cumsum(starts, 0) - 1
    q_lens = torch.bincount(group[real], minlength=int(starts.sum()))
    q_starts = starts.nonzero().flatten()
    kv_starts = first[q_starts]
    kv_lens = last[q_starts + q_lens - 1] - kv_starts + 1
    return BatchLayout(tuple(q_lens.tolist()), tuple(kv_lens.tolist()), tuple(q_starts.tolist()),
                       tuple(kv_starts.tolist()),
                       batch * lq, batch * lk, causal)


def layout_without_mask(batch: int, q_len: int, kv_len: int, *, causal: bool) -> BatchLayout:
    """``batch`` unpadded sequences, one per batch row (what a ``None`` HF mask means)."""
    return BatchLayout.from_lens([q_len] * batch, [kv_len] * batch, causal=causal)
