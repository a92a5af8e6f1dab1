"""The cost-aware policy: rent-or-buy pricing, hedging, determinism, pure previews,
acceptance on synthetic cost models (independent of the shipped default model)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.features import Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.dispatch import Dispatcher
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.modelling.simulation import SimulatedGraph, simulate
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.costaware import CostAware
from attnpolicy.policies.registry import make_policy, policy_registry
from attnpolicy.workloads.traces import Request, synthetic_default

FIXED = ("always-mask", "dynamic", "varlen")

pytestmark = pytest.mark.usefixtures("fresh_plugins")


def synthetic(compile_s: float, mask_cell: float, *, cell: float = 1e-9, varlen_call: float = 2e-4,
              build_cell: float = 1e-9) -> CostModel:
    """A cost model written by hand: every graph compiles in ``compile_s`` seconds; a
    MASK call costs ``mask_cell`` per score cell, CAUSAL and VARLEN ``cell`` (VARLEN
    also ``varlen_call`` per call); a mask build ``build_cell`` per cell."""
    return CostModel(run={CallKind.CAUSAL: Fit(base=1e-4, per_cell=cell),
                          CallKind.MASK: Fit(base=1e-4, per_cell=mask_cell),
                          CallKind.VARLEN: Fit(base=varlen_call, per_cell=cell)},
                     compile={f: Fit(base=compile_s) for f in CallKind},
                     mask_build=Fit(per_cell=build_cell), call_overhead_seconds=1e-4)


#: compiling a graph costs 0.5 s; a MASK call 4x the cells of a mask-free one
MODEL = synthetic(0.5, 4e-9)
SPEC = MODEL.spec


def dispatcher(max_graphs: int | None = None, model: CostModel = MODEL) -> Dispatcher:
    return Dispatcher(AttnPolicyConfig(policy="cost-aware", backend="aot_eager", max_graphs=max_graphs),
                      builder=lambda call, key, spec: SimulatedGraph(key), cost_model=model,
                      cache=GraphCache(max_graphs=max_graphs, sizeof=model.graph_bytes))


def test_registered_as_builtin():
    assert policy_registry()["cost-aware"].plugin == "attnpolicy.policies.costaware"
    assert isinstance(make_policy("cost-aware"), CostAware)


def test_one_off_long_sequence_runs_on_the_cached_mask_graph_then_compiles_once_it_pays():
    d = dispatcher()
    layout = BatchLayout.from_lens([4000])
    ctx = d.context_for(SPEC)
    (mask_key,) = ctx.keys_for(layout, MaskMode.MASK)
    (causal_key,) = ctx.keys_for(layout, MaskMode.CAUSAL)
    d.cache.get_or_compile(mask_key, lambda: SimulatedGraph(mask_key))  # warmed up
    # MASK: 4000² cells at 4e-9 + its mask build (84 ms) vs CAUSAL at 1e-9 (17 ms) + a 0.5 s
    # compile: renting accumulates 67 ms of regret per batch, buying pays after ~7
    first = d.decide(layout, SPEC)
    assert first.mode is MaskMode.MASK
    assert "mask 84.1 ms vs causal 17 ms + compile 1 graph 500 ms; renting" in first.reason
    d.prepare(layout, SPEC)
    assert causal_key not in d.cache
    modes = [MaskMode.MASK]
    for _ in range(14):  # the same long sequence again and again: compiling CAUSAL pays back
        modes.append(d.decide(layout, SPEC).mode)
        d.prepare(layout, SPEC)
    bought = modes.index(MaskMode.CAUSAL)
    assert 5 <= bought <= 14, modes
    assert modes[bought:] == [MaskMode.CAUSAL] * (len(modes) - bought)
    assert d.stats().cache.per_key[str(causal_key)].compiles == 1


def test_a_windowed_mask_is_priced_as_the_dispatcher_keeps_and_builds_it():
    model = MODEL.model_copy(update={"mask_build_window": Fit(per_cell=1e-7)})  # 100x a plain build
    spec = replace(SPEC, features=Features(window=64))
    d = dispatcher(model=model)
    layout = BatchLayout.from_lens([4000])
    (mask_key,) = d.context_for(spec).keys_for(layout, MaskMode.MASK)
    d.cache.get_or_compile(mask_key, lambda: SimulatedGraph(mask_key))
    mask = (model.run_seconds(mask_key) + model.call_overhead_seconds
            + model.mask_build_seconds(mask_key.q_len, mask_key.kv_len, 64))
    assert f"mask {mask * 1e3:.3g} ms" in d.decide(layout, spec).reason


def test_outside_a_dispatcher_it_answers_as_varlen():
    policy = CostAware()
    assert policy.decide(BatchLayout.from_lens([10]), PolicyContext()).mode is MaskMode.CAUSAL
    assert policy.decide(BatchLayout.from_lens([10, 20]), PolicyContext()).mode is MaskMode.VARLEN


def layouts(n: int = 30) -> list[BatchLayout]:
    return [BatchLayout.from_lens([min(r.prompt_tokens, 3000), 64], [min(r.prompt_tokens, 3000), 900])
            for r in synthetic_default(n)]


class Decisions:
    def __init__(self):
        self.seen = []

    @hookimpl
    def attnpolicy_on_decision(self, decision):
        self.seen.append((decision.mode.value, decision.reason))


def run(previews: bool) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The decisions of a cost-aware dispatcher over a layout stream (as the
    on_decision hook saw them), with or without previews between batches."""
    recorder = Decisions()
    get_plugin_manager().register(recorder)
    try:
        d = dispatcher(max_graphs=4)
        previewed = []
        for layout in layouts():
            if previews:
                for _ in range(3):
                    keys = d.graph_keys_for(layout, SPEC)
                previewed.append((d.preview(layout, SPEC).mode.value, len(keys)))
            d.prepare(layout, SPEC)
        assert d.stats().batches == len(recorder.seen)
        return recorder.seen, previewed
    finally:
        get_plugin_manager().unregister(recorder)


