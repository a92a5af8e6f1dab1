"""attnpolicy plan: buckets from the planner, warm set within budget, config → Dispatcher."""

from __future__ import annotations

import json

import pytest

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.cli import main
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.modelling.simulation import simulate_layouts, simulation_config
from attnpolicy.planning.graph_set import (
    AttentionPlanLevel,
    candidate_lists,
    completed,
    decided_shapes,
    graph_uses,
    longest_sequence,
    plan_graphs,
    plan_markdown,
    plannable,
    warm_set,
    with_fields,
)
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

pytestmark = pytest.mark.usefixtures("fresh_plugins")

SPEC = TensorSpec("float32", 2, 2, 16)
FORMER = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-seq-len", "128"]
PROMPTS = (20, 45, 9, 70, 33, 60, 12, 90)


def _steps():
    requests = [Request(float(i), p, 3) for i, p in enumerate(PROMPTS)]
    return list(BatchFormer(**FORMER).steps(requests))


def _base(**fields):
    model = CostModel.default()
    return model, simulation_config(model, BatchFormer(**FORMER), **fields)


@pytest.mark.parametrize("max_graphs", [3, None])
def test_plan_buckets_come_from_the_planner_and_the_warm_set_fits(max_graphs):
    model, base = _base(max_graphs=max_graphs)
    steps = _steps()
    plan = plan_graphs(steps, base, AttentionPlanLevel(model), ["varlen", "always-mask"], warmup_seconds=0.5, max_buckets=4)
    chosen = plan.chosen
    shapes = decided_shapes([s.layout for s in steps], chosen.policy, base, model)
    modes, longest = plannable(chosen.policy, base).modes, longest_sequence(shapes)
    lists = {completed(c.sizes, base, modes, longest)[0] for c in candidate_lists(shapes, base, model, 4)}
    assert chosen.buckets in lists and chosen.buckets == plan.config.buckets.sizes
    assert chosen.row.total_seconds == min(p.row.total_seconds for p in plan.policies)
    assert chosen.row.total_seconds <= min(c.totals.get(e, float("inf")) for c in chosen.candidates
                                           for e in c.totals)
    assert sum(w.compile_seconds for w in plan.warm) <= 0.5
    assert max_graphs is None or len(plan.warm) <= max_graphs
    assert plan.config.strict == "warn" and plan.config.policy == chosen.policy
    assert [w.shape for w in plan.warm] == list(plan.config.warmup)
    used = graph_uses(steps, plan.config, model)
    assert {w.shape for w in plan.warm} <= {g.shape for g in used}


def test_the_warm_set_takes_most_uses_per_second_within_each_bound():
    model, base = _base()
    used = graph_uses(_steps(), with_list(base, [16, 32, 64, 128]), model)
    assert used and all(a.uses >= b.uses for a, b in zip(used, used[1:]))
    assert warm_set(used, None, None, 0.0) == ()
    assert len(warm_set(used, 2, None, None)) == 2
    one = warm_set(used, None, min(g.bytes for g in used), None)
    assert len(one) == 1
    assert sum(g.uses for g in warm_set(used, None, None, None)) == sum(g.uses for g in used)


def with_list(base, sizes):
    return AttnPolicyConfig.model_validate({**base.model_dump(mode="json"),
                                            "buckets": {"kind": "list", "sizes": sizes}})


def test_dispatcher_warms_the_config_set_then_is_strict():
    model, base = _base()
    config = with_list(base, [16, 32, 64, 128]).model_dump(mode="json")
    plain = AttnPolicyConfig.model_validate({**config, "backend": "none", "strict": "raise"})
    used = graph_uses(_steps(), plain, model, SPEC)
    config = AttnPolicyConfig.model_validate({**config, "backend": "none", "strict": "raise",
                                              "warmup": [g.shape.model_dump(mode="json") for g in used]})
    d = Dispatcher(config)
    keys = d.warmup(SPEC)
    assert len(keys) == len(used) == len(d.cache) and d.warmup(SPEC) == []  # once per spec
    for step in _steps():
        d.prepare(step.layout, SPEC)  # strict="raise": any compile would raise
    assert d.stats().strict_violations == 0 and d.stats().cache.compiles == len(used)
    other = Dispatcher(config)
    other.warmup([BatchLayout.from_lens([100])], SPEC)  # the warm set, and the layouts' graphs
    assert len(other.cache) == len(used) + 1


