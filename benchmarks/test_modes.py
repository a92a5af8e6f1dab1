"""pytest-benchmark version of ``attnpolicy bench``: modes side by side, grouped by (L, n).

Run: ``pytest benchmarks --benchmark-json out.json`` (not part of the test suite).
MASK's timing includes building its mask afresh, as in ``attnpolicy bench``.
"""

from __future__ import annotations

import pytest
import torch

from attnpolicy.bench.mode_timing import modes_for, split_lengths, time_mode
from attnpolicy.bench.settings import BenchSettings
from attnpolicy.core.layout import BatchLayout

LENGTHS = (128, 512, 1024, 2048)
SEQS = (1, 4)


@pytest.mark.parametrize(("length", "num_seqs", "mode"),
                         [(length, n, mode) for length in LENGTHS for n in SEQS for mode in modes_for(n)],
                         ids=str)
def test_mode(benchmark, length, num_seqs, mode):
    settings = BenchSettings()
    layout = BatchLayout.from_lens(split_lengths(length, num_seqs))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, settings.heads, settings.head_dim, generator=g) for _ in range(3))
    benchmark.group = f"L={length} n={num_seqs}"
    benchmark.extra_info.update(mode=mode.value, seq_len=length, num_seqs=num_seqs, impl=settings.impl)
    with torch.inference_mode():
        benchmark.pedantic(time_mode, args=(q, k, v, layout, mode, settings), rounds=5, warmup_rounds=1)
