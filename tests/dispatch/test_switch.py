"""Dispatcher.switch_to: a re-planned config applied at a batch boundary once its warm
set is built in the background; exact outputs throughout, no foreground compile."""

from __future__ import annotations

import logging
import threading
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_for
from strategies import layouts, random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.errors import ConfigError, GraphCompileError
from attnpolicy.graphs.execute import graph_fn
from attnpolicy.graphs.keys import GraphKey, TensorSpec

SPEC = TensorSpec("float32", 2, 2, 16)
LAYOUTS = [BatchLayout.from_lens(lens) for lens in ([20, 50], [100], [200, 10], [30], [7, 120, 3])]


def _causal(*sizes: int) -> list[dict[str, object]]:
    return [{"family": "causal", "q_bucket": n, "kv_bucket": n} for n in sizes]


def _with(config: AttnPolicyConfig, **fields: object) -> AttnPolicyConfig:
    return AttnPolicyConfig.model_validate({**config.model_dump(mode="json"), **fields})


def _sizes(*sizes: int) -> dict[str, object]:
    return {"kind": "list", "sizes": list(sizes)}


OLD = AttnPolicyConfig(backend="eager", max_seq_len=256, max_graphs=4, buckets=_sizes(64, 256),
                       warmup=_causal(64, 256))
NEW = _with(OLD, buckets=_sizes(32, 128, 256), warmup=_causal(32, 128, 256), eviction="lfu", strict="warn")


class Builder:
    """Builds uncompiled graphs, recording the thread of every build; builds in a worker
    thread wait for ``gate`` (so a switch stays pending until the test opens it)."""

    def __init__(self, fail: int | None = None) -> None:
        self.builds: list[tuple[bool, str]] = []  # (in the main thread, key)
        self.gate = threading.Event()
        self.fail = fail  # a q bucket whose build raises in the worker

    def __call__(self, call, key, spec):
        main = threading.current_thread() is threading.main_thread()
        self.builds.append((main, str(key)))
        if not main:
            assert self.gate.wait(30)
            if key.q_len == self.fail:
                raise RuntimeError(f"no graph for {key.q_len}")
        return graph_fn(call, key.impl, spec.scale, None)

    def foreground(self) -> int:
        return sum(main for main, _ in self.builds)


_qkv = partial(random_qkv, heads=2)  # 2 heads of 16


def _serve(d: Dispatcher, seed: int = 0) -> None:
    """Every layout of LAYOUTS once, each output checked against the float64 reference."""
    for i, layout in enumerate(LAYOUTS):
        q, k, v = _qkv(layout, seed + i)
        out = d.attend(q, k, v, layout)
        torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)


def _built(d: Dispatcher) -> None:
    """Wait until the pending switch's graphs are built (the test's side, not a batch's)."""
    for future in d.switcher.target.builds.values():
        future.exception()


def _warm(config: AttnPolicyConfig = OLD, builder: Builder | None = None, **fields) -> tuple[Dispatcher, Builder]:
    builder = builder or Builder()
    d = Dispatcher(_with(config, **fields) if fields else config, builder=builder)
    _serve(d)  # warms the old warm set at the first attend, then serves from it
    return d, builder


def _warm_keys(d: Dispatcher, config: AttnPolicyConfig) -> list[GraphKey]:
    """The keys of ``config``'s warm set for SPEC, in its order."""
    from attnpolicy.dispatch.batch_plan import warm_call

    return [d.planner.key_for(*warm_call(w), SPEC) for w in config.warmup]


def _keys(d: Dispatcher, config: AttnPolicyConfig) -> set[str]:
    return set(map(str, _warm_keys(d, config)))


