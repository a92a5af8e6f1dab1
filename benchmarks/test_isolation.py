"""What sequence isolation costs a MASK call, on one packed batch of 4 sequences of
1024 tokens: the kernel alone (``none``), the kernel after the dispatcher's
check of q, K, V (``gate``: what an ordinary batch pays), and the kernel with
the branch-free in-graph isolation of ``attention(..., isolate=True)`` (``in-graph``).

Run: ``pytest benchmarks/test_isolation.py --benchmark-group-by=group``.
"""

from __future__ import annotations

import pytest
import torch

from attnpolicy.core.layout import BatchLayout
from attnpolicy.kernels.attention import attention
from attnpolicy.kernels.isolation import leak_free
from attnpolicy.kernels.masks import mask_for


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("isolation", ["none", "gate", "in-graph"])
def test_mask_call_isolation_cost(benchmark, impl, isolation):
    layout = BatchLayout.from_lens([1024] * 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, layout.q_tokens, 64, generator=g) for _ in range(3))
    mask = mask_for(layout).dense()
    benchmark.group = f"MASK 4x1024 {impl}"
    benchmark.extra_info.update(impl=impl, isolation=isolation)

    def run():
        if isolation == "gate":
            assert leak_free(q, k, v)
        return attention(q, k, v, impl=impl, mask=mask, isolate=isolation == "in-graph")
    with torch.inference_mode():
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
