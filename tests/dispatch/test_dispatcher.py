"""The Dispatcher end to end: policies, guard, buckets, graph cache, real compiles."""

from __future__ import annotations

import warnings
from dataclasses import asdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import layouts, qkv, random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher, GraphCache, hookimpl
from attnpolicy.core.modes import CallKind, MaskMode
from attnpolicy.dispatch import HostStep
from attnpolicy.errors import (
    BucketOverflowError,
    ConfigError,
    GraphCompileError,
    StrictModeError,
)
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.resolve import validate_names

POLICIES = ["always-mask", "always-causal", "dynamic", "varlen", "always-rows"]
SPEC = TensorSpec("float32", 4, 2, 16)




def _check(dispatcher, layout, q, k, v):
    out = dispatcher.attend(q, k, v, layout)
    tol = 1e-5 if q.dtype == torch.float32 else 2**-6
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=tol, rtol=tol)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40)
@given(data=st.data())
def test_every_policy_matches_reference_uncompiled(policy, data):
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_seq_len=2048))
    for _ in range(3):  # several batches through one dispatcher: cache hits too
        layout = data.draw(layouts(max_seqs=4))
        _check(d, layout, *data.draw(qkv(layout)))


MIXED = [BatchLayout.from_lens([37]), BatchLayout.from_lens([5, 20, 3]),
         BatchLayout.from_lens([100, 60]), BatchLayout.from_lens([20]), BatchLayout.from_lens([60, 9, 9, 9]),
         BatchLayout.from_lens([3, 4], [30, 50]), BatchLayout.from_lens([7, 7], causal=False),
         BatchLayout.from_lens([5, 6], padded_to=16)]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_reference_compiled(policy):
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend="eager", max_seq_len=256))
    for i, layout in enumerate(MIXED * 2):
        _check(d, layout, *random_qkv(layout, seed=i))
    stats = d.stats()
    assert stats.batches == 2 * len(MIXED)
    assert stats.cache.hits >= stats.cache.misses  # second round hits


def _keys(policy, stream):
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_seq_len=256))
    keys = set()
    for layout in stream:
        keys.update(d.graph_keys_for(layout, SPEC))
        d.prepare(layout, SPEC)
    return keys, d


def test_varlen_uses_only_causal_graphs_on_causal_prefills():
    stream = [BatchLayout.from_lens(lens) for lens in
              ([37], [5, 20, 3], [100, 60], [20], [60, 9, 9, 9], [200], [17, 17])]
    varlen, d = _keys("varlen", stream)
    causal_only, _ = _keys("dynamic", [BatchLayout.from_lens([n]) for lay in stream for n in lay.q_lens])
    assert {k.kind for k in varlen} == {CallKind.CAUSAL}
    assert varlen <= causal_only
    assert d.stats().modes["varlen"] == 4
    dynamic, _ = _keys("dynamic", stream)
    assert {k.kind for k in dynamic} == {CallKind.CAUSAL, CallKind.MASK}
    # one graph per bucket for varlen; dynamic needs both kinds
    assert len(dynamic) > len(varlen)


def test_varlen_packed_batch_reuses_single_sequence_graphs():
    counter = []
    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="eager", max_seq_len=256),
                   compile_counter=counter.append)
    single = BatchLayout.from_lens([30])
    d.attend(*random_qkv(single), single)
    assert len(counter) == 1
    packed = BatchLayout.from_lens([20, 25, 32])  # all in bucket 32
    _check(d, packed, *random_qkv(packed))
    assert len(counter) == 1 and d.stats().cache.hits == 3


def test_distinct_keys_are_real_compiles_and_eviction_recompiles():
    counter = []
    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="eager", max_seq_len=4096,
                                    buckets={"kind": "exact"}, max_graphs=4),
                   compile_counter=counter.append)
    lens = list(range(10, 30))
    for n in lens:
        lay = BatchLayout.from_lens([n])
        _check(d, lay, *random_qkv(lay))
    assert len(counter) == 20
    stats = d.stats().cache
    assert stats.compiles == 20 and stats.evictions == 16 and stats.graphs == 4
    lay = BatchLayout.from_lens([10])  # evicted long ago
    _check(d, lay, *random_qkv(lay))
    assert len(counter) == 21


def test_buckets_pad_and_waste_is_counted():
    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="none", max_seq_len=256))
    d.prepare(BatchLayout.from_lens([20]), SPEC)
    (key,) = d.cache.keys()
    assert (key.q_len, key.kv_len) == (32, 32)
    pad = asdict(d.stats().padding)
    assert pad == {"real_tokens": 20, "padded_tokens": 12, "waste": 12 / 20}


