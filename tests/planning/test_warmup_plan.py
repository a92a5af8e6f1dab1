"""Prompt and decode graphs planned together under one budget, priced beside the
runtimes' own warm-up sets by one rule: the rule's arithmetic on hand-made shapes,
coverage (every step within the limits served after warm-up) and the budget over
random workloads, an over-budget phase reported and priced, the plan's host settings
read back as each runtime reads them, and the CLI."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.cli import main
from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.modelling.cost_file import CostFile
from attnpolicy.modelling.peer_buckets import (
    Forward,
    PeerGraph,
    PeerLimits,
    PeerWarmSet,
    WorkloadForwards,
    gaudi_file_warmup,
    rbln_env_warmup,
    step_forwards,
    tpu_env_paddings,
)
from attnpolicy.modelling.warmup_costs import Pricing, peer_key, warmup_cost
from attnpolicy.planning.host_settings import GaudiBuckets, PlannedForms, host_settings
from attnpolicy.planning.scheme_comparison import compare_schemes, pow2_grid
from attnpolicy.planning.warmup_plan import Budget, Grid, RaggedGrid, RunPricing, plan_forms, plan_warmup
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request
from tests.cost_models import synthetic, with_rows, with_steps

LIMITS = PeerLimits(4, 256, 512, block_size=16)


def test_each_kind_of_graph_is_priced_as_the_step_graph_the_runner_compiles_for_it():
    """A prompt graph is a ROWS graph of its batch's rows over its blocks (vllm-rbln's:
    over max_model_len), a flat-paged decode a MASK graph of its rows over its blocks, a
    vllm-rbln decode a ROWS graph of one-token rows over max_model_len; a ragged graph
    (which does not run here) compiles as a MASK graph of its tokens and runs over the
    real context, by analogy."""
    def key(graph):
        k = peer_key(graph, LIMITS, "aot_eager")
        return k.mode, k.segments
    assert key(PeerGraph("prefill", 1, 64, 2)) == (MaskMode.ROWS, ((64, 32),))
    assert key(PeerGraph("prefill", 2, 64, 2)) == (MaskMode.ROWS, ((64, 32),) * 2)
    assert key(PeerGraph("prefill", 1, 256)) == (MaskMode.ROWS, ((256, 512),))  # rbln
    assert key(PeerGraph("decode", 4, 1, 10)) == (MaskMode.MASK, ((4, 160),))
    assert key(PeerGraph("decode", 2, 1)) == (MaskMode.ROWS, ((1, 512),) * 2)  # rbln: max_model_len each
    assert key(PeerGraph("mixed", 4, 128)) == (MaskMode.MASK, ((128, 0),))
    model = with_rows(with_steps())
    pricing = Pricing(model, LIMITS)
    rows = PeerGraph("prefill", 1, 64, 2)
    assert pricing.graph(rows) == (model.compile_seconds(peer_key(rows, LIMITS, "aot_eager")),
                                   model.graph_bytes(peer_key(rows, LIMITS, "aot_eager")))
    ragged = PeerWarmSet.of("tpu", [PeerGraph("mixed", 4, 128)])
    forward = step_forwards("tpu", (100, 1), (300, 41), LIMITS)[0]  # real context 240, cells 30000 + 41
    cost = warmup_cost("tpu", ragged, Counter({forward: 3}), pricing)
    assert (forward.tokens, forward.context, forward.cells) == (101, 240, 30041)
    assert cost.run_seconds == pytest.approx(3 * (1e-3 + 1e-5 * 128 + 1e-6 * 240 + 1e-8 * 30041))
    assert cost.warmup_seconds == pytest.approx(0.5 + 1.0 + 1e-3 * 128)  # start-up + the one compile
    assert (cost.padded_rows, cost.tokens, cost.runtime_compiles) == (3 * 27, 3 * 101, 0)
    assert cost.peak_bytes == pricing.graph(PeerGraph("mixed", 4, 128))[1] > 0
    with pytest.raises(ConfigError, match="no step-graph fits of mode=rows"):  # calibrated before ROWS
        Pricing(with_steps(), LIMITS).graph(rows)


def test_a_forward_no_graph_serves_compiles_its_own_shape_once():
    pricing = Pricing(with_rows(with_steps()), LIMITS)
    warm = PeerWarmSet.of("gaudi-x", [PeerGraph("prefill", 1, 64, 0), PeerGraph("decode", 4, 1, 8)])
    big = Forward("prefill", 1, 200, 0, 200, 0, 200 * 200)
    small = Forward("prefill", 1, 10, 0, 10, 0, 100)
    cost = warmup_cost("gaudi-x", warm, Counter({big: 2, small: 5}), pricing)
    assert (cost.runtime_compiles, cost.unserved) == (1, 2)
    compile_big = pricing.graph(PeerGraph("prefill", 1, 200, 0))[0]
    assert cost.runtime_compile_seconds == pytest.approx(compile_big)
    assert cost.padded_rows == 5 * (64 - 10)  # the compiled graph runs its own forwards unpadded
    assert cost.total_seconds == pytest.approx(cost.warmup_seconds + cost.runtime_compile_seconds + cost.run_seconds)


def test_a_model_without_step_fits_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="calibrate it again"):
        Pricing(synthetic(), LIMITS)


@st.composite
def workloads(draw):
    """Requests of random prompt and output lengths through the batch former of random limits."""
    seqs = draw(st.integers(1, 6))
    tokens = draw(st.sampled_from([64, 128, 200, 256]))
    mml = draw(st.sampled_from([256, 300, 512]))
    n = draw(st.integers(1, 12))
    requests = [Request(float(i), draw(st.integers(1, mml - 1)), 0) for i in range(n)]
    requests = [Request(r.arrival, r.prompt_tokens, draw(st.integers(1, mml - r.prompt_tokens))) for r in requests]
    former = BatchFormer(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=mml)
    steps = [s.layout for s in former.steps(requests)]
    limits = PeerLimits(seqs, tokens, mml, block_size=draw(st.sampled_from([16, 32])))
    return steps, limits


def every_forward(limits: PeerLimits, runtime: str) -> list[Forward]:
    """Forwards at the corners of what the limits allow (the largest shapes every plan must serve)."""
    block, mml, seqs, tokens = limits.block_size, limits.max_model_len, limits.max_num_seqs, limits.max_num_batched_tokens
    if runtime == "tpu":
        return [f for n in (1, seqs) for t in (n, tokens) if t >= n
                for f in step_forwards("tpu", [t - n + 1] + [1] * (n - 1), [mml] * n, limits)]
    q = min(tokens, mml)
    prompts = [Forward("prefill", 1, query, -(-(mml - 1) // block), query, 0, 0) for query in (2, q)]
    prompts += [Forward("prefill", 1, q, -(-(mml - q) // block), q, 0, 0)]
    decodes = [Forward("decode", b, 1, b * -(-mml // block), b, 0, 0) for b in range(1, seqs + 1)]
    return [*prompts, *decodes]


@settings(max_examples=25, deadline=None)
@given(workloads(), st.integers(2, 40), st.sampled_from([None, 30.0, 80.0]))
def test_the_plan_covers_every_step_within_the_limits_and_keeps_its_budget(workload, max_graphs, seconds):
    steps, limits = workload
    pricing = Pricing(with_rows(with_steps()), limits)
    forwards = WorkloadForwards(steps, limits)
    budget = Budget(max_graphs, None, seconds)
    for plan, runtime in zip(plan_forms(forwards, pricing, budget), ("gaudi", "tpu")):
        graphs = len(plan.warm.graphs)
        assert budget.why_over(graphs, plan.cost.peak_bytes, plan.cost.warmup_seconds) is None
        if plan.outside:
            continue
        for f in [*forwards.of(runtime), *every_forward(limits, runtime)]:
            assert plan.warm.serves(f.phase, f.batch, f.query_tokens, f.context_blocks) is not None, f
        assert plan.cost.runtime_compiles == 0
        # the search's vectorised prices are those of the one pricing rule
        start = pricing.model.warmup_seconds
        priced = RunPricing(forwards.of(runtime), limits, pricing).seconds(plan.grid)
        compile_seconds = sum(pricing.graph(g)[0] for g in plan.warm.graphs)
        assert start + compile_seconds + priced == pytest.approx(plan.cost.total_seconds, rel=1e-9)


@settings(max_examples=15, deadline=None)
@given(workloads())
def test_no_scheme_runs_a_workload_below_the_floor(workload):
    steps, limits = workload
    pricing = Pricing(with_rows(with_steps()), limits)
    forwards = WorkloadForwards(steps, limits)
    comparison = compare_schemes(forwards, pricing, plan_forms(forwards, pricing, Budget()), 16)
    for row in comparison.rows:
        if row.cost is not None:
            assert row.cost.run_seconds >= comparison.floor.run_seconds * (1 - 1e-9), row.scheme
    pow2 = next(r for r in comparison.rows if r.scheme == "pow2")
    assert pow2.cost is not None and pow2.cost.runtime_compiles == 0


def test_more_graphs_lower_the_total_until_the_search_stops():
    requests = [Request(float(i), p, o) for i, (p, o) in enumerate([(30, 40), (200, 5), (90, 60), (250, 20)] * 3)]
    steps = [s.layout for s in BatchFormer(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
             .steps(requests)]
    pricing = Pricing(with_rows(with_steps(compile_base=0.05)), LIMITS)
    forwards = WorkloadForwards(steps, LIMITS)
    totals = [plan_warmup(forwards.of("gaudi"), LIMITS, pricing, Budget(n)).cost.total_seconds for n in (2, 4, 8, 64)]
    assert totals == sorted(totals, reverse=True) and totals[-1] < totals[0]


def test_a_phase_over_the_budget_is_left_out_and_its_forwards_priced_as_run_time_compiles():
    requests = [Request(0.0, 100, 4), Request(1.0, 50, 3)]
    steps = [s.layout for s in BatchFormer(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
             .steps(requests)]
    forwards = WorkloadForwards(steps, LIMITS)
    pricing = Pricing(with_rows(with_steps()), LIMITS)
    plan = plan_warmup(forwards.of("gaudi"), LIMITS, pricing, Budget(max_graphs=1))
    assert isinstance(plan.grid, Grid) and plan.grid.queries and not plan.grid.batches  # the prompt's top kept
    decodes = sum(n for f, n in forwards.of("gaudi").items() if f.phase == "decode")
    assert plan.outside[0].startswith("decode: its largest graph") and f"its {decodes} forwards" in plan.outside[0]
    assert "max_graphs 1" in plan.outside[0]
    assert plan.cost.runtime_compiles >= 1 and plan.cost.unserved == decodes
    assert f"{plan.cost.runtime_compiles} graphs compiled at run time" in plan.outside[-1]
    nothing = plan_warmup(forwards.of("tpu"), LIMITS, pricing, Budget(warmup_seconds=0.1))
    assert isinstance(nothing.grid, RaggedGrid) and not nothing.warm.graphs and nothing.outside
    with pytest.raises(ConfigError, match="one runtime's forwards"):
        plan_warmup(forwards.of("gaudi") + forwards.of("tpu"), LIMITS, pricing, Budget())


def test_the_plans_host_settings_read_back_to_the_plans_graphs():
    requests = [Request(float(i), p, o) for i, (p, o) in enumerate([(30, 9), (200, 5), (90, 6), (250, 2)])]
    steps = [s.layout for s in BatchFormer(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
             .steps(requests)]
    forwards = WorkloadForwards(steps, LIMITS)
    pricing = Pricing(with_rows(with_steps(compile_base=0.05)), LIMITS)
    gaudi, ragged = plan_forms(forwards, pricing, Budget(12))
    planned = PlannedForms(GaudiBuckets.of(gaudi.warm), (), ragged.warm.prefill_lengths(), (), lambda warm: None)
    settings_ = host_settings(steps, gaudi.warm.prefill_lengths(), LIMITS, 16, forwards=forwards, planned=planned)
    assert gaudi_file_warmup(settings_.gaudi_file, LIMITS).graphs == gaudi.warm.graphs
    tpu = settings_.sections["tpu"]
    read = tpu_env_paddings(LIMITS, tpu["env"], tpu["additional_config"]["compilation_sizes"]).warmup()
    assert read.graphs == ragged.warm.graphs
    vllm = settings_.sections["vllm"]["compilation_config"]["cudagraph_capture_sizes"]
    assert vllm == list(ragged.warm.prefill_lengths())  # max_num_batched_tokens 256: the cover itself
    rbln = rbln_env_warmup(LIMITS, settings_.sections["rbln"]["env"])
    assert {g.batch for g in rbln.phase("decode")} == {g.batch for g in gaudi.warm.phase("decode")}
    with pytest.raises(ConfigError, match="multiples of 16 ending at 256"):
        host_settings(steps, (), LIMITS, 16, planned=replace(planned, paddings=(100, 256)))


def test_a_budget_names_the_bound_a_set_breaks():
    budget = Budget(max_graphs=4, max_bytes=1000, warmup_seconds=2.5)
    assert budget.why_over(4, 1000, 2.5) is None and Budget().why_over(10**6, 10**12, 1e9) is None
    assert budget.why_over(5, 10, 0.0) == "5 graphs > max_graphs 4"
    assert budget.why_over(1, 1001, 0.0) == "1001 bytes > max_bytes 1000"
    assert budget.why_over(1, 10, 3.0) == "3 warm-up s > warmup_seconds 2.5"


def test_pow2_doubles_every_dimension_up_to_the_maxima():
    grid = pow2_grid(PeerLimits(4, 200, 512, block_size=16))
    assert grid == Grid((16, 32, 64, 128, 200), (0, 1, 2, 4, 8, 16, 32), (1, 2, 4), (1, 2, 4, 8, 16, 32, 64, 128))


def test_cli_plans_whole_requests_beside_the_runtimes(tmp_path, capsys):
    path = CostFile(model=with_rows(with_steps(compile_base=0.05))).save(tmp_path / "m.json")
    out = tmp_path / "plan"
    flags = ["--limit", "30", "--max-seq-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "4"]
    assert main(["plan", "--family", "model", "--whole-requests", "--cost-model", str(path), "--max-graphs", "24",
                 "--out", str(out), *flags]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    markdown = (out / "plan.md").read_text()
    schemes = {r["scheme"]: r for r in plan["schemes"]}
    for name in ("gaudi-linear", "gaudi-exponential", "rbln", "tpu", "vllm", "pow2", "plan (gaudi form)",
                 "plan (ragged form)", "rbln-plan"):
        assert name in schemes and f"| {name} " in markdown
    assert plan["limits"] == {"max_num_seqs": 4, "max_num_batched_tokens": 512, "max_model_len": 2048,
                              "block_size": 128}
    for form in ("gaudi", "ragged"):
        assert plan["plans"][form]["budget"]["max_graphs"] == 24 and plan["plans"][form]["cost"]["graphs"] <= 24
    runnable = [r for r in plan["schemes"] if r.get("runtime_compiles") == 0 and not r["refused"]
                and not r["over_budget"] and not r["reference"]]
    best = min(runnable, key=lambda r: r["total_seconds"])
    assert plan["recommended"] == best["scheme"]
    assert f"lowest modelled total within max_graphs 24: {best['scheme']}" in " ".join(printed.split())
    assert all(r["total_seconds"] >= plan["floor"]["total_seconds"] for r in plan["schemes"] if "total_seconds" in r)
    host = json.loads((out / "host_settings.json").read_text())
    assert host["gaudi"]["env"]["VLLM_BUCKETING_FROM_FILE"] == str((out / "gaudi_buckets.txt").resolve())
    assert host["tpu"]["num_tokens_paddings"] == plan["plans"]["ragged"]["grid"]["tokens"]
    assert "## Warm-up schemes on whole requests, modelled" in markdown
    assert main(["plan", "--whole-requests", "--out", str(tmp_path / "x"), *flags]) == 2
    assert "--whole-requests: needs --family model" in capsys.readouterr().err
    for extra in (["--policies", "varlen"], ["--sample", "0"], ["--align", "64"]):
        assert main(["plan", "--family", "model", "--whole-requests", "--cost-model", str(path), "--out",
                     str(tmp_path / "x"), *flags, *extra]) == 2
        assert f"argument {extra[0]}: not taken with --whole-requests" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
