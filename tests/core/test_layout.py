"""BatchLayout constructors, validation, properties; typed masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import layouts

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import LayoutError
from attnpolicy.kernels.masks import (
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
    MaskCache,
    mask_for,
)


def test_constructors_agree():
    a = BatchLayout.from_lens([3, 5], [4, 9])
    b = BatchLayout.from_cu_seqlens([0, 3, 8], [0, 4, 13])
    c = BatchLayout.from_query_start_loc(torch.tensor([0, 3, 8]), torch.tensor([4, 9]))
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert (a.q_starts, a.kv_starts, a.q_tokens, a.kv_tokens) == ((0, 3), (0, 4), 8, 13)


def test_properties():
    single = BatchLayout.from_lens([7])
    assert single.is_single and not single.is_padded and single.max_len == 7 and single.num_seqs == 1
    padded = BatchLayout.from_lens([3, 2], padded_to=8)
    assert padded.is_padded and not padded.is_single and padded.total_tokens == 5 and padded.q_tokens == 8
    context = BatchLayout.from_query_start_loc([0, 1, 2], [10, 20], num_tokens=4)
    assert context.has_context and context.max_kv_len == 20 and context.q_tokens == 4
    assert context.kv_tokens == 30


def test_padding_mask_left_and_right():
    lay = BatchLayout.from_padding_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]]), causal=False)
    assert lay.q_lens == (2, 3) and lay.q_starts == (2, 4) and lay.q_tokens == 8 and not lay.causal


@pytest.mark.parametrize("build, message", [
    (lambda: BatchLayout.from_lens([3, 0]), r"q_lens\[1\] must be >= 1, got 0"),
    (lambda: BatchLayout.from_lens([3, -2]), r"q_lens\[1\] must be >= 1, got -2"),
    (lambda: BatchLayout.from_lens([]), r"q_lens must hold at least one sequence"),
    (lambda: BatchLayout.from_lens([4], [3]), r"kv_lens\[0\] must be >= q_lens\[0\] \(4\), got 3"),
    (lambda: BatchLayout.from_lens([4], [4, 5]), r"kv_lens must have one entry per sequence \(1\)"),
    (lambda: BatchLayout.from_lens([2.5]), r"q_lens must hold integers, got 2.5"),
    (lambda: BatchLayout.from_lens([4, 4], padded_to=7), r"padded_to must be an int >= sum\(q_lens\)=8, got 7"),
    (lambda: BatchLayout.from_cu_seqlens([0, 4, 4]), r"cu_seqlens_q must be strictly increasing: "
                                                     r"cu_seqlens_q\[2\]=4 <= 4"),
    (lambda: BatchLayout.from_cu_seqlens([1, 4]), r"cu_seqlens_q must start at 0"),
    (lambda: BatchLayout.from_query_start_loc([0, 2, 5], [2]), r"seq_lens must have one entry per sequence \(2\)"),
    (lambda: BatchLayout((2, 2), (2, 2), (0, 1), (0, 2), 4, 4), r"q_starts must be increasing without "
                                                                r"overlap: q_starts\[1\]=1 < end of previous"),
    (lambda: BatchLayout((2,), (2,), (3,), (0,), 4, 4), r"q_tokens=4 is smaller than the rows the sequences use"),
    (lambda: BatchLayout.from_padding_mask(torch.tensor([[1, 0, 1]])), "row 0 has non-contiguous tokens"),
    (lambda: BatchLayout.from_padding_mask(torch.tensor([[1, 1], [0, 0]])), "row 1 has no tokens"),
    (lambda: BatchLayout.from_padding_mask(torch.tensor([[1, 2]])), "only 0 and 1"),
    (lambda: BatchLayout.from_padding_mask(torch.ones(2, 2, 2)), r"must be 2-D \[batch, len\], got shape"),
    (lambda: BatchLayout.from_padding_mask(torch.zeros(2, 0)), r"batch >= 1 and len >= 1, got shape \(2, 0\)"),
    (lambda: BatchLayout.from_padding_mask(torch.zeros(0, 3)), r"batch >= 1 and len >= 1, got shape \(0, 3\)"),
    (lambda: BatchLayout.from_lens([2], causal="yes"), "causal must be a bool, got 'yes'"),
])
def test_bad_layouts_name_the_field_and_value(build, message):
    with pytest.raises(LayoutError, match=message):
        build()


def _naive(layout: BatchLayout, rows: int, cols: int) -> torch.Tensor:
    """Token-pair loop: the definition the vectorised masks must match."""
    m = [[False] * cols for _ in range(rows)]  # plain lists: a tensor's per-element writes are slow
    owner = {}
    for i, (qs, ql, ks, kl) in enumerate(zip(layout.q_starts, layout.q_lens, layout.kv_starts, layout.kv_lens)):
        for j in range(ql):
            owner[qs + j] = (i, kl - ql + j)
    for r in range(rows):
        if r not in owner:
            m[r] = [True] * cols
            continue
        i, pos = owner[r]
        ks, kl = layout.kv_starts[i], layout.kv_lens[i]
        for c in range(ks, ks + kl):
            m[r][c] = not layout.causal or c - ks <= pos
    return torch.tensor(m, dtype=torch.bool).reshape(rows, cols)


@given(layout=layouts(max_seqs=3))
def test_masks_match_the_token_pair_definition(layout):
    rows, cols = layout.q_tokens + 3, layout.kv_tokens + 5  # bucket padding too
    mask = mask_for(layout)
    assert isinstance(mask, BlockDiagonalCausalMask if layout.causal else BlockDiagonalMask)
    assert torch.equal(mask.materialize(rows, cols), _naive(layout, rows, cols))


def test_dense_is_cached_only_in_a_given_cache_and_additive_matches():
    mask = mask_for(BatchLayout.from_lens([2, 3]))
    assert mask.dense() is not mask.dense() and torch.equal(mask.dense(), mask.dense())
    cache = MaskCache(max_bytes=30)
    assert mask.dense(cache=cache) is mask.dense(cache=cache)
    assert (cache.stats().hits, cache.stats().misses, cache.stats().bytes) == (1, 1, 25)
    other = mask_for(BatchLayout.from_lens([1, 4]))
    other.dense(cache=cache)  # 25 more bytes: the first mask goes (LRU, 30-byte bound)
    assert cache.stats().evictions == 1 and cache.stats().bytes == 25
    big = mask_for(BatchLayout.from_lens([3, 4]))
    assert big.dense(cache=cache).shape == (7, 7) and cache.stats().uncached == 1  # 49 > 30: not kept
    bias = mask.additive(torch.float32)
    assert torch.equal(bias == 0, mask.dense()) and torch.isinf(bias[~mask.dense()]).all()
    with pytest.raises(ValueError, match=r"mask shape \(4, 5\) is smaller than the layout \(5, 5\)"):
        mask.materialize(4, 5)
