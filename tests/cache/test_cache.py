"""GraphCache: bounds, eviction strategies, single flight, failures, callbacks, stats."""

from __future__ import annotations

import itertools
import math
import threading
import time

import cachetools
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnpolicy.cache.graph_cache as cache_module
from attnpolicy.cache.evictions import GDSFCache
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.errors import (
    ConfigError,
    GraphCompileError,
    GraphTooLargeError,
    PluginError,
)
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager


def build_of(key):
    return lambda: ("graph", key)


def run(cache, keys):
    """Request each key in turn."""
    for key in keys:
        cache.get_or_compile(key, build_of(key))


class FakeClock:
    """Replaces perf_counter in attnpolicy.cache.graph_cache so build durations are exact."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def build(self, key, seconds):
        def build():
            self.now += seconds
            return ("graph", key)
        return build


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(cache_module, "perf_counter", fake)
    return fake


def evicting_cache(**kwargs):
    victims = []
    cache = GraphCache(on_evict=lambda key, nbytes: victims.append(key), **kwargs)
    return cache, victims


# -- acceptance: LRU -------------------------------------------------------------------

def test_lru_acceptance_sequence():
    cache, victims = evicting_cache(max_graphs=2, eviction="lru")
    for key in "ABACAB":
        assert cache.get_or_compile(key, build_of(key)) == ("graph", key)
        assert cache.stats().graphs <= 2
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions, s.compiles) == (2, 4, 2, 4)
    assert victims == ["B", "C"]
    assert sorted(cache.keys()) == ["A", "B"]
    assert s.peak_graphs == 2
    a = s.per_key["A"]
    assert (a.hits, a.misses, a.compiles, a.evictions, a.bytes) == (2, 1, 1, 0, 0)
    assert s.per_key["B"].misses == 2 and s.per_key["B"].evictions == 1


# -- strategies that pick a different victim than LRU -----------------------------------

def test_lfu_keeps_the_frequent_key_lru_would_evict():
    lru, lru_victims = evicting_cache(max_graphs=2, eviction="lru")
    lfu, lfu_victims = evicting_cache(max_graphs=2, eviction="lfu")
    for cache in (lru, lfu):
        run(cache, "AABC")
    assert lru_victims == ["A"]
    assert lfu_victims == ["B"]
    assert sorted(lfu.keys()) == ["A", "C"]


def test_cost_keeps_the_expensive_graph_lru_would_evict(clock):
    caches = {name: evicting_cache(max_graphs=2, eviction=name) for name in ("lru", "cost")}
    for cache, _ in caches.values():
        cache.get_or_compile("A", clock.build("A", 5.0))
        cache.get_or_compile("B", clock.build("B", 0.5))
        cache.get_or_compile("C", clock.build("C", 0.5))
    assert caches["lru"][1] == ["A"]
    assert caches["cost"][1] == ["B"]
    assert caches["cost"][0].stats().per_key["A"].compile_seconds == 5.0


def test_cost_evicts_the_larger_of_equally_expensive_graphs_under_a_byte_bound(clock):
    sizes = {"A": 100, "B": 10, "C": 10}
    cache, victims = evicting_cache(max_bytes=115, eviction="cost", sizeof=sizes.__getitem__)
    for key in "BAC":
        cache.get_or_compile(key, clock.build(key, 1.0))
    assert victims == ["A"]  # LRU would evict B, and C would then fit


def test_cost_under_a_count_bound_ranks_a_large_graph_as_one_slot(clock):
    """Under max_graphs alone a graph's bytes free no room: the often-used large graph
    stays, the once-used small one goes (ranking by bytes evicted A, used three times)."""
    sizes = {"A": 1000, "B": 10, "C": 10}
    cache, victims = evicting_cache(max_graphs=2, eviction="cost", sizeof=sizes.__getitem__)
    for key in "AAAB":
        cache.get_or_compile(key, clock.build(key, 1.0))
    cache.get_or_compile("C", clock.build("C", 1.0))
    assert victims == ["B"]
    assert sorted(cache.keys()) == ["A", "C"]


def test_gdsf_priority_formula_and_aging():
    s = GDSFCache()
    s.note("a", cost=4.0, size=2)
    s["a"] = 1
    s.note("b", cost=1.0, size=1)
    s["b"] = 2
    assert s.priority("a") == 2.0 and s.priority("b") == 1.0
    assert s.popitem() == ("b", 2)  # L becomes 1.0
    s.note("c", cost=3.0, size=3)
    s["c"] = 3
    assert s.priority("c") == 1.0 + 1 * 3.0 / 3
    s["c"]  # a use: freq 2
    assert s.priority("c") == 1.0 + 2 * 3.0 / 3
    assert s.popitem() == ("a", 1)


def test_gdsf_ties_go_to_the_first_inserted():
    s = GDSFCache()
    for key in "xyz":
        s[key] = key
    assert [s.popitem()[0] for _ in range(3)] == ["x", "y", "z"]


class Oracle:
    """next_use for a known request sequence; ``pos`` is the request being served."""

    def __init__(self, requests):
        self.requests = list(requests)
        self.pos = -1

    def __call__(self, key):
        for i in range(self.pos + 1, len(self.requests)):
            if self.requests[i] == key:
                return i
        return math.inf

    def replay(self, cache):
        for self.pos, key in enumerate(self.requests):
            cache.get_or_compile(key, build_of(key))


def test_belady_evicts_the_key_used_farthest_ahead():
    requests = "ABACB"
    oracle = Oracle(requests)
    belady, belady_victims = evicting_cache(max_graphs=2, eviction="belady",
                                            eviction_options={"next_use": oracle})
    oracle.replay(belady)
    lru, lru_victims = evicting_cache(max_graphs=2, eviction="lru")
    run(lru, requests)
    assert belady_victims == ["A"]  # never used again
    assert lru_victims == ["B", "A"]
    assert belady.stats().hits == 2 and lru.stats().hits == 1


def test_belady_ties_go_to_the_first_inserted():
    oracle = Oracle("ABCD")
    cache, victims = evicting_cache(max_graphs=2, eviction="belady", eviction_options={"next_use": oracle})
    oracle.replay(cache)
    assert victims == ["A", "B"]


# -- invariants under random sequences ---------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.integers(0, 7), max_size=40),
    sizes=st.lists(st.integers(0, 60), min_size=8, max_size=8),
    max_graphs=st.one_of(st.none(), st.integers(1, 4)),
    max_bytes=st.integers(60, 150),
    eviction=st.sampled_from(["lru", "lfu", "fifo", "cost", "belady"]),
)
def test_bounds_and_accounting_hold_for_random_sequences(requests, sizes, max_graphs, max_bytes, eviction):
    oracle = Oracle(requests)
    options = {"next_use": oracle} if eviction == "belady" else None
    cache = GraphCache(max_graphs=max_graphs, max_bytes=max_bytes, eviction=eviction,
                       sizeof=lambda key: sizes[key], eviction_options=options)
    serial = itertools.count()
    built = {}

    def build_for(key):
        def build():
            built[key] = (key, next(serial))
            return built[key]
        return build

    for oracle.pos, key in enumerate(requests):
        previous = built.get(key) if key in cache else None
        value = cache.get_or_compile(key, build_for(key))
        assert value is built[key]
        assert previous is None or value is previous
        s = cache.stats()
        assert s.hits + s.misses == oracle.pos + 1
        assert s.graphs == len(cache) <= (max_graphs or math.inf)
        assert s.bytes == sum(sizes[k] for k in cache.keys()) <= max_bytes
        assert s.compiles == s.misses == s.evictions + s.graphs


@settings(max_examples=60, deadline=None)
@given(
    before=st.lists(st.integers(0, 7), max_size=12),
    batches=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=10), min_size=1, max_size=4),
    max_graphs=st.integers(1, 5),
    eviction=st.sampled_from(["lru", "lfu", "fifo", "cost", "belady"]),
)
@example(before=[0, 1], batches=[[0, 1, 0]], max_graphs=2, eviction="lru")  # the last touch ranks
@example(before=[0, 1], batches=[[0, 0, 1]], max_graphs=2, eviction="lfu")  # every touch counts
def test_hit_many_is_get_or_compile_key_by_key(before, batches, max_graphs, eviction):
    """A batch fetched with hit_many (misses through get_or_compile) leaves the cache
    exactly as fetching every key with get_or_compile: counters, per-key figures,
    pins, and which keys later requests evict."""
    after = list(range(8, 16))  # new keys: each evicts one, in the order the state ranks them
    caches = []
    for bulk in (False, True):
        oracle = Oracle([*before, *(k for b in batches for k in b), *after])
        options = {"next_use": oracle} if eviction == "belady" else None
        cache = GraphCache(max_graphs=max_graphs, eviction=eviction, eviction_options=options,
                           compile_cost=lambda key, seconds: 1.0 + key)
        evicted = []
        for oracle.pos, key in enumerate(before):
            cache.get_or_compile(key, lambda key=key: key)
        for batch in batches:
            if bulk:
                i = 0
                while (j := cache.hit_many(batch, i, pin=True)) < len(batch):
                    cache.get_or_compile(batch[j], lambda key=batch[j]: key, pin=True)
                    i = j + 1
            else:
                for key in batch:
                    cache.get_or_compile(key, lambda key=key: key, pin=True)
            oracle.pos += len(batch)
            cache.unpin(batch)
        for key in after:
            oracle.pos += 1
            cache.get_or_compile(key, lambda key=key: key)
            evicted.append(sorted(cache.keys()))
        caches.append((cache.stats(), evicted))
    assert caches[0] == caches[1]


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=40),
    max_graphs=st.integers(1, 4),
    eviction=st.sampled_from(["lru", "lfu", "fifo", "cost"]),
)
def test_a_deferred_entry_counts_and_evicts_as_its_graph_and_builds_only_to_run(requests, max_graphs, eviction):
    """``reserve`` (a request whose graph the caller does not run) leaves hits, misses,
    evictions and contents exactly as ``get_or_compile`` would; a graph is built only
    when ``get_or_compile`` asks for a key holding none, and nothing unbuilt is released."""
    caches, built, released = [], [], []
    for defer in (False, True):
        cache = GraphCache(max_graphs=max_graphs, eviction=eviction, compile_cost=lambda key, seconds: 1.0 + key,
                           release=lambda key, value: released.append(value))
        states, builds = [], []
        for key, runs in requests:
            holds = cache.has_graph(key)
            if defer and not runs:
                cache.reserve(key)
                assert key in cache and cache.has_graph(key) == holds
            else:
                before = len(builds)
                value = cache.get_or_compile(key, lambda key=key, out=builds: out.append(key) or ("graph", key))
                assert value == ("graph", key) and cache.has_graph(key)
                assert len(builds) == before + (not holds)  # built exactly when it held no graph
            s = cache.stats()
            states.append((s.hits, s.misses, s.evictions, sorted(cache.keys())))
        caches.append(states)
        built.append(builds)
        s = cache.stats()
        assert s.compiles == len(builds)
        assert s.misses + s.deferred_built == s.compiles + s.deferred
    assert caches[0] == caches[1]
    assert set(built[1]) == {key for key, runs in requests if runs}
    assert all(value is not None for value in released)


def test_a_deferred_entry_is_built_in_place_by_its_first_get():
    loads, on_compile = [], []
    cache = GraphCache(on_compile=lambda key, seconds, nbytes: on_compile.append(key))
    cache.reserve("a")
    cache.reserve("a")  # a hit: cached, deferred
    cache.reserve("b")
    s = cache.stats()
    assert (s.misses, s.hits, s.deferred, s.compiles, s.graphs) == (2, 1, 2, 0, 2)
    values = []
    assert cache.hit_many(["a", "b"], values=values) == 0 and values == []  # a graph is wanted: not cached
    assert cache.hit_many(["a", "b"]) == 2  # only requested: both hits
    assert cache.get_or_compile("a", build_of("a")) == ("graph", "a")
    assert cache.get_or_compile("b", build_of("b"), load=lambda: loads.append("b") or "loaded") == "loaded"
    assert cache.get_or_compile("a", lambda: pytest.fail("built twice")) == ("graph", "a")
    s = cache.stats()
    assert (s.misses, s.compiles, s.loads, s.deferred_built, on_compile) == (2, 1, 1, 2, ["a"])
    assert s.per_key["a"].compiles == 1 and s.per_key["b"].loads == 1 and s.hits == 6


def test_a_failed_build_of_a_deferred_entry_leaves_it_deferred():
    cache = GraphCache()
    cache.reserve("k")

    def failing():
        raise RuntimeError("no")

    with pytest.raises(GraphCompileError, match="building the graph for key k failed: RuntimeError: no"):
        cache.get_or_compile("k", failing)
    assert "k" in cache and not cache.has_graph(key="k")
    assert cache.get_or_compile("k", build_of("k")) == ("graph", "k")
    s = cache.stats()
    assert (s.compile_failures, s.compiles, s.deferred_built, s.misses) == (1, 1, 2, 1)


def test_a_deferred_entry_is_built_once_for_several_threads():
    cache = GraphCache()
    cache.reserve("k")
    builds = []

    def build():
        builds.append(1)
        wait_for_waiters(cache, 3)
        return object()

    results = in_threads(4, lambda: cache.get_or_compile("k", build, pin=True))
    s = cache.stats()
    assert len(builds) == 1 and all(r is results[0] for r in results)
    assert (s.compiles, s.waits, s.hits) == (1, 3, 4)
    cache.unpin(["k"] * 4)  # each thread's pin, none of the build's own left


def test_a_deferred_entry_evicted_while_it_builds_is_released_when_built():
    released = []
    cache = GraphCache(max_graphs=1, release=lambda key, value: released.append(value))
    cache.reserve("k")

    def build():
        cache.get_or_compile("other", build_of("other"))  # evicts "k" while it builds
        return "graph"

    assert cache.get_or_compile("k", build) == "graph"
    assert released == ["graph"] and cache.keys() == ["other"]
    assert cache.stats().held_graphs == 0


# -- oversize --------------------------------------------------------------------------

def test_oversize_raise_refuses_without_building():
    builds = []
    cache = GraphCache(max_bytes=10, sizeof=lambda key: 20)
    with pytest.raises(GraphTooLargeError) as err:
        cache.get_or_compile("big", lambda: builds.append(1))
    assert all(part in str(err.value) for part in ("big", "20", "max_bytes=10"))
    assert builds == [] and "big" not in cache
    assert cache.stats().compiles == 0 and cache.stats().misses == 1


def test_oversize_uncached_builds_every_time_and_counts():
    builds = []
    cache = GraphCache(max_bytes=10, sizeof=lambda key: 20 if key == "big" else 5, oversize="uncached")
    cache.get_or_compile("small", build_of("small"))
    for _ in range(2):
        assert cache.get_or_compile("big", lambda: builds.append(1) or "value") == "value"
    s = cache.stats()
    assert builds == [1, 1] and s.uncached == 2 and s.compiles == 3
    assert cache.keys() == ["small"] and s.bytes == 5 and s.evictions == 0


# -- measured bytes ----------------------------------------------------------------------

def test_measured_bytes_replace_the_estimate_in_the_bounds_and_stats():
    """A graph's measured bytes (its compiler's figure) bound the cache once it is built;
    a graph that reports none keeps ``sizeof``'s estimate."""
    measured = {"a": 6, "b": 6, "c": None}
    cache = GraphCache(max_bytes=10, sizeof=lambda key: 1, measure=lambda key, graph: measured[key])
    run(cache, ["a", "c", "b"])  # b's 6 measured bytes evict a's 6
    s = cache.stats()
    assert cache.keys() == ["c", "b"] and s.bytes == 7 and s.evictions == 1
    assert (s.per_key["a"].bytes, s.per_key["c"].bytes) == (6, 1)


