"""BatchLayout from a HF-style boolean attention mask ``[batch, q_len, kv_len]``.

Self-attention rows are aligned bottom-right: query row ``i`` is the token at key
position ``kv_len - q_len + i``. A row whose own key is masked is padding (its
output is not used). Every other row must see one contiguous interval of keys:
for a causal layout the rows of a sequence share the interval's start and end at
their own position; for a bidirectional one they share the whole interval. The
result is exact: a mask that is not such a block structure (prefix-LM, custom
patterns) raises :class:`~attnpolicy.errors.LayoutError`. A causal sliding-window
mask (row ``p`` sees keys ``p - window < t <= p`` of its sequence) is read with its
``window``: a sequence starts at a row that sees only itself, and every row's
interval must be its sequence's, cut by the window.
Tensor rows: batch row ``b`` owns packed rows ``b * q_len ...`` (queries) and
``b * kv_len ...`` (keys).
"""

from __future__ import annotations

import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import LayoutError


def layout_from_mask(allowed: torch.Tensor, *, causal: bool, window: int | None = None) -> BatchLayout:
    """The layout whose attention pattern is exactly ``allowed`` (True = attend) on its
    non-padding rows, under a causal sliding ``window`` if given; raises
    :class:`LayoutError` if there is none."""
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
    own = torch.arange(lq, device=allowed.device) + off
    if causal and not bool(((last == own) | ~real).all()):
        raise LayoutError("causal mask rows must end at their own position")
    if window is not None:
        if not causal:
            raise LayoutError(f"a bidirectional sliding window ({window}) is not read from masks")
        first = _unwindowed(first, real, own, window)
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


def _unwindowed(first: torch.Tensor, real: torch.Tensor, own: torch.Tensor, window: int) -> torch.Tensor:
    """Each row's sequence start (``[batch, q_len]``) from the first keys of a causal
    ``window`` mask: a sequence starts at a row that sees only itself, or at the first
    real row after padding; a row's first key must then be
    ``max(sequence start, own - window + 1)``, else :class:`LayoutError`."""
    lq = first.shape[1]
    prev_real = torch.cat([real.new_zeros(real.shape[0], 1), real[:, :-1]], dim=1)
    start = real & ((first == own) | ~prev_real)
    cols = torch.arange(lq, device=first.device).expand_as(first)
    last_start = torch.where(start, cols, torch.zeros_like(cols)).cummax(dim=1).values
    seq_first = first.gather(1, last_start)
    if not bool(((first == torch.maximum(seq_first, own - window + 1)) | ~real).all()):
        raise LayoutError(f"mask rows are not a sliding window of {window} over contiguous sequences")
    return seq_first


def layout_without_mask(batch: int, q_len: int, kv_len: int, *, causal: bool) -> BatchLayout:
    """``batch`` unpadded sequences, one per batch row (what a ``None`` HF mask means)."""
    return BatchLayout.from_lens([q_len] * batch, [kv_len] * batch, causal=causal)
