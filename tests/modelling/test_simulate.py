"""simulate: the real dispatcher path with a cost model, the recorded-stream fast path, Belady's bound,
the lower bound, bucket schemes, rows, CLI."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from strategies import layouts

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.cache.key_stream import StreamCache, StreamStats, replay_stream
from attnpolicy.cli import main
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.features import Features
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind
from attnpolicy.dispatch import Dispatcher
from attnpolicy.errors import ConfigError, GraphTooLargeError
from attnpolicy.graphs.batch_cost import BatchCost
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey, TensorSpec
from attnpolicy.kernels.mask_cache import mask_entry
from attnpolicy.modelling.bucket_schemes import bucket_scheme, complete, vllm_sizes
from attnpolicy.modelling.simulation import (
    ROW_FIELDS,
    SimulatedGraph,
    belady_cache,
    lower_bounds,
    next_uses,
    simulate,
    simulate_layouts,
    simulation_config,
)
from attnpolicy.planning.call_table import CallTable
from attnpolicy.policies.guard import Guard
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request, synthetic_default

MODEL = CostModel.default()
FIXED = ("always-mask", "dynamic", "varlen")
SMALL = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 1024}


def gkey(i: int) -> GraphKey:
    return GraphKey(CallKind.CAUSAL, 16 * (i + 1), 16 * (i + 1), True, MODEL.spec, "sdpa", None, "aot_eager")


def requests(n: int = 40) -> list[Request]:
    return [Request(r.arrival, min(r.prompt_tokens, 600), min(r.output_tokens, 40)) for r in synthetic_default(n)]


def test_next_uses():
    keys = [gkey(i) for i in (0, 1, 0, 2, 1)]
    assert next_uses(keys) == [2, 4, math.inf, math.inf, math.inf]


def fewest_misses(stream: tuple[int, ...], capacity: int) -> int:
    """The fewest misses any eviction choice achieves on ``stream`` (exhaustive search)."""
    @functools.cache
    def best(i: int, held: frozenset[int]) -> int:
        if i == len(stream):
            return 0
        k = stream[i]
        if k in held:
            return best(i + 1, held)
        if len(held) < capacity:
            return 1 + best(i + 1, held | {k})
        return 1 + min(best(i + 1, held - {victim} | {k}) for victim in held)
    return best(0, frozenset())


@given(st.lists(st.integers(0, 5), max_size=14), st.integers(1, 3))
def test_belady_is_the_optimum_of_an_exhaustive_search(stream, capacity):
    keys = [gkey(i) for i in stream]
    config = AttnPolicyConfig(max_graphs=capacity, backend="aot_eager")
    belady = belady_cache(keys, config, MODEL).stats()
    assert belady.misses == fewest_misses(tuple(stream), capacity)
    # modelled compile seconds: every distinct key compiled at least once
    assert belady.compile_seconds >= sum(MODEL.compile_seconds(gkey(i)) for i in set(stream)) - 1e-9



def test_rows_hold_every_field_and_add_up():
    rows = simulate(requests(), ["dynamic", "varlen"], [2, None], ["lru", "cost", "belady"],
                    former_options=SMALL)
    assert [(r.policy, r.capacity, r.eviction) for r in rows] == [
        (p, c, e) for p in ("dynamic", "varlen") for c in (2, None) for e in ("lru", "cost", "belady")]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r.to_json())
        assert r.total_seconds == pytest.approx(r.run_seconds + r.compile_with_warmup_seconds)
        assert r.hit_rate == pytest.approx(r.hits / (r.hits + r.misses))
        assert r.hits + r.misses == r.calls
        assert r.peak_bytes > 0
    varlen = [r for r in rows if r.policy == "varlen"]
    assert all(r.mask_builds == 0 for r in varlen)
    assert all(r.modes["mask"] == 0 and r.modes["varlen"] > 0 for r in varlen)


def test_unbounded_capacity_misses_each_key_once():
    for policy in (*FIXED, "cost-aware"):
        (row,) = simulate(requests(), [policy], [None], ["lru"], former_options=SMALL)
        assert row.misses == row.distinct_keys
        assert row.evictions == 0


def test_simulated_compiles_equal_the_backend_compiles_of_a_real_run():
    """The simulator's compile count is that of a real run of the same batches,
    counted independently by the compile backend itself (a bounded cache: evictions
    and recompiles included)."""
    model = MODEL.model_copy(update={"heads": 2, "kv_heads": 1, "head_dim": 8, "backend": "eager"})
    reqs = requests(3)
    config = simulation_config(model, BatchFormer(**SMALL), policy="varlen", max_graphs=3)
    (row,) = simulate(reqs, ["varlen"], [3], ["lru"], config, model, SMALL)
    counter = []
    d = Dispatcher(config, compile_counter=counter.append)
    gen = torch.Generator().manual_seed(0)
    for step in BatchFormer(**SMALL).steps(reqs):
        lay = step.layout
        q = torch.randn(lay.q_tokens, 2, 8, generator=gen)
        k, v = (torch.randn(lay.kv_tokens, 1, 8, generator=gen) for _ in range(2))
        d.attend(q, k, v, lay)
    assert row.evictions > 0
    assert row.compiles == len(counter) == d.stats().cache.compiles


def textbook_belady_misses(keys: list, capacity: int) -> int:
    """Belady's rule written out independently: on a miss with a full cache, evict the
    key whose next request is farthest (or never)."""
    held: set = set()
    misses = 0
    for i, key in enumerate(keys):
        if key in held:
            continue
        misses += 1
        if len(held) == capacity:
            rest = keys[i + 1:]
            held.remove(max(held, key=lambda k: rest.index(k) if k in rest else math.inf))
        held.add(key)
    return misses


def test_belady_rows_are_the_optimum_for_the_keys_each_policy_requests():
    """For a fixed policy the requested key sequence does not depend on the cache:
    the belady row's misses are Belady's on that sequence, recorded here from a
    dispatcher with an unbounded cache."""
    reqs = synthetic_default(120)
    rows = simulate(reqs, list(FIXED), [2, 4, 8], ["lru", "belady"])
    by = {(r.policy, r.capacity, r.eviction): r for r in rows}
    former = BatchFormer()
    for policy in FIXED:
        d = Dispatcher(simulation_config(MODEL, former, policy=policy), cost_model=MODEL,
                       builder=lambda call, key, spec: SimulatedGraph(key))
        keys = [graph.key for step in former.steps(reqs) for _, graph in d.prepare(step.layout, MODEL.spec)]
        for capacity in (2, 4, 8):
            optimum = textbook_belady_misses(keys, capacity)
            assert by[policy, capacity, "belady"].misses == optimum
            assert by[policy, capacity, "lru"].misses >= optimum


def test_mask_builds_mirror_the_mask_cache():
    # a prefill-only workload of identical requests repeats one layout: one build
    same = [Request(0.0, 100, 0)] * 3
    (row,) = simulate(same, ["always-mask"], [None], ["lru"],
                      former_options={"max_num_seqs": 1, "max_num_batched_tokens": 128, "prefill_only": True})
    assert row.batches == 3 and row.mask_builds == 1


@settings(max_examples=50)
@given(distinct=st.lists(layouts(max_seqs=3, max_len=20, max_context=8, max_pad=6), min_size=1, max_size=4),
       picks=st.lists(st.integers(0, 3), min_size=1, max_size=10), window=st.one_of(st.none(), st.integers(1, 6)))
@example(distinct=[BatchLayout.from_lens([10]), BatchLayout.from_lens([12], causal=False),
                   BatchLayout.from_lens([20, 10])], picks=[0, 1, 0, 2, 1, 0, 2], window=None)  # 256, 256, 1024 bytes
def test_the_modelled_mask_cache_holds_the_masks_the_dispatcher_holds_batch_by_batch(distinct, picks, window):
    """For each byte bound, a real MASK run and its model (the batch cost's mask mirror,
    fed as a simulation feeds it) hold the same masks after every batch; the simulation
    and the planner's call table count the builds the real run makes."""
    steps = [distinct[i % len(distinct)] for i in picks]
    spec = TensorSpec("float32", 2, 1, 8, features=Features(window))
    gen = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(lay.q_tokens, 2, 8, generator=gen), torch.randn(lay.kv_tokens, 1, 8, generator=gen))
               for lay in steps]
    for bound in (300, 1_500, 5_000, 20_000):  # none, one or a few of the 16 x 16 ... 128 x 128 masks fit
        config = AttnPolicyConfig(policy="always-mask", backend="none", max_seq_len=128, max_batch_tokens=128,
                                  buckets={"kind": "list", "sizes": [16, 32, 64, 128]}, on_overflow="eager",
                                  max_mask_bytes=bound)
        real = Dispatcher(config)
        modelled = Dispatcher(config, builder=lambda call, key, spec: SimulatedGraph(key))
        costs = BatchCost(MODEL, bound)
        builds, seconds, seen = 0, 0.0, set()
        for layout, (q, k) in zip(steps, tensors):
            real.attend(q, k, k, layout, window=window)
            for call, _ in modelled.prepare(layout, spec):
                built = costs.mask_seconds(layout, call, spec.device, window)
                if built is not None:
                    builds += 1
                    seconds += built
                if call.kind is CallKind.MASK:
                    seen.add((layout, call.q_bucket, call.kv_bucket))
            for lay, rows, cols in seen:
                held = mask_entry(lay, rows, cols, q.device, window)[0] in real.masks
                assert held == costs.masks.held(mask_entry(lay, rows, cols, spec.device, window)[0]), bound
        assert real.stats().masks.misses == builds, bound
        (row,) = simulate_layouts(steps, ["always-mask"], [None], ["lru"], config, MODEL, spec)
        table = CallTable(steps, "always-mask", config, MODEL, spec).bucketed(config).recording
        assert (row.mask_builds, table.mask_builds) == (builds, builds), bound
        assert row.mask_build_seconds == table.mask_build_seconds == seconds, bound