def test_outputs_stay_exact_and_no_batch_compiles_through_a_switch(caplog):
    caplog.set_level(logging.INFO, logger="attnpolicy.dispatch")
    d, builder = _warm()
    before = builder.foreground()
    assert before == 2 and d.stats().cache.compiles == 2  # the old warm set, at the first attend
    keys = d.switch_to(NEW)
    assert sorted(map(str, keys)) == sorted(_keys(d, NEW) - _keys(d, OLD))  # 256 is cached: not rebuilt
    for round_ in range(3):  # the switch set is still building: the old config serves
        _serve(d, seed=10 * round_)
    s = d.stats().switch
    assert d.config == OLD and s.pending == 1 and s.switches == 0 and s.batches == 3 * len(LAYOUTS)
    builder.gate.set()
    _built(d)
    assert d.config == OLD  # applied at the next batch boundary, not before
    _serve(d, seed=100)
    s = d.stats()
    assert d.config == NEW and d.cache.eviction == "lfu"
    assert s.switch.switches == 1 and s.switch.pending == 0 and s.switch.compiled == len(keys) == 2
    assert s.switch.loaded == 0 and s.switch.batches == 3 * len(LAYOUTS)
    assert builder.foreground() == before  # no batch compiled, before, during or after the switch
    assert sum(not main for main, _ in builder.builds) == 2
    assert s.stalls.stalled == 0
    assert _keys(d, NEW) <= set(map(str, d.cache.keys()))
    # the new buckets plan the batches after the switch
    assert {c.q_bucket for c, _ in d.prepare(BatchLayout.from_lens([20]), SPEC)} == {32}
    assert caplog.text.count("attnpolicy: switched from policy varlen") == 1
    assert "2 compiled and 0 loaded from the store in the background" in caplog.text
    d.close()


def test_a_background_mode_dispatcher_switches_too():
    d, builder = _warm(OLD, compile_mode="background", switch_after=2)
    new = _with(NEW, compile_mode="background", switch_after=2)
    d.switch_to(new)
    _serve(d)
    builder.gate.set()
    _built(d)
    _serve(d)
    s = d.stats()
    assert d.config == new and d.background.config == new and d.source.config == new
    assert s.switch.switches == 1 and s.background.requested == 0 and builder.foreground() == 2
    d.close()


POLICIES = ("varlen", "dynamic", "always-mask")


@settings(max_examples=15)
@given(data=st.data(), old_policy=st.sampled_from(POLICIES), new_policy=st.sampled_from(POLICIES),
       sizes=st.sampled_from([(64, 512), (32, 128, 512), (100, 200, 300, 512)]), at=st.integers(0, 4),
       eviction=st.sampled_from(["lru", "lfu", "fifo", "cost"]), capacity=st.sampled_from([None, 3, 6]))
def test_outputs_match_the_reference_through_a_switch_whatever_the_configs(data, old_policy, new_policy, sizes,
                                                                           at, eviction, capacity):
    """Random batches, a switch requested at batch ``at`` to random buckets, policy and
    eviction: every output is the per-sequence reference, and the switch applies once
    its graphs are built."""
    batches = data.draw(st.lists(layouts(max_seqs=3), min_size=5, max_size=8))
    tensors = [_qkv(layout, seed) for seed, layout in enumerate(batches)]
    old = AttnPolicyConfig(backend="eager", policy=old_policy, max_seq_len=512, max_batch_tokens=2048,
                           max_graphs=capacity, warmup=_causal(512), on_overflow="eager")
    new = _with(old, policy=new_policy, buckets=_sizes(*sizes), eviction=eviction,
                warmup=_causal(*sizes[-min(len(sizes), capacity or 3):]))
    builder = Builder()
    builder.gate.set()
    with Dispatcher(old, builder=builder) as d:
        for i, (layout, (q, k, v)) in enumerate(zip(batches, tensors)):
            if i == at:
                d.switch_to(new, specs=[SPEC])
            out = d.attend(q, k, v, layout)
            torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)
        q, k, v = tensors[0]
        for _ in range(len(new.warmup) + 1):  # a warm graph cached at the request and evicted since is built too
            if d.switcher.target is not None:
                _built(d)
            d.attend(q, k, v, batches[0])
        assert d.config == new and d.stats().switch.switches == 1


