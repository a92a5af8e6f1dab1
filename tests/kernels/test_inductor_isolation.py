"""Isolation under the inductor backend: inductor compiles CPU code with
``-ffinite-math-only``, so the in-graph finiteness checks of masked kernels are
checked here with the compiled graphs themselves (one small MASK graph)."""

from __future__ import annotations

import pytest
import torch

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher


@pytest.mark.inductor
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_inductor_mask_graph_keeps_a_neighbours_nan_and_inf_out(impl):
    torch.manual_seed(0)
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="inductor", attn_impl=impl, max_seq_len=64))
    lay = BatchLayout.from_lens([5, 7], [9, 7])  # the first sequence has cached context
    q, k, v = torch.randn(12, 4, 32), torch.randn(16, 4, 32), torch.randn(16, 4, 32)
    clean = d.attend(q, k, v, lay)
    for target in ("k", "v"):
        for bad in (float("nan"), float("inf"), float("-inf")):
            kk, vv = k.clone(), v.clone()
            (kk if target == "k" else vv)[0, 0, 0] = bad  # a key row of the first sequence
            out = d.attend(q, kk, vv, lay)
            assert torch.equal(out[5:], clean[5:]), (target, bad)
            assert not out[:5].isfinite().all(), (target, bad)  # its own rows see it
    assert d.stats().cache.compiles == 1


@pytest.mark.inductor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_keeps_a_neighbours_overflowing_keys_out(dtype):
    """3e38 keys are finite, but their q·k overflows to +inf: sequence 0 stays clean."""
    torch.manual_seed(0)
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="inductor", max_seq_len=32))
    lay = BatchLayout.from_lens([10, 20])
    q, k, v = (torch.randn(30, 4, 16).to(dtype) for _ in range(3))
    clean = d.attend(q, k, v, lay)
    k[10:] = 3e38
    assert torch.equal(d.attend(q, k, v, lay)[:10], clean[:10])