def test_overflow_raises_or_runs_uncompiled():
    lay = BatchLayout.from_lens([300])
    strict = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=256))
    with pytest.raises(BucketOverflowError, match=r"length 300 exceeds the largest bucket 256 \(buckets pow2\(min=16\), max_seq_len=256\)"):
        strict.attend(*random_qkv(lay), lay)
    lenient = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=256, on_overflow="eager"))
    _check(lenient, lay, *random_qkv(lay))
    assert lenient.stats().overflow == 1 and lenient.stats().cache.graphs == 0


class _Exploding(GraphCache):
    def get_or_compile(self, key, build, **options):
        return super().get_or_compile(key, lambda: (_ for _ in ()).throw(RuntimeError("backend broke")), **options)


def test_compile_failure_raises_or_falls_back_to_eager():
    lay = BatchLayout.from_lens([12])
    d = Dispatcher(AttnPolicyConfig(backend="eager", max_seq_len=64), cache=_Exploding())
    with pytest.raises(GraphCompileError, match="causal/q16"):
        d.attend(*random_qkv(lay), lay)
    assert d.cache.stats().compile_failures == 1 and len(d.cache) == 0
    d = Dispatcher(AttnPolicyConfig(backend="eager", max_seq_len=64, on_compile_error="eager"),
                   cache=_Exploding())
    _check(d, lay, *random_qkv(lay))
    assert d.stats().compile_error_fallbacks == 1


@pytest.mark.parametrize("strict", ["warn", "raise"])
def test_strict_mode_flags_compiles_after_warmup(strict):
    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="none", max_seq_len=256, strict=strict))
    keys = d.warmup([BatchLayout.from_lens([20]), BatchLayout.from_lens([20, 30])], SPEC)
    assert len(keys) == 2 and len(d.cache) == 2
    d.prepare(BatchLayout.from_lens([25, 27]), SPEC)  # same MASK bucket: no compile
    other = BatchLayout.from_lens([100])
    if strict == "raise":
        batches = d.stats().batches
        with pytest.raises(StrictModeError, match="causal/q128"):
            d.prepare(other, SPEC)
        assert len(d.cache) == 2 and d.stats().batches == batches  # nothing half-counted
    else:
        with pytest.warns(RuntimeWarning, match="compiled after warm-up"):
            d.prepare(other, SPEC)
    assert d.stats().strict_violations == 1


def test_illegal_decision_falls_back_and_is_counted():
    d = Dispatcher(AttnPolicyConfig(policy="always-causal", backend="none", max_seq_len=256))
    lay = BatchLayout.from_lens([5, 9])
    _check(d, lay, *random_qkv(lay))
    assert d.stats().guard_fallbacks == 1 and d.stats().modes["varlen"] == 1


def test_observer_hooks_fire_on_compile_and_evict():
    seen: list[tuple] = []

    class Recorder:
        @hookimpl
        def attnpolicy_on_compile(self, key, seconds, nbytes):
            seen.append(("compile", str(key), nbytes))

        @hookimpl
        def attnpolicy_on_evict(self, key, nbytes):
            seen.append(("evict", str(key), nbytes))

    pm = get_plugin_manager()
    recorder = Recorder()
    pm.register(recorder)
    try:
        d = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=256, max_graphs=1))
        d.prepare(BatchLayout.from_lens([20]), SPEC)
        d.prepare(BatchLayout.from_lens([40]), SPEC)
    finally:
        pm.unregister(recorder)
    kinds = [s[0] for s in seen]
    assert kinds == ["compile", "evict", "compile"]
    assert seen[1][1] == seen[0][1] and seen[0][2] > 0


def test_graph_bytes_bound_is_never_exceeded():
    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="none", max_seq_len=512, max_bytes=1_000_000))
    for n in (10, 40, 100, 200, 20, 5):
        d.prepare(BatchLayout.from_lens([n, n]), SPEC)
        assert d.cache.stats().bytes <= 1_000_000
    assert d.cache.stats().evictions > 0


