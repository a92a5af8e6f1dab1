"""Whole-model graphs: the model-level cost model, its calibration through the real
runner, the model-graph simulator (its misses equal a real runner replay's), the
model-graph planner and the CLI forms (tiny models, aot_eager)."""

from __future__ import annotations

import json

import pytest
from cost_models import synthetic, with_rows, with_steps

from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.engine.keys import ModelKey, model_key_for
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.bucket_schemes import bucket_scheme
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.ranges import GRAPH_RANGE, outside_range
from attnpolicy.modelling.simulation import model_config, model_layouts, replay_key_streams, sweep_configs
from attnpolicy.modelling.stalls import WholeModelLevel, compare_stalls
from attnpolicy.modelling.whole_model_costs import ModelCostModel, ModelFit, ModelSample, StepFits, key_of
from attnpolicy.planning.graph_set import WholeModelPlanLevel, plan_graphs
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

SPEC = "llama:layers=1,hidden=64,heads=2,kv_heads=1,vocab=64,intermediate=128"
MODES = ("causal", "mask", "varlen", "rows")


#: prefill batches whose keys under pow2 buckets and 2 graphs evict
LAYOUTS = [BatchLayout.from_lens(lens) for lens in
           ([5], [9, 3], [20], [5], [40], [9, 3], [3, 3, 3], [20], [12, 30])]


def test_fit_recovers_its_coefficients_and_sums_varlen_segments():
    truth = ModelFit(base=0.5, per_token=1e-3, per_cell=2e-6, per_segment=0.1)
    keys = [key_of(m, segs, "aot_eager") for m, segs in
            [("varlen", (16,)), ("varlen", (64, 32)), ("varlen", (256,)), ("varlen", (128, 128, 16)),
             ("varlen", (512, 64)), ("varlen", (32,) * 6)]]
    fitted = ModelFit.to_samples([(k, truth(k)) for k in keys])
    for k in keys:
        assert fitted(k) == pytest.approx(truth(k), rel=1e-6)
    two = key_of("varlen", (64, 32), "aot_eager")
    # a VARLEN graph's cost is its fixed and per-token cost plus a sum over its segments
    assert truth(two) == pytest.approx(0.5 + 1e-3 * 96 + 2e-6 * (64 ** 2 + 32 ** 2) + 0.1 * 2)
    with pytest.raises(ConfigError, match="at least one"):
        ModelFit.to_samples([])


def test_one_fit_form_prices_step_graphs_over_their_context():
    """A step graph's features: its rows, its context columns, each segment's rows times
    its context and rows, its segments; the fit recovers them, and a prefill-only fit
    leaves the context term out (what every prefill fit was before steps)."""
    truth = ModelFit(base=0.2, per_token=1e-3, per_context=5e-4, per_cell=3e-6, per_segment=0.05)
    keys = [ModelKey(MaskMode.MASK, 16, c, ((16, c),), "aot_eager", kv=True) for c in (16, 64, 256)] + [
        ModelKey(MaskMode.MASK, 64, 512, ((64, 512),), "aot_eager", kv=True),
        ModelKey(MaskMode.VARLEN, 32, 96, ((16, 64), (16, 32)), "aot_eager", kv=True),
        ModelKey(MaskMode.VARLEN, 80, 64, ((64, 32), (16, 32)), "aot_eager", kv=True),
        ModelKey(MaskMode.VARLEN, 48, 384, ((16, 128),) * 3, "aot_eager", kv=True)]
    fitted = ModelFit.to_samples([(k, truth(k)) for k in keys])
    for k in keys:
        assert fitted(k) == pytest.approx(truth(k), rel=1e-6)
    varlen = keys[4]
    assert truth(varlen) == pytest.approx(0.2 + 1e-3 * 32 + 5e-4 * 96 + 3e-6 * (16 * 80 + 16 * 48) + 0.05 * 2)
    mask = keys[3]
    assert truth(mask) == pytest.approx(0.2 + 1e-3 * 64 + 5e-4 * 512 + 3e-6 * 64 * (512 + 64) + 0.05)
    prefill = [key_of("mask", (n,), "aot_eager") for n in (16, 64, 256)]
    assert ModelFit.to_samples([(k, 1.0 + k.tokens) for k in prefill]).per_context == 0.0
    with pytest.raises(ConfigError, match="holds no step-graph fits.*attnpolicy calibrate --model SPEC"):
        synthetic().model_copy(update={"steps": None}).run_seconds(keys[0])