def test_deterministic_on_a_layout_stream():
    assert run(previews=False) == run(previews=False)


def test_previews_do_not_change_the_decisions():
    plain, _ = run(previews=False)
    with_previews, previewed = run(previews=True)
    assert with_previews == plain  # previews advanced nothing and fired no hook
    # a preview is the followed rule's answer: the batch's decision, unless a rule overtook
    agree = sum(p == mode for (p, _), (mode, _) in zip(previewed, plain))
    assert agree >= len(plain) - 3


def totals(model: CostModel, capacities: tuple[int | None, ...],
           requests: list[Request] | None = None) -> dict[tuple[str, int | None], float]:
    if requests is None:
        requests = [Request(r.arrival, min(r.prompt_tokens, 2000), min(r.output_tokens, 30))
                    for r in synthetic_default(60)]
    rows = simulate(requests, [*FIXED, "cost-aware"], list(capacities), ["lru"], model=model)
    return {(r.policy, r.capacity): r.total_seconds for r in rows}


def test_with_free_compiles_it_beats_every_fixed_policy():
    """Compiles cost nothing: rent-or-buy runs each batch in its fastest legal mode,
    so it is at least as good as any fixed rule."""
    t = totals(synthetic(0.0, 4e-9), (2, None))
    for capacity in (2, None):
        best = min(t[p, capacity] for p in FIXED)
        assert t["cost-aware", capacity] <= best, (capacity, t)
        assert t["cost-aware", capacity] < t["always-mask", capacity] / 2


@pytest.mark.slow
@pytest.mark.parametrize("compile_s, model", [
    (5.0, synthetic(5.0, 4e-9)),
    (20.0, synthetic(20.0, 1e-10, cell=1e-10, varlen_call=1e-3, build_cell=0.0)),
], ids=["dear-compiles", "mask-cheap"])
def test_when_compiles_dominate_it_pays_at_most_two_extra_compiles(compile_s, model):
    """Compiles dominate (a bounded cache keeps evicting): the best rule is the one
    that compiles least, and on a long workload cost-aware ends within two compiles
    of it (what it pays to find it), far from the worst."""
    t = totals(model, (2, 8), synthetic_default(400))
    for capacity in (2, 8):
        fixed = sorted(t[p, capacity] for p in FIXED)
        assert t["cost-aware", capacity] <= fixed[0] + 2 * compile_s, (capacity, t)
        assert t["cost-aware", capacity] < fixed[-1] / 2, (capacity, t)


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_a_shadow_batch_that_hits_every_graph_skips_repeated_uses_without_changing_a_decision(monkeypatch,
                                                                                             eviction):
    """HIT_TOUCH: touching each key once at its last use (lru), or not at all (fifo),
    leaves the shadow caches as replaying every use does: the same decisions and
    reasons (modelled totals included) on a stream of multi-sequence batches."""
    from attnpolicy.policies import costaware
    from attnpolicy.workloads.batching import BatchFormer

    model = CostModel.default()
    steps = [s.layout for s in BatchFormer(max_num_seqs=4, max_num_batched_tokens=512).steps(synthetic_default(40))]

    def decisions():
        config = AttnPolicyConfig(policy="cost-aware", backend=model.backend, max_graphs=4, eviction=eviction,
                                  max_seq_len=8192, max_batch_tokens=32768)
        d = Dispatcher(config, builder=lambda call, key, spec: SimulatedGraph(key), cost_model=model)
        out = []
        for layout in steps:
            decision = d.prepare(layout, model.spec).decision
            out.append((decision.mode.value, decision.reason))
        return out

    fast = decisions()
    monkeypatch.setattr(costaware, "HIT_TOUCH", {})  # every shadow replays every use
    assert decisions() == fast
    assert len({mode for mode, _ in fast}) > 1  # the stream makes it switch modes