@pytest.mark.parametrize("oversize", ["raise", "uncached"])
def test_a_graph_measured_over_max_bytes_is_refused_or_uncached_and_released(oversize):
    released = []
    cache = GraphCache(max_bytes=10, sizeof=lambda key: 1, measure=lambda key, graph: 20, oversize=oversize,
                       release=lambda key, graph: released.append(key))
    if oversize == "raise":
        with pytest.raises(GraphTooLargeError, match="needs 20 bytes, more than max_bytes=10"):
            cache.get_or_compile("big", build_of("big"))
        assert released == ["big"]  # built, then refused: freed
    else:
        assert cache.get_or_compile("big", build_of("big")) == ("graph", "big")
    s = cache.stats()
    assert "big" not in cache and s.compiles == 1 and (s.refused, s.uncached) == (
        (1, 0) if oversize == "raise" else (0, 1))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_a_bad_measure_names_it(bad):
    cache = GraphCache(measure=lambda key, graph: bad)
    with pytest.raises(ConfigError, match=f"measure\\(k\\) returned {bad!r}; it must be an int >= 0 or None"):
        cache.get_or_compile("k", build_of("k"))
    assert "k" not in cache and cache.stats().refused == 1


# -- threads -----------------------------------------------------------------------------

def wait_for_waiters(cache, n, timeout=120.0):
    """Poll until ``n`` threads wait on the build (the condition, not a time: the bound
    only turns a hang into a failure, far past any loaded machine's delay)."""
    deadline = time.monotonic() + timeout
    while cache.stats().waits < n:
        assert time.monotonic() < deadline, f"{cache.stats().waits} of {n} threads waiting after {timeout} s"
        time.sleep(0.005)


