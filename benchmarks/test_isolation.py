"""What sequence isolation costs a MASK call: the kernel with and without its
non-finite-row guard, on one packed batch of 4 sequences of 1024 tokens.

Run: ``pytest benchmarks/test_isolation.py --benchmark-group-by=group``.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.kernels.attention import _IMPL_FNS, attention
from attnpolicy.kernels.masks import mask_for


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("isolated", [True, False])
def test_mask_call_isolation_cost(benchmark, impl, isolated):
    layout = BatchLayout.from_lens([1024] * 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, layout.q_tokens, 64, generator=g) for _ in range(3))
    mask = mask_for(layout).dense()
    benchmark.group = f"MASK 4x1024 {impl}"
    benchmark.extra_info.update(impl=impl, isolated=isolated)
    if isolated:
        def run():
            return attention(q, k, v, impl=impl, mask=mask)
    else:
        def run():
            return _IMPL_FNS[impl](q, k, v, False, mask, 1 / math.sqrt(64), None)
    with torch.inference_mode():
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
