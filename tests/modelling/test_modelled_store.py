"""The graph store in the cost model, the simulation, the cost eviction and the plan."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.bench.calibration import calibrate
from attnpolicy.bench.settings import CalibrationSettings
from attnpolicy.cache.disk_mirror import DiskMirror
from attnpolicy.cache.evictions import GDSFCache
from attnpolicy.cache.key_stream import replay_stream
from attnpolicy.cli import main
from attnpolicy.config import WarmShape
from attnpolicy.core.modes import CallKind
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.modelling.simulation import simulate, simulation_config
from attnpolicy.planning.graph_set import AttentionPlanLevel, WarmShapeCost, plan_graphs, warm_set
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import Request

COMPILE, LOAD = 1.0, 0.25
#: every kind compiles in 1 s and loads in 0.25 s; 1000 bytes on disk per graph
MODEL = CostModel(run={f: Fit(base=1e-4, per_cell=1e-9) for f in CallKind},
                  compile={f: Fit(base=COMPILE) for f in CallKind}, mask_build=Fit(per_cell=1e-10),
                  store_load={f: Fit(base=LOAD) for f in CallKind},
                  store_bytes={f: Fit(base=1000.0) for f in CallKind})
FORMER = {"max_num_seqs": 2, "max_num_batched_tokens": 128}


def requests(n: int) -> list[Request]:
    return [Request(0.01 * i, 7 + (37 * i) % 120, 1 + i % 3) for i in range(n)]


def base(**fields: object):
    return simulation_config(MODEL, BatchFormer(**FORMER), **fields)


def rows(store: dict[str, object] | None, evictions=("lru", "fifo", "cost", "belady"), warm: bool = False,
         policies=("varlen", "dynamic")):
    config = base(**(store or {}))
    return simulate(requests(40), list(policies), [1, 2], list(evictions), config, MODEL, FORMER,
                    store_warm=warm)


# --- the cost model -----------------------------------------------------------------------

def test_a_model_saved_before_the_store_fields_still_loads():
    text = resources.files("attnpolicy").joinpath("data", "default_costmodel.json").read_text()
    data = json.loads(text)
    assert data["store_load"] and data["store_bytes"]  # the built-in model knows the store
    for field in ("store_load", "store_bytes"):
        del data[field]
    data["samples"] = [x for x in data["samples"] if x["what"] not in ("store_load", "store_bytes")]
    old = CostModel.from_json(json.dumps(data), "old.json")
    assert not old.knows_store and old.store_load == {} and old.store_bytes == {}
    assert old.run == CostModel.default().run
    with pytest.raises(ConfigError, match="old.json has no store_load"):
        old.require_store("old.json")


def test_store_fits_come_together_and_cover_every_kind():
    fields = MODEL.model_dump()
    with pytest.raises(ConfigError, match="store_load and store_bytes"):
        CostModel.from_json(json.dumps({**fields, "store_bytes": {}}), "half.json")
    with pytest.raises(ConfigError, match="store_load needs a fit for every call kind"):
        CostModel.from_json(json.dumps({**fields, "store_load": {"causal": {"base": 1.0}}}), "some.json")


def test_calibrate_saves_and_loads_through_a_store(tmp_path):
    model = calibrate(CalibrationSettings(heads=2, kv_heads=2, head_dim=8, backend="eager", sizes=(16, 32),
                                          repeats=1))
    assert model.knows_store
    for what in ("store_load", "store_bytes"):
        for kind in CallKind:
            mine = [(x.rows, x.cols, x.seconds) for x in model.samples if x.what == what and x.kind is kind]
            assert mine and all(s > 0 for *_, s in mine)
            assert getattr(model, what)[kind] == Fit.to_samples(mine)
    sizes = [x.seconds for x in model.samples if x.what == "store_bytes"]
    assert all(s > 1000 for s in sizes)  # a real artifact and its manifest
    assert CostModel.load(model.save(tmp_path / "m.json")) == model


# --- the modelled disk ----------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=60), st.sampled_from(["lru", "fifo", "cost", "lfu"]),
       st.integers(1, 3), st.integers(1, 40), st.lists(st.integers(1, 12), min_size=10, max_size=10))
def test_the_disk_stays_in_its_bound_and_serves_only_what_it_saved(stream, eviction, graphs, disk_bytes, sizes):
    costs = [1.0 + i for i in range(10)]
    loads = [0.1 * (i + 1) for i in range(10)]
    saved: set[int] = set()

    class Checked(DiskMirror):
        def save(self, key):  # type: ignore[no-untyped-def]
            stored = super().save(key)
            assert self.nbytes <= disk_bytes
            assert stored == (sizes[key] <= disk_bytes)
            if stored:
                saved.add(key)
            return stored

        def load(self, key):  # type: ignore[no-untyped-def]
            seconds = super().load(key)
            assert seconds is None or key in saved  # never a graph it was not given
            return seconds

    disk = Checked(disk_bytes, sizes.__getitem__, loads.__getitem__)
    options = {"reload": disk.reload_seconds} if eviction == "cost" else None
    stats = replay_stream(stream, [1] * 10, costs, max_graphs=graphs, eviction=eviction, disk=disk,
                          eviction_options=options)
    plain = replay_stream(stream, [1] * 10, costs, max_graphs=graphs, eviction=eviction)
    assert stats.compiles + stats.loads == stats.misses
    assert disk.peak_bytes <= disk_bytes and stats.disk_peak_bytes == disk.peak_bytes
    if eviction != "cost":  # the memory tier is the same with or without a disk below it
        assert (stats.hits, stats.misses, stats.evictions) == (plain.hits, plain.misses, plain.evictions)
        assert stats.compile_seconds <= plain.compile_seconds


def test_reloads_replace_recompiles_exactly():
    """Capacity 1 over keys 0, 1, 0, 1, 0: five misses; with a disk big enough, two
    compiles and three loads, the total lower by three times compile − load."""
    costs, loads = [4.0, 6.0], [0.5, 1.5]
    disk = DiskMirror(10, lambda k: 1, loads.__getitem__)
    stats = replay_stream([0, 1, 0, 1, 0], [1, 1], costs, max_graphs=1, disk=disk)
    assert (stats.misses, stats.compiles, stats.loads) == (5, 2, 3)
    assert stats.compile_seconds == 10.0 and stats.load_seconds == 0.5 + 1.5 + 0.5
    tight = replay_stream([0, 1, 0, 1, 0], [1, 1], costs, max_graphs=1,
                          disk=DiskMirror(1, lambda k: 1, loads.__getitem__))
    assert (tight.compiles, tight.loads, tight.disk_evictions) == (5, 0, 4)  # each save evicts the other


# --- simulate --------------------------------------------------------------------------------

def test_rows_without_a_store_are_unchanged_and_have_no_store_field():
    no_fits = MODEL.model_copy(update={"store_load": {}, "store_bytes": {}})
    config = base()
    plain = simulate(requests(40), ["varlen", "cost-aware"], [1, 2], ["lru", "cost", "belady"], config, no_fits,
                     FORMER)
    assert plain == rows(None, ("lru", "cost", "belady"), policies=("varlen", "cost-aware"))
    assert all(r.store is None and "store" not in r.to_json() for r in plain)


def test_a_store_serves_reloads_and_lowers_totals_by_compile_minus_load():
    without, with_store = rows(None), rows({"store_dir": "modelled", "max_disk_bytes": 1 << 20})
    assert any(r.store.loads for r in with_store)
    for a, b in zip(without, with_store):
        assert b.store is not None and b.store.disk_evictions == 0
        if b.eviction != "cost":
            assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions)
            assert b.compiles == b.distinct_keys and b.compiles + b.store.loads == b.misses  # only first uses
            assert a.total_seconds - b.total_seconds == pytest.approx(b.store.loads * (COMPILE - LOAD), rel=1e-9)
        assert b.total_seconds >= b.bound_seconds - 1e-9
        assert b.to_json()["store"]["loads"] == b.store.loads


def test_the_disk_bound_is_respected_and_evicts():
    tight = rows({"store_dir": "modelled", "max_disk_bytes": 2500})  # two graphs of 1000 bytes
    assert any(r.store.disk_evictions for r in tight)
    assert all(r.store.disk_peak_bytes <= 2500 for r in tight)
    roomy = rows({"store_dir": "modelled", "max_disk_bytes": 1 << 20})
    assert sum(r.store.loads for r in tight) < sum(r.store.loads for r in roomy)


def test_a_warm_store_loads_what_a_previous_run_saved():
    warm = rows({"store_dir": "modelled", "max_disk_bytes": 1 << 20}, warm=True)
    for r in warm:
        assert r.store.warm and r.compiles == 0 and r.store.loads == r.misses
        assert r.compile_seconds == 0.0  # nothing compiles: no backend start-up either
        assert r.bound_seconds == pytest.approx(r.run_seconds + r.distinct_keys * LOAD)
        assert r.total_seconds >= r.bound_seconds - 1e-9


def test_a_cache_aware_policy_models_the_store_in_its_dispatcher_runs():
    for r in rows({"store_dir": "modelled", "max_disk_bytes": 1 << 20}, ("lru", "cost", "belady"),
                  policies=("cost-aware",)):
        assert r.store is not None and r.compiles + r.store.loads == r.misses
        assert r.compiles <= r.distinct_keys


def test_a_store_needs_a_model_that_knows_it():
    old = MODEL.model_copy(update={"store_load": {}, "store_bytes": {}})
    with pytest.raises(ConfigError, match="no store_load"):
        simulate(requests(5), ["varlen"], [1], ["lru"], base(store_dir="x"), old, FORMER)
    with pytest.raises(ConfigError, match="a warm store needs a store"):
        simulate(requests(5), ["varlen"], [1], ["lru"], base(), MODEL, FORMER, store_warm=True)


def test_simulate_cli_reports_the_store(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:15:{i:02d}.0,{10 + 29 * i % 90},2\n" for i in range(30)))
    out = tmp_path / "rows.json"
    assert main(["simulate", "--trace", str(trace), "--policies", "varlen", "--capacities", "1",
                 "--evictions", "lru", "--store-bytes", "1MiB", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["store"]["max_disk_bytes"] == 1 << 20 and row["store"]["loads"] > 0
    assert "graph store" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(trace), "--store-warm"]) == 2
    assert "--store-warm: needs a store" in capsys.readouterr().err


# --- the cost eviction -------------------------------------------------------------------------

def test_cost_eviction_keeps_the_key_that_is_dear_to_recompile_when_the_other_is_on_disk():
    on_disk = {"a": 0.1}
    for reload, victim in ((None, "b"), (on_disk.get, "a")):
        cache = GDSFCache(reload=reload)
        cache.note("a", cost=10.0, size=1)
        cache["a"] = 1
        cache.note("b", cost=5.0, size=1)
        cache["b"] = 2
        assert cache.popitem()[0] == victim  # with a disk, a is 0.1 s away, b 5 s


def test_cost_eviction_asks_the_disk_when_it_chooses():
    held: dict[str, float] = {"a": 0.1}
    cache = GDSFCache(reload=held.get)
    for k, cost in (("a", 10.0), ("b", 5.0)):
        cache.note(k, cost=cost, size=1)
        cache[k] = k
    del held["a"]  # the disk evicted a since: it costs its compile again
    assert cache.popitem()[0] == "b"


# --- plan ----------------------------------------------------------------------------------------

def test_a_warm_store_fits_more_graphs_into_the_warm_up_budget():
    shape = WarmShape(kind=CallKind.VARLEN, q_bucket=16, kv_bucket=64, causal=True, context=True)
    cold = [WarmShapeCost(shape, 10 - i, 1.0, 100) for i in range(6)]
    warm = [WarmShapeCost(shape, 10 - i, 1.0, 100, 0.1) for i in range(6)]
    assert len(warm_set(cold, None, None, 2.0)) == 2
    assert len(warm_set(warm, None, None, 2.0)) == 6


def test_plan_with_a_warm_store_loads_its_warm_set(tmp_path):
    former = BatchFormer(**FORMER)
    steps = list(former.steps(requests(40)))
    kwargs = {"policies": ["varlen"], "evictions": ["lru"], "warmup_seconds": 1.5}
    cold = plan_graphs(steps, base(max_graphs=4), AttentionPlanLevel(MODEL), **kwargs)
    warm = plan_graphs(steps, base(max_graphs=4, store_dir="s", max_disk_bytes=1 << 20), AttentionPlanLevel(MODEL),
                       **kwargs, store_warm=True)
    assert len(cold.warm) == 1 and all(w.load_seconds is None for w in cold.warm)  # 1.5 s: one compile
    assert len(warm.warm) == min(4, warm.chosen.row.distinct_keys) > 1  # loads: as many as the capacity holds
    assert all(w.load_seconds == LOAD for w in warm.warm)
    assert warm.warm_load_seconds == len(warm.warm) * LOAD and warm.warm_compile_seconds == 0.0
    assert all(w["from_disk"] for w in warm.to_json()["warm"])
    assert all("from_disk" not in w and "load_seconds" not in w for w in cold.to_json()["warm"])


# --- stalls ----------------------------------------------------------------------------------------

def test_stalls_with_a_store_wait_for_loads_instead_of_compiles():
    from attnpolicy.modelling.stalls import AttentionLevel, stall_row

    steps = list(BatchFormer(**FORMER).steps(requests(40)))
    for mode in ("sync", "background"):
        plain = stall_row(steps, base(max_graphs=1, compile_mode=mode), AttentionLevel(MODEL), warm="prefix:3")
        stored = stall_row(steps, base(max_graphs=1, compile_mode=mode, store_dir="s", max_disk_bytes=1 << 20),
                              AttentionLevel(MODEL), warm="prefix:3")
        assert plain.store is None and "store" not in plain.to_json()
        assert stored.store is not None and stored.store.loads > 0
        assert stored.compiles + stored.store.loads == plain.compiles  # the same misses, fewer compiles
        assert stored.compiles <= stored.distinct_keys  # each compiled once at most: the disk keeps them
        if mode == "sync":  # each load stalls for its load seconds instead of a compile's
            saved = stored.store.loads * (COMPILE - LOAD)
            assert plain.stall_seconds - stored.stall_seconds == pytest.approx(saved, rel=1e-9)
    warm = stall_row(steps, base(max_graphs=1, store_dir="s", max_disk_bytes=1 << 20), AttentionLevel(MODEL), store_warm=True)
    assert warm.compiles == 0 and warm.store.warm


# --- the cost eviction of a real dispatcher over a store ------------------------------------------

@pytest.mark.parametrize("dropped", [None, 0])
def test_a_dispatcher_with_a_store_evicts_the_graph_that_reloads_cheapest(tmp_path, dropped):
    """Graphs a (16×16) then b (32×32), both stored, in a cache of two graphs; with a's
    artifact gone, b is the cheap one to bring back (0.01 s against a's compile) and goes
    first; with both on disk they cost the same, and under a graph-count bound the larger
    takes one slot like the smaller: the first cached, a, goes."""
    import torch

    from attnpolicy import BatchLayout, Dispatcher
    from attnpolicy.graphs.keys import TensorSpec

    model = MODEL.model_copy(update={"store_load": {f: Fit(base=0.01) for f in CallKind}})
    config = base(backend="aot_eager", attn_impl="sdpa", max_graphs=2, eviction="cost", max_seq_len=64,
                  store_dir=str(tmp_path))
    spec_layouts = [BatchLayout.from_lens([n]) for n in (12, 30, 50)]
    with Dispatcher(config, cost_model=model) as d:
        keys = []
        for i, layout in enumerate(spec_layouts):
            q = torch.randn(layout.q_tokens, 2, 16)
            (key,) = d.graph_keys_for(layout, TensorSpec("float32", 2, 2, 16))
            keys.append(key)
            if i == 2 and dropped is not None:
                for path in (tmp_path / "objects").glob(f"{d.source.identity(keys[dropped]).digest()}.*"):
                    path.unlink()
            d.attend(q, q.clone(), q.clone(), layout)
        a, b, _ = keys
        assert (a in d.cache, b in d.cache) == ((False, True) if dropped is None else (True, False))


def test_plan_cli_with_a_warm_store_says_which_graphs_come_from_disk(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"2023-11-16 18:15:{i:02d}.0,{10 + 29 * i % 90},2\n" for i in range(30)))
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(trace), "--policies", "varlen", "--max-graphs", "4", "--out", str(out),
                 "--store-bytes", "1MiB", "--store-warm"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["config"]["store_dir"] == "attnpolicy_store" and plan["config"]["max_disk_bytes"] == 1 << 20
    assert plan["warm"] and all(w["from_disk"] and w["load_seconds"] > 0 for w in plan["warm"])
    assert "from disk (load s)" in (out / "plan.md").read_text()
    row = plan["policies"][0]["row"]
    assert row["store"]["max_disk_bytes"] == 1 << 20