def test_no_warning_when_everything_is_fine():
    d = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=256))
    lay = BatchLayout.from_lens([4, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.attend(*random_qkv(lay), lay)


def test_mask_calls_bucket_packed_rows_up_to_max_batch_tokens():
    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="none", max_seq_len=256, max_batch_tokens=1024))
    lay = BatchLayout.from_lens([200, 200, 200])  # 600 packed rows > max_seq_len
    _check(d, lay, *random_qkv(lay))
    (key,) = d.cache.keys()
    assert key.kind is CallKind.MASK and key.q_len == 1024
    big = BatchLayout.from_lens([250] * 5)
    with pytest.raises(BucketOverflowError, match=r"largest bucket 1024 \(buckets pow2\(min=16\), max_batch_tokens=1024\)"):
        d.attend(*random_qkv(big), big)


def test_padding_waste_counts_only_real_tokens_as_real():
    for policy, padded in (("always-mask", 32 - 5), ("varlen", 16 + 16 - 5)):
        d = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_seq_len=256))
        d.prepare(BatchLayout.from_lens([3, 2], padded_to=20), SPEC)
        assert asdict(d.stats().padding) == {"real_tokens": 5, "padded_tokens": padded, "waste": padded / 5}


def test_causal_and_bidirectional_batches_share_mask_graphs():
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=256))
    d.prepare(BatchLayout.from_lens([20, 30]), SPEC)
    d.prepare(BatchLayout.from_lens([20, 30], causal=False), SPEC)
    assert d.cache.stats().compiles == 1 and d.cache.stats().hits == 1


def test_cost_eviction_ranks_by_modelled_compile_seconds():
    from attnpolicy.graphs.costmodel import CostModel

    model = CostModel.default()
    d = Dispatcher(AttnPolicyConfig(policy="dynamic", backend="aot_eager", eviction="cost", max_seq_len=256),
                   builder=lambda call, key, spec: (lambda *a: None), cost_model=model)
    d.prepare(BatchLayout.from_lens([20]), SPEC)
    d.prepare(BatchLayout.from_lens([20, 30]), SPEC)
    expected = sum(model.compile_seconds(k) for k in d.cache.keys())
    # measured build time is ~0 here: the recorded seconds are the model's, the same on every rank
    assert d.cache.stats().compile_seconds == pytest.approx(expected)


class _Counting:
    """A policy plugin that counts how often it is asked (stateless or not)."""

    def __init__(self, stateless):
        self.asked = 0
        self.stateless = stateless

    name = "counting"
    description = "varlen, counting decisions"

    def decide(self, layout, ctx):
        from attnpolicy.core.modes import Decision
        self.asked += 1
        return Decision(MaskMode.VARLEN, "counted")


@pytest.mark.parametrize("stateless", [True, False])
def test_stateless_decisions_are_reused_per_layout_and_still_reported(stateless):
    decisions = []

    class Recorder:
        @hookimpl
        def attnpolicy_on_decision(self, layout, decision, policy, fell_back):
            decisions.append(decision.mode)

    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_seq_len=256))
    d.guard.policy = policy = _Counting(stateless)
    pm = get_plugin_manager()
    recorder = Recorder()
    pm.register(recorder)
    try:
        lay = BatchLayout.from_lens([5, 9])
        for seed in range(3):
            _check(d, lay, *random_qkv(lay, seed=seed))
    finally:
        pm.unregister(recorder)
    assert policy.asked == (1 if stateless else 3)
    assert decisions == [MaskMode.VARLEN] * 3
    stats = d.stats()
    assert stats.batches == 3 and stats.calls == 6 and stats.modes["varlen"] == 3
    assert stats.cache.hits + stats.cache.misses == 6  # fetched for every call


def test_guard_fallbacks_are_counted_per_batch_not_memoised():
    d = Dispatcher(AttnPolicyConfig(policy="always-causal", backend="none", max_seq_len=256))
    lay = BatchLayout.from_lens([5, 9])
    for seed in range(3):
        _check(d, lay, *random_qkv(lay, seed=seed))
    assert d.stats().guard_fallbacks == 3


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_graphs_are_called_directly(backend):
    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend=backend, max_seq_len=256))
    lay = BatchLayout.from_lens([5, 9], kv_lens=[7, 9])
    _check(d, lay, *random_qkv(lay))
    keys = d.cache.keys()
    assert keys
    for key in keys:
        assert d.cache.get_or_compile(key, None).direct
    assert d.stats().direct_call_fallbacks == 0