def test_bad_warm_set_entries_name_the_field(tmp_path):
    good = {"family": "varlen", "q_bucket": 16, "kv_bucket": 64, "causal": True, "context": True}
    for entry, named in [({**good, "q_bucket": 20}, "warmup.0.q_bucket: 20 is not a bucket"),
                         ({**good, "kv_bucket": 100000}, "warmup.0.kv_bucket"),
                         ({**good, "family": "mask", "context": False}, "needs context true"),
                         ({**good, "family": "causal"}, "a causal graph"),
                         ({**good, "q_bucket": 128}, "q_bucket 128 must be <= kv_bucket 64"),
                         ({**good, "family": "dense"}, "warmup.0.family"),
                         ({**good, "extra": 1}, "warmup.0.extra")]:
        (tmp_path / "attnpolicy_config.json").write_text(json.dumps({"warmup": [entry]}))
        with pytest.raises(ConfigError, match="warmup.0") as exc:
            AttnPolicyConfig.load(tmp_path)
        assert named in str(exc.value), (named, str(exc.value))
    assert AttnPolicyConfig(warmup=[good]).warmup[0].kind is CallKind.VARLEN


def _trace(tmp_path):
    """PROMPTS as a trace file."""
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:17:{i:02d}.0,{p},3\n" for i, p in enumerate(PROMPTS)))
    return trace


def _plan_and_run(tmp_path, policies, backend):
    """``plan --policies POLICIES`` on the PROMPTS trace, then ``run --check`` of the config
    it wrote under ``backend``: exact, its warm set compiled, nothing after warm-up.
    Returns the plan's directory."""
    trace = _trace(tmp_path)
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(trace), *FLAGS, "--policies", policies, "--max-buckets", "4",
                 "--out", str(out)]) == 0
    result = tmp_path / "run.json"
    assert main(["run", "--config", str(out), "--trace", str(trace), *FLAGS, "--backend", backend, "--check",
                 "--heads", "2", "--kv-heads", "2", "--head-dim", "16", "--json", str(result)]) == 0
    ran = json.loads(result.read_text())
    assert ran["passed"] and ran["warmup_graphs"] == len(AttnPolicyConfig.load(out).warmup)
    assert ran["compiles_after_warmup"] == 0 and ran["strict_violations"] == 0
    return out


def test_plan_then_run_checks_and_compiles_nothing_after_warmup(tmp_path, capsys):
    out = _plan_and_run(tmp_path, "varlen,dynamic", "eager")
    config = AttnPolicyConfig.load(out)
    assert config.warmup and config.strict == "warn" and config.buckets.kind == "list"
    report = json.loads((out / "plan.json").read_text())
    assert report["policy"] == config.policy and "Warm-up set" in (out / "plan.md").read_text()
    assert "compiles after warm-up" in capsys.readouterr().out


def test_plan_always_rows_warms_rows_graphs_and_runs_them_with_no_compile(tmp_path):
    """``plan --policies always-rows``: the warm set holds rows graphs at their row counts,
    the planned total is the simulator's for the config written, and its dispatcher runs
    the workload exactly with nothing compiled after warm-up."""
    out = _plan_and_run(tmp_path, "always-rows", "none")
    config = AttnPolicyConfig.load(out)
    assert config.policy == "always-rows" and config.warmup
    assert {w.kind for w in config.warmup} == {CallKind.ROWS} and {w.rows for w in config.warmup} > {1}
    assert "| family | rows |" in (out / "plan.md").read_text()
    model = CostModel.default()
    (simulated,) = simulate_layouts(_steps(), ["always-rows"], [None], [config.eviction],
                                    with_fields(config, warmup=[]), model)
    (planned,) = json.loads((out / "plan.json").read_text())["policies"]
    assert planned["row"]["total_seconds"] == simulated.total_seconds and simulated.modes["rows"] > 0


def test_rows_plans_total_what_the_simulator_totals_at_a_capacity():
    """Each rows policy's plan (``dynamic`` with its ``rows`` option decided under each
    candidate's buckets) is the simulated row of its buckets and eviction."""
    model, base = _base(max_graphs=3, policy="dynamic", policy_options={"rows": 3.0})
    steps = _steps()
    plan = plan_graphs(steps, base, AttentionPlanLevel(model), ["always-rows", "dynamic"], max_buckets=4)
    for p in plan.policies:
        config = with_fields(base, policy=p.policy, policy_options=base.policy_options if p.policy == "dynamic" else {},
                             buckets={"kind": "list", "sizes": list(p.buckets)}, eviction=p.eviction)
        (simulated,) = simulate_layouts(steps, [p.policy], [3], [p.eviction], config, model)
        assert (p.row.total_seconds, p.row.misses, p.row.modes) == (simulated.total_seconds, simulated.misses,
                                                                    simulated.modes)
        assert simulated.modes["rows"] > 0, p.policy