def test_the_new_warm_set_is_made_room_for_in_a_full_cache():
    """Old graphs fill the cache and are used far more often (LFU would evict a fresh
    graph first): the switch evicts graphs outside the new warm set to make room."""
    d, builder = _warm(OLD, max_graphs=3, eviction="lfu", buckets=_sizes(64, 160, 256))
    for _ in range(4):
        _serve(d)
    assert len(d.cache) == 3 and builder.foreground() == 3  # the old warm set, and 160 at its first use
    d.switch_to(_with(NEW, max_graphs=3))
    builder.gate.set()
    _built(d)
    _serve(d)
    assert d.stats().switch.switches == 1
    assert set(map(str, d.cache.keys())) == _keys(d, NEW)
    assert builder.foreground() == 3
    d.close()


def test_a_warm_graph_evicted_while_the_switch_is_pending_is_built_before_it_applies():
    builder = Builder()
    d = Dispatcher(_with(OLD, max_graphs=2, buckets=_sizes(64, 160, 256)), builder=builder)
    d.warmup(SPEC)
    assert d.switch_to(_with(NEW, max_graphs=2, warmup=_causal(32, 256))) == d.switch_to(
        _with(NEW, max_graphs=2, warmup=_causal(32, 256)))  # builds 32 only: 256 is cached
    layout = BatchLayout.from_lens([60])
    d.attend(*_qkv(layout, 0), layout)  # 64 used last: 256 is the next victim
    layout = BatchLayout.from_lens([150])
    d.attend(*_qkv(layout, 0), layout)  # compiles 160 (the running config's own miss), evicting 256
    assert builder.foreground() == 3 and not any("q256" in str(key) for key in d.cache.keys())
    builder.gate.set()
    _built(d)
    d.attend(*_qkv(layout, 0), layout)  # 256 is missing: built first, the switch waits
    assert d.stats().switch.switches == 0 and len(d.switcher.target.builds) == 2
    _built(d)
    d.attend(*_qkv(layout, 0), layout)
    s = d.stats().switch
    assert s.switches == 1 and s.compiled == 2 and builder.foreground() == 3
    d.close()


def test_finish_switch_waits_for_the_builds_and_applies_without_a_batch():
    d, builder = _warm()
    assert d.finish_switch() is False  # none pending
    keys = d.switch_to(NEW)
    builder.gate.set()  # the builds may still be running: finish_switch waits for them
    assert d.finish_switch() is True
    s = d.stats().switch
    assert d.config == NEW and s.switches == 1 and s.pending == 0 and s.batches == 0
    assert s.compiled == len(keys) == 2 and d.finish_switch() is False
    _serve(d)  # the new config serves from its warm set: no batch compiles
    assert builder.foreground() == 2 and set(map(str, d.cache.keys())) >= _keys(d, NEW)
    d.close()


def test_finish_switch_builds_a_warm_graph_evicted_while_the_switch_was_pending():
    builder = Builder()
    d = Dispatcher(_with(OLD, max_graphs=2, buckets=_sizes(64, 160, 256)), builder=builder)
    d.warmup(SPEC)
    new = _with(NEW, max_graphs=2, warmup=_causal(32, 256))
    assert len(d.switch_to(new)) == 1  # builds 32 only: 256 is cached
    for n in (60, 150):  # 64 used last, then 160 compiled by the running config, evicting 256
        layout = BatchLayout.from_lens([n])
        d.attend(*_qkv(layout, 0), layout)
    builder.gate.set()
    assert d.finish_switch() is True  # 256 built too, then applied
    s = d.stats().switch
    assert d.config == new and s.switches == 1 and s.compiled == 2 and s.batches == 2  # the two attends
    assert set(map(str, d.cache.keys())) == _keys(d, new)
    d.close()


@pytest.mark.parametrize("on_compile_error", ["eager", "raise"])
def test_finish_switch_drops_a_switch_whose_build_failed(on_compile_error):
    d, builder = _warm(OLD, Builder(fail=128), on_compile_error=on_compile_error)
    running = d.config
    d.switch_to(_with(NEW, on_compile_error=on_compile_error))
    builder.gate.set()
    if on_compile_error == "raise":
        with pytest.raises(GraphCompileError, match=r"switch set failed: RuntimeError: no graph for 128"):
            d.finish_switch()
    else:
        assert d.finish_switch() is False
    s = d.stats().switch
    assert d.config is running and s.failed == 1 and s.switches == 0 and s.pending == 0
    d.close()