def test_simulated_misses_equal_a_real_run():
    """The acceptance check: a real Dispatcher with real tensors misses exactly as simulated."""
    model = MODEL.model_copy(update={"heads": 2, "kv_heads": 1, "head_dim": 8, "backend": "none"})
    reqs = requests(12)
    for policy, capacity in (("dynamic", 2), ("varlen", 3), ("cost-aware", 2), ("always-rows", 2)):
        config = simulation_config(model, BatchFormer(**SMALL), policy=policy, max_graphs=capacity)
        (row,) = simulate(reqs, [policy], [capacity], ["lru"], config, model, SMALL)
        real = Dispatcher(config, cost_model=model)
        gen = torch.Generator().manual_seed(0)
        for step in BatchFormer(**SMALL).steps(reqs):
            lay = step.layout
            q = torch.randn(lay.q_tokens, 2, 8, generator=gen)
            k = torch.randn(lay.kv_tokens, 1, 8, generator=gen)
            real.attend(q, k, k, lay)
        stats = real.stats()
        assert (stats.cache.misses, stats.cache.hits, stats.modes) == (
            row.misses, row.hits, row.modes), policy


def test_rows_are_simulated_with_a_rows_price_and_refused_without_one(capsys):
    """``simulate --policies always-rows,varlen`` runs rows batches priced by the rows fit (a
    rows call: its rows × one row's seconds); a model calibrated before the rows kind names
    what to do."""
    reqs = requests(12)
    rows, varlen = simulate(reqs, ["always-rows", "varlen"], [None], ["lru"], former_options=SMALL)
    assert rows.modes["rows"] == rows.batches > 0 and varlen.modes["rows"] == 0
    assert rows.misses > 0 and rows.run_seconds > 0
    old = MODEL.model_copy(update={"run": {k: f for k, f in MODEL.run.items() if k is not CallKind.ROWS}})
    with pytest.raises(ConfigError, match="no rows fit .*run attnpolicy calibrate"):
        simulate(reqs, ["always-rows"], [None], ["lru"], model=old, former_options=SMALL)
    assert main(["simulate", "--trace", "default", "--limit", "12", "--policies", "always-rows,varlen",
                 "--capacities", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "batches c/m/v/r" in out and "always-rows" in out


def test_config_must_match_the_model():
    config = AttnPolicyConfig(backend="inductor")
    with pytest.raises(ConfigError, match="backend='inductor'"):
        simulate(requests(3), ["varlen"], [2], ["lru"], config, MODEL)


def test_unknown_eviction_is_named():
    with pytest.raises(ConfigError, match="eviction 'nope'"):
        simulate(requests(3), ["varlen"], [2], ["nope"])


def test_simulation_config_fits_packed_batches():
    former = BatchFormer(max_num_seqs=16, max_model_len=8192)
    config = simulation_config(MODEL, former, policy="varlen")
    assert config.max_seq_len == 8192 and config.max_batch_tokens == 16 * 8192
    assert (config.backend, config.attn_impl, config.policy) == ("aot_eager", "sdpa", "varlen")


def test_simulate_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["simulate", "--trace", "default", "--limit", "20", "--policies", "varlen,cost-aware",
                 "--capacities", "2,4", "--evictions", "lru,belady", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "512", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 20 and len(data["rows"]) == 8
    assert data["config"]["max_seq_len"] == 8192 and data["former"]["max_num_seqs"] == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "cost-aware" in capsys.readouterr().out


# -- the fast path: one recording per stateless policy, replayed per bound and eviction ----

EVICTIONS = ("lru", "lfu", "fifo", "cost", "belady")


def test_replayed_streams_equal_the_dispatcher_path(monkeypatch):
    """Every fixed policy × capacities × byte bounds × every eviction: the rows of the
    recorded-stream replay are those of a dispatcher run per configuration (the path a
    policy not declared stateless takes), field for field."""
    fixed = ["always-mask", "always-causal", "dynamic", "varlen"]
    args = (requests(30), fixed, [1, 2, 3, None], list(EVICTIONS))
    kwargs = {"former_options": SMALL, "max_bytes": [None, 6 << 20]}
    fast = simulate(*args, **kwargs)
    monkeypatch.setattr(Guard, "stateless", property(lambda self: False))
    slow = simulate(*args, **kwargs)
    assert fast == slow
    assert len(fast) == 4 * 4 * 2 * 5
    assert {r.eviction for r in fast if r.evictions} == set(EVICTIONS)
    assert any(r.evictions for r in fast if r.capacity is None and r.max_bytes)  # evicted for bytes alone


def test_cost_aware_runs_side_by_side_give_the_rows_of_runs_alone():
    """A cache-aware policy's dispatchers run side by side, sharing one planner and its
    pricing; each row is the one its configuration gives when simulated alone."""
    reqs = requests(30)
    capacities, evictions = [1, 2, None], ["lru", "lfu", "cost", "belady"]
    together = simulate(reqs, ["cost-aware"], capacities, evictions, former_options=SMALL)
    alone = [row for c in capacities for e in evictions
             for row in simulate(reqs, ["cost-aware"], [c], [e], former_options=SMALL)]
    assert together == alone
    assert len({row.total_seconds for row in together}) > 1  # the bounds do change the runs


def test_worker_processes_give_the_same_rows():
    args = (requests(20), ["varlen", "cost-aware"], [2, None], ["lru", "fifo", "belady"])
    assert simulate(*args, former_options=SMALL, workers=2) == simulate(*args, former_options=SMALL)


@given(st.lists(st.integers(0, 7), max_size=40), st.sampled_from(EVICTIONS), st.sampled_from([None, 1, 2, 3]),
       st.sampled_from([None, 3, 5, 8]), st.lists(st.integers(1, 6), min_size=8, max_size=8))
def test_replay_stream_counts_what_a_graph_cache_counts(stream, eviction, max_graphs, max_bytes, sizes):
    costs = [0.5 + i for i in range(8)]
    upcoming: dict[int, float] = {}
    options = {"next_use": upcoming.__getitem__} if eviction == "belady" else None
    cache = GraphCache(max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction, oversize="uncached",
                       eviction_options=options, sizeof=sizes.__getitem__,
                       compile_cost=lambda key, seconds: costs[key])
    for key, nxt in zip(stream, next_uses(stream)):
        upcoming[key] = nxt
        cache.get_or_compile(key, lambda: None)
    want = cache.stats()
    got = replay_stream(stream, sizes, costs, max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction,
                        oversize="uncached")
    assert got == StreamStats(want.hits, want.misses, want.compiles, want.compile_seconds, want.evictions,
                              want.uncached, want.peak_graphs, want.peak_bytes)


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 3)), max_size=30), st.sampled_from(EVICTIONS),
       st.sampled_from([None, 1, 2, 3]), st.sampled_from([None, 3, 5, 8]),
       st.lists(st.integers(1, 6), min_size=8, max_size=8))