def in_threads(n, target):
    barrier = threading.Barrier(n)
    results = [None] * n

    def worker(i):
        barrier.wait()
        try:
            results[i] = target()
        except Exception as exc:  # collected for the assertions
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)  # joined: the bound only turns a hang into a failure
        assert not t.is_alive()
    return results


def test_single_flight_eight_threads_one_build():
    cache = GraphCache()
    builds = []

    def build():
        builds.append(1)
        wait_for_waiters(cache, 7)  # each counted waiter gets this build's graph
        return object()

    results = in_threads(8, lambda: cache.get_or_compile("fresh", build))
    s = cache.stats()
    assert len(builds) == 1 and s.compiles == 1
    assert all(r is results[0] for r in results) and results[0] is not None
    assert (s.misses, s.hits, s.waits) == (1, 7, 7)


def test_single_flight_failure_reaches_every_waiter_then_retries():
    cache = GraphCache()
    builds = []

    def failing():
        builds.append(1)
        wait_for_waiters(cache, 3)
        raise RuntimeError("boom")

    results = in_threads(4, lambda: cache.get_or_compile("k", failing))
    assert len(builds) == 1
    assert all(isinstance(r, GraphCompileError) and "k" in str(r) for r in results)
    assert all(isinstance(r.__cause__, RuntimeError) for r in results)
    assert cache.stats().compile_failures == 1
    assert cache.get_or_compile("k", lambda: "ok") == "ok"


