"""Sequence isolation around a masked call, outside any compiled graph.

A call that packs several sequences (MASK, flex) or masks part of one (VARLEN)
lets hidden keys into its arithmetic: a probability of 0 times an infinite value
is NaN, and an additive ``-inf`` on a NaN score stays NaN. Only non-finite K/V
values can leak (a finite one gets weight exactly 0), so the common case costs one
cheap check per batch (:func:`all_finite`, one dot product), and only a batch that
fails it takes the isolating path: non-finite key rows are zeroed before the call
(:func:`sanitised`), and the output rows that attend one of them are set to NaN
after it (:func:`repoisoned`), the faithful result of their own bad input.

A batch of one sequence without padding rows (``BatchLayout.is_single``) has no
neighbour to protect and is not checked: what a bad value in it does is the
kernel's own answer, as in a CAUSAL call (with torch's SDPA, every row that
attends it is non-finite, and possibly earlier rows of the same kernel block).

The checks run in eager code: inductor compiles CPU code with
``-ffinite-math-only``, so an in-graph finiteness test cannot be relied on.
"""

from __future__ import annotations

import math

import torch

from attnpolicy.core.layout import BatchLayout


def all_finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``k`` and ``v`` (same shape) hold only finite values, in one reduction
    and one host synchronisation: ``k · v`` (flattened) is finite iff every product is
    (``inf · 0`` is NaN, ``inf · x`` infinite, a NaN stays NaN), unless the sum
    overflows. An overflow only sends the batch down the isolating path, which is as
    exact; fp16, whose products overflow early, sums each tensor in fp32 instead."""
    if k.dtype is torch.float16:
        return math.isfinite(float(k.sum(dtype=torch.float32)) + float(v.sum(dtype=torch.float32)))
    return math.isfinite(float(k.ravel().dot(v.ravel())))


def bad_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[T]`` True where a packed row of ``k`` or ``v`` (``[T, H, D]``) holds a
    non-finite value in any head."""
    return ~(torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1))


def sanitised(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Packed ``x[T, H, D]`` with the rows marked in ``bad[T]`` zeroed (a new tensor)."""
    return x.masked_fill(bad[:, None, None], 0)


def poisoned_rows(layout: BatchLayout, bad: torch.Tensor) -> torch.Tensor:
    """``[q_tokens]`` True for the query rows that attend a key row marked in ``bad``
    (bottom-right causal within a sequence, every key of it when bidirectional; rows
    outside every sequence attend nothing). The rare path: Python over the layout."""
    rows = torch.zeros(layout.q_tokens, dtype=torch.bool)
    marked = bad.nonzero().flatten().tolist()
    for qs, ql, ks, kl in zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens):
        first = min((r - ks for r in marked if ks <= r < ks + kl), default=None)
        if first is None:
            continue
        # query j sees key positions 0 .. (kl - ql) + j when causal, all keys otherwise
        j = max(0, first - (kl - ql)) if layout.causal else 0
        rows[qs + j:qs + ql] = True
    return rows.to(bad.device)


def repoisoned(out: torch.Tensor, layout: BatchLayout, bad: torch.Tensor) -> torch.Tensor:
    """Packed ``out[q_tokens, Hq, D]`` with the rows that attend a ``bad`` key row
    (:func:`poisoned_rows`) set to NaN in every head."""
    return out.masked_fill(poisoned_rows(layout, bad)[:, None, None], float("nan"))