def test_the_stream_cache_holds_and_evicts_the_keys_a_graph_cache_does(runs_, eviction, max_graphs, max_bytes, sizes):
    """Request by request, the modelled cache holds the keys the real one holds (in its
    order) and evicts the same victims, whatever the eviction; a replay of the same
    runs counts what the real cache counts."""
    costs = [0.5 + i for i in range(8)]
    stream = [key for key, n in runs_ for _ in range(n)]
    upcoming: dict[int, float] = {}
    options = {"next_use": upcoming.__getitem__} if eviction == "belady" else None
    evicted: list[int] = []
    real = GraphCache(max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction, oversize="uncached",
                      eviction_options=options, sizeof=sizes.__getitem__, on_evict=lambda key, _: evicted.append(key),
                      compile_cost=lambda key, seconds: costs[key])
    model = StreamCache(max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction, oversize="uncached",
                        eviction_options=options)
    for key, nxt in zip(stream, next_uses(stream)):
        upcoming[key] = nxt
        real.get_or_compile(key, lambda: None)
        before = set(model.keys())
        try:
            model.touch(key)
        except KeyError:
            model.miss(key, sizes[key], costs[key])
        assert model.keys() == real.keys()
        assert sorted(before - set(model.keys())) == sorted(evicted)
        evicted.clear()
    want = real.stats()
    ids, counts = [key for key, _ in runs_], [n for _, n in runs_]
    got = replay_stream(ids, sizes, costs, max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction,
                        oversize="uncached", counts=counts)
    assert got == StreamStats(want.hits, want.misses, want.compiles, want.compile_seconds, want.evictions,
                              want.uncached, want.peak_graphs, want.peak_bytes)