def test_a_switch_changes_the_policy_and_keeps_counting():
    d, builder = _warm()
    before = d.stats()
    assert before.guard_fallbacks == 0
    d.switch_to(_with(OLD, policy="always-causal"))
    _serve(d)  # nothing to build: applied at the first batch
    s = d.stats()
    assert s.switch.switches == 1 and s.switch.compiled == 0 and d.guard.policy_name == "always-causal"
    assert s.guard_fallbacks == len(LAYOUTS) - 2  # packed batches are no causal call: varlen
    assert s.modes["causal"] == before.modes["causal"] + 2
    assert builder.foreground() == 2
    d.close()


@pytest.mark.parametrize(("fields", "match"), [
    ({"backend": "aot_eager"}, r"backend='aot_eager' differs from the running config's 'eager'"),
    ({"max_graphs": 8}, r"max_graphs=8 differs"),
    ({"max_seq_len": 512}, r"max_seq_len=512 differs"),
    ({"policy": "no-such-policy"}, r"policy='no-such-policy'"),
    ({"policy": "dynamic", "policy_options": {"no_such_option": 1}}, r"policy_options="),
    ({"eviction": "no-such-eviction"}, r"eviction='no-such-eviction'"),
    ({"buckets": _sizes(16, 32), "warmup": _causal(16, 32)},
     r"buckets=list\(sizes=\[16, 32\]\) serve lengths up to 32 of max_seq_len 256, the running config's "
     r"list\(sizes=\[64, 256\]\) up to 256"),
])
def test_an_invalid_switch_raises_before_any_work_and_changes_nothing(fields, match):
    d, builder = _warm()
    keys, builds = sorted(map(str, d.cache.keys())), list(builder.builds)
    bad = _with(OLD, **fields)
    with pytest.raises(ConfigError, match=match):
        d.switch_to(bad)
    assert d.config is OLD and d.switcher.target is None and not d.switcher.busy
    assert builder.builds == builds and sorted(map(str, d.cache.keys())) == keys
    assert d.stats().switch.requested == 0
    _serve(d)
    assert d.config is OLD
    d.close()


def test_only_a_policy_that_can_run_mask_needs_buckets_up_to_max_batch_tokens():
    running = AttnPolicyConfig(backend="eager", policy="varlen", max_seq_len=256, max_batch_tokens=1024)
    d = Dispatcher(running)  # pow2: buckets up to max_batch_tokens
    seq_only = _with(running, buckets=_sizes(64, 256))
    with pytest.raises(ConfigError, match=r"serve lengths up to 256 of max_batch_tokens 1024"):
        d.switch_to(_with(seq_only, policy="dynamic"))  # MASK calls: packed rows above 256 would overflow
    assert d.switch_to(seq_only) == ()  # varlen makes no MASK call: nothing to build, switches next batch
    d.attend(*_qkv(LAYOUTS[0], 0), LAYOUTS[0])
    assert d.config == seq_only


def test_a_warm_set_that_cannot_stay_resident_for_every_spec_served_is_refused():
    d, builder = _warm()
    other = TensorSpec("float32", 2, 2, 8)
    d.warmup(other)  # two specs served: 4 warm graphs within max_graphs=4
    builds = list(builder.builds)
    with pytest.raises(ConfigError, match=r"the warm set of 3 graphs for tensors of .* and 3 warmed for other "
                                          r"specs exceeds max_graphs=4"):
        d.switch_to(NEW)
    assert d.switcher.target is None and builder.builds == builds
    assert len(d.switch_to(NEW, specs=[SPEC])) == 2  # for one of them it fits
    builder.gate.set()  # the builds run, and close joins the worker
    d.close()