def test_other_keys_proceed_while_one_builds():
    cache = GraphCache()
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        assert release.wait(120)  # the bounds only turn a hang into a failure
        return "slow"

    t = threading.Thread(target=cache.get_or_compile, args=("slow", slow))
    t.start()
    assert started.wait(120)
    assert cache.get_or_compile("fast", lambda: "fast") == "fast"
    assert "slow" not in cache
    release.set()
    t.join(timeout=120)
    assert not t.is_alive() and "slow" in cache and cache.stats().compile_failures == 0


def test_a_failing_eviction_strategy_does_not_leave_waiters_hanging():
    def next_use(key):
        raise RuntimeError("oracle broke")

    cache = GraphCache(max_graphs=1, eviction="belady", eviction_options={"next_use": next_use})
    cache.get_or_compile("A", build_of("A"))

    def build():
        wait_for_waiters(cache, 1)
        return "B"

    results = in_threads(2, lambda: cache.get_or_compile("B", build))
    assert sorted(type(r).__name__ for r in results) == ["GraphCompileError", "RuntimeError"]
    assert "B" not in cache


# -- failures --------------------------------------------------------------------------

def test_failed_build_caches_nothing_and_the_next_request_retries():
    cache = GraphCache(sizeof=lambda key: 7)
    original = ValueError("bad shape")

    def failing():
        raise original

    with pytest.raises(GraphCompileError) as err:
        cache.get_or_compile("key-1", failing)
    assert "key-1" in str(err.value) and err.value.__cause__ is original
    s = cache.stats()
    assert (s.compile_failures, s.compiles, s.graphs, s.bytes) == (1, 0, 0, 0)
    assert "key-1" not in cache
    assert cache.get_or_compile("key-1", lambda: "built") == "built"
    s = cache.stats()
    assert (s.compile_failures, s.compiles, s.misses, s.bytes) == (1, 1, 2, 7)


