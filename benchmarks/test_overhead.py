"""``Dispatcher.attend`` against the bare kernel it runs (1 torch thread).

Each case is timed by pytest-benchmark (``attend`` and ``bare`` side by side in
one group) and, in ``extra_info``, by the interleaved median that ``attnpolicy
bench --overhead`` reports (``overhead_us``: attend minus the bare kernel).
GQA cases time the 8:2 and 8:1 head ratios at 16×512 (no K/V repeat in any path).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.bench.overhead import (
    OVERHEAD_BACKENDS,
    OVERHEAD_POLICIES,
    SHAPES,
    bare_kernel,
    measure_overhead,
)
from attnpolicy.graphs.keys import TensorSpec


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _case(policy, backend, num_seqs, seq_len, kv_heads=8):
    layout = BatchLayout.from_lens([seq_len] * num_seqs)
    g = torch.Generator().manual_seed(0)
    n = layout.q_tokens
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (8, kv_heads, kv_heads))
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend=backend, max_seq_len=max(seq_len, 16),
                                    max_batch_tokens=max(n, 16)))
    d.attend(q, k, v, layout)  # compile: only cached calls are timed
    return d, layout, q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{s}" for n, s in SHAPES])
@pytest.mark.parametrize("policy", OVERHEAD_POLICIES)
@pytest.mark.parametrize("backend", OVERHEAD_BACKENDS)
def test_attend_overhead(benchmark, backend, policy, shape):
    num_seqs, seq_len = shape
    d, layout, q, k, v = _case(policy, backend, num_seqs, seq_len)
    benchmark.group = f"overhead {num_seqs}x{seq_len}"
    row = measure_overhead(backend, policy, num_seqs, seq_len, repeats=7)
    benchmark.extra_info.update(asdict(row))
    with torch.inference_mode():
        benchmark(d.attend, q, k, v, layout)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{s}" for n, s in SHAPES])
@pytest.mark.parametrize("policy", ["varlen", "always-mask"])
def test_bare_kernel(benchmark, policy, shape):
    num_seqs, seq_len = shape
    d, layout, q, k, v = _case(policy, "none", num_seqs, seq_len)
    benchmark.group = f"overhead {num_seqs}x{seq_len}"
    bare = bare_kernel(layout, d.preview(layout, TensorSpec.of(q, k)).mode)
    with torch.inference_mode():
        benchmark(bare, q, k, v)


@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa8:2", "gqa8:1"])
@pytest.mark.parametrize("impl", ["varlen", "loop"])
def test_gqa_16x512(benchmark, impl, kv_heads):
    d, layout, q, k, v = _case("varlen", "none", 16, 512, kv_heads)
    benchmark.group = "gqa 16x512"
    fn = bare_kernel(layout, d.preview(layout, TensorSpec.of(q, k)).mode) if impl == "loop" else (
        lambda q, k, v: d.attend(q, k, v, layout))
    with torch.inference_mode():
        benchmark.pedantic(fn, args=(q, k, v), rounds=5, warmup_rounds=1)
