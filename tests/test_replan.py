"""The planner's call table against the dispatcher simulation; drift and re-planning."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.cli import main
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.simulation import simulate_layouts, simulation_config
from attnpolicy.planning.call_table import CallTable
from attnpolicy.planning.graph_set import plan_graphs, with_fields
from attnpolicy.planning.replan import measure_drift, modelled_row, switch_set
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.layout_stream import LayoutStreamWriter
from attnpolicy.workloads.traces import Request

pytestmark = pytest.mark.usefixtures("fresh_plugins")

SPEC = TensorSpec("float32", 2, 2, 16)
FORMER = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 1024}
POLICIES = ("varlen", "dynamic", "always-mask", "always-causal")


def _steps(prompts, seed_arrival=0.0):
    requests = [Request(seed_arrival + i, p, 3) for i, p in enumerate(prompts)]
    return [s.layout for s in BatchFormer(**FORMER).steps(requests)]


def _base(**fields):
    model = CostModel.default()
    return model, simulation_config(model, BatchFormer(**FORMER), **fields)


layouts = st.lists(
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 400)), min_size=1, max_size=5).map(
        lambda seqs: BatchLayout.from_lens([q for q, _ in seqs], [q + c for q, c in seqs])),
    min_size=1, max_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=layouts, policy=st.sampled_from(POLICIES), capacity=st.sampled_from([1, 3, None]),
       sizes=st.sampled_from([None, [16, 64, 256], [48, 700]]), mask_bytes=st.sampled_from([None, 20000]),
       eviction=st.sampled_from(["lru", "lfu", "fifo", "cost", "belady"]))
def test_the_call_table_gives_the_rows_of_the_dispatcher_simulation(steps, policy, capacity, sizes, mask_bytes,
                                                                       eviction):
    model, base = _base(on_overflow="eager")
    fields = {"policy": policy}
    if sizes is not None:
        fields["buckets"] = {"kind": "list", "sizes": sizes}
    if mask_bytes is not None:
        fields["max_mask_bytes"] = mask_bytes
    config = with_fields(base, **fields)
    expected = simulate_layouts(steps, [policy], [capacity], [eviction], config, model)
    got = CallTable(steps, policy, config, model).rows(with_fields(config, max_graphs=capacity), [eviction],
                                                      expected[0].buckets)
    assert got == expected


def test_drift_is_zero_on_the_traffic_the_plan_was_fitted_on():
    model, base = _base(max_graphs=4)
    steps = _steps([20, 300, 45, 700, 90, 33, 512, 128])
    plan = plan_graphs(steps, base, model, ["varlen"], max_buckets=4)
    drift = measure_drift(steps, plan.config, model)
    assert drift.drift == pytest.approx(0.0, abs=1e-9) and not drift.replan
    assert switch_set(plan.config, drift.refit.config) == ()


def test_replanning_follows_traffic_whose_lengths_shift():
    model, base = _base(max_graphs=4)
    short = _steps([30 + 7 * i for i in range(12)])
    long = _steps([600 + 29 * i for i in range(12)], seed_arrival=100.0)
    old = plan_graphs(short, base, model, ["varlen"], max_buckets=4).config
    drift = measure_drift(long, old, model)
    assert drift.drift > drift.threshold and drift.replan
    new = drift.refit.config
    assert modelled_row(long, new, model).total_seconds < modelled_row(long, old, model).total_seconds
    # the refit buckets sit among the new prompt lengths, which the old plan padded
    planned = [s for s in new.buckets.sizes if s < base.max_seq_len]
    assert any(600 <= s <= 1000 for s in planned)
    assert not any(600 <= s <= 1000 for s in old.buckets.sizes if s < base.max_seq_len)
    switch = switch_set(old, new)
    assert switch and all(w not in old.warmup for w in switch)


def test_the_replan_command_writes_the_drift_and_the_refit_config(tmp_path):
    model, base = _base(max_graphs=4)
    old = plan_graphs(_steps([30 + 7 * i for i in range(12)]), base, model, ["varlen"], max_buckets=4).config
    current = tmp_path / "current"
    old.save(current)
    path = tmp_path / "layouts.jsonl"
    writer = LayoutStreamWriter(path, old, SPEC)
    counters = {"hits": 0, "misses": 0, "evictions": 0, "graphs": 0}
    for layout in _steps([600 + 29 * i for i in range(12)]):
        writer.write_step(layout, Dispatcher(old).preview(layout, SPEC).mode, [], counters)
    writer.close()
    out = tmp_path / "new"
    assert main(["replan", "--config", str(current), "--layouts", str(path), "--out", str(out)]) == 0
    report = json.loads((out / "replan.json").read_text())
    assert report["replan"] and report["drift"] > report["threshold"]
    assert report["current_total_seconds"] > report["refit_total_seconds"] and report["switch"]
    assert AttnPolicyConfig.load(out).buckets != old.buckets