# -- callbacks, explicit eviction, clear, reset ------------------------------------------

def test_callbacks_fire_with_key_seconds_bytes_and_value(clock):
    compiled, evicted, released = [], [], []
    cache = GraphCache(max_graphs=1, sizeof=lambda key: {"A": 3, "B": 4}[key],
                       on_compile=lambda *a: compiled.append(a),
                       on_evict=lambda *a: evicted.append(a),
                       release=lambda *a: released.append(a))
    cache.get_or_compile("A", clock.build("A", 2.0))
    cache.get_or_compile("B", clock.build("B", 0.25))
    assert compiled == [("A", 2.0, 3), ("B", 0.25, 4)]
    assert evicted == [("A", 3)]
    assert released == [("A", ("graph", "A"))]
    assert cache.stats().compile_seconds == 2.25


def test_explicit_evict_and_clear():
    evicted, released = [], []
    cache = GraphCache(sizeof=lambda key: 2, on_evict=lambda *a: evicted.append(a),
                       release=lambda key, value: released.append(key))
    run(cache, "ABC")
    assert cache.evict("B") is True and cache.evict("B") is False
    assert evicted == [("B", 2)] and cache.stats().evictions == 1
    cache.clear()
    s = cache.stats()
    assert sorted(released) == ["A", "B", "C"] and evicted == [("B", 2)]
    assert (s.graphs, s.bytes, s.evictions, s.peak_graphs) == (0, 0, 1, 3)