def test_auto_kernel_is_the_fastest_measured_one_that_fits():
    from attnpolicy.graphs.costmodel import CostModel

    measured = {"mask": {"flex": 0.001, "eager": 0.002, "sdpa": 0.5, "flash": 0.9}}
    model = CostModel.default().model_copy(update={"kernel_seconds": measured})
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", kernels={"mask": "auto"}),
                   cost_model=model)
    lay = BatchLayout.from_lens([5, 9])
    _check(d, lay, *random_qkv(lay))
    impls = {key.impl for key in d.cache.keys()}
    assert impls == {"flex"}
    _check(d, lay, *(t.double() for t in random_qkv(lay)))  # flex has no float64: the next fastest
    impls = {key.impl for key in d.cache.keys()}
    assert impls == {"flex", "eager"}


def test_kernel_configured_for_a_call_it_cannot_serve_names_it():
    d = Dispatcher(AttnPolicyConfig(policy="always-mask", backend="none", kernels={"mask": "flex"}))
    lay = BatchLayout.from_lens([5, 9])
    with pytest.raises(ConfigError, match="kernel 'flex' cannot serve this mask call .* dtype float64"):
        d.attend(*(t.double() for t in random_qkv(lay)), lay)
    assert d.stats().batches == 0 and len(d.cache) == 0


def test_unknown_kernel_in_config_is_refused():
    config = AttnPolicyConfig(kernels={"varlen": "flex"})  # plain data: the name is resolved where used
    with pytest.raises(ConfigError, match="kernels: 'flex' is not a registered varlen kernel"):
        Dispatcher(config)
    with pytest.raises(ConfigError, match="kernels: 'flex' is not a registered varlen kernel"):
        validate_names(config)
    with pytest.raises(ValueError, match="kernels: call kind 'decode' is not one of"):
        AttnPolicyConfig(kernels={"decode": "sdpa"})


def _decode_steps():
    """A generation's steps: prefills, a lone prompt (CAUSAL), decodes whose keys grow
    by one per step (their layouts never repeat), a chunk with cached context, one
    sequence over the largest bucket."""
    lens = [20, 70, 130, 33]
    steps = [BatchLayout.from_lens(lens), BatchLayout.from_lens([33]), BatchLayout.from_lens([1, 1, 5], [21, 71, 40])]
    for i in range(6):
        steps.append(BatchLayout.from_lens([1] * 4, [n + 1 + i for n in lens]))
    steps.append(BatchLayout.from_lens([1, 1, 300], [30, 40, 300]))  # 300 > max_seq_len 256: eager
    steps.append(BatchLayout.from_lens([1, 9, 9], [27, 9, 9]))
    return steps


def _untimed(stats):
    """Dispatcher stats without measured seconds, the count of full plans and graphs
    held by pins (batches that stalled are counted, not timed)."""
    cache = stats["cache"]
    per_key = {k: {**v, "compile_seconds": None} for k, v in cache["per_key"].items()}
    held = dict.fromkeys(("held_graphs", "held_bytes", "peak_held_graphs", "peak_held_bytes"))
    stalls = {k: stats["stalls"][k] for k in ("batches", "stalled")}
    return {**stats, "plans": None, "stalls": stalls,
            "cache": {**cache, **held, "compile_seconds": None, "per_key": per_key}}