@settings(max_examples=15, deadline=None)
@given(picks=st.lists(st.integers(0, 5), min_size=5, max_size=40),
       eviction=st.sampled_from(["lru", "fifo", "lfu"]), capacity=st.sampled_from([1, 2, 4, None]),
       mask_bytes=st.sampled_from([64, 1 << 20]))
def test_a_repeated_batch_is_replayed_exactly(picks, eviction, capacity, mask_bytes):
    """A batch repeating the last one's layout, when that one changed no shadow cache
    and no regret, is replayed: the same decisions and reasons (modelled totals
    included) as stepping every shadow again, on streams with repeats, evictions and
    mask-cache evictions."""
    from attnpolicy.policies import costaware

    pool = [BatchLayout.from_lens([16]), BatchLayout.from_lens([5, 7]), BatchLayout.from_lens([3], [40]),
            BatchLayout.from_lens([30, 2], padded_to=40), BatchLayout.from_lens([8, 8, 8], causal=False),
            BatchLayout.from_lens([64])]
    stream = [pool[i] for i in picks for _ in range(1 + i % 3)]  # runs of repeats

    def decisions() -> list[tuple[str, str]]:
        config = AttnPolicyConfig(policy="cost-aware", backend="aot_eager", max_graphs=capacity,
                                  eviction=eviction, max_mask_bytes=mask_bytes, on_overflow="eager")
        d = Dispatcher(config, builder=lambda call, key, spec: SimulatedGraph(key), cost_model=MODEL)
        return [(decision.mode.value, decision.reason)
                for decision in (d.prepare(layout, SPEC).decision for layout in stream)]

    steps = []
    real_step = costaware._Shadow.step

    def counted(self, layout, ctx):
        steps.append(1)
        return real_step(self, layout, ctx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(costaware._Shadow, "step", counted)
        replayed = decisions()
        with_replay = len(steps)
        mp.setattr(costaware, "_Repeat", lambda *args: None)  # never replay
        steps.clear()
        stepped = decisions()
    assert replayed == stepped
    assert with_replay <= len(steps)


def test_a_steady_repeat_steps_no_shadow(monkeypatch):
    """From the second batch of a layout whose graphs and masks are all cached on, the
    shadows are charged without being stepped (lfu excepted: its touches count)."""
    from attnpolicy.policies import costaware

    steps = []
    real_step = costaware._Shadow.step
    monkeypatch.setattr(costaware._Shadow, "step", lambda self, layout, ctx: steps.append(1) or real_step(
        self, layout, ctx))
    for eviction, stepped in (("lru", 8), ("fifo", 8), ("lfu", 40)):
        steps.clear()
        d = Dispatcher(AttnPolicyConfig(policy="cost-aware", backend="aot_eager", eviction=eviction),
                       builder=lambda call, key, spec: SimulatedGraph(key), cost_model=MODEL)
        for _ in range(10):
            d.prepare(BatchLayout.from_lens([5, 7]), SPEC)
        assert len(steps) == stepped, eviction  # 4 shadows: the first batch, the first repeat


@pytest.mark.slow
def test_at_or_below_the_best_fixed_policy_on_the_built_in_workload():
    """The built-in workload and cost model, the report's sweep: at every capacity
    cost-aware's best row is at or below the best fixed policy's (of every eviction)."""
    rows = simulate(synthetic_default(), [*FIXED, "cost-aware"], [2, 4, 8, 16], ["lru", "lfu", "cost"],
                    model=CostModel.default())
    best: dict[tuple[str, int | None], float] = {}
    for r in rows:
        best[r.policy, r.capacity] = min(best.get((r.policy, r.capacity), float("inf")), r.total_seconds)
    for capacity in (2, 4, 8, 16):
        fixed = min(best[p, capacity] for p in FIXED)
        assert best["cost-aware", capacity] <= fixed, (capacity, best)


def test_cost_aware_runs_rows_only_under_a_model_that_prices_them():
    """Without a rows fit (a model calibrated before the rows kind) cost-aware never
    chooses rows; with one that makes rows the cheapest, it does."""
    layout = BatchLayout.from_lens([1000] * 4)
    model = synthetic(0.05, 4e-9)
    assert CallKind.ROWS in model.compile and CallKind.ROWS not in model.run  # no rows price
    cheap_rows = model.model_copy(update={"run": {**model.run, CallKind.ROWS: Fit(base=1e-7)}})
    for priced, rows in ((model, False), (cheap_rows, True)):
        d = dispatcher(model=priced)
        for _ in range(60):
            d.prepare(layout, SPEC)
        assert (d.stats().modes["rows"] > 0) is rows