def test_reset_stats_keeps_graphs_and_resets_peaks_to_current():
    cache = GraphCache(sizeof=lambda key: 5)
    run(cache, "ABCA")
    cache.evict("C")
    cache.reset_stats()
    s = cache.stats()
    assert (s.hits, s.misses, s.compiles, s.evictions, s.compile_seconds) == (0, 0, 0, 0, 0.0)
    assert (s.graphs, s.bytes, s.peak_graphs, s.peak_bytes) == (2, 10, 2, 10)
    assert s.to_json()["per_key"]["A"] == {"hits": 0, "misses": 0, "compiles": 0, "evictions": 0,
                                 "compile_seconds": 0.0, "bytes": 5, "loads": 0, "load_seconds": 0.0}
    run(cache, "A")
    assert cache.stats().hits == 1


def test_contains_and_keys_have_no_side_effects():
    cache, victims = evicting_cache(max_graphs=2)
    run(cache, "AB")
    before = cache.stats()
    assert "A" in cache and "Z" not in cache and len(cache) == 2
    assert cache.keys() == ["A", "B"]
    assert cache.stats() == before
    run(cache, "C")
    assert victims == ["A"]  # peeking at A did not make it recent


def test_warmup_compiles_and_counts():
    cache = GraphCache()
    cache.warmup([(k, build_of(k)) for k in "AB"])
    cache.warmup([("A", build_of("A"))])
    s = cache.stats()
    assert cache.keys() == ["A", "B"] and (s.compiles, s.misses, s.hits) == (2, 2, 1)


# -- validation and plugins --------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"max_graphs": 0}, "max_graphs", "0"),
    ({"max_graphs": 1.5}, "max_graphs", "1.5"),
    ({"max_bytes": -1}, "max_bytes", "-1"),
    ({"oversize": "drop"}, "oversize", "'drop'"),
    ({"eviction": "nope"}, "eviction", "'nope'"),
    ({"eviction": "belady"}, "eviction_options", "None"),
    ({"eviction": "lru", "eviction_options": {"colour": 1}}, "eviction_options", "colour"),
    ({"release": 3}, "release", "3"),
])
def test_invalid_arguments_name_field_and_value(kwargs, field, value):
    with pytest.raises(ConfigError) as err:
        GraphCache(**kwargs)
    assert field in str(err.value) and value in str(err.value)


def test_unknown_eviction_lists_known_names():
    with pytest.raises(ValueError) as err:
        GraphCache(eviction="nope")
    assert all(name in str(err.value) for name in ("lru", "lfu", "fifo", "cost", "belady"))


def test_sizeof_must_return_non_negative_int():
    cache = GraphCache(sizeof=lambda key: -1)
    for _ in range(2):  # the second request is not left waiting on the first
        with pytest.raises(ConfigError, match=r"sizeof\(k\) returned -1"):
            cache.get_or_compile("k", lambda: 1)
    assert cache.stats().compiles == 0


class _Plugin:
    @hookimpl
    def attnpolicy_register_evictions(self, register):
        register("test-mru", MRU)
        register("test-broken", dict)
        register("test-fails-second-pop", FailsSecondPop)


class MRU(cachetools.Cache):
    """Most-recently-inserted first."""

    def __init__(self):
        super().__init__(math.inf)

    def popitem(self):
        key = list(self)[-1]
        return key, self.pop(key)


class FailsSecondPop(cachetools.LRUCache):
    """LRU whose second eviction in a row fails (a buggy plugin strategy)."""

    def __init__(self):
        super().__init__(math.inf)
        self.pops = 0

    def popitem(self):
        self.pops += 1
        if self.pops == 2:
            raise RuntimeError("strategy broke")
        return super().popitem()


