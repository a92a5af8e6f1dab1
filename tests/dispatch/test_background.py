"""Background compiles with pad-up: correct outputs, deterministic switches, stalls, errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cost_models import PRICEY
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import layouts, qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.dispatch import background, graph_source
from attnpolicy.errors import ConfigError, GraphCompileError, StrictModeError
from attnpolicy.graphs.costmodel import CostModel, Fit
from attnpolicy.graphs.execute import graph_fn
from attnpolicy.graphs.keys import TensorSpec

SPEC = TensorSpec("float32", 4, 2, 16)
#: compiles cost far more than any padding: every miss with a larger resident graph pads up


def _workers(before: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The compile threads alive now that were not in ``before`` (a worker of another
    test's dispatcher left to the garbage collector may still be winding down)."""
    return [t for t in threading.enumerate() if t.name.startswith("attnpolicy-compile") and t not in before]


def _uncompiled(call, key, spec):
    return graph_fn(call, key.impl, spec.scale, None)


class ThreadClock:
    """``perf_counter`` of the dispatcher's modules in these tests: each thread's clock
    moves only by the builds that thread runs, so every measured second is exact."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return getattr(self._local, "now", 0.0)

    def advance(self, seconds: float) -> None:
        self._local.now = self() + seconds


@pytest.fixture
def clock(monkeypatch):
    fake = ThreadClock()
    for module in (graph_source, background):
        monkeypatch.setattr(module, "perf_counter", fake)
    return fake


def _slow(seconds, clock, *, wall=False):
    """A build that takes ``seconds`` on ``clock``; ``wall``: as long in wall time too
    (a slow worker: what it changes must be nothing)."""
    def build(call, key, spec):
        if wall:
            time.sleep(seconds)
        clock.advance(seconds)
        return _uncompiled(call, key, spec)
    return build


# the largest graph of each kind the hypothesis layouts need (lengths ≤ 300, context ≤ 100)
WARM = {
    "varlen": [BatchLayout.from_lens([512]), BatchLayout.from_lens([512], [1024]),
               BatchLayout.from_lens([512], [1024], causal=False)],
    "always-mask": [BatchLayout.from_lens([1024, 1024], [1024, 1024])],
    "always-causal": [BatchLayout.from_lens([512])],
}


def _warm_dispatcher(policy: str, spec: TensorSpec) -> Dispatcher:
    cfg = AttnPolicyConfig(policy=policy, backend="eager", max_seq_len=1024, max_batch_tokens=2048,
                           compile_mode="background", switch_after=10**6, on_illegal="fallback",
                           fallback_mode="varlen" if policy != "always-mask" else "mask")
    d = Dispatcher(cfg, cost_model=PRICEY, builder=_uncompiled)  # aot_eager graphs: see the last tests
    d.warmup(WARM[policy], spec)
    return d


@pytest.mark.parametrize("policy", ["varlen", "always-mask", "always-causal"])
@settings(max_examples=25)
@given(data=st.data())
def test_pad_up_outputs_match_the_reference(policy, data):
    """Every call whose exact graph is not resident runs on a warm larger bucket
    (CAUSAL rows padded after the real ones, VARLEN bounds, MASK masks built for the
    larger bucket) and the output is still the per-sequence reference."""
    layout = data.draw(layouts(max_seqs=4, single=policy == "always-causal"))
    q, k, v = data.draw(qkv(layout))
    spec = TensorSpec.of(q, k)
    with _warm_dispatcher(policy, spec) as d:
        warm = set(d.cache.keys())
        planned = d.graph_keys_for(layout, spec)
        out = d.attend(q, k, v, layout)
        stats = d.stats()
        exact = sum(key in warm for key in planned)
        assert stats.background.pad_up_calls == len(planned) - exact
        assert stats.background.requested == len(set(planned) - warm)
        assert set(d.cache.keys()) == warm  # nothing compiled in the batch
        assert stats.stalls.stalled == 0
    torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)


STREAM = [BatchLayout.from_lens(lens) for lens in
          ([200], [20, 30], [20], [100, 9], [20, 31], [60], [5, 6, 7], [200, 20], [30], [70], [20], [9])]


def _trace(builder, switch_after=2, rounds=2):
    """What each batch ran (buckets), the cache contents and the pending switches."""
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background",
                           switch_after=switch_after, max_graphs=4)
    out = []
    with Dispatcher(cfg, builder=builder) as d:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        for layout in STREAM * rounds:
            graphs = d.prepare(layout, SPEC)
            out.append(([(c.kind, c.q_bucket, c.kv_bucket) for c, _ in graphs],
                        sorted(map(str, d.cache.keys())), [(str(k), due) for k, due in d.pending()]))
        return out, d.stats()


def test_switches_are_deterministic_whatever_the_compile_speed(clock):
    fast, fast_stats = _trace(_uncompiled)
    slow, slow_stats = _trace(_slow(0.05, clock, wall=True))
    assert fast == slow
    assert fast_stats.background.pad_up_calls > 0 and fast_stats.background.switched > 0
    assert slow_stats.background.switched == fast_stats.background.switched
    # a graph enters the cache exactly switch_after batches after it was requested
    requested = {}
    for i, (_, _, pending) in enumerate(fast):
        for key, due in pending:
            requested.setdefault(key, (i + 1, due))
    for key, (batch, due) in requested.items():
        assert due == batch + 2
    # the same graphs at every batch: each slow compile was waited for at its switch point
    # (how long that wait was depends on the machine: not asserted); its seconds are the worker's
    assert fast_stats.background.compile_seconds == 0.0
    assert slow_stats.background.compile_seconds == pytest.approx(0.05 * slow_stats.background.switched)


def test_sync_compiles_stall_their_batch(clock):
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256)
    before = frozenset(_workers())
    d = Dispatcher(cfg, builder=_slow(0.02, clock))
    for layout in [BatchLayout.from_lens([20]), BatchLayout.from_lens([20]), BatchLayout.from_lens([20, 100]),
                   BatchLayout.from_lens([30])]:
        d.prepare(layout, SPEC)
    stalls = d.stats().stalls
    assert (stalls.batches, stalls.stalled) == (4, 2)  # batches 1 and 3 compiled
    assert stalls.max == pytest.approx(0.02) and stalls.seconds == pytest.approx(0.04)
    assert stalls.p99 == stalls.max and stalls.p50 == 0.0
    assert d.stats().background.requested == 0 and not _workers(before)


def test_no_resident_larger_graph_compiles_now():
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background")
    with Dispatcher(cfg, builder=_uncompiled) as d:
        d.prepare(BatchLayout.from_lens([100]), SPEC)
        assert d.stats().stalls.stalled == 1 and d.stats().background.requested == 0
        d.prepare(BatchLayout.from_lens([100]), SPEC)  # hit
        d.prepare(BatchLayout.from_lens([20]), SPEC)  # pads up to 128
        b = d.stats().background
        assert (b.requested, b.pad_up_calls, b.pad_up_tokens) == (1, 1, 128 - 32)
        assert d.stats().padding.padded_tokens == (128 - 100) * 2 + (128 - 20)


def test_padding_dearer_than_compiling_compiles_now():
    cheap = CostModel.default().model_copy(update={"compile": {f: Fit() for f in CostModel.default().compile}})
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background")
    with Dispatcher(cfg, builder=_uncompiled, cost_model=cheap) as d:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        d.prepare(BatchLayout.from_lens([20]), SPEC)
        assert d.stats().background.pad_up_calls == 0 and len(d.cache) == 2


@pytest.mark.parametrize("on_error", ["raise", "eager"])
def test_background_compile_error_follows_on_compile_error(on_error):
    def broken(call, key, spec):
        if key.q_len == 32:
            raise RuntimeError("backend broke")
        return _uncompiled(call, key, spec)

    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", switch_after=2,
                           on_compile_error=on_error)
    small, other = BatchLayout.from_lens([20]), BatchLayout.from_lens([200])
    with Dispatcher(cfg, builder=broken) as d:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        d.prepare(small, SPEC)  # batch 1: pads up, requests q32 (switch at batch 3)
        d.prepare(other, SPEC)  # batch 2
        if on_error == "raise":
            with pytest.raises(GraphCompileError, match="q32.*backend broke"):
                d.prepare(other, SPEC)  # batch 3: the switch point
            assert d.stats().batches == 2
        else:
            d.prepare(other, SPEC)
            assert d.stats().compile_error_fallbacks == 1
        stats = d.stats()
        assert stats.background.failed == 1 and stats.background.switched == 0
        assert stats.cache.compile_failures == 1 and not d.pending()
        d.prepare(small, SPEC)  # asks again: pads up and compiles in the background again
        assert d.stats().background.requested == 2


def test_strict_mode_counts_a_background_compile_after_warmup():
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", strict="raise")
    with Dispatcher(cfg, builder=_uncompiled) as d:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        with pytest.raises(StrictModeError, match="q32"):
            d.prepare(BatchLayout.from_lens([20]), SPEC)
        assert d.stats().strict_violations == 1 and not d.pending()


def test_close_shuts_the_worker_down_and_drops_pending_compiles():
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", switch_after=50)
    started, release = threading.Event(), threading.Event()

    def held(call, key, spec):  # the worker's first compile is in flight, the others queued
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert release.wait(120)  # the bound only turns a hang into a failure
        return _uncompiled(call, key, spec)

    before = frozenset(_workers())
    d = Dispatcher(cfg, builder=held, cost_model=PRICEY)
    d.warmup([BatchLayout.from_lens([256])], SPEC)
    for n in (20, 40, 70):
        d.prepare(BatchLayout.from_lens([n]), SPEC)
    assert started.wait(120)
    assert len(d.pending()) == 3 and len(_workers(before)) == 1
    release.set()
    d.close()  # joins the worker
    assert not d.pending() and not _workers(before)
    assert d.stats().background.pending == 0


def test_background_compile_really_compiles_and_switches():
    """aot_eager graphs compiled in the worker thread serve after their switch."""
    cfg = AttnPolicyConfig(backend="aot_eager", max_seq_len=128, compile_mode="background", switch_after=1,
                           policy="varlen")
    lay = BatchLayout.from_lens([20, 50], causal=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(70, 4, 16, generator=g), torch.randn(70, 2, 16, generator=g), torch.randn(70, 2, 16,
                                                                                                    generator=g)
    before = frozenset(_workers())
    with Dispatcher(cfg) as d:
        d.warmup([BatchLayout.from_lens([128], causal=False)], TensorSpec.of(q, k))
        for _ in range(3):
            out = d.attend(q, k, v, lay)
            torch.testing.assert_close(out.double(), reference_for(q, k, v, lay), atol=1e-5, rtol=1e-5)
        stats = d.stats()
    assert stats.background.switched == 2 and stats.background.pad_up_calls == 2  # q32, q64: 1 batch each
    assert stats.cache.compiles == 3 and stats.background.compile_seconds > 0
    assert not _workers(before)


def test_config_names_bad_compile_mode_and_switch_after():
    with pytest.raises((ConfigError, ValueError), match="compile_mode"):
        AttnPolicyConfig.model_validate({"compile_mode": "lazy"})
    with pytest.raises((ConfigError, ValueError), match="switch_after"):
        AttnPolicyConfig.model_validate({"switch_after": 0})



# -- exact compile accounting ------------------------------------------------------------

class _Counted:
    """A builder that counts its builds (the backend compile count of a custom builder)."""

    def __init__(self, fail: int | None = None, error: type[BaseException] = RuntimeError):
        self.built: list[str] = []
        self.fail, self.error = fail, error

    def __call__(self, call, key, spec):
        self.built.append(str(key))
        if key.q_len == self.fail:
            raise self.error("builder stopped")
        return _uncompiled(call, key, spec)


def _accounted(stats, builds: int) -> None:
    """Every build is a compile or a failure of the cache, or one ``close()`` discarded."""
    c = stats.cache
    assert builds == c.compiles + c.compile_failures + stats.background.discarded


def test_close_counts_the_compiles_it_discards():
    builder = _Counted()
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", switch_after=50)
    d = Dispatcher(cfg, builder=builder, cost_model=PRICEY)
    d.warmup([BatchLayout.from_lens([256])], SPEC)
    for n in (20, 40, 70):
        d.prepare(BatchLayout.from_lens([n]), SPEC)
    for p in d.background.pending.values():
        p.future.result()  # all three ran in the worker
    d.close()
    stats = d.stats()
    assert len(builder.built) == 4 and stats.cache.compiles == 1 and stats.background.discarded == 3
    _accounted(stats, len(builder.built))


def test_warmup_reuses_a_pending_compile():
    builder = _Counted()
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", switch_after=50)
    small = BatchLayout.from_lens([20])
    with Dispatcher(cfg, builder=builder, cost_model=PRICEY) as d:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        d.prepare(small, SPEC)  # pads up; q32 compiles in the worker
        assert len(d.pending()) == 1
        (key,) = d.warmup([small], SPEC)
        assert builder.built.count(str(key)) == 1 and key in d.cache and not d.pending()
        assert d.stats().background.switched == 1
        _accounted(d.stats(), len(builder.built))


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, GeneratorExit])
@pytest.mark.parametrize("on_error", ["raise", "eager"])
def test_a_base_exception_in_the_worker_is_a_compile_error_of_its_key(error, on_error):
    """Raised in the worker, it is no interrupt of the process: its key's compile failed,
    met at its switch point under ``on_compile_error``, never at another batch."""
    builder = _Counted(fail=32, error=error)
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", switch_after=2,
                           on_compile_error=on_error)
    small, other = BatchLayout.from_lens([20]), BatchLayout.from_lens([200])
    with Dispatcher(cfg, builder=builder) as d:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        d.prepare(small, SPEC)  # batch 1: requests q32, due at batch 3
        d.background.pending[next(iter(d.background.pending))].future.exception()  # it has failed
        d.prepare(other, SPEC)  # batch 2: unrelated, runs
        if on_error == "raise":
            with pytest.raises(GraphCompileError, match=f"q32.*{error.__name__}"):
                d.prepare(other, SPEC)
        else:
            d.prepare(other, SPEC)
            assert d.stats().compile_error_fallbacks == 1
        stats = d.stats()
        assert stats.background.failed == 1 and stats.cache.compile_failures == 1
        _accounted(stats, len(builder.built))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.lists(st.integers(1, 256), min_size=1, max_size=3), min_size=1, max_size=8),
       switch_after=st.integers(1, 4), capacity=st.integers(1, 4), warm_at=st.integers(0, 8),
       fail=st.sampled_from([None, 32, 64]), on_error=st.sampled_from(["raise", "eager"]))
def test_background_stats_equal_the_builds_through_warmup_and_close(lens, switch_after, capacity, warm_at,
                                                                    fail, on_error):
    """Random batches in background mode, a warm-up of some of them midway, then
    ``close()``: every build is counted once (compile, failure, or discarded)."""
    builder = _Counted(fail=fail)
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=256, compile_mode="background", max_graphs=capacity,
                           switch_after=switch_after, on_compile_error=on_error)
    layouts = [BatchLayout.from_lens(x) for x in lens]
    d = Dispatcher(cfg, builder=builder, cost_model=PRICEY)
    try:
        d.warmup([BatchLayout.from_lens([256])], SPEC)
        for i, layout in enumerate(layouts):
            if i == warm_at:
                d.warmup(layouts[i:], SPEC)
            d.prepare(layout, SPEC)
            d.release_batch()
    except GraphCompileError:
        assert on_error == "raise" and fail is not None
    d.close()
    stats = d.stats()
    assert stats.background.pending == 0
    _accounted(stats, len(builder.built))


def test_background_compile_counter_equals_stats_through_warmup_and_close():
    """The real backend (``compile_counter``) in background mode, warm-up and ``close()``."""
    counter: list[object] = []
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=128, compile_mode="background", switch_after=3,
                           policy="varlen")
    d = Dispatcher(cfg, cost_model=PRICEY, compile_counter=counter.append)
    spec = TensorSpec("float32", 2, 1, 8)
    d.warmup([BatchLayout.from_lens([128])], spec)
    d.prepare(BatchLayout.from_lens([20]), spec)  # q32 in the worker
    d.warmup([BatchLayout.from_lens([20])], spec)  # reuses it
    d.prepare(BatchLayout.from_lens([40]), spec)  # q64 in the worker, never switched in
    for p in d.background.pending.values():
        p.future.result()
    d.close()
    stats = d.stats()
    assert len(counter) == 3 and stats.cache.compiles == 2 and stats.background.discarded == 1
    _accounted(stats, len(counter))


def test_a_background_compile_of_a_stored_graph_is_a_load(tmp_path):
    """With a graph store holding the exact graph, the worker loads it instead of
    compiling: counted as a load (cache, store and background), never as a compile."""
    cfg = AttnPolicyConfig(backend="aot_eager", max_seq_len=64, store_dir=str(tmp_path))
    small, large = BatchLayout.from_lens([12]), BatchLayout.from_lens([64])
    with Dispatcher(cfg) as first:  # compiles both graphs ahead of time into the store
        for layout in (small, large):
            first.prepare(layout, SPEC)
        assert first.stats().disk.saves == 2
    d = Dispatcher(cfg.model_copy(update={"compile_mode": "background", "switch_after": 1}), cost_model=PRICEY)
    d.warmup([large], SPEC)  # loaded from the store
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, h, 16, generator=g) for h in (4, 2, 2))
    outs = [d.attend(q, k, v, small) for _ in range(3)]  # padded up, then the exact graph once switched in
    stats = d.stats()
    d.close()
    assert stats.background.pad_up_calls == 1 and stats.background.switched == 1
    assert stats.background.loaded == 1 and stats.background.compile_seconds == 0.0
    assert stats.cache.compiles == 0 and stats.cache.loads == 2 and stats.disk.hits == 2
    assert stats.disk.saves == 0
    for out in outs:
        torch.testing.assert_close(out.double(), reference_for(q, k, v, small), atol=1e-5, rtol=1e-5)


def _host_counted(switch_after: int) -> tuple[Dispatcher, list[object], TensorSpec]:
    """A background-mode dispatcher whose host runs VARLEN steps (``host_varlen``), on
    the real backend with its ``compile_counter``."""
    counter: list[object] = []
    cfg = AttnPolicyConfig(backend="eager", max_seq_len=128, compile_mode="background", switch_after=switch_after,
                           policy="varlen")
    return Dispatcher(cfg, cost_model=PRICEY, compile_counter=counter.append, host_varlen=True), counter, \
        TensorSpec("float32", 2, 1, 8)


def test_a_host_step_in_background_mode_defers_its_keys_and_a_step_that_runs_one_compiles_it_now():
    """Under ``host_varlen`` a VARLEN step (vLLM's kernel runs it) compiles nothing in the
    background either: its keys enter the cache deferred, counted as in synchronous mode; a
    step that runs a deferred key with no larger built graph to pad up to compiles it now,
    as a deferred build."""
    d, counter, spec = _host_counted(switch_after=1)
    for _ in range(3):  # q64 and q32 deferred, then hits
        step = d.prepare(BatchLayout.from_lens([40, 20]), spec)
        assert list(step) == [] and d.source.pinned == [] and not d.pending()
    s = d.stats()
    assert counter == [] and s.background.requested == 0 and s.background.pad_up_calls == 0
    assert (s.cache.misses, s.cache.hits, s.cache.deferred, s.cache.compiles, s.cache.deferred_built) == (2, 4, 2, 0, 0)
    d.prepare(BatchLayout.from_lens([40]), spec)  # attnpolicy's CAUSAL q64 runs it: built now, in place
    s = d.stats()
    assert len(counter) == 1 and (s.cache.compiles, s.cache.deferred_built, s.cache.misses) == (1, 1, 2)
    assert s.background.requested == 0 and s.stalls.stalled == 1
    d.close()


def test_a_deferred_key_a_step_runs_compiles_in_the_worker_while_a_built_graph_serves_by_pad_up():
    """A deferred key is never a pad-up target (its graph is not built); a step that runs
    one pads up to a built larger graph while the worker compiles it, and it switches in
    ``switch_after`` batches later as the deferred entry's build: every backend compile is
    a graph that ran."""
    d, counter, spec = _host_counted(switch_after=2)
    d.warmup([BatchLayout.from_lens([128])], spec)  # CAUSAL q128, built
    d.prepare(BatchLayout.from_lens([40, 20]), spec)  # host step: q64 and q32 deferred, none requested
    s = d.stats()
    assert len(counter) == 1 and s.cache.deferred == 2 and s.background.requested == 0
    assert not d.pending() and s.background.pad_up_calls == 0
    d.prepare(BatchLayout.from_lens([40]), spec)  # runs q64: padded up to q128 while q64 compiles
    d.prepare(BatchLayout.from_lens([20, 10]), spec)  # host step: q32 a hit, q16 deferred
    d.prepare(BatchLayout.from_lens([40]), spec)  # q64 switched in: runs exactly
    s = d.stats()
    d.close()
    assert s.background.requested == s.background.switched == s.background.pad_up_calls == 1
    assert len(counter) == s.cache.compiles == 2 and s.cache.deferred_built == 1 and s.cache.deferred == 3
    assert s.cache.misses + s.cache.deferred_built == s.cache.compiles + s.cache.deferred
    assert all(map(d.cache.has_graph, d.graph_keys_for(BatchLayout.from_lens([40]), spec)))  # q64, built
    _accounted(s, len(counter))