def _unbuilt(stats):
    """``_untimed`` stats without what depends on which graphs were built: compiles,
    deferred entries, stalls."""
    stats = _untimed(stats)
    cache = {k: v for k, v in stats["cache"].items() if k not in ("compiles", "deferred", "deferred_built")}
    cache["per_key"] = {k: {**v, "compiles": None} for k, v in cache["per_key"].items()}
    return {**stats, "stalls": None, "cache": cache}


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("policy", ["varlen", "dynamic"])
def test_a_host_step_fetches_and_counts_as_a_planned_step(policy, eviction):
    """A dispatcher whose host runs VARLEN on its own kernel (host_varlen=True) takes
    the same decisions and leaves the same hits, misses, evictions and cache contents
    as planning every call; its VARLEN steps are HostSteps with no graph (none pinned,
    none built: their keys enter the cache deferred), its other steps return (and pin)
    their graphs, and it builds exactly the graphs those steps run."""
    cfg = AttnPolicyConfig(policy=policy, backend="aot_eager", max_seq_len=256, max_graphs=3,
                           eviction=eviction, on_overflow="eager")
    built = [[], []]
    ds = [Dispatcher(cfg, builder=lambda call, key, spec, out=out: out.append(key) or (lambda *a: None),
                     host_varlen=host) for out, host in zip(built, (False, True))]
    ran = set()
    for layout in _decode_steps():
        full = ds[0].prepare(layout, SPEC)
        fast = ds[1].prepare(layout, SPEC)
        assert fast.decision == full.decision
        varlen = full.decision.mode is MaskMode.VARLEN
        assert isinstance(fast, HostStep) == varlen
        calls = [call for call, _ in full]
        assert [call for call, _ in fast] == ([] if varlen else calls)
        if not varlen:
            ran.update(key for call, key in full.plan.calls if call.compiled)
        # the batch's graphs stay pinned until it has run; a VARLEN step run elsewhere uses none
        assert ds[1].source.pinned == ([] if varlen else ds[0].source.pinned)
        for mode in (MaskMode.VARLEN, full.decision.mode):
            keys = ds[1].context_for(SPEC).keys_for(layout, mode)
            assert keys == tuple(k for c, k in ds[0].planner.plan(layout, mode, SPEC).calls if c.compiled)
        stats = [_unbuilt(d.stats().to_json()) for d in ds]
        assert stats[1] == stats[0]
    assert set(built[1]) == ran <= set(built[0])  # the host's dispatcher builds what runs
    host = ds[1].stats().cache
    assert host.compiles == len(built[1])
    assert host.misses + host.deferred_built == host.compiles + host.deferred  # every miss accounted for
    if policy == "varlen":  # keys deferred by host steps, one built when the lone prompt ran it
        assert ran < set(built[0]) and host.deferred > 0 and host.deferred_built > 0
    assert stats[0]["cache"]["evictions"] > 0 and stats[0]["cache"]["hits"] > 0
    assert stats[0]["modes"][policy if policy == "varlen" else "mask"] > 0
    assert stats[0]["overflow"] > 0 or policy != "varlen"


@settings(max_examples=20, deadline=None)
@given(picks=st.lists(st.integers(0, 4), min_size=1, max_size=12), max_graphs=st.sampled_from([1, 2, 3, None]),
       eviction=st.sampled_from(["lru", "lfu", "fifo"]))
def test_a_batch_fetches_its_hits_together_exactly_as_one_by_one(picks, max_graphs, eviction):
    """Several compiled calls take their cached graphs under one lock: the cache ends
    in the same state (hits, misses, evictions, per-key figures, what it holds) as
    fetching every call's graph on its own, and the outputs are the same."""
    from attnpolicy.modelling.simulation import SimulatedGraph

    pool = [BatchLayout.from_lens([3, 5, 3]), BatchLayout.from_lens([8, 2], [9, 2]), BatchLayout.from_lens([16, 16]),
            BatchLayout.from_lens([4, 4, 4, 4], causal=False), BatchLayout.from_lens([30, 1], padded_to=40)]
    spec = TensorSpec("float32", 4, 2, 8)

    def run() -> tuple[object, ...]:
        config = AttnPolicyConfig(policy="varlen", backend="eager", max_graphs=max_graphs, eviction=eviction,
                                  max_seq_len=64)
        d = Dispatcher(config, builder=lambda call, key, spec: SimulatedGraph(key))
        fetched = []
        for i in picks:
            graphs = d.prepare(pool[i], spec)
            fetched.append([(call, graph.key) for call, graph in graphs])  # type: ignore[union-attr]
        d.release_batch()
        return _untimed(d.stats().to_json()), sorted(map(str, d.cache.keys())), fetched

    together = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphCache, "hit_many", lambda self, keys, start=0, **kw: start)  # one by one
        assert run() == together



def test_a_kept_step_holds_no_graph_the_cache_evicted():
    """The Step of a repeated layout is kept for reuse, but not its graphs once another
    batch is prepared: a graph the cache evicted is freed, and the kept step fetches
    its graph from the cache again (a miss, compiled again)."""
    import gc
    import weakref

    class Graph:
        def __init__(self, key):
            self.key = key

        def __call__(self, *args):
            raise AssertionError("not run")

    cfg = AttnPolicyConfig(policy="varlen", backend="eager", max_graphs=1, max_seq_len=64)
    d = Dispatcher(cfg, builder=lambda call, key, spec: Graph(key))
    short, long = BatchLayout.from_lens([3]), BatchLayout.from_lens([40])
    first = d.prepare(short, SPEC)
    (call, graph), = first
    freed = weakref.ref(graph)
    del graph
    d.prepare(long, SPEC)  # evicts the short layout's graph (max_graphs=1)
    d.release_batch()
    gc.collect()
    assert freed() is None and len(first) == 0
    again = d.prepare(short, SPEC)
    assert again is first and [c for c, _ in again] == [call]
    assert d.stats().cache.misses == 3 and d.stats().batches == 3


