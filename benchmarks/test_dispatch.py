"""Dispatch overhead on a cache hit, and each policy's cache behaviour on a workload.

``prepare`` is everything ``attend`` does besides touching tensors: the guarded
decision, the (memoised) plan with its graph keys, and the cache lookup.
"""

from __future__ import annotations

import pytest

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import synthetic_default

SPEC = TensorSpec("float32", 8, 8, 64)
LAYOUTS = {"single": BatchLayout.from_lens([1000]), "packed-4": BatchLayout.from_lens([250] * 4),
           "decode-16": BatchLayout.from_lens([1] * 16, list(range(100, 1700, 100)))}


def _stub(call, key, spec):
    return lambda *args: None


@pytest.mark.parametrize("policy", ["dynamic", "varlen", "always-mask", "cost-aware"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dispatch_overhead_on_hit(benchmark, policy, name):
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend="none"), builder=_stub)
    layout = LAYOUTS[name]
    d.prepare(layout, SPEC)  # compile (stub) once: every timed call is a hit
    benchmark.group = f"dispatch overhead {name}"
    benchmark.extra_info.update(policy=policy, calls_per_batch=len(d.prepare(layout, SPEC)))
    benchmark(d.prepare, layout, SPEC)
    stats = d.stats().to_json()["cache"]
    benchmark.extra_info.update(hit_rate=stats["hits"] / (stats["hits"] + stats["misses"]),
                                compiles=stats["compiles"])


@pytest.mark.parametrize("capacity", [4, 16])
@pytest.mark.parametrize("policy", ["always-mask", "dynamic", "varlen", "cost-aware"])
def test_policy_on_workload(benchmark, policy, capacity):
    steps = list(BatchFormer().steps(synthetic_default(100)))

    def replay():
        d = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_graphs=capacity), builder=_stub)
        for step in steps:
            d.prepare(step.layout, SPEC)
        return d.stats().to_json()

    benchmark.group = f"policy decisions on 100 default requests, capacity {capacity}"
    stats = benchmark.pedantic(replay, rounds=3)
    cache = stats["cache"]
    benchmark.extra_info.update(policy=policy, capacity=capacity, batches=stats["batches"],
                                hit_rate=cache["hits"] / (cache["hits"] + cache["misses"]),
                                compiles=cache["compiles"], evictions=cache["evictions"],
                                modes=stats["modes"])