def test_attend_warms_the_config_set_at_a_specs_first_use():
    """What the transformers integration relies on: the first attend of a spec warms."""
    import torch
    from reference import reference_for

    model, base = _base()
    fields = {**with_list(base, [16, 32, 64, 128]).model_dump(mode="json"), "backend": "none", "strict": "raise"}
    used = graph_uses(_steps(), AttnPolicyConfig.model_validate(fields), model, SPEC)
    config = AttnPolicyConfig.model_validate({**fields, "warmup": [g.shape.model_dump(mode="json") for g in used]})
    d = Dispatcher(config)
    layout = _steps()[0].layout
    g = torch.Generator().manual_seed(0)
    q = torch.randn(layout.q_tokens, 2, 16, generator=g)
    k, v = (torch.randn(layout.kv_tokens, 2, 16, generator=g) for _ in range(2))
    out = d.attend(q, k, v, layout)
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
    assert d.stats().cache.compiles == len(used) and d.stats().strict_violations == 0


def test_plan_a_recorded_layout_stream_keeps_its_config_and_spec(tmp_path):
    from attnpolicy.workloads.layout_stream import LayoutStreamWriter

    recorded = AttnPolicyConfig(max_seq_len=128, max_batch_tokens=512, backend="aot_eager")
    path = tmp_path / "layouts.jsonl"
    writer = LayoutStreamWriter(path, recorded, SPEC)
    counters = {"hits": 0, "misses": 0, "evictions": 0, "graphs": 0}
    for step in _steps():
        writer.write_step(step.layout, Dispatcher(recorded).preview(step.layout, SPEC).mode, [], counters)
    writer.close()
    out = tmp_path / "plan"
    assert main(["plan", "--layouts", str(path), "--policies", "varlen", "--max-graphs", "4", "--max-buckets", "3",
                 "--out", str(out)]) == 0
    config = AttnPolicyConfig.load(out)
    assert (config.max_seq_len, config.max_batch_tokens, config.max_graphs) == (128, 512, 4)
    assert 0 < len(config.warmup) <= 4 and config.buckets.sizes[-1] == 128  # varlen: no MASK rows, no 512
    assert json.loads((out / "plan.json").read_text())["policies"][0]["cover"] == [128]


def test_plan_md_counts_distinct_graphs_apart_from_the_peak_the_cache_held():
    model, base = _base(max_graphs=1)
    plan = plan_graphs(_steps(), base, AttentionPlanLevel(model), ["varlen", "always-mask"], max_buckets=4)
    text = plan_markdown(plan, "eight prompts")
    header = next(line for line in text.splitlines() if line.startswith("| policy |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in text.splitlines() if line.startswith(("| varlen", "| always-mask"))}
    for p in plan.policies:
        row = dict(zip(columns, cells[p.policy]))
        assert int(row["distinct graphs"]) == p.row.distinct_keys
        assert int(row["peak graphs held"]) == p.row.peak_graphs == 1 < p.row.distinct_keys
    assert "graphs used" not in text


def test_the_planned_list_is_completed_by_cover_buckets_no_planned_call_uses():
    raise_ = AttnPolicyConfig(max_seq_len=128, max_batch_tokens=512)
    eager = AttnPolicyConfig(max_seq_len=128, max_batch_tokens=512, on_overflow="eager")
    no_mask, mask = frozenset({MaskMode.CAUSAL, MaskMode.VARLEN}), frozenset(MaskMode)
    assert completed([16, 96], raise_, no_mask, 93) == ((16, 96, 128), (128,))  # no MASK rows: no 512
    assert completed([16, 96], raise_, mask, 93) == ((16, 96, 128, 512), (128, 512))
    assert completed([16, 128], raise_, no_mask, 120) == ((16, 128), ())
    # a sequence of 100 has no planned bucket within max_seq_len (300 is a MASK row's): 128 serves it
    assert completed([16, 64, 300], raise_, mask, 100) == ((16, 64, 128, 300, 512), (512,))
    assert completed([16, 96], eager, mask, 93) == ((16, 96), ())  # longer calls run uncompiled, counted
    assert completed([300], eager, mask, 0) == ((128, 300), (128,))  # a config needs a size within max_seq_len
