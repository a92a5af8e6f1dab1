"""Host mask build (uncached) and the cached lookup a repeated layout costs."""

from __future__ import annotations

import pytest

from attnpolicy.bench.mode_timing import split_lengths
from attnpolicy.core.layout import BatchLayout
from attnpolicy.kernels.masks import mask_for


@pytest.mark.parametrize("num_seqs", [1, 4, 16])
@pytest.mark.parametrize("length", [1024, 4096])
def test_mask_build(benchmark, length, num_seqs):
    mask = mask_for(BatchLayout.from_lens(split_lengths(length, num_seqs)))
    benchmark.group = f"mask build L={length}"
    benchmark.extra_info.update(seq_len=length, num_seqs=num_seqs, bytes=length * length)
    benchmark(mask.materialize)


@pytest.mark.parametrize("length", [1024, 4096])
def test_mask_cached(benchmark, length):
    mask = mask_for(BatchLayout.from_lens(split_lengths(length, 4)))
    mask.dense()
    benchmark.group = f"mask build L={length}"
    benchmark.extra_info.update(seq_len=length, cached=True)
    benchmark(mask.dense)