def test_a_cost_file_round_trips_both_families_and_refuses_bad_files(tmp_path):
    model = synthetic()
    both = CostFile(CostModel.default(), model)
    assert CostFile.load(both.save(tmp_path / "both.json")) == both
    # the attention section is the file's top level, as an attention-only file's
    top = json.loads((tmp_path / "both.json").read_text())
    assert CostModel.model_validate({k: v for k, v in top.items() if k != "model"}) == CostModel.default()
    only = CostFile(model=model)
    assert CostFile.load(only.save(tmp_path / "m.json")) == only
    with pytest.raises(ConfigError, match="m.json holds no attention fits"):
        only.attention_fits(str(tmp_path / "m.json"))
    with pytest.raises(ConfigError, match=r"holds no whole-model fits: run attnpolicy calibrate --model SPEC"):
        CostFile(CostModel.default()).model_fits("a.json")
    data = json.loads((tmp_path / "m.json").read_text())
    data["model"]["compile"]["mask"]["base"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"(?s)bad.json \(section model\).*compile.mask.base"):
        CostFile.load(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ConfigError, match="empty.json holds no fits"):
        CostFile.load(tmp_path / "empty.json")


def test_an_earlier_model_only_file_loads_as_the_model_section(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(synthetic().model_dump_json(indent=2))  # a ModelCostModel's fields at the top level
    assert CostFile.load(old) == CostFile(model=synthetic())
    flags = ["--limit", "5", "--max-seq-len", "2048", "--max-num-batched-tokens", "2048", "--capacities", "4",
             "--policies", "dynamic"]
    assert main(["simulate", "--cost-model", str(old), "--family", "model", *flags]) == 0
    capsys.readouterr()
    assert main(["simulate", "--cost-model", str(old), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(old) in err and "--family model" in err


def test_graph_bytes_are_the_runners_estimate():
    from types import SimpleNamespace

    from attnpolicy.engine.keys import estimate_bytes

    model = synthetic()
    config = SimpleNamespace(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             intermediate_size=128, vocab_size=64)
    for key in (key_of("mask", (64,), "aot_eager"), key_of("varlen", (32, 16), "aot_eager")):
        assert model.graph_bytes(key) == estimate_bytes(key, config)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from attnpolicy.bench.calibration import calibrate, graph_grid, runner_config
    from attnpolicy.bench.settings import ModelCalibrationSettings

    s = ModelCalibrationSettings(spec=SPEC, quick=True, repeats=1)
    model = calibrate(s)
    assert len(model.samples) == sum(not any(c) for _, _, c in graph_grid(s))
    config = runner_config(s, 1 << 12, 1 << 12)  # the keys depend on the buckets alone, not on these limits
    keys = {model_key_for(BatchLayout.from_lens(list(q), [a + b for a, b in zip(q, c)]), mode, config, kv=True)
            for mode, q, c in graph_grid(s) if any(c)}
    assert model.steps is not None and {x.key(model.backend) for x in model.steps.samples} == keys
    return model, tmp_path_factory.mktemp("model")


def test_calibrated_model_round_trips_and_predicts_its_samples(calibrated):
    model, tmp = calibrated
    assert CostFile.load(CostFile(model=model).save(tmp / "m.json")).model == model
    assert {x.mode for x in model.samples} == set(MODES)
    for x in model.samples:
        key = x.key(model.backend)
        assert x.compile_seconds > 0 and x.run_seconds > 0
        assert model.compile_seconds(key) > 0 and model.run_seconds(key) > 0
        assert x.estimate_bytes == model.graph_bytes(key)  # the runner's own estimate
    assert model.steps is not None and {x.mode for x in model.steps.samples} == set(MODES)
    for y in model.steps.samples:
        step = y.key(model.backend)
        assert y.compile_seconds > 0 and y.run_seconds > 0
        assert model.compile_seconds(step) > 0 and model.run_seconds(step) > 0
        assert y.estimate_bytes == model.graph_bytes(step)  # the runner's own estimate of a step graph


@pytest.mark.parametrize("policy", ["dynamic", "varlen", "always-rows"])
def test_simulated_misses_equal_a_real_runner_replay(calibrated, policy):
    from attnpolicy.bench.replay import MODEL_TOLERANCE, PrefillReplay, replay

    model, _ = calibrated
    config = model_config(model, 64, 128, policy=policy, max_graphs=2)
    result = replay(PrefillReplay(SPEC, LAYOUTS, config, check=True, cost=model))
    predicted = result.predicted
    assert predicted is not None
    assert (predicted.misses, predicted.compiles, predicted.evictions) == \
        (result.misses, result.figures["compiles"], result.figures["evictions"])
    assert result.figures["evictions"] > 0  # the cache was too small: eviction order mattered
    assert result.figures["hits"] + result.misses == len(LAYOUTS)
    assert result.max_abs_err is not None and result.max_abs_err <= MODEL_TOLERANCE
    assert result.ratios()["misses"] == 1.0


@pytest.mark.parametrize("policy", ["always-mask", "varlen", "always-rows"])
def test_simulated_steps_equal_a_real_serving_of_whole_requests(calibrated, policy):
    """Whole requests (chunked prefill, decodes) served over a KV cache, every step on a
    step graph: the simulator's misses, compiles and evictions are the runner's, and its
    seconds come from the step fits."""
    from attnpolicy.bench.replay import RequestReplay, replay

    model, _ = calibrated
    requests = [Request(0.0, 40, 6), Request(0.0, 9, 12), Request(0.1, 70, 3), Request(0.2, 3, 5)]
    former = BatchFormer(max_num_seqs=3, max_num_batched_tokens=32, max_model_len=128)
    steps = list(former.steps(requests))
    config = model_config(model, 128, 512, policy=policy, max_graphs=3)
    result = replay(RequestReplay(SPEC, requests, steps, config, cost=model))
    predicted = result.predicted
    assert predicted is not None and 0 < result.figures["context_steps"] < len(steps)
    assert (predicted.misses, predicted.compiles, predicted.evictions) == \
        (result.misses, result.figures["compiles"], result.figures["evictions"])
    assert result.figures["evictions"] > 0  # three graphs were too few: the eviction order mattered
    assert predicted.batches == len(steps) and predicted.run_seconds > 0 and predicted.compile_seconds > 0
    assert result.ratios()["misses"] == 1.0


def test_rows_graphs_are_priced_by_their_own_fits_or_refused():
    """A ROWS key's features are its totals and its rows (one segment each); a model
    without ROWS fits (calibrated before ROWS) refuses it naming the mode, never pricing
    it as another mode's graph."""
    step = ModelKey(MaskMode.ROWS, 4 * 16, 4 * 32, ((16, 32),) * 4, "aot_eager", kv=True)
    truth = ModelFit(base=0.2, per_token=1e-3, per_context=5e-4, per_cell=3e-6, per_segment=0.05)
    assert truth(step) == pytest.approx(0.2 + 1e-3 * 64 + 5e-4 * 128 + 3e-6 * 4 * 16 * 48 + 0.05 * 4)
    priced = with_rows(with_steps())
    assert priced.run_seconds(step) == pytest.approx(priced.steps.run["mask"](step) + 1e-4 * 4)
    prefill = key_of("rows", (32,) * 2, "aot_eager")
    assert prefill.rows == 2 and priced.run_seconds(prefill) > priced.run_seconds(key_of("rows", (32,), "aot_eager"))
    for old, key, kind in ((with_steps(), step, "step"), (synthetic(), prefill, "prefill")):
        with pytest.raises(ConfigError, match=rf"holds no {kind}-graph fits of mode=rows .*calibrate it again"):
            old.run_seconds(key)
    with pytest.raises(ValueError, match="missing: causal, mask, varlen"):  # the other modes stay required
        ModelCostModel.model_validate({**synthetic().model_dump(), "run": {"rows": ModelFit(base=1.0)}})


def test_simulate_stalls_and_plan_price_a_rows_policy(tmp_path):
    """simulate, stalls and plan ``--family model`` run a ROWS policy on ROWS keys priced
    by the ROWS fits; a file without them refuses it naming the mode."""
    path = CostFile(model=with_rows(synthetic())).save(tmp_path / "m.json")
    flags = ["--limit", "30", "--max-seq-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4"]
    assert main(["simulate", "--cost-model", str(path), "--family", "model", "--capacities", "4", "--policies",
                 "always-rows,always-mask", "--json", str(tmp_path / "sim.json"), *flags]) == 0
    rows = {(r["policy"], r["eviction"]): r for r in json.loads((tmp_path / "sim.json").read_text())["rows"]}
    assert rows["always-rows", "lru"]["run_seconds"] > rows["always-mask", "lru"]["run_seconds"]  # 0.1 ms a row more
    assert main(["stalls", "--cost-model", str(path), "--family", "model", "--capacities", "4", "--policies",
                 "always-rows", "--json", str(tmp_path / "st.json"), *flags]) == 0
    assert [r["policy"] for r in json.loads((tmp_path / "st.json").read_text())["rows"]] == ["always-rows"] * 2
    assert main(["plan", "--cost-model", str(path), "--family", "model", "--max-graphs", "4", "--policies",
                 "always-rows", "--out", str(tmp_path / "plan"), *flags]) == 0
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["policy"] == "always-rows"
    old = CostFile(model=synthetic()).save(tmp_path / "old.json")
    assert main(["simulate", "--cost-model", str(old), "--family", "model", "--policies", "always-rows", *flags]) == 2


def test_simulate_prices_whole_requests_under_each_policys_options(tmp_path):
    """``simulate --family model --whole-requests``: every engine step (chunked prefill,
    decodes) keyed as the runner keys it (a ROWS step one forward per phase), priced by the
    step fits under the policy's --option: its rows are the replay of the former's steps;
    the flag is refused at the attention level."""
    path = CostFile(model=with_rows(with_steps())).save(tmp_path / "m.json")
    trace = tmp_path / "trace.csv"
    shapes = [(300, 6), (90, 12), (700, 3), (30, 20), (1200, 4), (60, 9)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:0{i}.0000000,{p},{g}\n" for i, (p, g) in enumerate(shapes)))
    flags = ["--trace", str(trace), "--max-seq-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "4"]
    assert main(["simulate", "--cost-model", str(path), "--family", "model", "--whole-requests", "--capacities",
                 "4,inf", "--evictions", "lru", "--policies", "always-rows,dynamic", "--option", "dynamic:rows=0.5",
                 "--json", str(tmp_path / "sim.json"), *flags]) == 0
    out = json.loads((tmp_path / "sim.json").read_text())
    assert out["whole_requests"] and out["policy_options"] == {"always-rows": {}, "dynamic": {"rows": 0.5}}
    former = BatchFormer(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048)
    layouts = [s.layout for s in former.steps([Request(0.0, p, g) for p, g in shapes])]
    assert any(x.has_context for x in layouts) and any(1 in x.q_lens and x.max_len > 1 for x in layouts)
    model = CostFile.load(path).model
    assert model is not None
    configs = sweep_configs(model_config(model, 2048, 4 * 2048), ["always-rows", "dynamic"], [4, None],
                            policy_options={"dynamic": {"rows": 0.5}})
    expected = replay_key_streams(layouts, model, configs, ["lru"], steps=True)
    assert [r["total_seconds"] for r in out["rows"]] == pytest.approx([r.total_seconds for r in expected])
    assert [r["batches"] for r in out["rows"]] == [len(layouts)] * 4  # steps, not forwards
    assert main(["simulate", "--whole-requests", *flags]) == 2
    # a runtime's fixed batch size: every rows forward padded to 8 rows, fewer graphs
    assert main(["simulate", "--cost-model", str(path), "--family", "model", "--whole-requests", "--capacities",
                 "inf", "--evictions", "lru", "--policies", "always-rows", "--row-buckets", "8",
                 "--json", str(tmp_path / "fixed.json"), *flags]) == 0
    fixed = json.loads((tmp_path / "fixed.json").read_text())["rows"][0]
    (expected,) = replay_key_streams(layouts, model, sweep_configs(
        model_config(model, 2048, 4 * 2048, row_buckets=(8,)), ["always-rows"], [None]), ["lru"], steps=True)
    assert fixed["total_seconds"] == pytest.approx(expected.total_seconds)
    assert fixed["graphs"] < out["rows"][1]["graphs"]  # the default row buckets: more graphs
    assert main(["simulate", "--row-buckets", "4,2", *flags]) == 2


def test_a_step_that_builds_its_graph_costs_its_build_alone():
    """A step graph's build runs its step (as the runner and calibration do): a missed
    step is priced at its compile seconds, the hits at their run seconds."""
    from attnpolicy.modelling.simulation import replay_keys

    model = synthetic().model_copy(update={"steps": StepFits(
        compile=dict.fromkeys(("causal", "mask", "varlen"), ModelFit(base=2.0)),
        run=dict.fromkeys(("causal", "mask", "varlen"), ModelFit(base=0.25)),
        rss=dict.fromkeys(("causal", "mask", "varlen"), ModelFit(base=1e6)))})
    a, b = (ModelKey(MaskMode.MASK, 16, c, ((16, c),), "aot_eager", kv=True) for c in (16, 32))
    config = model_config(model, 64, 128, max_graphs=1)
    for keys, misses, hits in (([a, a, a], 1, 2), ([a, b, a, b], 4, 0), ([a, a, b, b, b], 2, 3)):
        row = replay_keys(keys, model, config, "lru", builds_run=True)
        assert (row.misses, row.compile_seconds, row.run_seconds) == (misses, 2.0 * misses, 0.25 * hits)
        whole = replay_keys(keys, model, config, "lru")  # a prefill graph's build does not run the batch
        assert whole.run_seconds == 0.25 * len(keys) and whole.compile_seconds == row.compile_seconds


def test_model_key_for_is_the_runners_key():
    config = AttnPolicyConfig(max_seq_len=64, max_batch_tokens=128)
    layout = BatchLayout.from_lens([9, 30, 3])
    key = model_key_for(layout, MaskMode.VARLEN, config, kv=False)
    assert key.segments == ((32, 0), (16, 0), (16, 0)) and key.tokens == 64  # sorted largest first
    assert model_key_for(layout, MaskMode.MASK, config, kv=False).tokens == 64
    assert model_key_for(BatchLayout.from_lens([17]), MaskMode.CAUSAL, config, kv=False).tokens == 32


def test_a_whole_model_sweep_builds_its_configs_by_the_sweeps_rule():
    """The configs of a whole-model sweep are the base config's per policy, bucket scheme,
    capacity and byte bound, in that nesting order (the rule the attention sweep builds
    its rows' configs by), and their key streams replay into rows with the model's keys."""
    model = synthetic()
    schemes = [bucket_scheme(s, 64, 128) for s in ("pow2", "exact")]
    configs = sweep_configs(model_config(model, 64, 128), ["varlen", "dynamic"], [1, None], buckets=schemes,
                            max_bytes=[None, 2**40])
    assert configs == [model_config(model, 64, 128, policy=p, max_graphs=c, max_bytes=b, buckets=s.buckets)
                       for p in ("varlen", "dynamic") for s in schemes for c in (1, None) for b in (None, 2**40)]
    base = model_config(model, 64, 128, max_bytes=2**30)  # no schemes or byte bounds given: the base config's
    assert sweep_configs(base, ["varlen"], [4]) == [model_config(model, 64, 128, policy="varlen", max_graphs=4,
                                                                 max_bytes=2**30)]
    rows = replay_key_streams(LAYOUTS, model, configs, ["lru", "belady"])
    assert len(rows) == 32
    assert list(rows[0].to_json()) == ["policy", "buckets", "max_graphs", "max_bytes", "eviction", "batches", "graphs",
                                       "misses", "compiles", "evictions", "compile_seconds", "warmup_seconds",
                                       "run_seconds", "peak_graphs", "peak_bytes", "total_seconds"]
    assert any(r.misses > r.distinct_keys for r in rows)  # one graph is too few: the bounds were applied


def test_model_layouts_refuse_cached_context():
    with pytest.raises(ConfigError, match="prefill"):
        model_layouts([BatchLayout.from_lens([1], [9])])


def test_plan_on_model_graphs_beats_pow2_lru_when_compiles_dominate():
    lens = [17, 33, 65, 129, 257, 300, 20, 40, 70, 140, 260, 35, 18, 66, 131, 290] * 4
    layouts = [BatchLayout.from_lens([n]) for n in lens]
    model = synthetic()
    base = model_config(model, 512, 512, max_graphs=4)
    plan = plan_graphs(layouts, base, WholeModelPlanLevel(model), ["dynamic"], ["lru"], max_buckets=8)
    chosen = plan.chosen
    assert chosen.row.total_seconds < chosen.base_lru.total_seconds
    assert chosen.row.distinct_keys <= 4 and chosen.row.evictions == 0  # every graph fits: compulsory misses only
    assert chosen.base_lru.evictions > 0  # pow2 needs more graphs than the cache holds
    assert plan.config.buckets == Buckets(kind="list", sizes=chosen.buckets)
    # the planned config serves the workload: re-simulated, the same row
    [again] = replay_key_streams(layouts, model, [plan.config], ["lru"])
    assert again.total_seconds == pytest.approx(chosen.row.total_seconds)


def test_plan_on_model_graphs_refuses_an_empty_workload_as_the_attention_plan_does():
    model = synthetic()
    with pytest.raises(ConfigError, match="at least one step"):
        plan_graphs([], model_config(model, 512, 512, max_graphs=4), WholeModelPlanLevel(model), ["dynamic"])


def test_cli_plan_and_simulate_with_a_model_cost_model(tmp_path, capsys):
    path = CostFile(model=synthetic()).save(tmp_path / "m.json")
    out = tmp_path / "plan"
    flags = ["--limit", "40", "--max-seq-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "1"]
    assert main(["plan", "--cost-model", str(path), "--family", "model", "--max-graphs", "4", "--out", str(out), *flags]) == 0
    plan = json.loads((out / "plan.json").read_text())
    host = json.loads((out / "host_settings.json").read_text())
    assert host["static"]["packed_padding"] == plan["buckets"]
    vllm = host["vllm"]["compilation_config"]  # step token counts, not the buckets: see test_host_settings.py
    sizes = vllm["cudagraph_capture_sizes"]
    assert vllm["compile_sizes"] == sizes == sorted(sizes) and vllm["max_cudagraph_capture_size"] == sizes[-1] <= 2048
    saved = AttnPolicyConfig.load(out)
    assert saved.buckets.sizes == tuple(plan["buckets"]) and saved.max_graphs == 4
    assert main(["simulate", "--cost-model", str(path), "--family", "model", "--capacities", "4", "--policies", "dynamic",
                 "--json", str(tmp_path / "sim.json"), *flags]) == 0
    rows = json.loads((tmp_path / "sim.json").read_text())["rows"]
    assert {r["eviction"] for r in rows} == {"lru", "belady"}
    lru, belady = (next(r for r in rows if r["eviction"] == e) for e in ("lru", "belady"))
    assert belady["misses"] <= lru["misses"]


def test_cli_calibrate_and_run_with_a_model(tmp_path):
    path = CostFile(CostModel.default()).save(tmp_path / "m.json")
    assert main(["calibrate", "--model", SPEC, "--sizes", "16", "--repeats", "1", "--out", str(path)]) == 0
    written = CostFile.load(path)
    assert written.attention == CostModel.default()  # the attention section is kept
    model = written.model_fits(str(path))
    assert model.spec.startswith("llama:layers=1") and len(model.samples) == 5  # ROWS: one row, two rows
    out = tmp_path / "run.json"
    assert main(["run", "--model", SPEC, "--prefill-only", "--cost-model", str(path), "--backend", "aot_eager", "--limit", "10",
                 "--max-seq-len", "512", "--max-num-batched-tokens", "512", "--max-num-seqs", "1",
                 "--policy", "dynamic", "--check", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["passed"] and result["max_abs_err"] <= 1e-4
    assert result["predicted"]["misses"] == result["misses"] >= 1
    assert result["predicted_over_measured"]["misses"] == 1.0


@pytest.mark.parametrize("capacity", [2, None])
def test_model_sync_stalls_are_the_compile_seconds_of_the_misses(capacity):
    model = synthetic()
    config = model_config(model, 64, 128, policy="varlen", max_graphs=capacity, switch_after=2)
    [sim] = replay_key_streams(LAYOUTS, model, [config], ["lru"])
    sync, background = compare_stalls(LAYOUTS, WholeModelLevel(model), [config])
    assert sync.compile_mode == "sync" and background.compile_mode == "background"
    assert sync.compiles == sim.misses and sync.stall_seconds == pytest.approx(sim.compile_seconds)
    assert sync.run_seconds == pytest.approx(sim.run_seconds) and sync.pad_up_calls == sync.eager_served == 0
    assert background.pad_up_calls + background.eager_served > 0
    assert background.stall_seconds < sync.stall_seconds  # compiles overlap the batches


def test_cli_stalls_with_a_model_cost_model(tmp_path):
    path = CostFile(model=synthetic()).save(tmp_path / "m.json")
    flags = ["--limit", "30", "--max-seq-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "2"]
    assert main(["stalls", "--cost-model", str(path), "--family", "model", "--capacities", "4", "--policies", "dynamic",
                 "--switch-after", "3", "--json", str(tmp_path / "s.json"), *flags]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["compile_mode"], r["switch_after"], r["capacity"]) for r in rows] == [
        ("sync", 3, 4), ("background", 3, 4)]
    assert rows[0]["stall_seconds"] == pytest.approx(rows[0]["compile_seconds"])
    assert main(["stalls", "--cost-model", str(path), "--family", "model", "--warm", "all", *flags]) == 2


def test_model_batches_outside_the_calibrated_tokens_or_segments_are_counted(tmp_path, capsys):
    sample = {"compile_seconds": 1.0, "run_seconds": 1e-3, "rss_bytes": 1, "estimate_bytes": 1}
    model = synthetic().model_copy(update={"samples": (
        ModelSample(mode="causal", segments=(24,), **sample), ModelSample(mode="varlen", segments=(12, 6), **sample))})
    assert model.calibrated_range == (24, 2)
    # 40 tokens, and three segments, are beyond what was calibrated; [12, 30] both
    outside = outside_range(model, LAYOUTS, GRAPH_RANGE)
    assert (outside.outside, outside.batches) == (3, len(LAYOUTS))
    assert outside.line() == ("3 of 9 batches priced outside the calibrated range (sizes up to 42 tokens and 3 "
                              "segments, calibrated to 24 tokens and 2 segments)")
    assert outside_range(synthetic(), LAYOUTS, GRAPH_RANGE) is None  # no samples: the range is unknown
    path = CostFile(model=model).save(tmp_path / "m.json")
    out = tmp_path / "sim.json"
    assert main(["simulate", "--cost-model", str(path), "--family", "model", "--capacities", "4", "--policies", "dynamic", "--limit", "5",
                 "--max-seq-len", "2048", "--max-num-batched-tokens", "2048", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines()[0] == f"cost model: {path} (--cost-model)"
    data = json.loads(out.read_text())
    assert data["cost_model_provenance"] == {"kind": "file", "file": str(path), "created": None}
    line = [x for x in printed.err.splitlines() if "calibrated range" in x]
    assert len(line) == 1 and line[0].startswith(f"attnpolicy: warning: {data['outside_calibrated_range']['outside']} "
                                                 f"of {data['batches']} batches priced outside")


def test_model_stalls_serve_batches_as_a_real_runner_with_background_compiles():
    """The model stalls drive the runner's graph source and background worker: a batch
    padded up is a hit on the graph that serves it, so under LRU that graph stays and
    the one unused since is evicted; the pad-ups, eager batches and compile requests are
    a real runner's."""
    import torch

    from attnpolicy.engine.model_specs import load_model
    from attnpolicy.engine.runner import StaticModelRunner

    model = synthetic()
    config = model_config(model, 64, 128, policy="varlen", max_graphs=2, switch_after=1).model_copy(
        update={"compile_mode": "background", "backend": "aot_eager"})
    # [20]'s graph serves [5] padded up, then [5]'s switches in and evicts [3, 3]'s: [20] hits
    layouts = [BatchLayout.from_lens(lens) for lens in ([20], [3, 3], [5], [5], [20])]
    runner = StaticModelRunner(load_model(SPEC)[0], config)
    try:
        for layout in layouts:
            runner.logits(torch.randint(0, 64, (layout.q_tokens,)), layout)
        stats = runner.stats()
    finally:
        runner.close()
    _, row = compare_stalls(layouts, WholeModelLevel(model), [config])
    assert stats.background is not None
    assert (row.pad_up_calls, row.eager_served, row.compiles) == (
        stats.background.pad_up_calls, stats.eager_served, stats.background.requested) == (1, 2, 3)
