"""The cost-aware policy: rent-or-buy pricing, hedging, determinism, acceptance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.dispatcher import Dispatcher
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.measure.simulation import SimulatedGraph, simulate
from attnpolicy.measure.workload import load_trace, synthetic_default
from attnpolicy.plugins.registry import make_policy, policy_registry
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.costaware import CostAware

MODEL = CostModel.default()
#: The Azure 2023 code trace, when the environment names a local copy (never in the repository).
AZURE = Path(os.environ.get("ATTNPOLICY_AZURE_TRACE", "azure_llm_2023_code.csv"))
FIXED = ("always-mask", "dynamic", "varlen")


def dispatcher(max_graphs: int | None = None) -> Dispatcher:
    d = Dispatcher(AttnPolicyConfig(policy="cost-aware", backend="aot_eager", max_graphs=max_graphs),
                   builder=lambda call, key, spec: SimulatedGraph(key), cost_model=MODEL,
                   cache=GraphCache(max_graphs=max_graphs, sizeof=MODEL.graph_bytes))
    d.use_spec(MODEL.spec)
    return d


def test_registered_as_builtin():
    assert policy_registry()["cost-aware"].plugin == "attnpolicy.policies.costaware"
    assert isinstance(make_policy("cost-aware"), CostAware)


def test_one_off_long_sequence_runs_on_the_cached_mask_graph_then_compiles_once_it_pays():
    d = dispatcher()
    layout = BatchLayout.from_lens([4000])
    (mask_key,) = d.context.keys_for(layout, MaskMode.MASK)
    (causal_key,) = d.context.keys_for(layout, MaskMode.CAUSAL)
    d.cache.get_or_compile(mask_key, lambda: SimulatedGraph(mask_key))  # warmed up
    first = d.decide(layout)
    assert first.mode is MaskMode.MASK
    assert "causal" in first.reason and "compile 1 graph" in first.reason and " ms" in first.reason
    d.prepare(layout, MODEL.spec)
    assert causal_key not in d.cache
    modes = []
    for _ in range(8):  # the same long sequence again and again: compiling CAUSAL pays back
        modes.append(d.decide(layout).mode)
        d.prepare(layout, MODEL.spec)
    assert MaskMode.CAUSAL in modes and causal_key in d.cache
    assert modes[modes.index(MaskMode.CAUSAL):] == [MaskMode.CAUSAL] * (len(modes) - modes.index(MaskMode.CAUSAL))
    assert d.stats()["cache"]["per_key"][str(causal_key)]["compiles"] == 1


def test_without_a_tensor_spec_it_falls_back_to_mask_free_modes():
    policy = CostAware()
    assert policy.decide(BatchLayout.from_lens([10]), PolicyContext()).mode is MaskMode.CAUSAL
    assert policy.decide(BatchLayout.from_lens([10, 20]), PolicyContext()).mode is MaskMode.VARLEN


def test_deterministic_on_a_layout_stream():
    def run() -> list[tuple[str, str]]:
        d = dispatcher(max_graphs=4)
        out = []
        for r in synthetic_default(30):
            layout = BatchLayout.from_lens([min(r.prompt_tokens, 3000), 64], [min(r.prompt_tokens, 3000), 900])
            out.append((d.decide(layout).mode.value, d.decide(layout).reason))
            d.prepare(layout, MODEL.spec)
        return out
    assert run() == run()


def check_acceptance(rows: list[dict], capacities: tuple[int, ...]) -> None:
    by = {(r.policy, r.capacity, r.eviction): r for r in rows}
    for capacity in capacities:
        for eviction in ("lru", "belady"):
            best = min(by[p, capacity, eviction].total_seconds for p in FIXED)
            assert by["cost-aware", capacity, eviction].total_seconds <= best, (capacity, eviction)
        for policy in (*FIXED, "cost-aware"):
            assert by[policy, capacity, "belady"].misses <= by[policy, capacity, "lru"].misses


@pytest.mark.slow
def test_acceptance_on_the_default_workload():
    rows = simulate(load_trace("default"), [*FIXED, "cost-aware"], [2, 4, 8], ["lru", "belady"])
    check_acceptance(rows, (2, 4, 8))


@pytest.mark.slow
@pytest.mark.skipif(not AZURE.is_file(), reason=f"{AZURE} not present")
def test_acceptance_on_the_azure_code_trace():
    rows = simulate(load_trace(AZURE, 1000), [*FIXED, "cost-aware"], [2, 4, 8], ["lru", "belady"])
    check_acceptance(rows, (2, 4, 8))