@pytest.fixture
def plugin():
    pm = get_plugin_manager()
    pm.register(_Plugin(), name="test-evictions")
    yield
    pm.unregister(name="test-evictions")


def test_plugin_strategy_by_name(plugin):
    cache, victims = evicting_cache(max_graphs=2, eviction="test-mru")
    run(cache, "ABC")
    assert victims == ["B"]
    with pytest.raises(PluginError, match="test-broken"):
        GraphCache(eviction="test-broken")


def test_victims_evicted_before_a_strategy_fails_are_still_released(plugin):
    released = []
    cache = GraphCache(max_bytes=2, sizeof=lambda key: 2 if key == "C" else 1, eviction="test-fails-second-pop",
                       release=lambda key, graph: released.append(key))
    run(cache, "AB")
    with pytest.raises(RuntimeError, match="strategy broke"):
        cache.get_or_compile("C", build_of("C"))  # needs two evictions; the second fails
    # the victim that already left is freed, and so is the graph that was built for C
    assert released == ["A", "C"] and cache.keys() == ["B"] and cache.stats().bytes == 1
    s = cache.stats()
    assert (s.misses, s.compiles, s.compile_failures, s.refused) == (3, 3, 0, 0)


# -- faults: no hang, counters consistent, nothing leaked -------------------------------

def _balanced(cache):
    """Every miss ended in exactly one outcome."""
    s = cache.stats()
    return s.misses == s.compiles + s.compile_failures + s.refused


def test_a_build_requesting_its_own_key_raises_instead_of_hanging():
    cache = GraphCache()

    def build():
        return cache.get_or_compile("A", build)

    done = []

    def request() -> None:
        with pytest.raises(GraphCompileError) as raised:
            cache.get_or_compile("A", build)
        done.append(raised)

    t = threading.Thread(target=request)
    t.start()
    t.join(timeout=120)  # the bound only turns a hang into a failure
    assert not t.is_alive(), "a re-entrant build hangs"
    assert "re-entrant build" in str(done[0].value) and "key A" in str(done[0].value)
    assert cache.get_or_compile("A", build_of("A")) == ("graph", "A")  # the key still works
    assert _balanced(cache) and cache.stats().compile_failures == 1


def test_an_interrupted_build_is_counted_and_the_key_builds_again():
    cache = GraphCache()

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.get_or_compile("A", interrupted)
    s = cache.stats()
    assert (s.misses, s.compile_failures, s.compiles) == (1, 1, 0) and _balanced(cache)
    assert cache.get_or_compile("A", build_of("A")) == ("graph", "A")


def test_a_raising_sizeof_is_a_counted_refusal_naming_the_key():
    def sizeof(key):
        raise OSError("no size")

    cache = GraphCache(sizeof=sizeof)
    with pytest.raises(ConfigError, match=r"sizeof\(k\) raised OSError: no size"):
        cache.get_or_compile("k", build_of("k"))
    s = cache.stats()
    assert (s.misses, s.refused, s.compiles) == (1, 1, 0) and _balanced(cache)


def test_a_raising_compile_cost_counts_the_compile_and_releases_the_graph():
    released = []

    def cost(key, seconds):
        raise RuntimeError("model broke")

    cache = GraphCache(compile_cost=cost, release=lambda key, graph: released.append(key))
    with pytest.raises(RuntimeError, match="model broke"):
        cache.get_or_compile("A", build_of("A"))
    assert released == ["A"] and "A" not in cache and _balanced(cache)


# -- pinning -----------------------------------------------------------------------------

def test_a_pinned_graph_evicted_is_held_until_unpinned():
    released = []
    cache = GraphCache(max_graphs=1, release=lambda key, graph: released.append(key))
    a = cache.get_or_compile("A", build_of("A"), pin=True)
    cache.get_or_compile("B", build_of("B"), pin=True)  # evicts A: pinned, so held, not released
    s = cache.stats()
    assert cache.keys() == ["B"] and s.graphs == 1 and s.evictions == 1
    assert (s.held_graphs, s.peak_held_graphs) == (1, 1) and released == []
    assert a == ("graph", "A")
    cache.unpin(["A", "B"])
    assert released == ["A"] and cache.stats().held_graphs == 0 and cache.stats().peak_held_graphs == 1
    cache.get_or_compile("C", build_of("C"))  # B is no longer pinned: released at once
    assert released == ["A", "B"]