def test_a_policy_whose_reason_changes_keeps_its_step_and_reports_each_reason():
    """A stateful policy's reason may change batch by batch (cost-aware's holds running
    totals): a repeated layout in the same mode reuses its step, plan and graphs, and the
    step reports the reason it was asked with this time."""
    from attnpolicy.core.modes import Decision

    class Talking:
        name, asked = "talking", 0

        def decide(self, layout, ctx):
            self.asked += 1
            return Decision(MaskMode.VARLEN, f"batch {self.asked}")

    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_seq_len=256))
    d.guard.policy = Talking()
    lay = BatchLayout.from_lens([5, 9])
    steps = [d.prepare(lay, SPEC) for _ in range(3)]
    assert steps[0] is steps[1] is steps[2]
    assert steps[2].decision == steps[2].asked == Decision(MaskMode.VARLEN, "batch 3")
    for seed in range(2):  # the reused step still computes the batch
        _check(d, lay, *random_qkv(lay, seed=seed))
    assert d.stats().batches == 5 and d.stats().modes["varlen"] == 5


def test_a_mask_decision_over_max_mask_bytes_keeps_its_fallen_back_step_with_each_reason():
    """A reused step whose MASK decision fell back to VARLEN (its mask over max_mask_bytes)
    says so with the reason of each batch and counts every fallback; another mode on the
    same layout is another step."""
    from attnpolicy.core.modes import Decision

    class Talking:
        name, asked, mode = "talking", 0, MaskMode.MASK

        def decide(self, layout, ctx):
            self.asked += 1
            return Decision(self.mode, f"batch {self.asked}")

    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="none", max_seq_len=256, max_mask_bytes=100,
                                    on_overflow="eager"))
    d.guard.policy = policy = Talking()
    lay = BatchLayout.from_lens([20, 30])  # a 50 x 50 mask: over 100 bytes
    first, second = d.prepare(lay, SPEC), d.prepare(lay, SPEC)
    assert first is second and second.fell_back
    assert second.decision == Decision(MaskMode.VARLEN, "batch 2; its mask exceeds max_mask_bytes: ran varlen")
    assert d.stats().mask_fallbacks == 2
    policy.mode = MaskMode.VARLEN
    third = d.prepare(lay, SPEC)
    assert third is not second and not third.fell_back and third.decision == Decision(MaskMode.VARLEN, "batch 3")
    with pytest.raises(ValueError, match="asked in mask cannot serve a varlen decision"):
        second.retake(Decision(MaskMode.VARLEN, "x"))
    _check(d, lay, *random_qkv(lay))


def test_dispatchers_sharing_a_planner_plan_once_and_keep_their_own_caches():
    """Dispatchers that differ in bounds, eviction and policy share one planner: a layout
    planned by one is a memo hit for the other, while caches, contexts and decisions stay
    each dispatcher's; a config that plans otherwise is refused naming the field."""
    base = {"backend": "none", "max_seq_len": 256}
    a = Dispatcher(AttnPolicyConfig(policy="always-mask", max_graphs=1, **base))
    b = Dispatcher(AttnPolicyConfig(policy="varlen", max_graphs=4, eviction="lfu", **base), planner=a.planner)
    assert b.planner is a.planner
    lay = BatchLayout.from_lens([5, 9])
    a.prepare(lay, SPEC)
    plans = len(a.planner.plans)
    assert b.prepare(lay, SPEC).plan is a.planner.plan(lay, MaskMode.VARLEN, SPEC)
    b.prepare(lay, SPEC)
    assert len(a.planner.plans) == plans + 1  # b's VARLEN plan, once
    assert a.context_for(SPEC) is not b.context_for(SPEC)
    assert a.context_for(SPEC).config.max_graphs == 1 and b.context_for(SPEC).config.max_graphs == 4
    assert a.context_for(SPEC).derived is b.context_for(SPEC).derived
    assert a.stats().cache.misses == 1 and b.stats().cache.misses == 1  # one graph each: its own cache
    assert b.stats().cache.hits == 3  # two sequences in one bucket, twice
    _check(b, lay, *random_qkv(lay))
    for field, value in (("max_seq_len", 512), ("buckets", {"kind": "list", "sizes": [16, 256]}), ("max_mask_bytes", 1 << 10)):
        with pytest.raises(ConfigError, match=f"planner: .*{field}="):
            Dispatcher(AttnPolicyConfig(**{**base, field: value}), planner=a.planner)