def test_replay_stream_refuses_an_oversize_graph_like_the_cache():
    with pytest.raises(GraphTooLargeError, match="key 0 needs 9 bytes, more than max_bytes=8"):
        replay_stream([0], [9], [1.0], max_bytes=8)


# -- bounds ------------------------------------------------------------------------------

def test_every_row_is_at_or_above_its_lower_bound():
    rows = simulate(requests(), [*FIXED, "cost-aware"], [2, 4, None], ["lru", "fifo", "belady"],
                    former_options=SMALL)
    for r in rows:
        compulsory = r.bound_seconds - r.run_seconds
        assert r.total_seconds >= r.bound_seconds - 1e-9
        assert r.bound_gap == pytest.approx(r.total_seconds / r.bound_seconds - 1)
        assert compulsory <= r.compile_with_warmup_seconds + 1e-9
        if r.capacity is None:  # each graph compiled once: the bound is reached
            assert r.bound_gap == pytest.approx(0.0, abs=1e-12)
    for r in rows:  # a fixed policy's bound is one figure whatever the cache
        if r.policy in FIXED:
            assert r.bound_seconds == next(x.bound_seconds for x in rows if x.policy == r.policy)
    bounds = {b.policy: b for b in lower_bounds(rows)}
    for policy, b in bounds.items():
        mine = [r for r in rows if r.policy == policy]
        assert b.bound_seconds == min(r.bound_seconds for r in mine)
        assert b.best_belady == min(r.total_seconds for r in mine if r.eviction == "belady")
        assert b.best_online == min(r.total_seconds for r in mine if r.eviction != "belady")


