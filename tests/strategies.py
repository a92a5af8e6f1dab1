"""Hypothesis strategies for batch layouts and matching tensors."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from attnpolicy.core.layout import BatchLayout

MAX_LEN = 300


@st.composite
def layouts(draw, single: bool = False, max_seqs: int = 8, *, min_seqs: int = 1, max_len: int = MAX_LEN,
            max_context: int = 100, max_pad: int = 64) -> BatchLayout:
    """``min_seqs``–``max_seqs`` sequences of 1–``max_len`` tokens; causal or
    bidirectional; with or without cached context (up to ``max_context`` tokens each);
    unpadded, trailing-padded (up to ``max_pad`` rows), or HF-style per-row padded."""
    if single:
        n = draw(st.integers(1, max_len))
        return BatchLayout.from_lens([n])
    k = draw(st.integers(min_seqs, max_seqs))
    q_lens = draw(st.lists(st.integers(1, max_len), min_size=k, max_size=k))
    causal = draw(st.booleans())
    shape = draw(st.sampled_from(["packed", "context", "trailing-pad", "hf-pad"]))
    if shape == "context":
        extra = draw(st.lists(st.integers(0, max_context), min_size=k, max_size=k))
        return BatchLayout.from_lens(q_lens, [q + e for q, e in zip(q_lens, extra)], causal=causal)
    if shape == "trailing-pad":
        pad = draw(st.integers(1, max_pad))
        return BatchLayout.from_lens(q_lens, causal=causal, padded_to=sum(q_lens) + pad)
    if shape == "hf-pad":
        width = max(q_lens) + draw(st.integers(0, 8))
        left = draw(st.booleans())
        mask = torch.zeros(k, width, dtype=torch.int64)
        for row, n in enumerate(q_lens):
            if left:
                mask[row, width - n:] = 1
            else:
                mask[row, :n] = 1
        return BatchLayout.from_padding_mask(mask, causal=causal)
    return BatchLayout.from_lens(q_lens, causal=causal)


def random_qkv(layout: BatchLayout, seed: int = 0, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random q ``[q_tokens, heads, head_dim]``, k and v ``[kv_tokens, kv_heads,
    head_dim]`` for ``layout`` (drawn in that order, then cast to ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(layout.q_tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(layout.kv_tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(layout.kv_tokens, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


@st.composite
def qkv(draw, layout: BatchLayout, dtype: torch.dtype = torch.float32):
    """Random q, k, v for ``layout`` with a GQA ratio of 1, 2 or 4."""
    kv_heads, ratio = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]))
    head_dim = draw(st.sampled_from([8, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return random_qkv(layout, seed, heads=kv_heads * ratio, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


@st.composite
def poisons(draw, layout: BatchLayout):
    """A non-finite value for one kv row of one sequence: ``(seq, tensor, row, value)``
    with tensor ``"k"`` or ``"v"`` and ``row`` a packed kv row of that sequence."""
    seq = draw(st.integers(0, layout.num_seqs - 1))
    row = layout.kv_starts[seq] + draw(st.integers(0, layout.kv_lens[seq] - 1))
    return seq, draw(st.sampled_from(["k", "v"])), row, draw(st.sampled_from([float("nan"), float("inf"),
                                                                             float("-inf")]))


@st.composite
def features(draw, heads: int | None = None):
    """``(window, softcap, sinks)``: a sliding window of 1–48 keys or None, a soft cap
    in [0.5, 50] or None, and sink logits ``[heads]`` in [-4, 4] or None (None too when
    ``heads`` is None)."""
    window = draw(st.one_of(st.none(), st.integers(1, 48)))
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    sinks = None
    if heads is not None and draw(st.booleans()):
        sinks = torch.tensor(draw(st.lists(st.floats(-4.0, 4.0), min_size=heads, max_size=heads)))
    return window, softcap, sinks