def test_a_warm_set_with_no_spec_served_needs_specs():
    d = Dispatcher(OLD, builder=Builder())
    with pytest.raises(ConfigError, match=r"no tensor spec yet: pass specs"):
        d.switch_to(NEW)
    d.close()
    builder = Builder()
    d = Dispatcher(OLD, builder=builder)
    assert len(d.switch_to(NEW, specs=[SPEC])) == 3  # nothing cached yet
    builder.gate.set()
    _built(d)
    _serve(d)  # the first attend warms the running config's warm set, then the switch applies
    assert d.config == NEW and builder.foreground() == 2 and d.stats().switch.compiled == 2
    d.close()


def test_a_request_while_one_is_pending_replaces_it():
    d, builder = _warm()
    first = d.switch_to(NEW)
    newer = _with(NEW, buckets=_sizes(32, 256), warmup=_causal(32, 256), eviction="lru")
    assert d.switch_to(newer) == first[:1]  # the build of 32 is kept, 128 is dropped
    assert d.switch_to(newer) == first[:1]  # the same request again changes nothing
    _serve(d)
    builder.gate.set()
    _built(d)
    _serve(d)
    s = d.stats().switch
    assert d.config == newer and s.requested == 2 and s.replaced == 1 and s.switches == 1
    assert s.compiled == 1 and not any("q128" in str(key) for key in d.cache.keys())
    assert builder.foreground() == 2
    # a request for the running config drops a pending switch
    d.switch_to(NEW)
    assert d.switch_to(newer) == () and d.switcher.target is None
    _serve(d)
    assert d.config == newer and d.stats().switch.replaced == 2
    d.close()


@pytest.mark.parametrize("on_compile_error", ["eager", "raise"])
def test_a_failed_build_drops_the_switch(on_compile_error, caplog):
    caplog.set_level(logging.WARNING, logger="attnpolicy.dispatch")
    d, builder = _warm(OLD, Builder(fail=128), on_compile_error=on_compile_error)
    running = d.config
    d.switch_to(_with(NEW, on_compile_error=on_compile_error))
    builder.gate.set()
    _built(d)
    layout = LAYOUTS[0]
    q, k, v = _qkv(layout, 0)
    if on_compile_error == "raise":
        with pytest.raises(GraphCompileError, match=r"switch set failed: RuntimeError: no graph for 128"):
            d.attend(q, k, v, layout)
    _serve(d)
    s = d.stats().switch
    assert d.config is running and s.failed == 1 and s.switches == 0 and s.pending == 0
    assert "the switch to policy varlen, buckets list(sizes=[32, 128, 256]) was dropped" in caplog.text
    assert builder.foreground() == 2
    d.close()


def test_a_stored_switch_set_is_loaded_not_compiled(tmp_path):
    store = {"backend": "aot_eager", "store_dir": str(tmp_path)}
    old, new = _with(OLD, **store), _with(NEW, **store)
    with Dispatcher(new) as first:  # compiles the new warm set ahead of time into the store
        _serve(first)
    d = Dispatcher(old)
    _serve(d)
    compiles = d.stats().cache.compiles
    keys = d.switch_to(new)
    _built(d)
    _serve(d)
    s = d.stats()
    assert s.switch.switches == 1 and s.switch.loaded == len(keys) == 2 and s.switch.compiled == 0
    assert s.cache.compiles == compiles
    d.close()