# -- bucket schemes ------------------------------------------------------------------------

def test_vllm_sizes_follow_vllms_default_capture_pattern():
    sizes = vllm_sizes(8192)
    assert sizes[:5] == (1, 2, 4, 8, 16) and 248 in sizes and 252 not in sizes
    assert sizes[sizes.index(256):sizes.index(256) + 3] == (256, 272, 288)
    assert sizes[-1] == 8192 and vllm_sizes(1000)[-1] == 1000
    assert complete((16, 48), 100, 1000) == (16, 48, 100, 200, 400, 800, 1000)


def test_schemes_are_simulated_side_by_side(tmp_path):
    AttnPolicyConfig(max_seq_len=1024, max_batch_tokens=4096,
                     buckets={"kind": "list", "sizes": [64, 300, 1024]}).save(tmp_path)
    schemes = [bucket_scheme(s, 1024, 4096) for s in ("pow2", "vllm", "exact", str(tmp_path))]
    assert schemes[3].buckets.sizes == (64, 300, 1024, 2048, 4096)  # completed up to max_batch_tokens
    rows = simulate(requests(), ["varlen"], [4, None], ["lru"], former_options=SMALL, buckets=schemes)
    assert [(r.buckets, r.capacity) for r in rows] == [(s.name, c) for s in schemes for c in (4, None)]
    keys = {r.buckets: r.distinct_keys for r in rows if r.capacity is None}
    assert keys["exact"] > keys["vllm"] > keys["pow2"]  # finer buckets, more graphs
    with pytest.raises(ConfigError, match="nope"):
        bucket_scheme("nope", 1024, 4096)


def test_simulate_cli_compares_schemes_at_equal_bytes(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["simulate", "--limit", "10", "--policies", "varlen", "--capacities", "inf",
                 "--max-bytes", "64MiB,inf", "--buckets", "pow2,vllm", "--evictions", "lru,belady",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["buckets"], r["max_bytes"], r["eviction"]) for r in rows] == [
        (s, b, e) for s in ("pow2", "vllm") for b in (64 << 20, None) for e in ("lru", "belady")]
    printed = capsys.readouterr().out
    assert "total seconds per bucket scheme" in printed and "lower bounds" in printed
    for flag, value, message in (("--buckets", "nope", "argument --buckets: unknown bucket scheme 'nope'"),
                                 ("--max-bytes", "12XB", "argument --max-bytes: expected comma-separated sizes")):
        assert main(["simulate", "--limit", "2", flag, value]) == 2
        assert message in capsys.readouterr().err
