"""The planner's call table against the dispatcher simulation; drift and re-planning."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.cache.key_stream import StreamCache
from attnpolicy.cli import main
from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import ConfigError, GraphTooLargeError
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.kernels import mask_cache
from attnpolicy.modelling.simulation import simulate_layouts, simulated, simulation_config
from attnpolicy.planning.call_table import CallTable, _first_order, _positions
from attnpolicy.planning.graph_set import AttentionPlanLevel, plan_graphs, with_fields
from attnpolicy.planning.replan import measure_drift, modelled_row, switch_set
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.layout_stream import LayoutStreamWriter
from attnpolicy.workloads.traces import Request

pytestmark = pytest.mark.usefixtures("fresh_plugins")

SPEC = TensorSpec("float32", 2, 2, 16)
FORMER = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 1024}
POLICIES = ("varlen", "dynamic", "always-mask", "always-causal", "always-rows", "dynamic-rows")
#: The policies of POLICIES with options: ``dynamic`` weighing a rows plan's padding.
OPTIONS = {"dynamic-rows": ("dynamic", {"rows": 0.3})}
#: The code of ROWS in a :class:`CallTable`'s ``modes``.
_ROWS_MODE = list(MaskMode).index(MaskMode.ROWS)


def _steps(prompts, seed_arrival=0.0):
    requests = [Request(seed_arrival + i, p, 3) for i, p in enumerate(prompts)]
    return [s.layout for s in BatchFormer(**FORMER).steps(requests)]


def _base(**fields):
    model = CostModel.default()
    return model, simulation_config(model, BatchFormer(**FORMER), **fields)


def _policy(name):
    """A policy of POLICIES: its registered name and the config fields that choose it."""
    policy, options = OPTIONS.get(name, (name, {}))
    return policy, {"policy": policy, "policy_options": options}


layouts = st.lists(
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 400)), min_size=1, max_size=5).map(
        lambda seqs: BatchLayout.from_lens([q for q, _ in seqs], [q + c for q, c in seqs])),
    min_size=1, max_size=12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=layouts, policy=st.sampled_from(POLICIES), capacity=st.sampled_from([1, 3, None]),
       sizes=st.sampled_from([None, [16, 64, 256], [48, 700], "exact"]), mask_bytes=st.sampled_from([None, 20000]),
       eviction=st.sampled_from(["lru", "lfu", "fifo", "cost", "belady"]),
       row_buckets=st.sampled_from([None, (2,), (1, 3)]))
def test_the_call_table_gives_the_rows_of_the_dispatcher_simulation(steps, policy, capacity, sizes, mask_bytes,
                                                                       eviction, row_buckets):
    """Every policy, rows policies too (``dynamic`` with its ``rows`` option decides from
    rows plans, so under each config's buckets), calls for calls; a table built under
    other row buckets gives a config's rows by that config's."""
    model, base = _base(on_overflow="eager")
    policy, fields = _policy(policy)
    if row_buckets is not None:
        fields["row_buckets"] = row_buckets
    if sizes is not None:
        fields["buckets"] = {"kind": "exact"} if sizes == "exact" else {"kind": "list", "sizes": sizes}
    if mask_bytes is not None:
        fields["max_mask_bytes"] = mask_bytes
    config = with_fields(base, **fields)
    expected = simulate_layouts(steps, [policy], [capacity], [eviction], config, model)
    table = CallTable(steps, policy, with_fields(config, row_buckets=base.row_buckets), model)  # other row buckets
    got = table.rows(with_fields(config, max_graphs=capacity), [eviction], expected[0].buckets)
    assert got == expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=layouts, repeat=st.integers(2, 3), capacity=st.sampled_from([1, None]),
       mask_bytes=st.sampled_from([None, 5000, 40000]))
def test_mask_builds_of_repeated_layouts_are_those_of_the_dispatcher(steps, repeat, capacity, mask_bytes):
    model, base = _base(on_overflow="eager")
    config = with_fields(base, policy="always-mask", **({"max_mask_bytes": mask_bytes} if mask_bytes else {}))
    steps = steps * repeat  # the mask cache hits on a layout seen before, or builds it again once evicted
    expected = simulate_layouts(steps, ["always-mask"], [capacity], ["lru"], config, model)
    got = CallTable(steps, "always-mask", config, model).rows(with_fields(config, max_graphs=capacity), ["lru"],
                                                             expected[0].buckets)
    assert got == expected


def test_a_rows_decodes_length_one_is_a_key_apart_from_the_smallest_buckets():
    """A decode's rows call runs at query length 1, never a bucket: it is its own graph
    beside a chunk's call of the smallest bucket, in the table as in the dispatcher."""
    model, base = _base(on_overflow="eager", policy="always-rows", backend="none")
    config = with_fields(base, buckets={"kind": "list", "sizes": [32, 96, 128]})
    steps = [BatchLayout.from_lens([10], [52]), BatchLayout.from_lens([1], [92])]
    (expected,) = simulate_layouts(steps, ["always-rows"], [None], ["lru"], config, model)
    bucketed = CallTable(steps, "always-rows", config, model).bucketed(config)
    assert [(k.q_len, k.kv_len, k.rows, k.context) for k in bucketed.keys] == [(32, 96, 1, True), (1, 96, 1, True)]
    assert bucketed.q_bucket.tolist() == [32, 1] and expected.distinct_keys == 2
    assert CallTable(steps, "always-rows", config, model).rows(config, ["lru"], expected.buckets) == [expected]


def test_a_policy_that_weighs_rows_plans_is_decided_under_each_configs_buckets():
    """``dynamic`` with its ``rows`` option runs ROWS where a rows plan pads little: which
    batches depends on the buckets (decodes' ``[rows, 1]`` calls pad no query under any),
    so the table decides again under each config, batch for batch as that config's
    dispatcher does."""
    model, base = _base(on_overflow="eager", policy="dynamic", policy_options={"rows": 0.3})
    steps = _steps([20, 45, 300, 9, 70, 33, 31, 200, 64])
    table = CallTable(steps, "dynamic", base, model)
    decodes = {i for i, layout in enumerate(steps) if set(layout.q_lens) == {1}}
    ran = []
    for buckets in ({"kind": "exact"}, {"kind": "list", "sizes": [48, 700]}):
        config = with_fields(base, buckets=buckets)
        (expected,) = simulate_layouts(steps, ["dynamic"], [None], ["lru"], config, model)
        assert table.rows(config, ["lru"], expected.buckets) == [expected]
        dispatcher = Dispatcher(config, builder=simulated, cost_model=model)
        rows = {i for i, layout in enumerate(steps) if dispatcher.prepare(layout, SPEC).mode_name == "rows"}
        assert rows == {i for i, m in enumerate(table.of_config(config).modes.tolist()) if m == _ROWS_MODE}
        assert rows >= decodes and len(rows) == expected.modes["rows"]
        ran.append(rows)
    assert decodes and ran[0] != ran[1]


def _strict_mask(q_bucket, kv_bucket, max_mask_bytes):
    """A mask rule four times as strict as the built-in one."""
    return q_bucket * kv_bucket > max_mask_bytes // 4


def _strict_compile(q_bucket, kv_bucket, largest):
    """A compile rule that runs every call past half the largest bucket uncompiled."""
    return (q_bucket > largest // 2) | (kv_bucket > largest // 2)


_row_groups = plan_rules.row_groups


def _pairs(q_lens, max_rows=None):
    """A rows rule that runs at most two sequences a call."""
    return _row_groups(q_lens, 2 if max_rows is None else min(max_rows, 2))


@settings(max_examples=30, deadline=None)
@given(steps=layouts, policy=st.sampled_from(POLICIES),
       buckets=st.sampled_from([{"kind": "pow2", "min": 16}, {"kind": "multiple", "multiple": 48},
                                {"kind": "list", "sizes": [16, 64, 200]}, {"kind": "exact"}]),
       max_seq_len=st.sampled_from([256, 700]), max_batch_tokens=st.sampled_from([700, 4096]),
       mask_bytes=st.sampled_from([5000, 40000, 1 << 24]),
       rule=st.sampled_from(["built-in", "mask", "compile", "rows"]))
def test_the_call_table_and_the_dispatcher_plan_by_one_rule(steps, policy, buckets, max_seq_len, max_batch_tokens,
                                                           mask_bytes, rule):
    """Lengths over the largest bucket (uncompiled) and masks over max_mask_bytes (VARLEN
    instead) under every kind of buckets give the table the dispatcher's rows, and so
    does a changed rule: both apply the rules of ``plan_rules``."""
    model, base = _base(on_overflow="eager")
    policy, fields = _policy(policy)
    config = with_fields(base, **fields, buckets=buckets, max_seq_len=max_seq_len,
                         max_batch_tokens=max_batch_tokens, max_mask_bytes=mask_bytes)
    with pytest.MonkeyPatch.context() as patch:
        if rule == "mask":
            patch.setattr(plan_rules, "mask_over", _strict_mask)
        elif rule == "compile":
            patch.setattr(plan_rules, "uncompiled", _strict_compile)
        elif rule == "rows":
            patch.setattr(plan_rules, "row_groups", _pairs)
        expected = simulate_layouts(steps, [policy], [None], ["lru"], config, model)
        got = CallTable(steps, policy, config, model).rows(config, ["lru"], expected[0].buckets)
    assert got == expected


def _shape_only(layout, rows, cols, device, window=None):
    """A mask entry whose key shares one mask among the layouts of a shape."""
    return (rows, cols, device, window), rows * cols


def _lengths_only(layout, rows, cols, device, window=None):
    """A mask entry whose key ignores causality."""
    return (layout.q_lens, layout.kv_lens, rows, cols, device, window), rows * cols


def test_the_planner_keeps_masks_by_the_rule_the_dispatcher_keeps_them_by(monkeypatch):
    a, b, c = BatchLayout.from_lens([20, 30]), BatchLayout.from_lens([20, 30], causal=False), BatchLayout.from_lens([25, 25])
    d, e = BatchLayout.from_lens([10], [40]), BatchLayout.from_lens([40, 10])
    steps = [a, b, a, b, c, d, c, a, e, e, b]  # 64 x 64 masks but d's 16 x 64; two 64 x 64 fit
    model = CostModel.default()
    config = AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=256, max_mask_bytes=2 * 64 * 64 + 1024,
                              buckets={"kind": "list", "sizes": [16, 64, 256]})
    builds = {}
    for rule in (mask_cache.mask_entry, _shape_only, _lengths_only):
        monkeypatch.setattr(mask_cache, "mask_entry", rule)
        dispatcher = Dispatcher(config)
        g = torch.Generator().manual_seed(0)
        for layout in steps:
            dispatcher.attend(torch.randn(layout.q_tokens, 4, 16, generator=g),
                              *torch.randn(2, layout.kv_tokens, 2, 16, generator=g), layout)
        assert dispatcher.stats().modes["mask"] == len(steps)
        table = CallTable(steps, "always-mask", config, model).bucketed(config).recording
        (simulated,) = simulate_layouts(steps, ["always-mask"], [None], ["lru"], config, model)
        builds[rule.__name__] = (dispatcher.stats().masks.misses, table.mask_builds, simulated.mask_builds)
        assert table.mask_build_seconds == simulated.mask_build_seconds
    assert all(len(set(counts)) == 1 for counts in builds.values()), builds
    assert len({counts[0] for counts in builds.values()}) == 3, builds  # each rule keeps other masks


@given(st.lists(st.integers(0, 9), max_size=60), st.sampled_from(["lru", "fifo"]), st.sampled_from([None, 1, 2, 4]),
       st.sampled_from([None, 4, 7, 12]), st.sampled_from(["uncached", "raise"]),
       st.lists(st.integers(1, 9), min_size=10, max_size=10))
def test_serving_a_whole_stream_counts_what_serving_each_request_counts(stream, eviction, max_graphs, max_bytes,
                                                                       oversize, sizes):
    costs = [0.1 * (i + 1) ** 1.5 for i in range(10)]
    caches = [StreamCache(max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction, oversize=oversize)
              for _ in range(2)]
    one, whole = caches
    hits, errors = 0, []
    try:
        for key in stream:
            try:
                one.touch(key)
                hits += 1
            except KeyError:
                one.miss(key, sizes[key], costs[key])
    except GraphTooLargeError as exc:
        errors.append(str(exc))
    try:
        assert whole.serve_ordered(stream, sizes, costs) == hits
    except GraphTooLargeError as exc:
        errors.append(str(exc))
    assert len(errors) in (0, 2) and len(set(errors)) <= 1
    fields = ("misses", "compiles", "compile_seconds", "evictions", "uncached", "nbytes", "peak_graphs", "peak_bytes")
    assert [getattr(whole, f) for f in fields] == [getattr(one, f) for f in fields]
    assert list(whole.order) == list(one.order) and dict(whole.held) == dict(one.held)


@given(st.lists(st.integers(1, 1 << 17), min_size=1, max_size=20, unique=True), st.integers(0, 1 << 16))
def test_positions_of_sizes_by_table_or_search_are_the_searched_ones(sizes, n):
    sizes = np.array(sorted(sizes), dtype=np.int64)
    values = sizes[np.arange(50) % sizes.size]
    assert _positions(sizes, n)(values).tolist() == np.searchsorted(sizes, values).tolist()


@given(st.lists(st.integers(0, 30), max_size=80))
def test_dense_first_request_ids_are_the_sorted_ones(codes):
    code = np.array(codes, dtype=np.int64)
    ids, first = _first_order(code)
    dense_ids, dense_first = _first_order(code, 31)
    assert np.array_equal(ids, dense_ids) and np.array_equal(first, dense_first)
    assert [codes[i] for i in first.tolist()] == list(dict.fromkeys(codes))  # first-request order
    assert all(codes[f] == c for f, c in zip(first[ids].tolist(), codes, strict=True))


def test_drift_is_zero_on_the_traffic_the_plan_was_fitted_on():
    model, base = _base(max_graphs=4)
    steps = _steps([20, 300, 45, 700, 90, 33, 512, 128])
    plan = plan_graphs(steps, base, AttentionPlanLevel(model), ["varlen"], max_buckets=4)
    drift = measure_drift(steps, plan.config, model)
    assert drift.drift == pytest.approx(0.0, abs=1e-9) and not drift.replan
    assert switch_set(plan.config, drift.refit.config) == ()


def test_replanning_follows_traffic_whose_lengths_shift():
    model, base = _base(max_graphs=4)
    short = _steps([30 + 7 * i for i in range(12)])
    long = _steps([600 + 29 * i for i in range(12)], seed_arrival=100.0)
    old = plan_graphs(short, base, AttentionPlanLevel(model), ["varlen"], max_buckets=4).config
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
    old = plan_graphs(_steps([30 + 7 * i for i in range(12)]), base, AttentionPlanLevel(model), ["varlen"], max_buckets=4).config
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


def test_drift_is_never_negative_when_the_refit_models_slower():
    """A refit that plans only other policies (or misses the current buckets) may model
    slower than the current config: the current config is the best plan known, drift 0."""
    model, base = _base(max_graphs=4)
    steps = _steps([20, 300, 45, 700, 90, 33, 512, 128])
    current = plan_graphs(steps, base, AttentionPlanLevel(model), ["dynamic"]).config
    drift = measure_drift(steps, current, model, ["varlen"])
    assert drift.refit.chosen.row.total_seconds > drift.current.total_seconds  # varlen is slower here
    assert drift.drift == 0.0 and not drift.replan


def _recorded(tmp_path, config: AttnPolicyConfig, name: str = "layouts") -> str:
    """A layout stream of long prompts recorded under ``config`` (in ``name``.jsonl), on
    the tensor spec of the built-in cost model that prices it."""
    path, spec = tmp_path / f"{name}.jsonl", CostModel.default().spec
    writer = LayoutStreamWriter(path, config, spec)
    counters = {"hits": 0, "misses": 0, "evictions": 0, "graphs": 0}
    for layout in _steps([600 + 29 * i for i in range(12)]):
        writer.write_step(layout, Dispatcher(config).preview(layout, spec).mode, [], counters)
    writer.close()
    return str(path)


@pytest.mark.parametrize(("args", "flag"), [(["--policies", "varlen,cost-aware"], "--policies"),
                                            ([], "--config")])
def test_replan_refuses_a_policy_plan_refuses(tmp_path, capsys, args, flag):
    model, base = _base(max_graphs=4)
    config = with_fields(base, policy="cost-aware") if flag == "--config" else base
    config.save(tmp_path / "current")
    layouts = _recorded(tmp_path, config)
    assert main(["plan", "--layouts", layouts, "--out", str(tmp_path / "plan"), "--policies", "cost-aware"]) == 2
    refused = capsys.readouterr().err
    assert main(["replan", "--config", str(tmp_path / "current"), "--layouts", layouts,
                 "--out", str(tmp_path / "new"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnpolicy: error: argument {flag}: policy 'cost-aware' decides from the cache state")
    assert err.split(": ", 3)[3] == refused.split(": ", 3)[3]  # the message plan gives
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="'cost-aware' decides from the cache state"):
        measure_drift(_steps([30, 40]), with_fields(base, policy="cost-aware"), model)
    if flag == "--config":  # re-planning at run time: refused before the run
        assert main(["run", "--config", str(tmp_path / "current"), "--replan-every", "5", "--limit", "3",
                     "--backend", "none"]) == 2
        assert "argument --replan-every: policy 'cost-aware' decides" in capsys.readouterr().err


def test_replan_says_when_the_stream_was_recorded_under_another_config(tmp_path, capsys):
    model, base = _base(max_graphs=4)
    old = plan_graphs(_steps([30 + 7 * i for i in range(12)]), base, AttentionPlanLevel(model), ["varlen"], max_buckets=4).config
    old.save(tmp_path / "current")
    for i, (recorded, said) in enumerate(((old, ""), (with_fields(old, policy="dynamic", eviction="fifo"),
                                                         "policy, eviction"))):
        layouts = _recorded(tmp_path, recorded, f"layouts{i}")
        assert main(["replan", "--config", str(tmp_path / "current"), "--layouts", layouts,
                     "--out", str(tmp_path / "new")]) == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        report = json.loads((tmp_path / "new" / "replan.json").read_text())
        assert report["recorded_config_differs"] == (said.split(", ") if said else [])
        if said:
            assert warnings == [f"attnpolicy: warning: the layout stream was recorded under a config that differs "
                                f"from --config in {said}: the drift is that of --config on the recorded traffic"]
        else:
            assert warnings == []