@pytest.mark.parametrize("held", [False, True], ids=["builds-free", "builds-held-to-the-end"])
def test_attnpolicy_run_replans_when_the_lengths_change_halfway(tmp_path, caplog, capsys, monkeypatch, held):
    """A trace whose prompts grow tenfold halfway, run on a plan fitted to its first
    half: the drift measured on the second half triggers a switch, whose graphs build
    in the background; every output stays within the float64 reference's tolerance.
    However fast the builds run, the run ends with the switch applied (waited for after
    the last batch if it is still pending); ``held``: the switch's builds wait until the
    replay has run its last batch, so the switch applies after it."""
    import json

    from attnpolicy.cli import main
    from attnpolicy.dispatch.call_graphs import CallFamily
    from attnpolicy.graphs.costmodel import CostModel
    from attnpolicy.modelling.simulation import simulation_config
    from attnpolicy.planning.graph_set import AttentionPlanLevel, plan_graphs
    from attnpolicy.workloads.batching import BatchFormer
    from attnpolicy.workloads.traces import load_trace

    caplog.set_level(logging.INFO, logger="attnpolicy.dispatch")
    former = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 1024}
    short = [(i, 30 + 7 * i) for i in range(12)]
    long = [(100 + i, 600 + 29 * i) for i in range(12)]
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:{t // 60:02d}:{t % 60:02d}.0000000,{n},3\n" for t, n in short + long))
    model = CostModel.default()
    steps = [s.layout for s in BatchFormer(**former).steps(load_trace(trace))]
    assert max(steps[9].kv_lens) < 300 < max(steps[19].kv_lens)  # the lengths change at batch 10
    old = plan_graphs(steps[:10], simulation_config(model, BatchFormer(**former), max_graphs=4, backend="eager"),
                      AttentionPlanLevel(model), ["varlen"], max_buckets=4).config
    old.save(tmp_path / "plan")
    if held:
        replayed, build, finish = threading.Event(), CallFamily.compile, Dispatcher.finish_switch

        def held_build(self, call, key, spec):
            if threading.current_thread() is not threading.main_thread():
                assert replayed.wait(60)  # the bound only turns a hang into a failure
            return build(self, call, key, spec)

        def finish_after_replay(self):
            replayed.set()
            return finish(self)
        monkeypatch.setattr(CallFamily, "compile", held_build)
        monkeypatch.setattr(Dispatcher, "finish_switch", finish_after_replay)
    out = tmp_path / "run.json"
    assert main(["run", "--config", str(tmp_path / "plan"), "--trace", str(trace), "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "256", "--max-seq-len", "1024", "--heads", "2", "--kv-heads", "2",
                 "--head-dim", "16", "--backend", "eager", "--check", "--replan-every", "10",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    checks = data["replan"]["checks"]
    assert data["passed"] and data["max_abs_err"] < 1e-4
    assert checks[0]["batch"] == 10 and checks[0]["drift"] < 0.1 and checks[0]["switch"] is None  # the first half
    switched = [c for c in checks if c["switch"] is not None]
    assert switched and switched[0]["batch"] == 20 and switched[0]["drift"] > 0.1  # the second half
    s = data["switch"]
    assert s["requested"] == len(switched) and s["failed"] == 0
    # every request applied or replaced by the next, the last applied: however fast the builds ran
    assert s["switches"] >= 1 and s["switches"] + s["replaced"] == s["requested"] and s["pending"] == 0
    assert s["compiled"] + s["loaded"] > 0
    if held:  # pending from the first request on, each later one replacing it, applied after the last batch
        assert data["switch_at_end"] and s["switches"] == 1 and s["replaced"] == len(switched) - 1
        assert s["batches"] == data["batches"] - switched[0]["batch"]
        assert f"{len(switched)} / {len(switched) - 1} / 1 (1 after the last batch)" in capsys.readouterr().out
    assert data["config"] == old.model_dump(mode="json")  # the config the run began with
    assert f"attnpolicy: switched from policy varlen, buckets {old.buckets.describe()}" in caplog.text


def _every_build_counted_once(d: Dispatcher, builds: int) -> None:
    """Every build ran is counted exactly once: inserted (a cache compile), failed (a
    cache compile failure) or built and dropped (``switch.discarded``)."""
    s = d.stats()
    assert builds == s.cache.compiles + s.cache.compile_failures + s.switch.discarded


def test_the_builds_of_a_replaced_switch_are_counted():
    d, builder = _warm()
    d.switch_to(NEW)  # builds 32 and 128
    builder.gate.set()
    _built(d)  # both ran
    d.switch_to(_with(NEW, buckets=_sizes(32, 256), warmup=_causal(32, 256)))  # 128 is dropped
    _built(d)
    _serve(d)  # the newer switch applies; the dropped build is released
    s = d.stats().switch
    assert s.switches == 1 and s.compiled == 1 and s.discarded == 1
    _every_build_counted_once(d, len(builder.builds))
    d.close()
    _every_build_counted_once(d, len(builder.builds))


def test_the_builds_of_a_switch_pending_at_close_are_counted():
    d, builder = _warm()
    d.switch_to(NEW)
    builder.gate.set()
    _built(d)
    d.close()
    assert d.stats().switch.discarded == 2 and d.stats().switch.switches == 0
    _every_build_counted_once(d, len(builder.builds))


def test_the_builds_of_a_failed_switch_are_counted():
    d, builder = _warm(OLD, Builder(fail=128), on_compile_error="eager")
    d.switch_to(_with(NEW, on_compile_error="eager"))
    builder.gate.set()
    _built(d)
    _serve(d)  # the failure is met: the switch is dropped
    s = d.stats()
    assert s.switch.failed == 1 and s.cache.compile_failures == 1
    d.close()
    assert d.stats().switch.discarded == 1  # the build of 32, done but never used
    _every_build_counted_once(d, len(builder.builds))


def test_stats_count_every_real_backend_compile_through_replaced_and_closed_switches():
    """The real backend (``compile_counter``), no custom builder: each compile of a
    replaced or abandoned switch appears in the stats exactly once."""
    counter: list[object] = []
    real = {"backend": "aot_eager"}
    d = Dispatcher(_with(OLD, **real), compile_counter=counter.append)
    _serve(d)
    d.switch_to(_with(NEW, **real))
    _built(d)
    d.switch_to(_with(NEW, buckets=_sizes(32, 256), warmup=_causal(32, 256), **real))  # drops 128
    _built(d)
    d.switch_to(_with(NEW, buckets=_sizes(16, 256), warmup=_causal(16, 256), **real))  # drops 32
    _built(d)
    d.close()  # drops 16
    _every_build_counted_once(d, len(counter))
    assert d.stats().switch.discarded == 3


def _varlen(q: int, kv: int) -> dict[str, object]:
    return {"family": "varlen", "q_bucket": q, "kv_bucket": kv, "context": True}


#: a host runs the VARLEN steps (``host_varlen``): the warm sets' VARLEN graphs are deferred
HOST_OLD = _with(OLD, backend="aot_eager", warmup=[*_causal(64), _varlen(256, 256)])
HOST_NEW = _with(NEW, backend="aot_eager", warmup=[*_causal(32), _varlen(32, 128), _varlen(256, 256)])


@pytest.mark.parametrize("evicted", [False, True], ids=["kept", "deferred-entry-evicted"])
def test_a_switch_carries_the_hosts_varlen_keys_over_deferred_and_compiles_none(evicted):
    """Under ``host_varlen`` a switch builds only graphs attnpolicy runs: the new warm set's
    VARLEN keys (vLLM's kernel runs them) enter the cache deferred when the switch applies,
    counted as a warm-up's; one deferred by the running config stays deferred (evicted
    meanwhile: deferred again), never built."""
    counter: list[object] = []
    d = Dispatcher(HOST_OLD, compile_counter=counter.append, host_varlen=True)
    d.warmup(SPEC)  # CAUSAL q64 built, VARLEN q256 deferred
    d.prepare(BatchLayout.from_lens([1, 1], [100, 20]), SPEC)  # decode, run by the host: deferred
    before = d.stats().cache
    assert len(counter) == before.compiles == 1 and before.deferred == 3
    causal32, new_varlen, old_varlen = map(str, _warm_keys(d, HOST_NEW))
    if evicted:
        assert d.cache.evict(next(k for k in d.cache.keys() if str(k) == old_varlen))
    keys = d.switch_to(HOST_NEW)
    assert [str(k) for k in keys] == [causal32]  # the VARLEN graphs are not built
    assert d.finish_switch()
    s = d.stats()
    d.close()
    assert d.config == HOST_NEW and s.switch.compiled == 1 and len(counter) == s.cache.compiles == 2
    deferred = {str(k) for k in d.cache.keys() if not d.cache.has_graph(k)}
    assert {old_varlen, new_varlen} <= deferred
    assert s.cache.deferred == before.deferred + 1 + evicted and s.cache.deferred_built == 0
    _every_build_counted_once(d, len(counter))
